"""Configuration of every test run, the doctests in jaxamp/ included.

Strict dtype and rank promotion, as the house style asks: code that relies on
implicit promotion fails here rather than in a user's strict program.
"""

import jax

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
