"""Configuration of every test run, the doctests in jaxamp/ included.

Strict dtype and rank promotion, as the house style asks: code that relies on
implicit promotion fails here rather than in a user's strict program.
"""

import os

import jax
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True)
def _trace_afresh_for_mutation_stats():
  """In the mutation run's stats pass (``.ci/mutation``), each test traces afresh.

  mutmut learns which tests reach a function by recording the calls of each
  test. jaxamp's functions run when a step is traced; a test that reuses a
  step an earlier test traced (JAX's caches, jaxamp's own) would call none of
  them and never be run against their mutants. Outside that pass: nothing.
  """
  if os.environ.get("MUTANT_UNDER_TEST") == "stats":
    from jaxamp._src import autocast
    from jaxamp._src.facade import scaler_state

    jax.clear_caches()
    autocast._cache.clear()  # noqa: SLF001 -- traced autocast programs
    scaler_state.update_fn.cache_clear()
  yield
