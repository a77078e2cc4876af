"""The fp8 autocast benchmark's claims at a fast size, and its speed mode on this machine.

The LM of ``bench_train_step.py`` (2 blocks of width 32, every product but the
attention's in float8) ends within 2% of bfloat16 autocast, a loss scale
changes no bit of its gradients, and keeping every chosen layer in bfloat16
gives bfloat16's gradients exactly.
"""

import json

import jax
import pytest

from benchmarks import bench_fp8_autocast as bench

pytestmark = pytest.mark.benchmarks  # run by `pytest -m benchmarks` (.ci/run does)


@pytest.fixture(scope="module")
def lm():
  # The benchmark's model is written for JAX's default promotion rules.
  with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
    return bench.lm_numerics(steps=80, width=32, layers=2, vocab=64, batch=4, length=16, lr=3e-3,
                             min_dim=16)


def test_the_lm_in_fp8_ends_within_two_percent_of_bfloat16(lm):
  for name, run in lm["runs"].items():
    assert run["skipped_steps"] == 0, name
    assert abs(run["ratio_to_bfloat16"] - 1) <= 0.02, (name, run["ratio_to_bfloat16"])
  assert lm["runs"]["fp8"]["final_loss"] < 0.8 * lm["runs"]["fp8"]["curve"][0]  # it learns


def test_a_loss_scale_changes_no_bit_of_the_fp8_gradients(lm):
  assert lm["loss_scale_invariance"]["fp8"]["identical"]


def test_the_exclusions_keep_their_layers_exactly_in_bfloat16(lm):
  # Two blocks: keeping the first, the last and the head in bfloat16 keeps every product there.
  errors = lm["grad_error_vs_bfloat16"]
  assert all(e["error"] == 0 for e in errors["fp8_keep_first_last_head"].values())
  assert all(e["error"] > 0 for path, e in errors["fp8"].items() if "block" in path)
  # Keeping the head only: the blocks still differ from bfloat16.
  assert errors["fp8_keep_head"]["['block_0']['qkv']"]["error"] > 0


def test_the_speed_mode_runs_and_counts_the_float8_products(tmp_path):
  path = tmp_path / "speed.json"
  with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
    bench.main(["--what", "speed", "--d", "64", "--heads", "8", "--seq", "32", "--speed-batch",
                "1", "--min-dim", "16", "--rounds", "1", "--inner", "1", "--json", str(path)])
  run = json.loads(path.read_text())["runs"][0]
  assert run["provenance"]["commit"] and "--json" not in run["provenance"]["command"]
  products = run["results"]["speed"]["products"]
  # The four projections and their eight gradient products; the attention's (head size 8) not.
  assert products["fp8"]["dots_on_float8"] == 12 and products["fp8"]["dots"] == 18
  assert products["bfloat16"]["dots_on_float8"] == 0
