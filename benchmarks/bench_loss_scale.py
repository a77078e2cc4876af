"""Cost of dynamic loss scaling in a jitted optimizer update, against today's JAX recipes.

Times ``tx.update`` + ``optax.apply_updates`` (params and optimizer state
donated) on about ``--size`` parameters in about 30 leaves (``--shapes``: a
transformer's, by default, or 1-D leaves of odd sizes), for:

- ``adam``: plain ``optax.adam`` (the baseline);
- ``jaxamp``: ``jaxamp.dynamic_loss_scale(adam)``;
- ``apply_if_finite``: what a user writes today with optax alone: unscale,
  ``optax.apply_if_finite(adam)``, then a ``where``-based scale update;
- ``flax_dynamic_scale``: flax's ``DynamicScale`` recipe: unscale and check
  as ``DynamicScale.value_and_grad`` does, update, then ``jnp.where`` over
  the new and old params and optimizer state, as the flax examples do;

and the same four with ``optax.clip_by_global_norm(1.0)`` before adam. Each
is printed as a ratio to plain adam (the clipped ones also to clip+adam).

Run: ``python benchmarks/bench_loss_scale.py [--size N] [--rounds R] [--dtype bfloat16]
[--json PATH]``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any, Callable, Dict, NamedTuple

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jaxamp  # noqa: E402
from benchmarks.common import (add_param_args, device_summary,  # noqa: E402
                               interleaved_medians, make_params, print_ratios)
from benchmarks.record import add_json_args, write_json  # noqa: E402

GROWTH_INTERVAL = 2000
INIT_SCALE = 2.0**16


def _apply(params, updates):
  return optax.apply_updates(params, updates)


# ----------------------------------------------------------------------------- variants


def plain(inner: optax.GradientTransformation):
  """The inner optimizer alone: the gradients are taken as they come."""

  def init(params):
    return inner.init(params)

  def step(params, state, grads):
    updates, state = inner.update(grads, state, params)
    return _apply(params, updates), state

  return init, step


def with_jaxamp(inner: optax.GradientTransformation):
  tx = jaxamp.dynamic_loss_scale(inner, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return _apply(params, updates), state

  return tx.init, step


class _HandState(NamedTuple):
  scale: jax.Array
  tracker: jax.Array
  inner: Any


def with_apply_if_finite(inner: optax.GradientTransformation):
  """optax alone: unscale by hand, apply_if_finite, then PyTorch's scale rule with where."""
  tx = optax.apply_if_finite(inner, max_consecutive_errors=2**30)

  def init(params):
    return _HandState(jnp.asarray(INIT_SCALE, jnp.float32), jnp.zeros([], jnp.int32),
                      tx.init(params))

  def step(params, state, grads):
    grads = jax.tree.map(lambda g: g * (1.0 / state.scale).astype(g.dtype), grads)
    updates, inner_state = tx.update(grads, state.inner, params)
    finite = inner_state.last_finite
    tracker = jnp.where(finite, state.tracker + 1, 0)
    grow = tracker >= GROWTH_INTERVAL
    grown = state.scale * 2.0
    scale = jnp.where(finite, jnp.where(grow & jnp.isfinite(grown), grown, state.scale),
                      state.scale * 0.5)
    tracker = jnp.where(grow, 0, tracker)
    return _apply(params, updates), _HandState(scale, tracker, inner_state)

  return init, step


class _FlaxScale(NamedTuple):
  # DynamicScale's pytree fields, held as typed arrays (Python numbers recompile).
  fin_steps: jax.Array
  scale: jax.Array


class _FlaxState(NamedTuple):
  dynamic_scale: _FlaxScale
  opt_state: Any


def _flax_unscale(ds: _FlaxScale, grads):
  """The part of flax's DynamicScale.value_and_grad that follows the backward pass."""
  grads = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32) / ds.scale, grads)
  finite = jnp.array(True)
  for g in jax.tree.leaves(grads):
    finite &= jnp.all(jax.lax.is_finite(g))
  grow = ds.fin_steps == GROWTH_INTERVAL
  fin_scale = jnp.where(grow & finite,
                        jnp.minimum(ds.scale * 2.0, jnp.finfo(jnp.float32).max), ds.scale)
  inf_scale = jnp.maximum(ds.scale * 0.5, jnp.finfo(jnp.float32).tiny)
  scale = jnp.where(finite, fin_scale, inf_scale)
  fin_steps = jnp.where(grow | (~finite), 0, ds.fin_steps + 1)
  return _FlaxScale(fin_steps, scale), finite, grads


