"""Renders the documentation's figures from ``benchmarks/results/*.json`` and from the sources.

::

  python benchmarks/render_docs.py                        # rewrite every region of every page
  python benchmarks/render_docs.py design-line-counts     # only these regions
  python benchmarks/render_docs.py --check                # rewrite nothing; exit 1 if one is stale

A page (``README.md``, ``docs/*.md``) holds regions, which this script owns::

  <!-- table: NAME -->
  ...
  <!-- /table -->

or, inside a sentence, ``<!-- fig: NAME -->...<!-- /fig -->``. Each ``NAME`` is a
function below. The timings come from the JSON files that the benchmarks write
with ``--json`` (``python benchmarks/refresh.py`` re-runs them all), and each
table of them ends with the command, the results file, the commit, the date and
the machine they came from. Figures that are not timings are computed here from
the code itself (line counts, bytes per parameter) or recorded by a benchmark
whose results ``tests/test_doc_figures.py`` reproduces (drift, convergence).
So a re-run of a benchmark changes its tables, and a hand edit inside a region
is undone by the next render (and fails ``--check``, which the tests run).
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import re
import sys
from typing import Callable, Dict, Iterable, List, Sequence, Tuple

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
PAGES = ("README.md", "docs/*.md")

# A region: its opening comment, its body and its closing comment (a table's on lines of their own;
# a marker quoted in backticks is text).
_BLOCK = re.compile(r"^(<!-- table: (?P<name>[\w-]+) -->\n)(?P<body>.*?)^(<!-- /table -->)$",
                    re.S | re.M)
_INLINE = re.compile(r"(?<!`)(<!-- fig: (?P<name>[\w-]+) -->)(?P<body>.*?)(<!-- /fig -->)", re.S)

REGIONS: Dict[str, Callable[[], str]] = {}


def region(name: str):
  """Registers the renderer of the region ``name`` (it returns the region's body)."""
  def register(fn):
    REGIONS[name] = fn
    return fn
  return register


# ----------------------------------------------------------------------------- reading results


class Results:
  """The runs of one results file, ``benchmarks/results/NAME.json``."""

  def __init__(self, name: str):
    self.name = name
    self.path = RESULTS / f"{name}.json"
    if not self.path.exists():
      raise FileNotFoundError(f"{self.path} is missing: run python benchmarks/refresh.py {name}")
    self.runs = json.loads(self.path.read_text())["runs"]

  def values(self, *keys) -> List:
    """``run["results"][k0][k1]...`` of every run (``None`` where a run lacks it)."""
    out = []
    for run in self.runs:
      value = run["results"]
      for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
      out.append(value)
    return out

  def ratio(self, table: str | Tuple[str, ...], variant: str,
            baseline: str | None = None) -> List[float]:
    """The ratio of ``variant`` to the baseline of a table of timings (or to ``baseline``), in
    every run; ``table`` is its key in the results (a tuple of keys for a nested one)."""
    keys = table if isinstance(table, tuple) else (table,)
    return [t["seconds"][variant] / t["seconds"][baseline or t["baseline"]]
            for t in self.values(*keys)]


def span(values: Sequence[float], fmt: str = "{:.2f}") -> str:
  """One value, or the range ``"a to b"`` of several runs' values (as formatted)."""
  shown = [fmt.format(v) for v in sorted(values)]
  return shown[0] if shown[0] == shown[-1] else f"{shown[0]} to {shown[-1]}"


def table(header: Sequence[str], rows: Iterable[Sequence[str]], align: str = "") -> str:
  """A markdown table; ``align`` gives each column's ``l`` or ``r`` (default: left)."""
  marks = ["---:" if a == "r" else "---" for a in align.ljust(len(header), "l")]
  lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(marks) + " |"]
  lines += ["| " + " | ".join(row) + " |" for row in rows]
  return "\n".join(lines)


def sources(*names: str) -> str:
  """The lines under a table of recorded figures: what produced them, when and where."""
  groups: Dict[str, List[str]] = {}
  for name in names:
    for run in Results(name).runs:
      prov, machine = run["provenance"], run["provenance"]["machine"]
      commit = prov["commit"] + (" (with uncommitted changes)" if prov["uncommitted_changes"]
                                 else "")
      where = f"commit `{commit}` on {machine['cpu']} ({machine['cores']} cores), jax {prov['jax']}"
      entry = (f"- `{prov['command']}`: `benchmarks/results/{name}.json`, {prov['date'][:10]}, "
               f"load average {machine['load_average'][0]:.1f}")
      if entry not in groups.setdefault(where, []):
        groups[where].append(entry)
  return "\n\n".join(f"Measured at {where}:\n\n" + "\n".join(entries)
                     for where, entries in groups.items())


# ----------------------------------------------------------------------------- whole train steps

TRAIN_STEP_RUNS = {"compute-bound": "train_step_compute", "update-bound": "train_step_update",
                   "update-bound, clipped": "train_step_update_clip",
                   "update-bound, bfloat16": "train_step_update_bfloat16"}
