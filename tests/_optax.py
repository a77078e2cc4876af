"""optax transformations for the tests, which run under strict dtype promotion."""

import jax
import optax


def adam(learning_rate):
  """optax.adam, whose bias correction mixes float and int32, traced with standard promotion."""
  tx = optax.adam(learning_rate)

  def update(updates, state, params=None):
    with jax.numpy_dtype_promotion("standard"):
      return tx.update(updates, state, params)

  return optax.GradientTransformation(tx.init, update)
