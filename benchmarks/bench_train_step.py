"""Whole train steps (forward, backward, update) of a small transformer LM, in two regimes.

Each variant is one jitted step with params and optimizer state donated:

- ``optax_f32``: plain ``optax.adamw`` on a float32 forward and backward;
- ``plain_f16``: the same with the forward in float16 and no loss scaling
  (what mixed precision costs without its protection);
- ``jaxamp``: float16 forward, ``jaxamp.scale_loss`` and
  ``jaxamp.dynamic_loss_scale(adamw)`` (the recommended functional path);
- ``apply_if_finite``: float16 forward, a hand-scaled loss, unscale,
  ``optax.apply_if_finite(adamw)`` and a hand-written scale update;
- ``flax_dynamic_scale``: float16 forward and flax's ``DynamicScale`` recipe
  (unscale, check, update, ``where`` over new and old params and state).

``--regime compute`` runs a batch of 8 x 128 tokens (the forward and backward
dominate), ``--regime update`` a batch of 1 x 16 (the optimizer update
dominates). ``--clip`` puts ``optax.clip_by_global_norm(1.0)`` before adamw.
Ratios are to ``plain_f16``; ``--cost`` adds XLA's compiled temporary bytes
as a multiple of the parameter bytes.

Run: ``python benchmarks/bench_train_step.py [--regime compute|update] [--dtype bfloat16]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Dict

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jaxamp  # noqa: E402
from benchmarks.bench_loss_scale import (INIT_SCALE, with_apply_if_finite,  # noqa: E402
                                         with_flax_dynamic_scale)
from benchmarks.common import device_summary, interleaved_medians, print_ratios  # noqa: E402

REGIMES = {"compute": (8, 128), "update": (1, 16)}


def make_lm(vocab: int = 1024, d: int = 256, layers: int = 2, seed: int = 0):
  """Float32 params of a pre-norm transformer LM with tied embeddings."""
  rng = np.random.default_rng(seed)

  def dense(a, b):
    return jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), jnp.float32)

  params = {"embed": jnp.asarray(rng.standard_normal((vocab, d)) * 0.02, jnp.float32),
            "final_scale": jnp.ones((d,), jnp.float32)}
  for i in range(layers):
    params[f"block_{i}"] = {
        "ln1": jnp.ones((d,), jnp.float32), "ln2": jnp.ones((d,), jnp.float32),
        "qkv": dense(d, 3 * d), "out": dense(d, d), "up": dense(d, 4 * d), "down": dense(4 * d, d),
        "up_bias": jnp.zeros((4 * d,), jnp.float32),
    }
  return params


def _norm(x, scale):
  x32 = x.astype(jnp.float32)
  var = jnp.mean(jnp.square(x32 - x32.mean(-1, keepdims=True)), -1, keepdims=True)
  return ((x32 - x32.mean(-1, keepdims=True)) * jax.lax.rsqrt(var + 1e-6)).astype(x.dtype) * scale


def lm_loss(params, tokens, heads: int = 4):
  """Next-token cross-entropy, computed in the dtype of ``params`` (reduced in float32)."""
  h = params["embed"][tokens[:, :-1]]
  b, t, d = h.shape
  mask = jnp.tril(jnp.ones((t, t), bool))
  for name in sorted(k for k in params if k.startswith("block_")):
    p = params[name]
    q, k, v = jnp.split(_norm(h, p["ln1"]) @ p["qkv"], 3, axis=-1)
    split = lambda x: x.reshape(b, t, heads, d // heads)  # noqa: E731
    logits = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / np.sqrt(d // heads)
    logits = jnp.where(mask, logits.astype(jnp.float32), -1e9)
    attn = jax.nn.softmax(logits, axis=-1).astype(h.dtype)
    h = h + jnp.einsum("bhqk,bkhd->bqhd", attn, split(v)).reshape(b, t, d) @ p["out"]
    h = h + jax.nn.gelu(_norm(h, p["ln2"]) @ p["up"] + p["up_bias"]) @ p["down"]
  logits = (_norm(h, params["final_scale"]) @ params["embed"].T).astype(jnp.float32)
  targets = tokens[:, 1:]
  return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
      logits, targets[..., None], -1)[..., 0])


def _half(params, dtype):
  return jax.tree.map(lambda p: p.astype(dtype), params)


# ----------------------------------------------------------------------------- variants
# Each returns (init(params) -> state, step(params, state, tokens) -> (params, state)).


def optax_f32(inner, dtype):
  del dtype

  def step(params, state, tokens):
    grads = jax.grad(lm_loss)(params, tokens)
    updates, state = inner.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return inner.init, step


def plain_half(inner, dtype):
  def step(params, state, tokens):
    grads = jax.grad(lambda p: lm_loss(_half(p, dtype), tokens))(params)
    updates, state = inner.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return inner.init, step


def with_jaxamp(inner, dtype):
  tx = jaxamp.dynamic_loss_scale(inner, init_scale=INIT_SCALE)

  def step(params, state, tokens):
    scaled = lambda p: jaxamp.scale_loss(lm_loss(_half(p, dtype), tokens), state)  # noqa: E731
    updates, state = tx.update(jax.grad(scaled)(params), state, params)
    return optax.apply_updates(params, updates), state

  return tx.init, step


def _scaled_by_hand(make_variant):
  """A variant of bench_loss_scale (a step over scaled gradients) fed by a half forward."""

  def make(inner, dtype):
    init, update = make_variant(inner)

    def step(params, state, tokens):
      scale = state.scale if hasattr(state, "scale") else state.dynamic_scale.scale
      scaled = lambda p: lm_loss(_half(p, dtype), tokens) * scale  # noqa: E731
      return update(params, state, jax.grad(scaled)(params))

    return init, step

  return make


VARIANTS: Dict[str, Callable] = {
    "optax_f32": optax_f32,
    "plain_f16": plain_half,
    "jaxamp": with_jaxamp,
    "apply_if_finite": _scaled_by_hand(with_apply_if_finite),
    "flax_dynamic_scale": _scaled_by_hand(with_flax_dynamic_scale),
}


def make_runner(make_variant, inner, dtype, params, tokens) -> Callable[[], None]:
  init, step = make_variant(inner, dtype)
  jitted = jax.jit(step, donate_argnums=(0, 1))
  box = {"params": jax.tree.map(jnp.copy, params)}
  box["state"] = jax.jit(init)(box["params"])

  def run():
    box["params"], box["state"] = jitted(box["params"], box["state"], tokens)
    jax.block_until_ready(box["params"])

  def temp_bytes() -> float:
    compiled = jitted.lower(box["params"], box["state"], tokens).compile()
    return float(compiled.memory_analysis().temp_size_in_bytes)

  run.temp_bytes = temp_bytes
  return run


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--regime", choices=sorted(REGIMES), default="compute")
  parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16",
                      help="compute dtype of the mixed-precision variants")
  parser.add_argument("--clip", action="store_true", help="clip_by_global_norm(1.0) before adamw")
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--inner", type=int, default=3)
  parser.add_argument("--cost", action="store_true", help="also print compiled temporary bytes")
  args = parser.parse_args(argv)

  dtype = jnp.dtype(args.dtype)
  batch, seq = REGIMES[args.regime]
  params = make_lm(d=args.width, layers=args.layers)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 1024, (batch, seq + 1)), jnp.int32)
  inner = optax.adamw(1e-3)
  if args.clip:
    inner = optax.chain(optax.clip_by_global_norm(1.0), inner)
  n = sum(p.size for p in jax.tree.leaves(params))
  print(f"{device_summary()}; LM with {n:,} params, batch {batch} x {seq}, {args.dtype} compute"
        f"{', clipped' if args.clip else ''}; {args.rounds} rounds x {args.inner} calls")
  steps = {name: make_runner(make, inner, dtype, params, tokens)
           for name, make in VARIANTS.items()}
  medians = interleaved_medians(steps, rounds=args.rounds, inner=args.inner)
  print(f"\nmedian time of plain_f16: {medians['plain_f16'] * 1e3:.2f} ms")
  print_ratios(medians, "plain_f16", f"Whole train step, {args.regime}-bound")
  if args.cost:
    param_bytes = 4.0 * n
    print("\nCompiled temporaries, in parameter bytes:")
    for name, run in steps.items():
      print(f"  {name:<20} {run.temp_bytes() / param_bytes:6.2f}x")


if __name__ == "__main__":
  main()
