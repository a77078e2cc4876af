"""Test configuration: strict dtype and rank promotion, as the house style asks."""

import jax
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def count_traces():
  """Wraps a function so that each trace (compilation) of it is counted."""

  def wrap(fn):
    counter = {"n": 0}

    def traced(*args, **kwargs):
      counter["n"] += 1
      return fn(*args, **kwargs)

    return traced, counter

  return wrap
