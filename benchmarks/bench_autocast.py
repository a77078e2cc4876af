"""Step time of float32, whole-cast half precision and op-level autocast, with trace and compile time.

Times one jitted training step (``value_and_grad`` of the loss and an SGD
update, params donated) for:

- ``float32``: the loss as written (the baseline);
- ``whole_cast``: ``jaxamp.mixed_precision(loss, "c=<dtype>")``: every
  floating input cast to the half dtype, as jmp does;
- ``autocast``: ``jaxamp.autocast(loss, dtype)``: matmuls in the half dtype,
  exp/log/sums/norms in float32, as ``torch.autocast``;

on two problems: the MLP of ``benchmarks/common.py`` and a pre-norm
transformer block (attention and MLP, layer norms, a log-softmax loss). The
variants are interleaved round by round; medians are printed as ratios to
``float32``. Trace time (``jit(...).lower``) and compile time
(``.compile()``) are measured once per variant.

On a CPU, half precision is emulated (XLA converts to float32 around each
op), so the ratios mostly measure the cost of the casts, not the speed-up a
GPU gives.

Run: ``python benchmarks/bench_autocast.py [--rounds R] [--dtype bfloat16] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Dict

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jaxamp  # noqa: E402
from benchmarks.common import (device_summary, interleaved_medians,  # noqa: E402
                               mlp_loss, mlp_problem, print_ratios)
from benchmarks.record import add_json_args, write_json  # noqa: E402


def _layer_norm(h, scale):
  mu = jnp.mean(h, -1, keepdims=True)
  var = jnp.mean(jnp.square(h - mu), -1, keepdims=True)
  return (h - mu) * jax.lax.rsqrt(var + 1e-5) * scale


def transformer_problem(d: int, heads: int, seq: int, batch: int, vocab: int = 256):
  """A pre-norm transformer block's float32 params, one batch of embeddings and labels."""
  rng = np.random.default_rng(0)
  w = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32)
  params = {"qkv": w(d, 3 * d), "out": w(d, d), "up": w(d, 4 * d), "down": w(4 * d, d),
            "norm1": jnp.ones(d), "norm2": jnp.ones(d), "head": w(d, vocab)}
  x = jnp.asarray(rng.standard_normal((batch, seq, d)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, vocab, (batch, seq)), jnp.int32)
  return params, x, labels, heads


def transformer_loss(params, x, labels, heads):
  b, s, d = x.shape
  h = _layer_norm(x, params["norm1"])
  q, k, v = jnp.split(h @ params["qkv"], 3, axis=-1)
  split = lambda t: t.reshape(b, s, heads, d // heads)
  scores = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / np.sqrt(d // heads)
  attn = jax.nn.softmax(scores, axis=-1)
  o = jnp.einsum("bhqk,bkhd->bqhd", attn, split(v)).reshape(b, s, d)
  x = x + o @ params["out"]
  h = _layer_norm(x, params["norm2"])
  x = x + jax.nn.gelu(h @ params["up"]) @ params["down"]
  logp = jax.nn.log_softmax(x @ params["head"])
  return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def make_runner(loss_fn: Callable, params, args) -> Dict:
  """A zero-argument step carrying its own donated params; trace and compile seconds."""

  def step(params, *batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
    return jax.tree.map(lambda p, g: p - 1e-3 * g.astype(p.dtype), params, grads), loss

  jitted = jax.jit(step, donate_argnums=0)
  box = {"params": jax.tree.map(jnp.copy, params)}
  start = time.perf_counter()
  lowered = jitted.lower(box["params"], *args)
  traced = time.perf_counter() - start
  start = time.perf_counter()
  compiled = lowered.compile()
  compile_s = time.perf_counter() - start

  def run():
    box["params"], loss = compiled(box["params"], *args)
    jax.block_until_ready(loss)

  return {"run": run, "trace": traced, "compile": compile_s}


def bench(title: str, loss_fn: Callable, params, args, dtype, rounds: int, inner: int) -> Dict:
  """Times the three variants of ``loss_fn``; returns the ratios, trace and compile seconds."""
  name = jnp.dtype(dtype).name
  variants = {
      "float32": loss_fn,
      "whole_cast": jaxamp.mixed_precision(loss_fn, f"c={name}"),
      "autocast": jaxamp.autocast(loss_fn, dtype),
  }
  runners = {k: make_runner(f, params, args) for k, f in variants.items()}
  medians = interleaved_medians({k: r["run"] for k, r in runners.items()}, rounds=rounds,
                                inner=inner)
  print(f"\n== {title}: median float32 step {medians['float32'] * 1e3:.2f} ms")
  step = print_ratios(medians, "float32", f"{title}, step time ({name})")
  print("  trace / compile (s):  " + "   ".join(
      f"{k} {r['trace']:.2f} / {r['compile']:.2f}" for k, r in runners.items()))
  return {"step": step, "trace_s": {k: r["trace"] for k, r in runners.items()},
          "compile_s": {k: r["compile"] for k, r in runners.items()}}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds")
  parser.add_argument("--inner", type=int, default=3, help="calls per variant per round")
  parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
  add_json_args(parser)
  args = parser.parse_args(argv)
  dtype = jnp.dtype(args.dtype)
  print(f"{device_summary()}; {args.rounds} rounds x {args.inner} calls")

  params, x, y = mlp_problem(hidden=512, depth=3, batch=256)
  results = {"dtype": args.dtype}
  results["mlp"] = bench("MLP (512 -> 3 x 512 -> 64, batch 256)", mlp_loss, params, (x, y), dtype,
                         args.rounds, args.inner)

  params, x, labels, heads = transformer_problem(d=256, heads=4, seq=128, batch=8)

  def block_loss(params, x, labels):
    return transformer_loss(params, x, labels, heads)

  results["block"] = bench("Transformer block (d 256, 4 heads, seq 128, batch 8)", block_loss,
                           params, (x, labels), dtype, args.rounds, args.inner)
  write_json(args.json, results, args.append)


if __name__ == "__main__":
  main()