TRAIN_STEP_ROWS = {
    "jaxamp": "jaxamp functional core (`scale_loss`, `dynamic_loss_scale`), one `jit`",
    "train_state": "`jaxamp.TrainState`, one `jit`",
    "grad_scaler": "`GradScaler` + `OptimWrapper(donate=True)`",
    "amp_optim_wrapper": "`AmpOptimWrapper(cast=\"whole\", donate=True).update_params`",
    "apply_if_finite": "`optax.apply_if_finite` with a hand-written scale, one `jit`",
    "flax_dynamic_scale": "flax's `DynamicScale` (the imagenet example's step), one `jit`",
    "plain_f16_2calls": "plain float16, as two jitted calls (backward, then update)",
    "jaxamp_2calls": "jaxamp functional core, as two jitted calls",
    "optax_f32": "plain optax in float32, one `jit`",
}


@region("train-step")
def train_step_table() -> str:
  runs = {column: Results(name) for column, name in TRAIN_STEP_RUNS.items()}
  rows = [[label] + [span(res.ratio("step", variant)) for res in runs.values()]
          for variant, label in TRAIN_STEP_ROWS.items()]
  rows.append(["*plain float16, milliseconds per step*"]
              + [span([s["plain_f16"] * 1e3 for s in res.values("step", "seconds")], "{:.1f}")
                 for res in runs.values()])
  return (table(["variant", *runs], rows) + "\n\n" + sources(*TRAIN_STEP_RUNS.values()))


@region("train-step-temporaries")
def train_step_temporaries() -> str:
  columns = {"plain_f16": "plain float16", "train_state": "jaxamp, `TrainState`",
             "apply_if_finite": "`apply_if_finite`", "flax_dynamic_scale": "flax `DynamicScale`"}
  rows = []
  for label, name in TRAIN_STEP_RUNS.items():
    temps = Results(name).values("temp_param_bytes")
    rows.append([label] + [span([t[v] for t in temps]) for v in columns])
  return table(["", *columns.values()], rows) + "\n\n" + sources(*TRAIN_STEP_RUNS.values())


@region("train-step-vs-peers")
def train_step_vs_peers() -> str:
  """jaxamp's one-jit steps against the peers', over the update-bound runs."""
  update_bound = list(TRAIN_STEP_RUNS.values())[1:]

  def over(variant, peer):
    return span([r for name in update_bound for r in Results(name).ratio("step", variant, peer)])

  return (f"the functional core's step took {over('jaxamp', 'apply_if_finite')} times the time "
          f"of `apply_if_finite`'s and {over('jaxamp', 'flax_dynamic_scale')} times flax's "
          f"recipe's, and `TrainState`'s {over('train_state', 'apply_if_finite')} times "
          "`apply_if_finite`'s")


@region("two-call-ratio")
def two_call_ratio() -> str:
  """Plain float16 as two calls against one call, over the update-bound runs."""
  return span([r for name in list(TRAIN_STEP_RUNS.values())[1:]
               for r in Results(name).ratio("step", "plain_f16_2calls")]) + " times"


# ----------------------------------------------------------------------------- low precision

ROUNDING_LABELS = {"stochastic": "stochastic", "kahan": "Kahan", "nearest": "nearest"}


def _numerics(kind: str) -> dict:
  """The drift or convergence figures (deterministic: the last run's)."""
  return Results("low_precision_numerics").runs[-1]["results"][kind]


@region("lowp-drift")
def lowp_drift() -> str:
  drift = _numerics("drift")
  kahan = drift["kahan"]
  rows = [["nearest", f"{drift['nearest']['mean']:.7g} (every update lost)"],
          ["stochastic", f"mean of 4096 parameters {drift['stochastic']['mean']:.6g} "
                         "(required: within `2e-3`)"],
          ["Kahan", f"visible weight {span([kahan['min'], kahan['max']], '{:.7g}')} (within one "
                    f"spacing, `2**-7`); weight + compensation "
                    f"{span([kahan['sum_min'], kahan['sum_max']], '{:.8g}')}, the float32 "
                    "master's own sum (required: within `1e-4`)"]]
  return table(["rounding", "result"], rows) + "\n\n" + sources("low_precision_numerics")


@region("lowp-drift-summary")
def lowp_drift_summary() -> str:
  drift = _numerics("drift")
  kahan = drift["kahan"]
  return (f"nearest stays at {drift['nearest']['mean']:.7g}; stochastic's mean over 4096 "
          f"parameters is {drift['stochastic']['mean']:.6g}; Kahan's visible weight is "
          f"{kahan['max']:.7g} (within one spacing, `2**-7`) and weight plus compensation is "
          f"{kahan['sum_max']:.8g}, the float32 master's own value")


@region("lowp-convergence-summary")
def lowp_convergence_summary() -> str:
  conv = _numerics("convergence")
  base = conv["float32"]
  return (f"float32 {base:.4f}, stochastic {conv['stochastic']:.4f} "
          f"({conv['stochastic'] / base:.3f}x), Kahan {conv['kahan']:.4f} "
          f"({conv['kahan'] / base:.3f}x), nearest {conv['nearest']:.4g} (stalled)")


@region("lowp-convergence")
def lowp_convergence() -> str:
  conv = _numerics("convergence")
  base = conv["float32"]
  required = {"stochastic": "at most 1.2x", "kahan": "at most 1.05x", "nearest": "(stalls)"}
  rows = [["float32", f"{base:.4f}", "1.000x", ""]]
  rows += [[ROUNDING_LABELS[r], f"{conv[r]:.4g}", f"{conv[r] / base:.3f}x", required[r]]
           for r in ROUNDING_LABELS]
  return (table(["weights", "final mean squared error", "vs float32", "required"], rows)
          + "\n\n" + sources("low_precision_numerics"))


