"""The low-precision benchmark's claims at a fast size: LM parity with the master, memory per parameter."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks import bench_low_precision as bench


@pytest.fixture(scope="module")
def final():
  # The benchmark's model is written for JAX's default promotion rules.
  with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
    curves = bench.train_curves(steps=150, d=32, layers=1, vocab=64, batch=4, length=17)
  return bench.final_losses(curves)


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_lm_trained_in_bfloat16_ends_within_two_percent_of_the_master(final, rounding):
  assert abs(final[rounding] / final["master"] - 1) <= 0.02, final


def test_lm_trained_with_nearest_rounding_lags(final):
  assert final["nearest"] > 1.02 * final["master"], final


def test_memory_per_parameter():
  with jax.numpy_dtype_promotion("standard"):
    master = bench.bytes_per_param("master", jnp.float32, d=64, layers=1)
    kahan16 = bench.bytes_per_param("kahan", jnp.bfloat16, d=64, layers=1)
    kahan32 = bench.bytes_per_param("kahan", jnp.float32, d=64, layers=1)
  assert master["total"] == 18.0  # float32 master, m and v, gradients, bfloat16 compute copy
  assert kahan16["total"] == 10.0 and kahan16["total"] <= 0.6 * master["total"]
  assert kahan32["total"] == 14.0
