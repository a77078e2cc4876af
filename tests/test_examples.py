"""Every script in ``examples/`` runs, with small settings, and does what it claims.

The examples are imported from their files and their ``main(argv)`` called
in-process (one JAX start-up for all of them); one of them also runs as a
script. They are user code, written for JAX's default promotion rules (optax
itself needs them), so they run under those rather than the strict ones the
test suite sets.
"""

import importlib.util
import math
import os
import pathlib
import subprocess
import sys
from types import ModuleType
from typing import Any, Dict

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _load(name: str) -> ModuleType:
  spec = importlib.util.spec_from_file_location(f"jaxamp_example_{name}", EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def run_example(name: str, *argv: str) -> Dict[str, Any]:
  with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
    return _load(name).main(list(argv))


def test_every_example_is_listed_documented_and_tested():
  scripts = sorted(p.stem for p in EXAMPLES.glob("*.py"))
  assert scripts
  listing = (EXAMPLES / "README.md").read_text(encoding="utf-8")
  docs_page = (ROOT / "docs" / "examples.md").read_text(encoding="utf-8")
  this_file = pathlib.Path(__file__).read_text(encoding="utf-8")
  for name in scripts:
    assert f"{name}.py" in listing, f"examples/README.md does not list {name}.py"
    assert f"examples/{name}.py" in docs_page, f"docs/examples.md does not show {name}.py"
    assert f'run_example("{name}"' in this_file, f"no test runs examples/{name}.py"
    source = (EXAMPLES / f"{name}.py").read_text(encoding="utf-8")
    assert "def main(argv" in source and 'if __name__ == "__main__":' in source, name


def test_optax_core_trains():
  out = run_example("optax_core", "--steps", "30", "--accumulate", "2", "--batch-size", "64",
                    "--log-every", "10")
  assert out["final_loss"] < out["first_loss"]
  assert out["optimizer_steps"] == 30
  assert math.isfinite(out["scale"]) and out["scale"] > 0


def test_amp_recipes_each_section_trains():
  out = run_example("amp_recipes", "--steps", "10")
  assert set(out["final_losses"]) == {"typical", "gradient_clipping", "gradient_accumulation",
                                      "gradient_penalty", "multiple_models", "save_and_resume",
                                      "disabled_scaler"}
  for name, loss in out["final_losses"].items():
    assert math.isfinite(loss) and loss < out["first_loss"], name


def test_torch_style_trains_and_round_trips_the_scaler_state():
  out = run_example("torch_style", "--steps", "8", "--accumulate", "2", "--batch-size", "32",
                    "--log-every", "4")
  assert out["final_loss"] < out["first_loss"]
  assert sorted(out["state_dict"]) == sorted(
      ["scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"])
  assert out["restored_scale"] == out["scale"] == out["state_dict"]["scale"]


def test_mmengine_config_counts_and_groups_as_mmengine():
  # 10 iterations in windows of 4: optimizer steps after iterations 4, 8 and 10.
  out = run_example("mmengine_config", "--iters", "10", "--accumulate", "4", "--batch-size",
                    "32", "--log-every", "5", "--lr", "1e-2")
  assert out["inner_count"] == 10 and out["grads_cleared"]
  assert out["loss_scaler"]["_growth_tracker"] == 3  # three finite optimizer steps
  assert out["final_loss"] < out["first_loss"]
  lrs = {tuple(names): (lr, decay) for names, lr, decay in out["param_groups"]}
  assert lrs[("head.bias",)] == (1e-2, 0.0)           # bias_decay_mult=0
  assert lrs[("head.kernel",)] == (1e-2, 0.05)
  backbone = [v for k, v in lrs.items() if k[0].startswith("backbone.")]
  assert backbone == [(pytest.approx(1e-3), 0.05)]    # custom_keys win over the other rules


def test_paddle_style_hysteresis():
  out = run_example("paddle_style", "--steps", "12", "--overflow-at", "3", "7", "8",
                    "--batch-size", "16", "--log-every", "6")
  scales = out["scales"]
  assert scales[:8] == [1024.0] * 8   # an isolated overflow (3) and the first of two (7): kept
  assert scales[8:] == [512.0] * 4    # the second consecutive overflow halves the scale
  overflowed = [i for i, loss in enumerate(out["losses"]) if not math.isfinite(loss)]
  assert overflowed == [3, 7, 8]


def test_gan_with_optim_wrapper_dict():
  out = run_example("gan_optim_wrapper_dict", "--iters", "40", "--batch-size", "64",
                    "--log-every", "20")
  assert out["distance"] < 0.5 * out["start_distance"]
  assert sorted(out["lr"]) == ["discriminator.lr", "generator.lr"]
  assert out["state_keys"] == ["discriminator", "generator"]


def test_checkpoint_resume_is_bit_identical():
  # Windows of 4 over 14 micro-steps: [0-3], [4-7], [8-11], [12-13]. The save
  # after micro-step 6 leaves 2 micro-batches in the open window; the overflows
  # at micro-steps 2 and 9 skip one window before and one after it.
  out = run_example("checkpoint_resume", "--micro-steps", "14", "--stop-at", "6",
                    "--accumulate", "4", "--poison", "2", "9", "--batch-size", "8")
  assert out["bit_identical"] is True
  assert out["restored_at"] == 6
  assert out["window_fill_at_save"] == 2
  assert out["skipped_steps"] == 2


def test_checkpoint_resume_detects_a_lost_accumulator(monkeypatch):
  """The comparison is not vacuous: dropping the half-filled window breaks it."""
  module = _load("checkpoint_resume")
  original = module.ocp.CheckpointManager.restore

  def restore_with_empty_window(self, *args, **kwargs):
    state = original(self, *args, **kwargs)
    acc = module.jaxamp.get_accumulation_state(state["opt_state"])
    emptied = acc._replace(acc_grads=jax.tree.map(lambda a: a * 0, acc.acc_grads))
    state["opt_state"] = emptied
    return state

  monkeypatch.setattr(module.ocp.CheckpointManager, "restore", restore_with_empty_window)
  with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
    out = module.main(["--micro-steps", "14", "--stop-at", "6", "--accumulate", "4",
                       "--poison", "--batch-size", "8"])
  assert out["bit_identical"] is False


def test_an_example_runs_as_a_script():
  proc = subprocess.run(
      [sys.executable, str(EXAMPLES / "paddle_style.py"), "--steps", "2", "--overflow-at", "1",
       "--batch-size", "8", "--log-every", "1"],
      cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
      # The jaxamp of this checkout, whatever an installed copy points at.
      env=dict(os.environ, PYTHONPATH=os.pathsep.join(
          [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])))
  assert proc.returncode == 0, proc.stderr
  assert "iteration    2" in proc.stdout and "scaler.state_dict()" in proc.stdout


def test_bfloat16_params_roundings_against_the_master():
  out = run_example("bfloat16_params", "--steps", "80", "--lr", "3e-4", "--batch-size", "32")
  master = out["master"]["final_loss"]
  assert out["kahan"]["final_loss"] <= 1.05 * master
  assert out["stochastic"]["final_loss"] <= 1.1 * master
  assert out["nearest"]["final_loss"] > out["kahan"]["final_loss"]
  assert out["kahan"]["stale_fraction"] > 0.5  # nearest rounding would lose most updates
  assert round(out["master"]["bytes_per_param"]) == 16  # params, m, v, gradients (+ a counter)
  assert round(out["stochastic"]["bytes_per_param"]) == 12
