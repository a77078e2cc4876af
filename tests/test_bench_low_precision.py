"""The low-precision benchmark's claims at a fast size: LM parity with the master, memory per parameter.

(The lag of round-to-nearest shows at the benchmark's size, not at this one: see docs/benchmarks.md.)
"""

import jax
import jax.numpy as jnp
import pytest

from benchmarks import bench_low_precision as bench

pytestmark = pytest.mark.benchmarks  # run by `pytest -m benchmarks` (.ci/run does)


@pytest.fixture(scope="module")
def final():
  # The benchmark's model is written for JAX's default promotion rules.
  with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
    curves = bench.train_curves(steps=100, d=32, layers=1, vocab=64, batch=4, length=17, lr=1e-3,
                                configs=("master", "stochastic", "kahan"))
  return bench.final_losses(curves)


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_lm_trained_in_bfloat16_ends_within_two_percent_of_the_master(final, rounding):
  assert abs(final[rounding] / final["master"] - 1) <= 0.02, final


def test_memory_per_parameter():
  with jax.numpy_dtype_promotion("standard"):
    master = bench.bytes_per_param("master", jnp.float32, d=64, layers=1)
    kahan16 = bench.bytes_per_param("kahan", jnp.bfloat16, d=64, layers=1)
    kahan32 = bench.bytes_per_param("kahan", jnp.float32, d=64, layers=1)
  # float32 master, m and v, gradients, bfloat16 compute copy (and Adam's step counters)
  assert master["total"] == pytest.approx(18.0, abs=0.01)
  assert kahan16["total"] == pytest.approx(10.0, abs=0.01)
  assert kahan16["total"] <= 0.6 * master["total"]  # at least 40% less
  assert kahan32["total"] == pytest.approx(14.0, abs=0.01)
