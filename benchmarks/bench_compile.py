"""Compile time of a jitted train step (gradient, update, apply): loss-scaled against plain.

Trace (``jax.jit(step).trace``), lowering (``.lower()``) and XLA's compile
(``.compile()``) are timed apart, on a fresh function each time (no cache is
hit), variants interleaved round by round, medians printed as ratios to the
plain step. Variants:

- ``plain``: plain optax, no loss scaling (the baseline);
- ``jaxamp``: ``jaxamp.scale_loss`` and ``jaxamp.dynamic_loss_scale(inner)``;
- ``jaxamp_plain_select``: the same with ``jaxamp.set_fused_selection(False)``;
- ``apply_if_finite``: optax alone: a hand-scaled loss, unscaling,
  ``optax.apply_if_finite(inner)`` and a hand-written scale update;
- ``train_state``: ``jaxamp.TrainState`` (whole-step models only);
- ``check_only``: the plain step that also runs jaxamp's finite check on its
  gradients and returns the flags: no unscaling, no selection, no scale
  update. It is what any check that reads every leaf adds at the least.

Two problems: a sweep over the number of parameter leaves (``--leaves``,
each a 64 x 64 matrix, the loss a sum over leaves of a small matmul's mean
square), and the LM of ``benchmarks/bench_train_step.py``. With
``--autocast`` the loss runs under ``jaxamp.autocast(loss, float16)``
(otherwise the leaf sweep is float32 and the LM is cast whole to float16).
``--hlo`` also prints the instruction and computation counts of the lowered
and compiled modules. ``--xla-passes`` reads XLA's own timers from its log:
the seconds of its HLO passes (the largest by name) and of its code generation,
which the compile phase is made of, and how many distinct kernels it compiled to
machine code, with the seconds they took (summed over XLA's compile threads).

Run: ``python benchmarks/bench_compile.py [--leaves 10 100 400 1000] [--lm] [--autocast on]
[--json PATH]``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Sequence

XLA_PASSES = "--xla-passes" in sys.argv
if XLA_PASSES:  # read by XLA's logging when jax first loads: it must precede the import
  os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
  os.environ["TF_CPP_VMODULE"] = ("hlo_pass_pipeline=1,cpu_compiler=1,gpu_compiler=1,"
                                  "fusion_compiler=1,ir_compiler=1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jaxamp  # noqa: E402
from benchmarks import bench_train_step as train_step  # noqa: E402
from benchmarks.bench_loss_scale import INIT_SCALE, with_apply_if_finite  # noqa: E402
from benchmarks.common import device_summary  # noqa: E402
from benchmarks.record import add_json_args, write_json  # noqa: E402
from jaxamp._src import finite, loss_scale, selective_update, validation  # noqa: E402

PHASES = ("trace", "lower", "compile")
# CPU seconds of this process (all its threads): other processes on a shared machine slow the
# wall clock, much less the work counted here. ``--wall`` times the wall clock instead.
CLOCK = time.process_time


def leaf_problem(leaves: int, width: int = 64, batch: int = 8):
  """``leaves`` float32 ``(width, width)`` params, one input batch and a loss of them."""
  rng = np.random.default_rng(0)
  params = {f"w{i:04d}": jnp.asarray(rng.standard_normal((width, width)) / width, jnp.float32)
            for i in range(leaves)}
  x = jnp.asarray(rng.standard_normal((batch, width)), jnp.float32)

  def loss(params, x):
    return sum(jnp.mean(jnp.square(x @ w)) for w in params.values())

  return params, x, loss


def lm_problem(batch: int = 8, seq: int = 128, width: int = 256, layers: int = 2):
  params = train_step.make_lm(d=width, layers=layers)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 1024, (batch, seq + 1)), jnp.int32)
  return params, tokens, train_step.lm_loss


# ----------------------------------------------------------------------------- variants
# Each returns (init(params) -> state, step(params, state, batch) -> (params, state)).


def plain(inner, loss):
  def step(params, state, batch):
    grads = jax.grad(loss)(params, batch)
    updates, state = inner.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return inner.init, step


def with_jaxamp(inner, loss):
  tx = jaxamp.dynamic_loss_scale(inner, init_scale=INIT_SCALE)

  def step(params, state, batch):
    scaled = lambda p: jaxamp.scale_loss(loss(p, batch), state)  # noqa: E731
    updates, state = tx.update(jax.grad(scaled)(params), state, params)
    return optax.apply_updates(params, updates), state

  return tx.init, step


def with_apply_if_finite_step(inner, loss):
  init, update = with_apply_if_finite(inner)

  def step(params, state, batch):
    scaled = lambda p: loss(p, batch).astype(jnp.float32) * state.scale  # noqa: E731
    return update(params, state, jax.grad(scaled)(params))

  return init, step


def with_train_state(inner, loss):
  tx = jaxamp.dynamic_loss_scale(inner, init_scale=INIT_SCALE)

  def init(params):
    return jaxamp.TrainState.create(apply_fn=loss, params=params, tx=tx)

  def step(params, state, batch):
    del params
    _, grads = state.value_and_grad(loss)(state.params, batch)
    return None, state.apply_gradients(grads=grads)

  return init, step


def check_only(inner, loss):
  def init(params):
    return inner.init(params), finite.check(params)

  def step(params, state, batch):
    grads = jax.grad(loss)(params, batch)
    updates, inner_state = inner.update(grads, state[0], params)
    return optax.apply_updates(params, updates), (inner_state, finite.check(grads))

  return init, step


VARIANTS: Dict[str, Callable] = {
    "plain": plain,
    "check_only": check_only,
    "jaxamp": with_jaxamp,
    "jaxamp_plain_select": with_jaxamp,
    "apply_if_finite": with_apply_if_finite_step,
    "train_state": with_train_state,
}

# ----------------------------------------------------------------------------- attribution
# ``--attribute`` switches one part of the loss-scaled step off at a time by patching jaxamp's
# private functions for the duration of one trace (never for the timed plain step). The patched
# steps are unsound or wrong by design: they measure what each part costs to compile, nothing else.


def _patch(module, name, value):
  @contextlib.contextmanager
  def patched():
    old = getattr(module, name)
    setattr(module, name, value)
    try:
      yield
    finally:
      setattr(module, name, old)

  return patched


def _no_check(grads, scale, axis_name=None):
  # No check at all: every step counts as finite (the unscaling and the selection remain).
  del axis_name
  ok = jnp.ones([], jnp.bool_)
  return finite.unscale(grads, scale), finite.Check(
      ok, jnp.zeros([len(finite.float_leaves(grads))], jnp.bool_))


def _flag_per_leaf(grads, scale, axis_name=None):
  # The check of an earlier jaxamp: each unscaled leaf's flag compared on its own (one small
  # kernel per leaf).
  del axis_name
  unscaled = finite.unscale(grads, scale)
  flags = jnp.stack([jnp.isnan(finite.leaf_witness(x)) for x in finite.float_leaves(unscaled)])
  return unscaled, finite.Check(jnp.logical_not(jnp.any(flags)), flags)


def _simple_unscale(grads, scale, axis_name=None):
  inv = (1.0 / jnp.asarray(scale, jnp.float32))
  unscaled = jax.tree.map(lambda g: (g * inv.astype(g.dtype)) if validation.is_inexact(g) else g,
                          grads)
  return unscaled, finite.check(unscaled, axis_name)


def _no_selection(pred, update, old_state):
  # The inner update, unselected; the predicate is still computed (for the state).
  del pred, old_state
  return update()


def _same_scale(self, scale, growth_tracker, overflow_count, found_inf):
  del self, found_inf
  return scale, growth_tracker, overflow_count


PARTS: Dict[str, Callable[[], Any]] = {
    "no_barriers": _patch(finite, "stored_once", lambda tree: tree),
    "no_check": _patch(finite, "unscale_and_check", _no_check),
    "flag_per_leaf": _patch(finite, "unscale_and_check", _flag_per_leaf),
    "simple_unscale": _patch(finite, "unscale_and_check", _simple_unscale),
    "no_selection": _patch(selective_update, "select_update", _no_selection),
    "no_scale_update": _patch(loss_scale.ScaleRule, "adjust", _same_scale),
}

# ----------------------------------------------------------------------------- measurement


def count_hlo(lowered, compiled) -> Dict[str, int]:
  """Operations and functions of the lowered StableHLO; instructions and computations of XLA's
  optimised HLO."""
  low = lowered.as_text()
  opt = compiled.as_text() or ""
  return {
      "lowered_ops": sum(1 for line in low.splitlines() if re.match(r"\s+(%\S+ = )?\"?\w+\.", line)),
      "lowered_funcs": low.count("func.func"),
      "hlo_instructions": sum(1 for line in opt.splitlines()
                              if re.match(r"\s+(ROOT )?%?[\w.\-]+ = ", line)),
      "hlo_computations": sum(1 for line in opt.splitlines()
                              if re.match(r"(ENTRY )?%?[\w.\-]+ .*\{\s*$", line)),
  }


_TIME = r"time: ([\d.]+) (us|ms|s) "
_UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


@contextlib.contextmanager
def xla_log():
  """Collects what XLA logs (file descriptor 2) inside the block, as a list of one string."""
  box: list = []
  with tempfile.TemporaryFile() as tmp:
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(tmp.fileno(), 2)
    try:
      yield box
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      tmp.seek(0)
      box.append(tmp.read().decode(errors="replace"))


def xla_seconds(log: str) -> Dict[str, float]:
  """XLA's timers for the module ``jit_step``: its HLO passes, each pass, and code generation."""
  seconds: Dict[str, float] = collections.Counter()
  # The log holds every module compiled in the block; each pipeline's passes follow its header.
  for segment in re.split(r"Running HLO pass pipeline on module ", log)[1:]:
    if segment.startswith("jit_step:"):
      for name, value, unit in re.findall(r"HLO pass: (\S+) " + _TIME, segment):
        seconds["pass " + name] += float(value) * _UNIT[unit]
  # Code generation compiles each distinct kernel (identical fusions share one) to machine code.
  codegen = re.search(r"Compiling: jit_step\n(.*?)Compiling \[jit_step\]", log, re.S)
  body = codegen.group(1) if codegen else ""
  seconds["kernels"] = len(re.findall(r"Compiled LLVM module: ", body))
  seconds["kernel codegen"] = sum(
      float(v) * _UNIT[u] for v, u in re.findall(r"Compiled (?:LLVM|MLIR) module: \S+ " + _TIME, body))
  for key, label in (("HLO passes", r"Running HLO passes on \[jit_step\] for \w+ "),
                     ("code generation", r"Compiling \[jit_step\] for \w+ using JIT ")):
    match = re.search(label + _TIME, log)
    seconds[key] = float(match.group(1)) * _UNIT[match.group(2)] if match else float("nan")
  return seconds


