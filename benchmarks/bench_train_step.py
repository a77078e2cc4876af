"""Whole train steps (forward, backward, update) of a small transformer LM, in two regimes.

Every variant trains the same LM with ``optax.adamw`` (optionally clipped),
params and optimizer state donated:

- ``optax_f32``: plain optax on a float32 forward and backward;
- ``plain_f16``: the same with the forward in float16 and no loss scaling
  (what mixed precision costs without its protection; the baseline);
- ``jaxamp``: the functional core, one jitted step: ``jaxamp.scale_loss`` and
  ``jaxamp.dynamic_loss_scale(adamw)``;
- ``train_state``: ``jaxamp.TrainState`` (``value_and_grad`` and
  ``apply_gradients``), one jitted step;
- ``grad_scaler``: the PyTorch-style loop, ``jaxamp.GradScaler`` with
  ``jaxamp.OptimWrapper(..., donate=True)`` (``backward``, ``step`` and
  ``update`` are separate jitted calls);
- ``amp_optim_wrapper``: ``jaxamp.AmpOptimWrapper(..., cast='whole',
  donate=True).update_params``, the mmengine-style loop;
- ``apply_if_finite``: optax alone: a hand-scaled loss, unscale,
  ``optax.apply_if_finite(adamw)`` and a hand-written scale update;
- ``flax_dynamic_scale``: flax's own ``DynamicScale.value_and_grad`` and the
  ``jnp.where`` over new and old params and state of flax's imagenet example;
- ``plain_f16_2calls``, ``jaxamp_2calls``: ``plain_f16`` and ``jaxamp`` as
  two jitted calls, the backward pass and then the donated update, as the
  facades run them.

``--regime compute`` runs a batch of 8 x 128 tokens (the forward and backward
dominate), ``--regime update`` a batch of 1 x 16 (the optimizer update
dominates). ``--clip`` puts ``optax.clip_by_global_norm(1.0)`` before adamw.
Ratios are to ``plain_f16``; ``--cost`` adds XLA's compiled temporary bytes
of the one-jit variants, as a multiple of the parameter bytes.

``--variants`` runs only the variants named (``plain_f16``, the baseline, always
runs): compiling each variant dominates a run on a large LM, e.g. on a GPU.

Run: ``python benchmarks/bench_train_step.py [--regime compute|update] [--dtype bfloat16]
[--variants NAME ...] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Callable, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jaxamp  # noqa: E402
from benchmarks.bench_loss_scale import INIT_SCALE, with_apply_if_finite  # noqa: E402
from benchmarks.common import (device_summary, interleaved_medians,  # noqa: E402
                               print_ratios)
from benchmarks.record import add_json_args, write_json  # noqa: E402

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
    with jax.named_scope(name):  # names for fp8 autocast's exclusions (bench_fp8_autocast.py)
      q, k, v = jnp.split(_norm(h, p["ln1"]) @ p["qkv"], 3, axis=-1)
      split = lambda x: x.reshape(b, t, heads, d // heads)  # noqa: E731
      logits = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / np.sqrt(d // heads)
      logits = jnp.where(mask, logits.astype(jnp.float32), -1e9)
      attn = jax.nn.softmax(logits, axis=-1).astype(h.dtype)
      h = h + jnp.einsum("bhqk,bkhd->bqhd", attn, split(v)).reshape(b, t, d) @ p["out"]
      h = h + jax.nn.gelu(_norm(h, p["ln2"]) @ p["up"] + p["up_bias"]) @ p["down"]
  with jax.named_scope("head"):
    logits = (_norm(h, params["final_scale"]) @ params["embed"].T).astype(jnp.float32)
  targets = tokens[:, 1:]
  return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
      logits, targets[..., None], -1)[..., 0])


def half_loss(dtype):
  """``loss(params, tokens)``: :func:`lm_loss` on the params cast to ``dtype`` (float32 masters)."""

  def loss(params, tokens):
    return lm_loss(jax.tree.map(lambda p: p.astype(dtype), params), tokens)

  return loss


# ----------------------------------------------------------------------------- variants
# One-jit variants return (init(params) -> state, step(params, state, tokens) -> (params, state));
# the loops (FACADES) return a zero-argument run() that trains one step on their own copy. Every
# runner has .params(), the current params (tests/test_benchmarks.py compares them).


def optax_f32(inner, dtype):
  del dtype

  def step(params, state, tokens):
    grads = jax.grad(lm_loss)(params, tokens)
    updates, state = inner.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return inner.init, step


def plain_half(inner, dtype):
  def step(params, state, tokens):
    grads = jax.grad(half_loss(dtype))(params, tokens)
    updates, state = inner.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return inner.init, step


def with_jaxamp(inner, dtype):
  tx = jaxamp.dynamic_loss_scale(inner, init_scale=INIT_SCALE)

  def step(params, state, tokens):
    scaled = lambda p: jaxamp.scale_loss(half_loss(dtype)(p, tokens), state)  # noqa: E731
    updates, state = tx.update(jax.grad(scaled)(params), state, params)
    return optax.apply_updates(params, updates), state

  return tx.init, step


def with_train_state(inner, dtype):
  tx = jaxamp.dynamic_loss_scale(inner, init_scale=INIT_SCALE)

  def init(params):
    return jaxamp.TrainState.create(apply_fn=lm_loss, params=params, tx=tx)

  def step(params, state, tokens):
    del params  # the state holds them
    _, grads = state.value_and_grad(half_loss(dtype))(state.params, tokens)
    return None, state.apply_gradients(grads=grads)

  return init, step


def with_apply_if_finite_step(inner, dtype):
  init, update = with_apply_if_finite(inner)

  def step(params, state, tokens):
    scaled = lambda p: half_loss(dtype)(p, tokens) * state.scale  # noqa: E731
    return update(params, state, jax.grad(scaled)(params))

  return init, step


def with_flax_dynamic_scale(inner, dtype):
  from flax.training import dynamic_scale  # flax is optional: imported when this variant runs

  def init(params):
    # Array fields (flax's defaults are Python numbers, which would retrace once).
    scale = dynamic_scale.DynamicScale(fin_steps=jnp.zeros([], jnp.int32),
                                       scale=jnp.asarray(INIT_SCALE, jnp.float32))
    return scale, inner.init(params)

  def step(params, state, tokens):
    scale, opt_state = state
    scale, is_fin, _, grads = scale.value_and_grad(half_loss(dtype))(params, tokens)
    updates, new_opt_state = inner.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    # flax's imagenet example: keep the old params and optimizer state where not finite.
    keep = lambda new, old: jnp.where(is_fin, new, old)  # noqa: E731
    return (jax.tree.map(keep, new_params, params),
            (scale, jax.tree.map(keep, new_opt_state, opt_state)))

  return init, step


VARIANTS: Dict[str, Callable] = {
    "optax_f32": optax_f32,
    "plain_f16": plain_half,
    "jaxamp": with_jaxamp,
    "train_state": with_train_state,
    "apply_if_finite": with_apply_if_finite_step,
    "flax_dynamic_scale": with_flax_dynamic_scale,
}


def grad_scaler_loop(inner, dtype, params, tokens) -> Callable[[], None]:
  opt = jaxamp.OptimWrapper(inner, jax.tree.map(jnp.copy, params), donate=True)
  scaler = jaxamp.GradScaler(init_scale=INIT_SCALE)
  loss_fn = half_loss(dtype)  # one function: the holder compiles per function identity

  def run():
    opt.zero_grad()
    opt.backward(scaler.scale(loss_fn), tokens)
    scaler.step(opt)
    scaler.update()
    jax.block_until_ready(opt.params)

  run.params = lambda: opt.params
  return run


def amp_optim_wrapper_loop(inner, dtype, params, tokens) -> Callable[[], None]:
  wrapper = jaxamp.AmpOptimWrapper(inner, jax.tree.map(jnp.copy, params), dtype=dtype,
                                   cast="whole", donate=True,
                                   loss_scale={"init_scale": INIT_SCALE})

  def run():
    jax.block_until_ready(wrapper.update_params(lm_loss, tokens))

  run.params = lambda: wrapper.params
  return run


def _two_calls(make_tx, scale_loss):
  """A loop of two jitted calls: the backward pass, then the donated update (as the facades run)."""

  def loop(inner, dtype, params, tokens) -> Callable[[], None]:
    tx = make_tx(inner)

    @jax.jit
    def backward(params, state, tokens):
      return jax.grad(lambda p: scale_loss(half_loss(dtype)(p, tokens), state))(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def update(params, state, grads):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    box = {"params": jax.tree.map(jnp.copy, params)}
    box["state"] = tx.init(box["params"])

    def run():
      grads = backward(box["params"], box["state"], tokens)
      box["params"], box["state"] = update(box["params"], box["state"], grads)
      jax.block_until_ready(box["state"])

    run.params = lambda: box["params"]
    return run

  return loop


FACADES: Dict[str, Callable] = {
    "grad_scaler": grad_scaler_loop,
    "amp_optim_wrapper": amp_optim_wrapper_loop,
    "plain_f16_2calls": _two_calls(lambda inner: inner, lambda loss, state: loss),
    "jaxamp_2calls": _two_calls(lambda inner: jaxamp.dynamic_loss_scale(inner, init_scale=INIT_SCALE),
                                jaxamp.scale_loss),
}


def make_runner(make_variant, inner, dtype, params, tokens) -> Callable[[], None]:
  init, step = make_variant(inner, dtype)
  jitted = jax.jit(step, donate_argnums=(0, 1))
  box = {"params": jax.tree.map(jnp.copy, params)}
  box["state"] = jax.jit(init)(box["params"])
  if isinstance(box["state"], jaxamp.TrainState):
    # The state holds the params and the step returns None for them: None from the first call on,
    # so that the step compiles once.
    box["params"] = None

  def run():
    box["params"], box["state"] = jitted(box["params"], box["state"], tokens)
    jax.block_until_ready(box["state"])

  def temp_bytes() -> float:
    compiled = jitted.lower(box["params"], box["state"], tokens).compile()
    return float(compiled.memory_analysis().temp_size_in_bytes)

  run.temp_bytes = temp_bytes
  # TrainState carries the params in its state (its step returns None for them).
  run.params = lambda: box["state"].params if box["params"] is None else box["params"]
  return run


def temp_bytes(run) -> Optional[float]:
  """Compiled temporary bytes of a one-jit variant; None for a facade (several programs)."""
  return run.temp_bytes() if hasattr(run, "temp_bytes") else None


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
  parser.add_argument("--variants", nargs="+", choices=sorted({**VARIANTS, **FACADES}),
                      default=list({**VARIANTS, **FACADES}),
                      help="the variants to run (plain_f16, the baseline, always runs)")
  add_json_args(parser)
  args = parser.parse_args(argv)
  wanted = {"plain_f16", *args.variants}

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
           for name, make in VARIANTS.items() if name in wanted}
  steps.update({name: loop(inner, dtype, params, tokens) for name, loop in FACADES.items()
                if name in wanted})
  medians = interleaved_medians(steps, rounds=args.rounds, inner=args.inner)
  print(f"\nmedian time of plain_f16: {medians['plain_f16'] * 1e3:.2f} ms")
  results = {"regime": args.regime, "dtype": args.dtype, "clip": args.clip, "params": n,
             "step": print_ratios(medians, "plain_f16", f"Whole train step, {args.regime}-bound")}
  if args.cost:
    param_bytes = 4.0 * n
    print("\nCompiled temporaries, in parameter bytes:")
    results["temp_param_bytes"] = {}
    for name, run in steps.items():
      temps = temp_bytes(run)
      shown = "several programs" if temps is None else f"{temps / param_bytes:6.2f}x"
      print(f"  {name:<20} {shown}")
      if temps is not None:
        results["temp_param_bytes"][name] = temps / param_bytes
  write_json(args.json, results, args.append)


if __name__ == "__main__":
  main()
