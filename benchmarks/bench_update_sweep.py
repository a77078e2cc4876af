"""The cost of loss scaling over leaf sizes: the optimizer update alone and the whole step.

Each cell of the sweep is ``L x N``: ``L`` float32 parameter leaves of ``N``
elements each (1-D). For each cell and each mode the variants below are
jitted with params and optimizer state donated, timed interleaved round after
round, and printed as ratios of medians to the baseline:

- ``given`` (the optimizer update alone): float32 gradients are passed in;
  baseline ``adam`` (``optax.adam``), against ``jaxamp``
  (``jaxamp.dynamic_loss_scale(adam)``), ``apply_if_finite`` (unscale by hand,
  ``optax.apply_if_finite(adam)``, a hand-written scale update) and
  ``flax_dynamic_scale`` (flax's recipe: unscale and check, update, ``where``
  over new and old params and state). The variants are those of
  ``bench_loss_scale.py``.
- ``computed`` (the whole step, update-bound): the gradients of a float16 loss
  (each leaf cast to float16, ``mean((p - 0.5) ** 2)`` summed over leaves) are
  computed in the step; baseline ``plain_f16`` (the same step without loss
  scaling), against ``jaxamp`` (``scale_loss``, ``dynamic_loss_scale``),
  ``apply_if_finite`` and ``flax_dynamic_scale`` (``DynamicScale.value_and_grad``).

With ``--clip yes`` (or ``both``, the default) every variant runs again with
``optax.clip_by_global_norm(1.0)`` before adam, and the clipped ratios are to
the clipped baseline. Each ratio is the median over rounds of the variant's
time in that round over the baseline's, with the lower and upper quartiles as
its spread. ``--json PATH`` writes every cell's medians, ratios and spreads,
with the machine, the JAX version and the jaxamp commit, for
``benchmarks/compare_commits.py`` and for the documentation's tables.

Run: ``python benchmarks/bench_update_sweep.py [--grid full|issue|quick] [--cells 32x131072,...]
[--modes given,computed] [--clip no|yes|both] [--rounds R] [--device cpu|gpu] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _jaxamp_path(argv: Optional[Sequence[str]]) -> str:
  """The source tree whose jaxamp this run imports (``--jaxamp DIR``, read before any import)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  for i, arg in enumerate(argv):
    if arg == "--jaxamp" and i + 1 < len(argv):
      return os.path.abspath(argv[i + 1])
    if arg.startswith("--jaxamp="):
      return os.path.abspath(arg.split("=", 1)[1])
  return _ROOT


sys.path.insert(0, _ROOT)
if __name__ == "__main__":
  sys.path.insert(0, _jaxamp_path(None))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxamp  # noqa: E402
from benchmarks import bench_loss_scale  # noqa: E402
from benchmarks.record import cpu_model  # noqa: E402
from benchmarks.bench_loss_scale import INIT_SCALE  # noqa: E402

# ----------------------------------------------------------------------------- the grid

#: Cells (leaves, elements per leaf). ``full`` covers the corners of 1 to 1000 leaves and 10^3 to
#: 1.6 x 10^7 elements, with at most 1.6 x 10^7 parameters in a cell.
GRIDS: Dict[str, List[Tuple[int, int]]] = {
    "full": [(1, 1_000), (1000, 1_000), (512, 8_192), (64, 65_536), (32, 131_072),
             (4, 1_048_576), (1, 4_000_000), (16, 1_000_000), (1, 16_000_000)],
    "issue": [(32, 131_072), (512, 8_192), (4, 1_048_576), (1, 4_000_000)],
    "quick": [(2, 1_000), (1, 70_000)],
}

#: Targets of the update alone from this many elements per leaf up (see docs/benchmarks.md).
TARGET_FROM = 65_536
TARGETS = {("given", False): 1.15, ("given", True): 1.03}