def time_once(make_variant: Callable, inner, make_loss: Callable, params, batch,
              fused: bool = True, part: str = ""
              ) -> tuple[Dict[str, float], Dict[str, int], Dict[str, float]]:
  """Seconds of each phase for a freshly built step (nothing cached), its HLO counts and, with
  ``--xla-passes``, XLA's timers.

  ``make_loss()`` returns a new loss function, so that no trace of it (an autocast trace
  included) is reused. ``part``: a key of :data:`PARTS`, switched off while the step is traced."""
  previous = jaxamp.set_fused_selection(fused)
  off = PARTS[part]() if part else contextlib.nullcontext()
  logged = xla_log() if XLA_PASSES else contextlib.nullcontext([""])
  try:
    log = logged.__enter__()
    off.__enter__()
    init, inner_step = make_variant(inner, make_loss())
    state = jax.jit(init)(params)

    def step(*args):  # a new function each time: JAX's trace cache misses
      return inner_step(*args)

    t0 = CLOCK()
    traced = jax.jit(step, donate_argnums=(0, 1)).trace(params, state, batch)
    t1 = CLOCK()
    lowered = traced.lower()
    t2 = CLOCK()
    compiled = lowered.compile()
    t3 = CLOCK()
  finally:
    off.__exit__(None, None, None)
    logged.__exit__(None, None, None)
    jaxamp.set_fused_selection(previous)
  xla = xla_seconds(log[0]) if XLA_PASSES else {}
  return dict(zip(PHASES, (t1 - t0, t2 - t1, t3 - t2))), count_hlo(lowered, compiled), xla