def _lm_rows(name: str) -> List[List[str]]:
  finals = Results(name).values("lm", "final")
  rows = [["float32 master, bfloat16 compute", span([f["master"] for f in finals], "{:.4f}"),
           "1.000x"]]
  for rounding, label in ROUNDING_LABELS.items():
    rows.append([f"bfloat16, {label}", span([f[rounding] for f in finals], "{:.4f}"),
                 span([f[rounding] / f["master"] for f in finals], "{:.3f}x")])
  return rows


@region("lowp-lm")
def lowp_lm() -> str:
  return (table(["configuration", "final loss", "vs master"], _lm_rows("low_precision_lm"))
          + "\n\n" + sources("low_precision_lm"))


@region("lowp-lm-lr3e-3")
def lowp_lm_fast() -> str:
  return (table(["configuration", "final loss", "vs master"], _lm_rows("low_precision_lm_lr3e-3"))
          + "\n\n" + sources("low_precision_lm_lr3e-3"))


@region("lowp-lm-summary")
def lowp_lm_summary() -> str:
  finals = Results("low_precision_lm").values("lm", "final")
  return ", ".join(f"{label} {span([f[r] / f['master'] for f in finals], '{:.3f}x')}"
                   for r, label in ROUNDING_LABELS.items())


def _b(value: float) -> str:
  """Bytes per parameter as the tables give them (Adam's step counters are a few bytes in all)."""
  return f"{round(value, 2):g}"


_MEMORY_NOTE = ("*Computed by `python benchmarks/render_docs.py` from the shapes and dtypes of the "
                "parameters and optimizer states (`bench_low_precision.memory_figures`, the LM of "
                "`bench_train_step.py`); Adam's step counters, a few bytes in all, are left out.*")


def _memory() -> dict:
  from benchmarks import bench_low_precision  # jax: imported only for the regions that need it
  return bench_low_precision.memory_figures()


@region("lowp-memory")
def lowp_memory() -> str:
  memory = _memory()
  master = memory["float32"]["master"]

  def row(label, b):
    state = f"{_b(b['optimizer state'] - 2)} + 2" if label.startswith("Kahan") else (
        _b(b["optimizer state"]))
    less = "" if b is master else f"{100 * (1 - b['total'] / master['total']):.0f}% less"
    copy = _b(b["compute copy"]) if b["compute copy"] else ""
    return [label, _b(b["params"]), state, _b(b["gradients"]), copy, _b(b["total"]), less]

  rows = [row("float32 master, bfloat16 compute", master),
          row("Kahan, `state_dtype=bfloat16`", memory["bfloat16"]["kahan"]),
          row("stochastic or nearest, `state_dtype=bfloat16`", memory["bfloat16"]["stochastic"]),
          row("Kahan, float32 moments", memory["float32"]["kahan"]),
          row("stochastic or nearest, float32 moments", memory["float32"]["stochastic"])]
  return (table(["configuration", "params", "optimizer state", "gradients", "compute copy",
                 "total", "vs master"], rows)
          + "\n\n" + _MEMORY_NOTE)


def _bytes(rounding: str, state_dtype: str) -> str:
  memory = _memory()
  total = memory[state_dtype][rounding]["total"]
  less = 1 - total / memory["float32"]["master"]["total"]
  return f"{_b(total)} ({100 * less:.0f}% less)"


@region("lowp-rounding-memory")
def lowp_rounding_memory() -> str:
  memory = _memory()
  rows = [["float32 master, bfloat16 compute", _b(memory["float32"]["master"]["total"]), "",
           "yes"],
          ["**kahan**, `state_dtype=bfloat16`", _bytes("kahan", "bfloat16"),
           "to float32 precision", "yes"],
          ["**kahan**, float32 moments", _bytes("kahan", "float32"), "to float32 precision", "yes"],
          ["**stochastic**, `state_dtype=bfloat16`", _bytes("stochastic", "bfloat16"),
           "in expectation", "per seed"],
          ["**stochastic**, float32 moments", _bytes("stochastic", "float32"), "in expectation",
           "per seed"],
          ["nearest", f"{_b(memory['bfloat16']['nearest']['total'])} or "
                      f"{_b(memory['float32']['nearest']['total'])}",
           "no: updates below `2**-9` of the parameter are lost", "yes"]]
  return (table(["", "memory (AdamW, bytes per parameter)", "matches the master", "deterministic"],
                rows) + "\n\n" + _MEMORY_NOTE)


@region("readme-lowp-bytes")
def readme_lowp_bytes() -> str:
  memory = _memory()
  return (f"{_b(memory['bfloat16']['stochastic']['total'])} (stochastic) or "
          f"{_b(memory['bfloat16']['kahan']['total'])} (Kahan) bytes per parameter with AdamW and "
          f"`state_dtype=jnp.bfloat16` ({_b(memory['float32']['stochastic']['total'])} or "
          f"{_b(memory['float32']['kahan']['total'])} with float32 moments) instead of "
          f"{_b(memory['float32']['master']['total'])}")


