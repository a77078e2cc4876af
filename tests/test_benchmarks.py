"""The whole-step benchmark compares like with like: every loss-scaled variant trains alike."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from benchmarks import bench_train_step as bench

STEPS = 3


@pytest.fixture(scope="module", params=["sgd_momentum", "clipped_adamw"])
def trained(request):
  """The params of every variant after ``STEPS`` steps of a small LM, and the initial ones.

  Optimizers whose step depends on the gradients' size (not adam alone, which
  is nearly blind to a forgotten unscaling).
  """
  if request.param == "sgd_momentum":
    inner = optax.sgd(0.1, momentum=0.9)
  else:
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  params = bench.make_lm(d=64, layers=1)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 1024, (2, 9)), jnp.int32)
  # The benchmark's model is written for JAX's default promotion rules.
  with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
    runs = {name: bench.make_runner(make, inner, jnp.float16, params, tokens)
            for name, make in bench.VARIANTS.items()}
    runs.update({name: loop(inner, jnp.float16, params, tokens)
                 for name, loop in bench.FACADES.items()})
    for run in runs.values():
      for _ in range(STEPS):
        run()
  return params, {name: run.params() for name, run in runs.items()}


def assert_trees_close(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), a, b)


LOSS_SCALED = ["train_state", "grad_scaler", "amp_optim_wrapper", "jaxamp_2calls",
               "apply_if_finite", "flax_dynamic_scale"]


@pytest.mark.parametrize("name", LOSS_SCALED)
def test_loss_scaled_variants_train_as_the_core(trained, name):
  _, params = trained
  assert_trees_close(params[name], params["jaxamp"])


def test_the_core_trains(trained):
  initial, params = trained
  moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), params["jaxamp"], initial)
  assert all(jax.tree.leaves(moved))
  assert_trees_close(params["plain_f16_2calls"], params["plain_f16"])


def test_the_compile_benchmark_times_every_phase_and_restores_what_it_switches_off():
  from benchmarks import bench_compile
  from jaxamp._src import finite, loss_scale, selective_update

  params, x, loss = bench_compile.leaf_problem(2, width=8)
  modules = (finite, loss_scale.ScaleRule, selective_update)
  before = [dict(vars(m)) for m in modules]
  names = ["plain"] + [f"jaxamp:{part}" for part in bench_compile.PARTS]
  with jax.numpy_dtype_promotion("standard"):
    medians, counts = bench_compile.measure(names, optax.sgd(0.1), loss, params, x, repeats=1)
  assert [dict(vars(m)) for m in modules] == before
  assert all(t > 0 for m in medians.values() for t in m.values())
  assert counts["jaxamp:no_check"]["hlo_instructions"] > counts["plain"]["hlo_instructions"]
