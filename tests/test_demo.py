"""The demo: `python -m jaxamp.demo` with tiny settings, its outputs, its progress bar."""

import io
import json
import math
import os
import subprocess
import sys

import jax
import pytest

from jaxamp.demo import cli
from jaxamp.demo import data
from jaxamp.demo import train

def run_demo(args, **streams):
  # The demo is user code, written for JAX's default promotion rules (optax's
  # Adam mixes a float and an int32 counter), not for the suite's strict ones.
  with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
    return cli.main(args, **streams)


TINY = ["--steps", "200", "--accumulate", "2", "--batch-size", "32", "--width", "64",
        "--depth", "2", "--classes", "3", "--train-size", "2000", "--eval-size", "400",
        "--growth-interval", "20", "--lr", "1e-2"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("demo")
  stdout, stderr = io.StringIO(), io.StringIO()
  status = run_demo(TINY + ["--out", str(out)], stdout=stdout, stderr=stderr)
  with open(out / "metrics.json", encoding="utf-8") as f:
    metrics = json.load(f)
  return dict(status=status, out=out, stdout=stdout.getvalue(), stderr=stderr.getvalue(),
              metrics=metrics)


def test_demo_writes_metrics_and_plot(demo_run):
  assert demo_run["status"] == 0
  out = demo_run["out"]
  assert sorted(os.listdir(out)) == ["metrics.json", "training.png"]
  with open(out / "training.png", "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert os.path.getsize(out / "training.png") > 10_000


def test_metrics_fields(demo_run):
  metrics = demo_run["metrics"]
  assert set(metrics) == {"config", "device", "versions", "model", "summary", "history", "eval"}
  config, summary, history = metrics["config"], metrics["summary"], metrics["history"]
  assert config["dtype"] == "float16" and config["loss_scale"] and config["accumulate"] == 2
  assert metrics["model"]["compute_dtype"] == "float16"
  assert metrics["model"]["param_dtype"] == "float32"
  for key in ("initial_loss", "final_loss", "eval_loss", "eval_accuracy", "skipped_steps",
              "scale_changes", "scale_increases", "scale_decreases", "initial_scale",
              "final_scale", "steps_per_second", "micro_steps_per_second", "train_seconds",
              "compile_seconds", "applied_steps", "optimizer_steps", "micro_steps"):
    assert isinstance(summary[key], (int, float)) and math.isfinite(summary[key]), key
  assert summary["optimizer_steps"] == 200 and summary["micro_steps"] == 400
  assert [len(history[k]) for k in ("step", "loss", "scale", "skipped")] == [200] * 4
  assert metrics["eval"]["step"][0] == 0 and metrics["eval"]["step"][-1] == 200
  assert metrics["device"]["platform"] == train.default_platform()


def test_loss_decreased_and_the_scale_calibrated(demo_run):
  summary, history = demo_run["metrics"]["summary"], demo_run["metrics"]["history"]
  assert summary["final_loss"] < 0.7 * summary["initial_loss"]
  assert summary["eval_loss"] < summary["initial_eval_loss"]
  assert summary["eval_accuracy"] > summary["initial_eval_accuracy"] + 0.2
  # The high initial scale overflows float16 first: some steps are skipped and
  # the scale backs off, then grows again every growth_interval good steps.
  assert summary["skipped_steps"] >= 1 and summary["scale_decreases"] >= 1
  assert summary["scale_increases"] >= 1
  assert summary["skipped_steps"] == sum(history["skipped"])
  assert summary["applied_steps"] == 200 - summary["skipped_steps"]
  assert summary["initial_scale"] == 2.0**24 and history["scale"][0] == 2.0**24
  for before, after, skipped in zip(history["scale"], history["scale"][1:], history["skipped"]):
    if skipped:
      assert after == before / 2


def test_summary_and_progress_bar(demo_run):
  stdout, stderr = demo_run["stdout"], demo_run["stderr"]
  for text in ("jaxamp demo: 3-class spirals", "skipped steps", "loss scale      dynamic, 2^24",
               "optimizer steps/s", "metrics.json", "training.png"):
    assert text in stdout, text
  assert "train 100% |" in stderr and "| scale 2^" in stderr
  assert stderr.count("\n") <= 15  # not a terminal: one line per tenth


def test_other_dtypes_and_no_loss_scale(tmp_path):
  stdout = io.StringIO()
  args = ["--steps", "10", "--accumulate", "1", "--width", "16", "--depth", "1",
          "--train-size", "500", "--eval-size", "100"]
  status = run_demo(args + ["--dtype", "bfloat16", "--no-loss-scale", "--no-plot", "--quiet",
                            "--out", str(tmp_path)], stdout=stdout, stderr=io.StringIO())
  assert status == 0 and os.listdir(tmp_path) == ["metrics.json"]
  with open(tmp_path / "metrics.json", encoding="utf-8") as f:
    metrics = json.load(f)
  assert metrics["summary"]["final_scale"] == 1.0 and metrics["summary"]["skipped_steps"] == 0
  assert set(metrics["history"]["scale"]) == {1.0}
  assert "loss scale      off" in stdout.getvalue()


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "steps must be an int >= 1, got 0"),
    (["--dtype", "float8"], "invalid choice: 'float8'"),
    (["--clip", "-1"], "clip must be >= 0"),
    (["--init-scale", "inf"], "init_scale must be positive and finite"),
])
def test_bad_arguments(args, message, capsys):
  with pytest.raises(SystemExit) as info:
    cli.main(args)
  assert info.value.code == 2
  assert message in capsys.readouterr().err