def with_flax_dynamic_scale(inner: optax.GradientTransformation):
  """flax's recipe: update unconditionally, then keep the old params/state where not finite."""

  def init(params):
    return _FlaxState(_FlaxScale(jnp.zeros([], jnp.int32), jnp.asarray(INIT_SCALE, jnp.float32)),
                      inner.init(params))

  def step(params, state, grads):
    ds, is_fin, grads = _flax_unscale(state.dynamic_scale, grads)
    updates, opt_state = inner.update(grads, state.opt_state, params)
    new_params = _apply(params, updates)
    keep = functools.partial(jnp.where, is_fin)
    opt_state = jax.tree.map(keep, opt_state, state.opt_state)
    new_params = jax.tree.map(keep, new_params, params)
    return new_params, _FlaxState(ds, opt_state)

  return init, step


VARIANTS: Dict[str, Callable] = {
    "adam": plain,
    "jaxamp": with_jaxamp,
    "apply_if_finite": with_apply_if_finite,
    "flax_dynamic_scale": with_flax_dynamic_scale,
}


# ----------------------------------------------------------------------------- harness


def make_runner(make_variant, inner, params, grads) -> Callable[[], None]:
  """A zero-argument step that carries its own (donated) params and state."""
  init, step = make_variant(inner)
  jitted = jax.jit(step, donate_argnums=(0, 1))
  box = {"params": jax.tree.map(jnp.copy, params)}
  box["state"] = jax.jit(init)(box["params"])

  def run():
    box["params"], box["state"] = jitted(box["params"], box["state"], grads)
    jax.block_until_ready(box["params"])

  def cost() -> Dict[str, float]:
    compiled = jitted.lower(box["params"], box["state"], grads).compile()
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    return {k: float(analysis.get(k, float("nan"))) for k in ("bytes accessed", "flops")}

  run.cost = cost
  return run


def print_costs(steps: Dict[str, Callable], baseline: str) -> None:
  """XLA's own count of the bytes and flops of each compiled step (conditional branches
  included, even where they do not run), as ratios: deterministic, unlike the timings."""
  costs = {name: run.cost() for name, run in steps.items()}
  base = costs[baseline]
  width = max(len(n) for n in costs)
  print(f"\nCompiled cost (XLA cost analysis; ratio to {baseline!r}): bytes accessed, flops")
  for name, c in costs.items():
    mb, flops = c["bytes accessed"], c["flops"]
    print(f"  {name:<{width}}  {mb / 1e6:8.1f} MB {mb / base['bytes accessed']:6.3f}x   "
          f"{flops / base['flops']:6.3f}x flops")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  add_param_args(parser)
  parser.add_argument("--rounds", type=int, default=30, help="interleaved timing rounds")
  parser.add_argument("--inner", type=int, default=5, help="calls per variant per round")
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                      help="dtype of params and gradients")
  parser.add_argument("--no-clip", action="store_true", help="skip the clip_by_global_norm variants")
  parser.add_argument("--cost", action="store_true",
                      help="also print XLA's compiled cost analysis (bytes accessed, flops)")
  add_json_args(parser)
  args = parser.parse_args(argv)

  dtype = jnp.dtype(args.dtype)
  params = make_params(args.size, args.leaves, dtype=dtype, shapes=args.shapes)
  # The gradients of a loss scaled by INIT_SCALE: finite, so no step is skipped.
  keys = iter(jax.random.split(jax.random.key(1), len(params)))
  grads = jax.tree.map(
      lambda p: (jax.random.normal(next(keys), p.shape) * 1e-3 * INIT_SCALE).astype(dtype), params)
  n = sum(p.size for p in jax.tree.leaves(params))
  print(f"{device_summary()}; {n:,} {args.dtype} params in {len(params)} {args.shapes} leaves; "
        f"{args.rounds} rounds x {args.inner} calls")

  adam = optax.adam(1e-3)
  clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
  steps = {}
  for name, make_variant in VARIANTS.items():
    steps[name] = make_runner(make_variant, adam, params, grads)
  if not args.no_clip:
    for name, make_variant in VARIANTS.items():
      steps[f"clip+{name}"] = make_runner(make_variant, clipped, params, grads)
  medians = interleaved_medians(steps, rounds=args.rounds, inner=args.inner)

  print(f"\nmedian time of plain adam: {medians['adam'] * 1e3:.2f} ms")
  results = {"dtype": args.dtype, "params": n, "leaves": len(params), "shapes": args.shapes}
  results["unclipped"] = print_ratios(
      {k: v for k, v in medians.items() if not k.startswith("clip+")}, "adam", "Without clipping",
      targets={"jaxamp": 1.15})
  if not args.no_clip:
    print_ratios(medians, "adam", "All variants")
    results["clipped"] = print_ratios(
        {k: v for k, v in medians.items() if k.startswith("clip+")}, "clip+adam",
        "With clip_by_global_norm(1.0)", targets={"clip+jaxamp": 1.03})
  if args.cost:
    print_costs(steps, "adam")
  write_json(args.json, results, args.append)


if __name__ == "__main__":
  main()