@region("lowp-time")
def lowp_time() -> str:
  res = Results("low_precision_time")
  rows = [[f"{regime}-bound ({tokens} tokens)"]
          + [span(res.ratio(("time", regime), r)) for r in ROUNDING_LABELS]
          for regime, tokens in (("update", "1 x 16"), ("compute", "8 x 128"))]
  return (table(["regime", *ROUNDING_LABELS.values()], rows) + "\n\n"
          + sources("low_precision_time"))


@region("lowp-time-update")
def lowp_time_update() -> str:
  res = Results("low_precision_time")
  return (f"{span(res.ratio(('time', 'update'), 'kahan'))} times the master's step with Kahan "
          f"rounding and {span(res.ratio(('time', 'update'), 'stochastic'))} with stochastic "
          "rounding")


# ----------------------------------------------------------------------------- loss scaling

LOSS_SCALE_ROWS = {
    ("unclipped", "jaxamp"): "`jaxamp.dynamic_loss_scale(adam)` / adam",
    ("unclipped", "apply_if_finite"):
        "unscale + `optax.apply_if_finite(adam)` + a hand-written scale update",
    ("unclipped", "flax_dynamic_scale"):
        "flax `DynamicScale` recipe (`jnp.where` over params and optimizer state)",
    ("clipped", "clip+jaxamp"): "with `clip_by_global_norm(1.0)` first: jaxamp / clip + adam",
    ("clipped", "clip+apply_if_finite"): "the `apply_if_finite` recipe with clipping / clip + adam",
    ("clipped", "clip+flax_dynamic_scale"): "the flax recipe with clipping / clip + adam",
}
LOSS_SCALE_RUNS = {"float32": "loss_scale_float32", "bfloat16": "loss_scale_bfloat16"}


@region("loss-scale")
def loss_scale_table() -> str:
  runs = {dtype: Results(name) for dtype, name in LOSS_SCALE_RUNS.items()}
  rows = [[label] + [span(res.ratio(group, variant)) for res in runs.values()]
          for (group, variant), label in LOSS_SCALE_ROWS.items()]
  return table(["variant", *runs], rows) + "\n\n" + sources(*LOSS_SCALE_RUNS.values())


@region("loss-scale-vs-apply-if-finite")
def loss_scale_vs_apply_if_finite() -> str:
  parts = []
  for name in LOSS_SCALE_RUNS.values():
    res = Results(name)
    for group, prefix in (("unclipped", ""), ("clipped", "clip+")):
      parts.append(span(res.ratio(group, prefix + "jaxamp", prefix + "apply_if_finite")))
  verdicts = []
  for dtype, name in LOSS_SCALE_RUNS.items():
    res = Results(name)
    for group, prefix in (("unclipped", ""), ("clipped", "clip+")):
      target = res.values(group, "targets", prefix + "jaxamp")[-1]
      ratios = res.ratio(group, prefix + "jaxamp")
      clipped = " with clipping" if prefix else ""
      verdicts.append(f"{_within(ratios, target)} its target of {target}{clipped} in {dtype}")
  return (f"{parts[0]} times the `apply_if_finite` recipe's time in float32 ({parts[1]} with "
          f"clipping) and {parts[2]} in bfloat16 ({parts[3]} with clipping); against adam alone "
          f"it is " + ", ".join(verdicts))


# ----------------------------------------------------------------------------- accumulation


_IO = ("argument", "output", "alias")


@region("accumulation")
def accumulation_table() -> str:
  res = Results("accumulation")
  ms = lambda table_, variant: span(  # noqa: E731
      [s[variant] * 1e3 for s in res.values(table_, "seconds")], "{:.1f} ms")
  memory = res.values("memory")

  def mb(variant, field):
    return span([m[variant][field] / 1e6 for m in memory], "{:.1f} MB")

  def of(variant, field):
    return span([m[variant][field] / m["MultiSteps"][field] for m in memory])

  rows = [
      ["mean time per micro-step", ms("mean", "jaxamp"), ms("mean", "MultiSteps"),
       span(res.ratio("mean", "jaxamp")), "at most 0.6"],
      ["the same with `total_steps` (its end-of-run check)", ms("mean", "jaxamp total_steps"), "",
       span(res.ratio("mean", "jaxamp total_steps")), ""],
      ["`total_steps` with `raise_past_end=False`", ms("mean", "jaxamp total_steps, no callback"),
       "", span(res.ratio("mean", "jaxamp total_steps, no callback")), ""],
      ["accumulating micro-step, as a multiple of plain adam",
       span(res.ratio("by_kind", "jaxamp accumulating"), "{:.2f}x"),
       span(res.ratio("by_kind", "MultiSteps accumulating"), "{:.2f}x"),
       span(res.ratio("by_kind", "jaxamp accumulating", "MultiSteps accumulating")), ""],
      ["emitting micro-step, as a multiple of plain adam",
       span(res.ratio("by_kind", "jaxamp closing"), "{:.2f}x"),
       span(res.ratio("by_kind", "MultiSteps closing"), "{:.2f}x"),
       span(res.ratio("by_kind", "jaxamp closing", "MultiSteps closing")), ""],
      ["persistent state", mb("jaxamp", "state"), mb("MultiSteps", "state"),
       of("jaxamp", "state"), "at most 1.0"],
      ["temporaries", mb("jaxamp", "temp"), mb("MultiSteps", "temp"), of("jaxamp", "temp"),
       "at most 1.0"],
      ["arguments / outputs / aliased", " / ".join(mb("jaxamp", f) for f in _IO),
       " / ".join(mb("MultiSteps", f) for f in _IO), "", ""],
  ]
  return (table(["", "`jaxamp.accumulate_gradients`", "`optax.MultiSteps`", "jaxamp / MultiSteps",
                 "target"], rows) + "\n\n" + sources("accumulation"))