def measure(names: Sequence[str], inner, make_loss: Callable, params, batch, repeats: int
            ) -> tuple[Dict[str, Dict[str, float]], Dict[str, Dict[str, int]]]:
  """Median seconds per phase (and per XLA timer) of each variant over ``repeats`` interleaved
  rounds, and the HLO counts."""
  samples: Dict[str, Dict[str, list]] = {n: collections.defaultdict(list) for n in names}
  counts: Dict[str, Dict[str, int]] = {}
  for r in range(repeats):
    order = list(names[r % len(names):]) + list(names[:r % len(names)])
    for name in order:
      variant, _, part = name.partition(":")
      times, counts[name], xla = time_once(VARIANTS[variant], inner, make_loss, params, batch,
                                           fused=name != "jaxamp_plain_select", part=part)
      for key, t in {**times, **xla}.items():
        samples[name][key].append(t)
  medians = {n: {k: statistics.median(v) for k, v in s.items()} for n, s in samples.items()}
  return medians, counts


def print_table(title: str, medians: Dict[str, Dict[str, float]], counts: Dict[str, Dict[str, int]],
                hlo: bool, baseline: str = "plain") -> None:
  base = medians[baseline]
  print(f"\n{title}")
  print("  " + "plain seconds: " + ", ".join(f"{p} {base[p]:.3f}" for p in PHASES))
  width = max(len(n) for n in medians)
  header = "".join(f"{p:>10}" for p in PHASES)
  extra = "   lowered ops/funcs   hlo instr/comps" if hlo else ""
  print(f"  {'':<{width}}{header}{extra}")
  for name, m in medians.items():
    row = "".join(f"{m[p] / base[p]:9.2f}x" for p in PHASES)
    if hlo:
      c = counts[name]
      row += (f"   {c['lowered_ops']:>8}/{c['lowered_funcs']:<8}"
              f"  {c['hlo_instructions']:>8}/{c['hlo_computations']:<6}")
    print(f"  {name:<{width}}{row}")
  if XLA_PASSES:
    print_xla_seconds(medians, width)


