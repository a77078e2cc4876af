"""The whole-step benchmark compares like with like: every loss-scaled variant trains alike."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from benchmarks import bench_train_step as bench

pytestmark = pytest.mark.benchmarks  # run by `pytest -m benchmarks` (.ci/run does)

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
  names = ["plain", "check_only", "jaxamp"] + [f"jaxamp:{part}" for part in bench_compile.PARTS]
  with jax.numpy_dtype_promotion("standard"):
    medians, counts = bench_compile.measure(names, optax.sgd(0.1), bench_compile.fresh(loss, True),
                                            params, x, repeats=1)
  assert [dict(vars(m)) for m in modules] == before
  assert all(t > 0 for m in medians.values() for t in m.values())
  assert counts["jaxamp:no_check"]["hlo_instructions"] > counts["plain"]["hlo_instructions"]
  assert counts["check_only"]["hlo_instructions"] > counts["plain"]["hlo_instructions"]
  # Each patch reaches the step (a patched function the step no longer calls changes nothing).
  for part in ("no_check", "flag_per_leaf", "simple_unscale"):
    assert counts[f"jaxamp:{part}"]["hlo_instructions"] != counts["jaxamp"]["hlo_instructions"]


def test_the_compile_benchmark_reads_xlas_timers_of_the_step_alone():
  from benchmarks import bench_compile

  log = """\
Running HLO pass pipeline on module jit_init: optimization
HLO pass: fusion time: 7 ms (7000 us) (cumulative: 7 ms, max: 7 ms, #called: 1)
Running HLO pass pipeline on module jit_step: optimization
HLO pass: fusion time: 250 us (250 us) (cumulative: 7.25 ms, max: 7 ms, #called: 2)
HLO pass: copy-insertion time: 1.5 ms (1500 us) (cumulative: 1.5 ms, max: 1.5 ms, #called: 1)
HLO pass: fusion time: 250 us (250 us) (cumulative: 7.5 ms, max: 7 ms, #called: 3)
Running HLO passes on [jit_step] for CPU time: 2 ms (2000 us) (cumulative: 9 ms, max: 7 ms, #called: 2)
Compiling: jit_step
Compiled MLIR module: add_fusion_kernel_module time: 3 ms (3000 us) (cumulative: 3 ms)
Compiled LLVM module: add_fusion_kernel_module time: 1 ms (1000 us) (cumulative: 1 ms)
Compiled LLVM module: __compute_module_select time: 2 ms (2000 us) (cumulative: 3 ms)
Compiling [jit_step] for CPU using JIT time: 1.2 s (1200000 us) (cumulative: 1.2 s)
Compiled LLVM module: other_kernel_module time: 9 ms (9000 us) (cumulative: 12 ms)
"""
  seconds = bench_compile.xla_seconds(log)
  assert seconds["pass fusion"] == pytest.approx(0.0005)
  assert seconds["pass copy-insertion"] == pytest.approx(0.0015)
  assert seconds["HLO passes"] == pytest.approx(0.002)
  assert seconds["code generation"] == pytest.approx(1.2)
  assert seconds["kernels"] == 2
  assert seconds["kernel codegen"] == pytest.approx(0.006)


def test_the_compile_benchmark_traces_a_new_autocast_each_time():
  from benchmarks import bench_compile

  make = bench_compile.fresh(lambda p: p, True)
  assert make() != make()
  assert bench_compile.fresh(abs, False)() is abs


def test_the_update_sweep_and_the_comparison_of_two_commits_read_what_they_write(tmp_path, capsys):
  # The regression guard's parts, with no timing asserted: a sweep of one tiny cell in both modes
  # writes a record per mode with every variant's ratio; its tables print; two runs compare cell
  # by cell; a commit is exported with its name.
  from benchmarks import bench_update_sweep as sweep
  from benchmarks import compare_commits

  out = tmp_path / "sweep.json"
  with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
    run = sweep.main(["--cells", "2x1000", "--clip", "no", "--rounds", "1", "--min-sample", "0",
                      "--json", str(out)])
  records = run["results"]["records"]
  assert [(r["mode"], r["baseline"]) for r in records] == [("given", "adam"),
                                                          ("computed", "plain_f16")]
  for r in records:
    assert set(r["ratios"]) == {r["baseline"], "jaxamp", "apply_if_finite", "flax_dynamic_scale"}
  sweep.main(["--markdown", str(out), "--before", str(out)])
  assert "| 2 x 1,000 |" in capsys.readouterr().out
  rows = compare_commits.compare([run], [run])
  assert len(rows) == 2 * 3 and all(row["new_over_old"] == 1.0 for row in rows)
  directory = compare_commits.export("HEAD", str(tmp_path))
  assert (tmp_path / "jaxamp" / "__init__.py").exists() and directory == str(tmp_path)