@region("multisteps-cost")
def multisteps_cost() -> str:
  res = Results("accumulation")
  return (f"{span(res.ratio('by_kind', 'MultiSteps accumulating'), '{:.1f}x')} the time of a "
          f"plain adam step, {span(res.ratio('by_kind', 'MultiSteps closing'), '{:.1f}x')} on the "
          "micro-step that closes a window")


# ----------------------------------------------------------------------------- facades


def _within(ratios: Sequence[float], target: float) -> str:
  return "within" if max(ratios) <= target else "over"


@region("optim-wrapper")
def optim_wrapper_table() -> str:
  res = Results("optim_wrapper")
  rows = [["`AmpOptimWrapper.update_params`, `accumulative_counts=1`",
           span(res.ratio("acc1", "amp_wrapper")), "at most 1.10"],
          ["the same with `donate=True`", span(res.ratio("acc1", "amp_wrapper_donate")),
           "at most 1.10"],
          ["`accumulative_counts=4`, per micro-batch, against the core with "
           "`accumulate_gradients(..., 4)`", span(res.ratio("acc4", "amp_wrapper_acc4")), ""],
          ["the same with `donate=True`", span(res.ratio("acc4", "amp_wrapper_acc4_donate")), ""]]
  return (table(["loop", "time / functional core", "target"], rows) + "\n\n"
          + sources("optim_wrapper"))


GRAD_SCALER_ROWS = {
    "torch_donate": "`GradScaler` + `OptimWrapper(..., donate=True)` (PyTorch style; params, "
                    "state and gradients donated, as the core's)",
    "paddle_donate": "`jaxamp.paddle.GradScaler.minimize` + `OptimWrapper(..., donate=True)` "
                     "(Paddle style)",
    "torch_style": "the PyTorch-style loop with the default holder (`donate=False`)",
    "paddle_style": "the Paddle-style loop with the default holder",
    "torch_no_watch": "the PyTorch-style loop, default holder, `on_stall='ignore'`",
    "adam": "the core's step without loss scaling",
}


@region("grad-scaler")
def grad_scaler_table() -> str:
  res = Results("grad_scaler")
  targets = res.runs[-1]["results"]["loops"]["targets"]
  rows = [[label, span(res.ratio("loops", variant)),
           f"at most {targets[variant]:.2f}" if variant in targets else ""]
          for variant, label in GRAD_SCALER_ROWS.items()]
  return (table(["loop", "time / functional core", "target"], rows) + "\n\n"
          + sources("grad_scaler"))


@region("grad-scaler-target")
def grad_scaler_target() -> str:
  res = Results("grad_scaler")
  torch, paddle = res.ratio("loops", "torch_donate"), res.ratio("loops", "paddle_donate")
  return (f"the PyTorch-style loop is {_within(torch, 1.10)} its target ({span(torch)}) and the "
          f"Paddle-style loop {_within(paddle, 1.10)} it ({span(paddle)})")


@region("grad-scaler-watch")
def grad_scaler_watch() -> str:
  return span(Results("grad_scaler").ratio("loops", "torch_no_watch", "torch_style"))


# ----------------------------------------------------------------------------- many devices

SHARDING_LAYOUTS = {"dp": "data parallel, `jit` + `NamedSharding`",
                    "fsdp": "fully sharded (FSDP-style), `jit` + `NamedSharding`",
                    "shard_map": "data parallel, `shard_map` (`lax.pmean`, `axis_name`)"}


@region("sharding")
def sharding_table() -> str:
  many, one = Results("sharding"), Results("sharding_1_device")
  devices = many.runs[-1]["results"]["devices"]
  rows = [[label, f"`{many.runs[-1]['results'][layout]['added']}`",
           span(many.ratio((layout, "step"), "jaxamp")),
           span(one.ratio((layout, "step"), "jaxamp"))]
          for layout, label in SHARDING_LAYOUTS.items()]
  return (table(["layout", "communication added by jaxamp",
                 f"time / plain adam, {devices} devices", "1 device"], rows)
          + "\n\n" + sources("sharding", "sharding_1_device"))


# ----------------------------------------------------------------------------- autocast

AUTOCAST_PROBLEMS = {"mlp": "MLP 512 -> 3 x 512 -> 64, batch 256",
                     "block": "transformer block, d 256, 4 heads, sequence 128, batch 8"}


@region("autocast-step")
def autocast_step() -> str:
  res = Results("autocast")
  rows = []
  for key, label in AUTOCAST_PROBLEMS.items():
    base = span([s["float32"] * 1e3 for s in res.values(key, "step", "seconds")], "{:.1f} ms")
    rows.append([f"{label} (float32 step {base})", "1.00",
                 span(res.ratio((key, "step"), "whole_cast")),
                 span(res.ratio((key, "step"), "autocast"))])
  return (table(["problem", "float32", "whole cast", "autocast"], rows) + "\n\n"
          + sources("autocast"))


