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
- ``train_state``: ``jaxamp.TrainState`` (whole-step models only).

Two problems: a sweep over the number of parameter leaves (``--leaves``,
each a 64 x 64 matrix, the loss a sum over leaves of a small matmul's mean
square), and the LM of ``benchmarks/bench_train_step.py``. With
``--autocast`` the loss runs under ``jaxamp.autocast(loss, float16)``
(otherwise the leaf sweep is float32 and the LM is cast whole to float16).
``--hlo`` also prints the instruction and computation counts of the lowered
and compiled modules.

Run: ``python benchmarks/bench_compile.py [--leaves 10 100 400 1000] [--lm] [--autocast]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import sys
import time
from typing import Any, Callable, Dict, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jaxamp  # noqa: E402
from benchmarks import bench_train_step as train_step  # noqa: E402
from benchmarks.bench_loss_scale import INIT_SCALE, with_apply_if_finite  # noqa: E402
from benchmarks.common import device_summary  # noqa: E402
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


VARIANTS: Dict[str, Callable] = {
    "plain": plain,
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


def _no_check(tree, axis_name=None):
  # No check at all: every step counts as finite (the selection remains).
  del axis_name
  ok = jnp.ones([], jnp.bool_)
  return finite.Check(ok, jnp.zeros([len(finite.float_leaves(tree))], jnp.bool_))


def _flag_per_leaf(tree, axis_name=None):
  # The check as before: each leaf's flag compared on its own (one small kernel per leaf).
  del axis_name
  flags = jnp.stack([jnp.isnan(finite.leaf_witness(x)) for x in finite.float_leaves(tree)])
  return finite.Check(jnp.logical_not(jnp.any(flags)), flags)


def _simple_unscale(tree, scale):
  inv = (1.0 / jnp.asarray(scale, jnp.float32))
  return jax.tree.map(lambda g: (g * inv.astype(g.dtype)) if validation.is_inexact(g) else g, tree)


def _no_selection(pred, update, old_state):
  # The inner update, unselected; the predicate is still computed (for the state).
  del pred, old_state
  return update()


def _same_scale(self, scale, growth_tracker, overflow_count, found_inf):
  del self, found_inf
  return scale, growth_tracker, overflow_count


PARTS: Dict[str, Callable[[], Any]] = {
    "no_barriers": _patch(finite, "stored_once", lambda tree: tree),
    "no_check": _patch(finite, "check", _no_check),
    "flag_per_leaf": _patch(finite, "check", _flag_per_leaf),
    "simple_unscale": _patch(finite, "unscale", _simple_unscale),
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


def time_once(make_variant: Callable, inner, loss, params, batch, fused: bool = True,
              part: str = "") -> tuple[Dict[str, float], Dict[str, int]]:
  """Seconds of each phase for a freshly built step (nothing cached), and its HLO counts.

  ``part``: a key of :data:`PARTS`, switched off while the step is traced."""
  previous = jaxamp.set_fused_selection(fused)
  off = PARTS[part]() if part else contextlib.nullcontext()
  try:
    off.__enter__()
    init, step = make_variant(inner, loss)
    state = jax.jit(init)(params)
    fresh = lambda *a: step(*a)  # noqa: E731 -- a new function: JAX's trace cache misses
    t0 = CLOCK()
    traced = jax.jit(fresh, donate_argnums=(0, 1)).trace(params, state, batch)
    t1 = CLOCK()
    lowered = traced.lower()
    t2 = CLOCK()
    compiled = lowered.compile()
    t3 = CLOCK()
  finally:
    off.__exit__(None, None, None)
    jaxamp.set_fused_selection(previous)
  return dict(zip(PHASES, (t1 - t0, t2 - t1, t3 - t2))), count_hlo(lowered, compiled)


def measure(names: Sequence[str], inner, loss, params, batch, repeats: int
            ) -> tuple[Dict[str, Dict[str, float]], Dict[str, Dict[str, int]]]:
  """Median seconds per phase of each variant over ``repeats`` interleaved rounds."""
  samples: Dict[str, Dict[str, list]] = {n: {p: [] for p in PHASES} for n in names}
  counts: Dict[str, Dict[str, int]] = {}
  for r in range(repeats):
    order = list(names[r % len(names):]) + list(names[:r % len(names)])
    for name in order:
      variant, _, part = name.partition(":")
      times, counts[name] = time_once(VARIANTS[variant], inner, loss, params, batch,
                                      fused=name != "jaxamp_plain_select", part=part)
      for phase, t in times.items():
        samples[name][phase].append(t)
  medians = {n: {p: statistics.median(v) for p, v in s.items()} for n, s in samples.items()}
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


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--leaves", type=int, nargs="*", default=[10, 100, 400, 1000])
  parser.add_argument("--lm", action="store_true", help="also the whole-step LM (8 x 128)")
  parser.add_argument("--autocast", choices=("off", "on", "both"), default="off")
  parser.add_argument("--clip", action="store_true", help="clip_by_global_norm(1.0) before adam")
  parser.add_argument("--variants", nargs="*",
                      default=["plain", "jaxamp", "jaxamp_plain_select", "apply_if_finite"])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--hlo", action="store_true", help="print HLO instruction counts")
  parser.add_argument("--attribute", action="store_true",
                      help="also the loss-scaled step with each part switched off (see PARTS)")
  parser.add_argument("--wall", action="store_true", help="wall-clock seconds, not CPU seconds")
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
  for cast in modes:
    for n in args.leaves:
      params, batch, loss = leaf_problem(n)
      if cast:
        loss = jaxamp.autocast(loss, jnp.float16)
      medians, counts = measure(variants, inner, loss, params, batch, args.repeats)
      print_table(f"{n} leaves of 64 x 64, autocast {'on' if cast else 'off'}", medians, counts,
                  args.hlo)
    if args.lm:
      params, batch, loss = lm_problem()
      loss = (jaxamp.autocast(loss, jnp.float16) if cast
              else train_step.half_loss(jnp.float16))
      with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        medians, counts = measure(list(args.variants) + (
            ["train_state"] if "train_state" not in args.variants else []),
                                  inner, loss, params, batch, args.repeats)
      print_table(f"LM step ({sum(p.size for p in jax.tree.leaves(params)):,} params, 8 x 128), "
                  f"{'autocast' if cast else 'whole float16 cast'}", medians, counts, args.hlo)


if __name__ == "__main__":
  main()