def parse_cells(text: str) -> List[Tuple[int, int]]:
  """``"32x131072,4x1048576"`` as ``[(32, 131072), (4, 1048576)]``."""
  cells = []
  for part in text.split(","):
    leaves, _, elements = part.strip().lower().partition("x")
    try:
      cell = (int(leaves), int(float(elements)))
    except ValueError:
      raise ValueError(f"a cell is LEAVESxELEMENTS, e.g. 32x131072, got {part!r}") from None
    if min(cell) < 1:
      raise ValueError(f"a cell needs at least one leaf of one element, got {part!r}")
    cells.append(cell)
  return cells


def make_params(leaves: int, elements: int, seed: int = 0) -> Dict[str, jax.Array]:
  """``leaves`` float32 vectors of ``elements`` standard normal values."""
  rng = np.random.default_rng(seed)
  return {f"leaf_{i:04d}": jnp.asarray(rng.standard_normal(elements, np.float32))
          for i in range(leaves)}


# ----------------------------------------------------------------------------- computed mode


def half_loss(params) -> jax.Array:
  """An update-bound float16 loss: ``mean((p - 0.5) ** 2)`` of each leaf in float16, summed."""
  terms = [jnp.mean(jnp.square(p.astype(jnp.float16) - jnp.float16(0.5)).astype(jnp.float32))
           for p in jax.tree.leaves(params)]
  return jnp.sum(jnp.stack(terms))


def plain_f16(inner):
  def step(params, state, _):
    updates, state = inner.update(jax.grad(half_loss)(params), state, params)
    return optax.apply_updates(params, updates), state

  return inner.init, step


def _scaler(inner, **kwargs):
  return jaxamp.dynamic_loss_scale(inner, init_scale=INIT_SCALE,
                                   growth_interval=bench_loss_scale.GROWTH_INTERVAL, **kwargs)


def jaxamp_update(inner, **kwargs):
  tx = _scaler(inner, **kwargs)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return tx.init, step


def jaxamp_step(inner, **kwargs):
  tx = _scaler(inner, **kwargs)

  def step(params, state, _):
    grads = jax.grad(lambda p: jaxamp.scale_loss(half_loss(p), state))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return tx.init, step


def apply_if_finite_step(inner):
  init, update = bench_loss_scale.with_apply_if_finite(inner)

  def step(params, state, _):
    return update(params, state, jax.grad(lambda p: half_loss(p) * state.scale)(params))

  return init, step


def flax_dynamic_scale_step(inner):
  from flax.training import dynamic_scale  # flax is optional: imported when this variant runs

  def init(params):
    scale = dynamic_scale.DynamicScale(fin_steps=jnp.zeros([], jnp.int32),
                                       scale=jnp.asarray(INIT_SCALE, jnp.float32))
    return scale, inner.init(params)

  def step(params, state, _):
    scale, opt_state = state
    scale, is_fin, _, grads = scale.value_and_grad(half_loss)(params)
    updates, new_opt_state = inner.update(grads, opt_state, params)
    keep = lambda new, old: jnp.where(is_fin, new, old)  # noqa: E731
    return (jax.tree.map(keep, optax.apply_updates(params, updates), params),
            (scale, jax.tree.map(keep, new_opt_state, opt_state)))

  return init, step


#: mode -> (baseline, {variant: make(inner) -> (init, step(params, state, grads))}). ``jaxamp``
#: takes the defaults; ``jaxamp_warn`` (only when asked for) ``on_stall="warn"``.
MODES: Dict[str, Tuple[str, Dict[str, Callable]]] = {
    "given": ("adam", {"adam": bench_loss_scale.plain,
                       "jaxamp": jaxamp_update,
                       "jaxamp_warn": functools.partial(jaxamp_update, on_stall="warn"),
                       "apply_if_finite": bench_loss_scale.with_apply_if_finite,
                       "flax_dynamic_scale": bench_loss_scale.with_flax_dynamic_scale}),
    "computed": ("plain_f16", {"plain_f16": plain_f16,
                               "jaxamp": jaxamp_step,
                               "jaxamp_warn": functools.partial(jaxamp_step, on_stall="warn"),
                               "apply_if_finite": apply_if_finite_step,
                               "flax_dynamic_scale": flax_dynamic_scale_step}),
}