@region("autocast-compile")
def autocast_compile() -> str:
  res = Results("autocast")
  rows = []
  for key, label in AUTOCAST_PROBLEMS.items():
    cells = []
    for variant in ("float32", "whole_cast", "autocast"):
      trace = span([t[variant] for t in res.values(key, "trace_s")])
      compile_s = span([c[variant] for c in res.values(key, "compile_s")])
      cells.append(f"{trace} / {compile_s}")
    rows.append([label.split(",")[0], *cells])
  return (table(["problem", "float32", "whole cast", "autocast"], rows) + "\n\n"
          + sources("autocast"))


@region("autocast-vs-whole-cast")
def autocast_vs_whole_cast() -> str:
  res = Results("autocast")
  parts = []
  for key, label in (("mlp", "the MLP"), ("block", "the transformer block")):
    parts.append(f"{span(res.ratio((key, 'step'), 'autocast', 'whole_cast'))} times whole "
                 f"casting's on {label}")
  return "autocast's step took " + " and ".join(parts)


# ----------------------------------------------------------------------------- compile time

COMPILE_COLUMNS = {"check_only": "`check_only`", "jaxamp": "`jaxamp`",
                   "jaxamp_plain_select": "`jaxamp`, plain selection",
                   "apply_if_finite": "`apply_if_finite`", "train_state": "`TrainState`"}


def _compile_problems(*names: str) -> Dict[str, List[dict]]:
  """``{label: [one problem's results per run]}`` over the given results files, in order."""
  problems: Dict[str, List[dict]] = {}
  for name in names:
    for run in Results(name).runs:
      for problem in run["results"]["problems"]:
        label = problem["problem"]
        if problem["problem"] == "LM":
          label = "LM, autocast" if problem["autocast"] else "LM, float16 cast"
        elif problem["autocast"]:
          label += ", autocast"
        problems.setdefault(label, []).append(problem)
  return problems


def _seconds(value: float) -> str:
  return f"{value:.2f} s" if value < 1 else f"{value:.1f} s"


@region("compile-time")
def compile_time() -> str:
  names = ("compile", "compile_1000", "compile_autocast", "compile_autocast_1000")
  rows = []
  for label, runs in _compile_problems(*names).items():
    plain = [p["medians"]["plain"]["compile"] for p in runs]
    shown = sorted({_seconds(v) for v in plain})
    row = [label, " to ".join([shown[0], shown[-1]] if len(shown) > 1 else shown)]
    for variant in COMPILE_COLUMNS:
      ratios = [p["medians"][variant]["compile"] / p["medians"]["plain"]["compile"]
                for p in runs if variant in p["medians"]]
      row.append(span(ratios) if ratios else "")
    rows.append(row)
  return (table(["problem", "plain step", *COMPILE_COLUMNS.values()], rows) + "\n\n"
          + sources(*names))


@region("compile-hlo")
def compile_hlo() -> str:
  problems = _compile_problems("compile", "compile_1000")
  variants = {"plain": "plain step", "check_only": "`check_only`", "jaxamp": "`jaxamp`",
              "apply_if_finite": "`apply_if_finite`"}
  rows = []
  for label in ("100 leaves", "1000 leaves", "LM, float16 cast"):
    counts = problems[label][-1]["counts"]
    rows.append([label] + [f"{counts[v]['hlo_instructions']:,} / {counts[v]['hlo_computations']:,}"
                           for v in variants])
  return table(["problem", *variants.values()], rows) + "\n\n" + sources("compile", "compile_1000")


@region("compile-xla-passes")
def compile_xla_passes() -> str:
  problems = _compile_problems("compile_xla_passes")
  columns = {"HLO passes": "HLO passes", "code generation": "code generation",
             "kernels": "kernels", "kernel codegen": "their compile",
             "pass copy-insertion": "copy insertion", "pass layout-assignment": "layout assignment"}
  rows = []
  for label, runs in problems.items():
    medians = runs[-1]["medians"]
    for variant in ("plain", "check_only", "jaxamp", "apply_if_finite"):
      if variant in medians:
        cells = [f"{medians[variant].get(k, 0):.0f}" if k == "kernels"
                 else f"{medians[variant].get(k, 0):.3f}" for k in columns]
        rows.append([f"{label}, {variant if variant == 'plain' else f'`{variant}`'}", *cells])
  return (table(["problem, variant", *columns.values()], rows) + "\n\n"
          + sources("compile_xla_passes"))


ATTRIBUTE_ROWS = {
    "jaxamp": "as it is",
    "jaxamp:no_check": "without the check (every step finite)",
    "jaxamp:flag_per_leaf": "the flags computed leaf by leaf (before)",
    "jaxamp:simple_unscale": "unscaling as one product, no selection",
    "jaxamp:no_selection": "without the selection (update unselected)",
    "jaxamp:no_scale_update": "without the scale update",
    "jaxamp:no_barriers": "without the optimization barriers",
    "check_only": "`check_only`",
    "apply_if_finite": "`apply_if_finite`",
}


