"""Small problems the tests share."""

import jax
import jax.numpy as jnp


def classification():
  """A two-layer classifier's float32 params, a batch of 32 inputs of 8 features, 4 labels."""
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  params = {"w1": jax.random.normal(k1, (8, 16)) * 0.3, "b1": jnp.zeros(16),
            "w2": jax.random.normal(k2, (16, 4)) * 0.3}
  x = jax.random.normal(k3, (32, 8))
  labels = jnp.arange(32, dtype=jnp.int32) % 4
  return params, x, labels