def print_xla_seconds(medians: Dict[str, Dict[str, float]], width: int, top: int = 5) -> None:
  """XLA's timers in seconds: its HLO passes, code generation, and the passes that take longest."""
  widest = max(medians, key=lambda n: medians[n].get("HLO passes", 0.0))
  passes = sorted((k for k in medians[widest] if k.startswith("pass ")),
                  key=lambda k: -medians[widest][k])[:top]
  columns = ["HLO passes", "code generation", "kernels", "kernel codegen"] + passes
  print(f"  XLA's timers, seconds: {', '.join(c.removeprefix('pass ') for c in columns)}")
  for name, m in medians.items():
    print(f"  {name:<{width}}" + "".join(
        f"{m.get(c, 0.0):9.0f} " if c == "kernels" else f"{m.get(c, 0.0):9.3f} " for c in columns))


def _kept(medians: Dict[str, Dict[str, float]]) -> Dict[str, Dict[str, float]]:
  """What ``--json`` keeps of the medians: the phases, XLA's totals and its passes that take 1% or
  more of its HLO passes' time (of the hundred or so it times)."""
  return {name: {k: v for k, v in m.items()
                 if not k.startswith("pass ") or v >= 0.01 * m.get("HLO passes", 0.0)}
          for name, m in medians.items()}