@region("compile-attribute")
def compile_attribute() -> str:
  problems = _compile_problems("compile_attribute")
  ten, hundred = problems["10 leaves"][-1], problems["100 leaves"][-1]

  def ratio(problem, variant):
    return problem["medians"][variant]["compile"] / problem["medians"]["plain"]["compile"]

  rows = []
  for variant, label in ATTRIBUTE_ROWS.items():
    counts = hundred["counts"][variant]
    rows.append([label, f"{ratio(ten, variant):.2f}", f"{ratio(hundred, variant):.2f}",
                 f"{counts['hlo_instructions']:,} / {counts['hlo_computations']:,}",
                 f"{ten['medians'][variant]['kernels']:.0f} / "
                 f"{hundred['medians'][variant]['kernels']:.0f}"])
  return (table(["the loss-scaled step", "compile / plain, 10 leaves", "100 leaves",
                 "instructions / computations, 100 leaves", "kernels, 10 / 100 leaves"], rows)
          + "\n\n" + sources("compile_attribute"))


def _compile_ratios(variant: str, problems: Dict[str, List[dict]]) -> Dict[str, List[float]]:
  return {label: [p["medians"][variant]["compile"] / p["medians"]["plain"]["compile"]
                  for p in runs if variant in p["medians"]]
          for label, runs in problems.items()}


@region("compile-summary")
def compile_summary() -> str:
  problems = _compile_problems("compile", "compile_1000", "compile_autocast",
                               "compile_autocast_1000")
  jaxamp_ = _compile_ratios("jaxamp", problems)
  peer = _compile_ratios("apply_if_finite", problems)
  check = _compile_ratios("check_only", problems)
  leaves = [r for label, rs in jaxamp_.items() if "leaves" in label for r in rs]
  below = [label for label in jaxamp_ if max(jaxamp_[label]) <= min(peer[label])]
  return (f"the loss-scaled step (`jaxamp`) compiles in {span(leaves)} times the plain step's "
          f"time over the leaf sweep, {span(jaxamp_['LM, float16 cast'])} on the float16 LM and "
          f"{span(jaxamp_['LM, autocast'])} on the LM under autocast, in no more time than "
          f"`apply_if_finite`'s in {len(below)} of the {len(jaxamp_)} problems; `check_only`, the "
          "plain step plus the check alone, with nothing else of loss scaling, compiles in "
          f"{span([r for rs in check.values() for r in rs])} times the plain step's time")


def _xla(label: str, variant: str, key: str) -> float:
  return _compile_problems("compile_xla_passes")[label][-1]["medians"][variant][key]


@region("compile-per-kernel")
def compile_per_kernel() -> str:
  """The kernels' compile seconds per extra kernel of the loss-scaled step, at 10 leaves."""
  extra = _xla("10 leaves", "jaxamp", "kernels") - _xla("10 leaves", "plain", "kernels")
  seconds = (_xla("10 leaves", "jaxamp", "kernel codegen")
             - _xla("10 leaves", "plain", "kernel codegen"))
  return f"about {1e3 * seconds / extra:.0f} ms of CPU per distinct kernel"


@region("compile-codegen-10")
def compile_codegen_10() -> str:
  return (f"{_xla('10 leaves', 'jaxamp', 'code generation'):.3f} s against "
          f"{_xla('10 leaves', 'plain', 'code generation'):.3f} s")


@region("compile-passes-400")
def compile_passes_400() -> str:
  counts = _compile_problems("compile")["400 leaves"][-1]["counts"]
  return (f"At 400 leaves the HLO passes take {_xla('400 leaves', 'jaxamp', 'HLO passes'):.2f} s "
          f"against {_xla('400 leaves', 'plain', 'HLO passes'):.2f} s, mostly copy insertion and "
          "layout assignment, which grow faster than the number of instructions "
          f"({counts['jaxamp']['hlo_instructions']:,} against "
          f"{counts['plain']['hlo_instructions']:,}) and buffers")


@region("compile-check-only-400")
def compile_check_only_400() -> str:
  return f"{_xla('400 leaves', 'check_only', 'HLO passes'):.2f} s"


@region("compile-check-share")
def compile_check_share() -> str:
  problems = _compile_problems("compile_attribute")
  shares = []
  for label in ("10 leaves", "100 leaves"):
    medians = problems[label][-1]["medians"]
    shares.append((medians["jaxamp"]["compile"] - medians["jaxamp:no_check"]["compile"])
                  / medians["plain"]["compile"])
  return (f"{shares[0]:.2f} times the plain step's compile at 10 leaves, {shares[1]:.2f} at 100, "
          "in the table's run")


# ----------------------------------------------------------------------------- line counts

# ``wc -l`` of the modules before the module layout of docs/design.md (a one-off count), and the
# modules that layout removed.
LINES_BEFORE = {
    "__init__.py": 69, "paddle.py": 5, "nnx.py": 5, "_src/facade/builder.py": 855,
    "_src/facade/torch.py": 720, "_src/facade/paddle.py": 428, "_src/clipping.py": 201,
    "_src/sharding.py": 208, "_src/numerics.py": 590, "_src/loss_scale.py": 479,
    "_src/accumulation.py": 469, "_src/microbatch.py": 224, "_src/train_state.py": 230,
    "_src/policy.py": 184, "_src/nnx_optimizer.py": 87, "demo/cli.py": 145,
}
GONE = {
    "_src/facade/mmengine.py": ("1885", "(the package `_src/facade/mmengine/`)"),
    "_src/facade/mmengine/hyperparams.py":
        ("", "(split: `facade/hyperparam_codecs.py`, `mmengine/param_groups.py`)"),
    "_src/facade/scaler_core.py": ("", "(split: `holder.py`, `stages.py`, `scaler_state.py`)"),
    "conftest.py": ("6", "(moved to the repository root)"),
    "demo/progress.py": ("107", "(replaced by `rich`)"),
}