def test_python_dash_m_entry_point():
  result = subprocess.run([sys.executable, "-m", "jaxamp.demo", "--help"], capture_output=True,
                          text=True, check=False, timeout=120)
  assert result.returncode == 0, result.stderr
  for option in ("--steps", "--dtype", "--accumulate", "--no-loss-scale", "--out", "--seed"):
    assert option in result.stdout


def test_spirals_are_deterministic_and_balanced():
  a, b = data.make_spirals(3000, seed=7), data.make_spirals(3000, seed=7)
  assert (a.x == b.x).all() and (a.y == b.y).all()
  counts = [int((a.y == c).sum()) for c in range(5)]
  assert min(counts) > 500
  with pytest.raises(ValueError, match="num_classes must be >= 2"):
    data.make_spirals(10, num_classes=1)


def test_the_summary_names_the_leaves_of_the_last_skipped_step(demo_run):
  summary = demo_run["metrics"]["summary"]
  assert summary["last_skipped_step"] is not None and summary["last_skipped_leaves"]
  assert all(name.startswith("['Dense_") for name in summary["last_skipped_leaves"])
  assert f"the last (step {summary['last_skipped_step']}) had inf/nan" in demo_run["stdout"]
  assert summary["stalled_steps"] == 0 and not any(demo_run["metrics"]["history"]["stalled"])


def test_the_plot_marks_a_stall(demo_run, tmp_path, monkeypatch):
  from jaxamp.demo import plot as plot_lib
  metrics = json.loads(json.dumps(demo_run["metrics"]))
  metrics["history"]["stalled"] = [step > 180 for step in metrics["history"]["step"]]
  spans = []
  import matplotlib.axes
  real = matplotlib.axes.Axes.axvspan
  monkeypatch.setattr(matplotlib.axes.Axes, "axvspan",
                      lambda self, a, b, **kw: spans.append((a, b, kw.get("label"))) or
                      real(self, a, b, **kw))
  plot_lib.plot_training(metrics, str(tmp_path / "plot.png"))
  assert (181, 200, "stalled: every step skipped") in spans


def test_demo_trains_bfloat16_params_without_a_master(tmp_path):
  stdout = io.StringIO()
  args = ["--steps", "40", "--accumulate", "1", "--batch-size", "32", "--width", "32", "--depth",
          "1", "--classes", "3", "--train-size", "500", "--eval-size", "100", "--no-plot",
          "--quiet", "--params", "bfloat16", "--rounding", "kahan", "--out", str(tmp_path)]
  assert run_demo(args, stdout=stdout, stderr=io.StringIO()) == 0
  with open(tmp_path / "metrics.json", encoding="utf-8") as f:
    metrics = json.load(f)
  assert metrics["model"]["param_dtype"] == "bfloat16"
  assert 0.0 <= metrics["summary"]["stale_fraction"] <= 1.0
  assert metrics["summary"]["final_loss"] < metrics["summary"]["initial_loss"]
  assert "bfloat16 parameters (kahan rounding, no master copy" in stdout.getvalue()