def fresh(loss: Callable, cast: bool) -> Callable[[], Callable]:
  """A function that returns ``loss``, or with ``cast`` a new ``autocast`` of it each time (its
  trace cache keys on the function, so each timing then pays for the interpretation)."""
  if not cast:
    return lambda: loss
  return lambda: jaxamp.autocast(lambda *args: loss(*args), jnp.float16)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--leaves", type=int, nargs="*", default=[10, 100, 400, 1000])
  parser.add_argument("--lm", action="store_true", help="also the whole-step LM (8 x 128)")
  parser.add_argument("--autocast", choices=("off", "on", "both"), default="off")
  parser.add_argument("--clip", action="store_true", help="clip_by_global_norm(1.0) before adam")
  parser.add_argument("--variants", nargs="*",
                      default=["plain", "check_only", "jaxamp", "jaxamp_plain_select",
                               "apply_if_finite"])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--hlo", action="store_true", help="print HLO instruction counts")
  parser.add_argument("--attribute", action="store_true",
                      help="also the loss-scaled step with each part switched off (see PARTS)")
  parser.add_argument("--wall", action="store_true", help="wall-clock seconds, not CPU seconds")
  parser.add_argument("--xla-passes", action="store_true",
                      help="also XLA's timers: its HLO passes and its code generation")
  add_json_args(parser)
  args = parser.parse_args(argv)
  if args.wall:
    global CLOCK
    CLOCK = time.perf_counter
  if args.attribute:
    args.variants = list(args.variants) + [f"jaxamp:{part}" for part in PARTS]

  inner: Any = optax.adam(1e-3)
  if args.clip:
    inner = optax.chain(optax.clip_by_global_norm(1.0), inner)
  modes = {"off": [False], "on": [True], "both": [False, True]}[args.autocast]
  print(f"{device_summary()}; adam{' clipped' if args.clip else ''}; median of {args.repeats} "
        f"interleaved rounds of {'wall' if args.wall else 'CPU'} seconds; ratios to 'plain'")
  variants = [v for v in args.variants if v != "train_state"]
  problems = []  # for --json: one entry per table printed
  for cast in modes:
    for n in args.leaves:
      params, batch, loss = leaf_problem(n)
      medians, counts = measure(variants, inner, fresh(loss, cast), params, batch, args.repeats)
      print_table(f"{n} leaves of 64 x 64, autocast {'on' if cast else 'off'}", medians, counts,
                  args.hlo)
      problems.append({"problem": f"{n} leaves", "autocast": cast, "medians": _kept(medians),
                       "counts": counts})
    if args.lm:
      params, batch, loss = lm_problem()
      make_loss = fresh(loss, cast) if cast else lambda: train_step.half_loss(jnp.float16)
      with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        medians, counts = measure(list(args.variants) + (
            ["train_state"] if "train_state" not in args.variants else []),
                                  inner, make_loss, params, batch, args.repeats)
      print_table(f"LM step ({sum(p.size for p in jax.tree.leaves(params)):,} params, 8 x 128), "
                  f"{'autocast' if cast else 'whole float16 cast'}", medians, counts, args.hlo)
      problems.append({"problem": "LM", "autocast": cast, "medians": _kept(medians),
                       "counts": counts})
  write_json(args.json, {"clip": args.clip, "repeats": args.repeats,
                         "clock": "wall" if args.wall else "cpu", "problems": problems},
             args.append)


if __name__ == "__main__":
  main()