def module_lines() -> Dict[str, int]:
  """``wc -l`` of every module of the package, by path under ``jaxamp/``."""
  package = ROOT / "jaxamp"
  return {path.relative_to(package).as_posix(): len(path.read_bytes().splitlines())
          for path in sorted(package.rglob("*.py"))}


def _module_order(path: str) -> tuple:
  parts = path.split("/")
  return (len(parts) > 1 and parts[0] == "demo", parts[:-1], parts[-1] != "__init__.py", parts[-1])


@region("design-line-counts")
def design_line_counts() -> str:
  lines = module_lines()
  rows = [[f"`{path}`", str(LINES_BEFORE.get(path, "")), str(count)]
          for path, count in sorted(lines.items(), key=lambda kv: _module_order(kv[0]))]
  rows += [[f"`{path}`", before, now] for path, (before, now) in GONE.items()]
  facade = sum(n for p, n in lines.items() if p.startswith("_src/facade/"))
  rows.append(["**`_src/facade/`, in all**", "", f"**{facade}**"])
  rows.append(["**`jaxamp/`, in all**", "", f"**{sum(lines.values())}**"])
  return (table(["module", "before", "now"], rows, "lrr")
          + "\n\n*`wc -l`, computed by `python benchmarks/render_docs.py design-line-counts` "
            "(`tests/test_doc_figures.py` fails when a count differs from the files); the "
            "\"before\" column is a one-off count of the modules before this layout.*")


def docstring_lines(path: pathlib.Path) -> int:
  """The lines of ``path`` taken by docstrings (of the module, its classes and functions)."""
  tree = ast.parse(path.read_text())
  total = 0
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      body = node.body
      if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
          and isinstance(body[0].value.value, str):
        total += body[0].end_lineno - body[0].lineno + 1
  return total


def code_lines(path: pathlib.Path) -> int:
  """The lines of ``path`` that are neither blank, comments nor docstrings."""
  lines = path.read_text().splitlines()
  blank = sum(1 for line in lines if not line.strip() or line.strip().startswith("#"))
  return len(lines) - blank - docstring_lines(path)


OPTIM_WRAPPER = ROOT / "jaxamp" / "_src" / "facade" / "mmengine" / "optim_wrapper.py"


@region("optim-wrapper-docstring-lines")
def optim_wrapper_docstring_lines() -> str:
  total = len(OPTIM_WRAPPER.read_text().splitlines())
  return f"About {round(docstring_lines(OPTIM_WRAPPER), -1)} of its {total} lines are docstrings"


@region("optim-wrapper-code-lines")
def optim_wrapper_code_lines() -> str:
  return f"about {round(code_lines(OPTIM_WRAPPER), -1)} lines"


# ----------------------------------------------------------------------------- rendering


def pages() -> List[pathlib.Path]:
  return sorted(p for pattern in PAGES for p in ROOT.glob(pattern))


def render_text(text: str, only: Sequence[str] = ()) -> str:
  """``text`` with every region (or those in ``only``) rendered anew."""
  def replace(match, block):
    name = match.group("name")
    if name not in REGIONS:
      raise KeyError(f"unknown region {name!r}; the regions are {sorted(REGIONS)}")
    if only and name not in only:
      return match.group(0)
    body = REGIONS[name]()
    body = body + "\n" if block else body
    return match.group(1) + body + match.group(4)

  text = _BLOCK.sub(lambda m: replace(m, True), text)
  return _INLINE.sub(lambda m: replace(m, False), text)


def region_names(text: str) -> List[str]:
  return [m.group("name") for pattern in (_BLOCK, _INLINE) for m in pattern.finditer(text)]


def stale_regions(path: pathlib.Path, only: Sequence[str] = ()) -> List[str]:
  """The regions of ``path`` whose text differs from their rendering."""
  text = path.read_text()
  out = []
  for pattern, block in ((_BLOCK, True), (_INLINE, False)):
    for match in pattern.finditer(text):
      name = match.group("name")
      if only and name not in only:
        continue
      body = REGIONS[name]() + ("\n" if block else "")
      if match.group("body") != body:
        out.append(name)
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
  parser.add_argument("regions", nargs="*", metavar="REGION",
                      help="regions to render (default: all)")
  parser.add_argument("--check", action="store_true",
                      help="rewrite nothing; exit 1 and name the regions that are stale")
  args = parser.parse_args(argv)
  unknown = sorted(set(args.regions) - set(REGIONS))
  if unknown:
    parser.error(f"unknown regions {unknown}; the regions are {sorted(REGIONS)}")
  stale = []
  for path in pages():
    if args.check:
      stale += [f"{path.relative_to(ROOT)}: {name}" for name in stale_regions(path, args.regions)]
      continue
    text = path.read_text()
    new = render_text(text, args.regions)
    if new != text:
      path.write_text(new)
      print(f"rendered {path.relative_to(ROOT)}")
  if stale:
    print("stale: " + ", ".join(stale) + "\nrender them: python benchmarks/render_docs.py "
          + " ".join(sorted({s.split(': ')[1] for s in stale})))
    return 1
  return 0


if __name__ == "__main__":
  sys.path.insert(0, str(ROOT))
  sys.exit(main())
