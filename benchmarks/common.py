"""Shared helpers for the benchmarks: a parameter set and interleaved median timing.

Every benchmark compares variants in one run, interleaving them round by
round so that machine noise hits all of them alike, and prints medians and
ratios (never single absolute times); ``--json PATH`` (:mod:`benchmarks.record`)
also writes them to a file.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def make_params(total: int = 4_000_000, leaves: int = 30, seed: int = 0, dtype=jnp.float32,
                shapes: str = "model"):
  """About ``total`` parameters in about ``leaves`` leaves (a dict of arrays).

  ``shapes="model"``: the leaves of a stack of transformer blocks (``leaves // 6``
  blocks of width ``d``, a multiple of 64: kernels ``(d, 3d)``, ``(d, d)``,
  ``(d, 4d)``, ``(4d, d)`` and two ``(d,)`` norm scales), as real models have.
  ``shapes="uneven"``: 1-D leaves of random, mostly odd, sizes.
  """
  rng = np.random.default_rng(seed)
  if shapes == "uneven":
    weights = rng.uniform(0.2, 1.8, leaves)
    sizes = np.maximum(1, (weights / weights.sum() * total).astype(int))
    return {f"layer_{i:02d}": jnp.asarray(rng.standard_normal(int(n)), dtype)
            for i, n in enumerate(sizes)}
  if shapes != "model":
    raise ValueError(f"shapes must be 'model' or 'uneven', got {shapes!r}")
  blocks = max(1, leaves // 6)
  d = max(64, int(round((total / (12 * blocks))**0.5 / 64)) * 64)
  block = {"qkv": (d, 3 * d), "out": (d, d), "up": (d, 4 * d), "down": (4 * d, d),
           "norm1": (d,), "norm2": (d,)}
  return {f"block_{i:02d}_{name}": jnp.asarray(rng.standard_normal(shape), dtype)
          for i in range(blocks) for name, shape in block.items()}


def add_param_args(parser) -> None:
  """Adds ``--size``, ``--leaves`` and ``--shapes`` (the arguments of :func:`make_params`)."""
  parser.add_argument("--size", type=int, default=4_000_000, help="number of parameters")
  parser.add_argument("--leaves", type=int, default=30, help="number of parameter leaves")
  parser.add_argument("--shapes", choices=("model", "uneven"), default="model",
                      help="leaf shapes: a transformer's, or 1-D of random (mostly odd) sizes")


def make_mlp(d_in: int, hidden: int, d_out: int, depth: int, seed: int = 0):
  """An MLP's float32 params: ``{'layer_i': {'kernel', 'bias'}}``, ``depth`` hidden layers."""
  rng = np.random.default_rng(seed)
  sizes = [d_in] + [hidden] * depth + [d_out]
  params = {}
  for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
    params[f"layer_{i}"] = {
        "kernel": jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), jnp.float32),
        "bias": jnp.zeros((b,), jnp.float32),
    }
  return params


def mlp_problem(hidden: int, depth: int, batch: int, d_in: int = 512, d_out: int = 64):
  """The facade benchmarks' problem: :func:`make_mlp` params and one float32 batch ``(x, y)``."""
  params = make_mlp(d_in, hidden, d_out, depth)
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((batch, d_in)), jnp.float32)
  y = jnp.asarray(rng.standard_normal((batch, d_out)), jnp.float32)
  return params, x, y


def mlp_loss(params, x, y):
  """Mean squared error of the ReLU MLP of :func:`make_mlp`, reduced in float32."""
  h = x
  layers = [params[k] for k in sorted(params)]
  for layer in layers[:-1]:
    h = jax.nn.relu(h @ layer["kernel"] + layer["bias"])
  out = h @ layers[-1]["kernel"] + layers[-1]["bias"]
  return jnp.mean(jnp.square(out - y).astype(jnp.float32))


def interleaved_medians(steps: Dict[str, Callable[[], None]], rounds: int = 15,
                        inner: int = 5, warmup: int = 2) -> Dict[str, float]:
  """Times each zero-argument ``step`` (which must block on its result).

  Each round runs every variant ``inner`` times, in an order that rotates
  between rounds; returns the median seconds per call of each variant.
  """
  names = list(steps)
  for name in names:
    for _ in range(warmup):
      steps[name]()
  samples = {name: [] for name in names}
  for r in range(rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    for name in order:
      start = time.perf_counter()
      for _ in range(inner):
        steps[name]()
      samples[name].append((time.perf_counter() - start) / inner)
  return {name: statistics.median(v) for name, v in samples.items()}


def print_ratios(medians: Dict[str, float], baseline: str, title: str,
                 targets: Dict[str, float] | None = None) -> Dict[str, Any]:
  """Prints each variant's median as a ratio to ``baseline`` (and its target, if any).

  Returns what it printed, for :func:`write_json`: ``{"baseline", "seconds",
  "ratios", "targets"}``.
  """
  targets = targets or {}
  print(f"\n{title}  (ratio to {baseline!r}; median of interleaved rounds)")
  base = medians[baseline]
  width = max(len(n) for n in medians)
  for name, value in medians.items():
    target = f"   target <= {targets[name]:.2f}x" if name in targets else ""
    print(f"  {name:<{width}}  {value / base:6.3f}x{target}")
  return {"baseline": baseline, "seconds": dict(medians),
          "ratios": {name: value / base for name, value in medians.items()},
          "targets": dict(targets)}


def block(tree) -> None:
  jax.block_until_ready(tree)


def device_summary() -> str:
  devices = jax.devices()
  return f"{len(devices)} x {devices[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}"


__all__: Sequence[str] = ("add_param_args", "make_params", "make_mlp", "mlp_problem", "mlp_loss",
                          "interleaved_medians", "print_ratios", "block", "device_summary")