# ----------------------------------------------------------------------------- timing


def time_interleaved(steps: Dict[str, Callable[[], None]], rounds: int, min_sample: float
                     ) -> Tuple[Dict[str, List[float]], Dict[str, float]]:
  """Seconds per call of each step in each round, the steps interleaved in a rotating order.

  Each sample runs a step as many times as it takes (measured once before) to
  last ``min_sample`` seconds, so that short steps are not timed one by one.
  Also returns each step's minor page faults per call (on XLA:CPU, a step
  whose temporaries exceed the allocator's mmap threshold, 32 MiB in glibc,
  maps and faults in fresh pages on every call).
  """
  calls = {}
  for name, run in steps.items():
    run()
    run()  # compiled and warm
    start = time.perf_counter()
    run()
    calls[name] = max(1, int(np.ceil(min_sample / max(time.perf_counter() - start, 1e-9))))
  names = list(steps)
  samples: Dict[str, List[float]] = {name: [] for name in names}
  faults = dict.fromkeys(names, 0)
  for r in range(rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
      before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      start = time.perf_counter()
      for _ in range(calls[name]):
        steps[name]()
      samples[name].append((time.perf_counter() - start) / calls[name])
      faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
  return samples, {name: faults[name] / (rounds * calls[name]) for name in names}


def ratio_stats(samples: Sequence[float], base: Sequence[float]) -> Dict[str, float]:
  """The median and the quartiles of the per-round ratios ``samples[r] / base[r]``."""
  ratios = np.asarray(samples) / np.asarray(base)
  low, mid, high = np.percentile(ratios, [25, 50, 75])
  return {"ratio": float(mid), "low": float(low), "high": float(high)}


def run_cell(leaves: int, elements: int, mode: str, clip: bool, variants: Sequence[str],
             rounds: int, min_sample: float) -> Dict[str, Any]:
  """Times one cell in one mode; returns its record (medians in seconds, ratios to the baseline)."""
  baseline, makers = MODES[mode]
  params = make_params(leaves, elements)
  # The gradients of a loss scaled by INIT_SCALE: finite, so no step is skipped.
  grads = jax.tree.map(lambda p: p * jnp.float32(1e-3 * INIT_SCALE), params)
  inner = optax.adam(1e-3)
  if clip:
    inner = optax.chain(optax.clip_by_global_norm(1.0), inner)
  names = [baseline] + [v for v in variants if v != baseline and v in makers]
  steps = {name: bench_loss_scale.make_runner(makers[name], inner, params, grads)
           for name in names}
  samples, faults = time_interleaved(steps, rounds, min_sample)
  del steps
  medians = {name: statistics.median(v) for name, v in samples.items()}
  return {"leaves": leaves, "elements": elements, "mode": mode, "clip": clip,
          "baseline": baseline, "rounds": rounds, "medians": medians,
          "page_faults_per_call": faults,
          "ratios": {name: ratio_stats(samples[name], samples[baseline]) for name in names}}


# ----------------------------------------------------------------------------- output


def commit_of(path: str) -> str:
  """The git commit of the source tree at ``path`` (with ``+`` when it has uncommitted changes).

  A tree exported by ``compare_commits.py`` names its commit in a file ``COMMIT``.
  """
  if os.path.exists(os.path.join(path, "COMMIT")):
    with open(os.path.join(path, "COMMIT")) as f:
      return f.read().strip()
  try:
    head = subprocess.run(["git", "-C", path, "rev-parse", "--short=7", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", path, "status", "--porcelain", "--untracked-files=no"],
                           check=True, capture_output=True, text=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return head + ("+" if dirty else "")


def _reproducing(argv: Sequence[str]) -> List[str]:
  """``argv`` without where it wrote (``--json``, ``--append``) or which tree it imported."""
  out, skip = [], False
  for arg in argv:
    if skip:
      skip = False
    elif arg in ("--json", "--jaxamp"):
      skip = True
    elif arg != "--append" and not arg.startswith(("--json=", "--jaxamp=")):
      out.append(arg)
  return out


def provenance(argv: Sequence[str], jaxamp_path: str) -> Dict[str, Any]:
  """Where a run comes from: command, jaxamp's commit, date, machine (and its load), versions."""
  import jaxlib

  commit = commit_of(jaxamp_path)
  devices = jax.devices()
  return {
      "command": " ".join(["python", "benchmarks/bench_update_sweep.py", *argv]),
      "commit": commit.rstrip("+"), "uncommitted_changes": commit.endswith("+"),
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "system": platform.system(),
                  "load_average": [round(x, 2) for x in os.getloadavg()]},
      "devices": f"{len(devices)} x {devices[0].device_kind} ({jax.default_backend()})",
      "jax": jax.__version__, "jaxlib": jaxlib.__version__, "optax": optax.__version__,
      "python": platform.python_version(),
  }


def earlier_runs(path: Optional[str], append: bool) -> List[Dict[str, Any]]:
  """The runs already in ``path`` when appending to it, else none."""
  if not (path and append and os.path.exists(path)):
    return []
  with open(path) as f:
    return json.load(f)["runs"]


def write_json(path: str, runs: List[Dict[str, Any]]) -> None:
  """Writes ``{"runs": runs}`` to ``path``."""
  with open(path, "w") as f:
    json.dump({"runs": runs}, f, indent=1, sort_keys=True)
    f.write("\n")


def _cell_name(record) -> str:
  return f"{record['leaves']} x {record['elements']:,}"


def print_record(record) -> None:
  clip = record["clip"]
  base = record["baseline"] if not clip else f"clip+{record['baseline']}"
  target = TARGETS.get((record["mode"], clip)) if record["elements"] >= TARGET_FROM else None
  cells = []
  for name, r in record["ratios"].items():
    if name == record["baseline"]:
      continue
    mark = ""
    if name == "jaxamp" and target is not None:
      mark = " ok" if r["ratio"] <= target else f" > {target}"
    faults = record.get("page_faults_per_call", {}).get(name)
    shown = "" if faults is None else f" {faults:.0f}pf"
    cells.append(f"{name} {r['ratio']:.2f} [{r['low']:.2f}-{r['high']:.2f}]{shown}{mark}")
  print(f"  {_cell_name(record):>16}  {record['mode']:<8} {'clip' if clip else '    '}  "
        f"{base} {record['medians'][record['baseline']] * 1e3:8.2f} ms | " + " | ".join(cells),
        flush=True)


def _records_by_key(paths: Sequence[str]) -> Dict[tuple, List[Dict[str, Any]]]:
  table: Dict[tuple, List[Dict[str, Any]]] = {}
  for path in paths:
    with open(path) as f:
      for run in json.load(f)["runs"]:
        for record in run["results"]["records"]:
          key = (record["leaves"], record["elements"], record["mode"], record["clip"])
          table.setdefault(key, []).append(record)
  return table


def markdown(before: Sequence[str], after: Sequence[str]) -> str:
  """Markdown tables of the results files ``after`` (and jaxamp's ratios in ``before``).

  One table per mode: a row per cell, with jaxamp's ratio before and after
  (the median, and the quartiles after) and the peers' ratios after, without
  and with clipping. Where a file holds a cell twice, the median of its runs.
  """
  old, new = _records_by_key(before), _records_by_key(after)

  def ratio(records, name, field="ratio"):
    values = [r["ratios"][name][field] for r in records if name in r["ratios"]]
    return statistics.median(values) if values else None

  def fmt(x):
    return "" if x is None else f"{x:.2f}"

  out = []
  for mode, (baseline, _) in MODES.items():
    cells = sorted({(k[0], k[1]) for k in new if k[2] == mode}, key=lambda c: (c[0] * c[1], c))
    if not cells:
      continue
    head = ["cell (leaves x elements)"]
    for clip in (False, True):
      base = f"clip+{baseline}" if clip else baseline
      head += [f"jaxamp before / {base}", "jaxamp after", "apply_if_finite", "flax DynamicScale"]
    out.append("| " + " | ".join(head) + " |")
    out.append("| " + " | ".join(["---"] * len(head)) + " |")
    for leaves, elements in cells:
      row = [f"{leaves} x {elements:,}"]
      for clip in (False, True):
        recs = new.get((leaves, elements, mode, clip), [])
        after = ratio(recs, "jaxamp")
        spread = (f" ({fmt(ratio(recs, 'jaxamp', 'low'))}-{fmt(ratio(recs, 'jaxamp', 'high'))})"
                  if after is not None else "")
        row += [fmt(ratio(old.get((leaves, elements, mode, clip), []), "jaxamp")),
                fmt(after) + spread, fmt(ratio(recs, "apply_if_finite")),
                fmt(ratio(recs, "flax_dynamic_scale"))]
      out.append("| " + " | ".join(row) + " |")
    out.append("")
  return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--grid", choices=sorted(GRIDS), default="full")
  parser.add_argument("--cells", help="LEAVESxELEMENTS,... instead of --grid (e.g. 32x131072)")
  parser.add_argument("--modes", default="given,computed", help="given, computed or both")
  parser.add_argument("--clip", choices=("no", "yes", "both"), default="both")
  parser.add_argument("--variants", default="jaxamp,apply_if_finite,flax_dynamic_scale",
                      help="variants besides the baseline")
  parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
  parser.add_argument("--min-sample", type=float, default=0.05,
                      help="seconds each timed sample lasts at least (several calls if needed)")
  parser.add_argument("--device", choices=("cpu", "gpu", "tpu"), default=None,
                      help="the backend to run on (default: JAX's default, a GPU when present)")
  parser.add_argument("--jaxamp", metavar="DIR", default=None,
                      help="import jaxamp from this source tree (benchmarks/compare_commits.py)")
  parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
  parser.add_argument("--append", action="store_true",
                      help="with --json: add this run to the runs already in PATH")
  parser.add_argument("--markdown", nargs="+", metavar="JSON",
                      help="time nothing: print the tables of these results files (after "
                           "--before's, whose jaxamp ratios become the 'before' columns)")
  parser.add_argument("--before", nargs="*", default=[], metavar="JSON",
                      help="with --markdown: the results of the earlier commit")
  args = parser.parse_args(argv)
  if args.markdown:
    print(markdown(args.before, args.markdown))
    return {}

  cells = parse_cells(args.cells) if args.cells else GRIDS[args.grid]
  modes = [m.strip() for m in args.modes.split(",") if m.strip()]
  unknown = sorted(set(modes) - set(MODES))
  if unknown:
    parser.error(f"unknown mode(s) {unknown}: choose among {sorted(MODES)}")
  clips = {"no": [False], "yes": [True], "both": [False, True]}[args.clip]
  variants = [v.strip() for v in args.variants.split(",") if v.strip()]
  info = provenance(_reproducing(sys.argv[1:] if argv is None else argv), _jaxamp_path(argv))
  print(f"{info['devices']}, {info['machine']['cpu']}, jax {info['jax']}, jaxamp "
        f"{info['commit']}{'+' if info['uncommitted_changes'] else ''} "
        f"({os.path.dirname(jaxamp.__file__)}); {args.rounds} rounds of samples of at least "
        f"{args.min_sample * 1e3:.0f} ms; ratios: median [quartiles] of per-round ratios", flush=True)
  earlier = earlier_runs(args.json, args.append)
  records: List[Dict[str, Any]] = []
  run = {"provenance": info,
         "results": {"rounds": args.rounds, "min_sample_s": args.min_sample, "records": records}}
  device = jax.devices(args.device)[0] if args.device else None
  with jax.default_device(device) if device is not None else contextlib.nullcontext():
    for leaves, elements in cells:
      for mode in modes:
        for clip in clips:
          record = run_cell(leaves, elements, mode, clip, variants, args.rounds, args.min_sample)
          print_record(record)
          records.append(record)
          if args.json:  # after every cell, so that an interrupted run keeps what it measured
            write_json(args.json, earlier + [run])
  return run


if __name__ == "__main__":
  main()
