"""bfloat16 parameters without a float32 master copy: the three roundings side by side.

A small MLP regresses a fixed random "teacher" MLP. Four runs share the data,
the initialization and AdamW (with a small learning rate, where plain bfloat16
training loses most updates):

- ``master``: float32 parameters and a bfloat16 forward pass (mixed precision);
- ``nearest``, ``stochastic``, ``kahan``: bfloat16 parameters updated by
  ``jaxamp.low_precision_params(adamw, rounding)``.

Each step is one jitted call; ``jaxamp.step_metrics`` reports the fraction of
the update that round-to-nearest loses (``stale_fraction``). The script prints
each run's final loss, its ratio to the master's and the bytes per parameter
of params, optimizer state and gradients.

Run: ``python examples/bfloat16_params.py [--steps 400] [--lr 3e-4]``
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp

IN, HIDDEN, OUT = 16, 128, 4


def init_params(key: jax.Array, dtype: Any) -> Dict[str, jax.Array]:
  k1, k2 = jax.random.split(key)
  return {"w1": (jax.random.normal(k1, (IN, HIDDEN)) * IN**-0.5).astype(dtype),
          "b1": jnp.zeros((HIDDEN,), dtype),
          "w2": (jax.random.normal(k2, (HIDDEN, OUT)) * HIDDEN**-0.5).astype(dtype)}


def mlp(params: Dict[str, jax.Array], x: jax.Array) -> jax.Array:
  p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)  # bfloat16 compute in every run
  h = jax.nn.gelu(x.astype(jnp.bfloat16) @ p["w1"] + p["b1"])
  return (h @ p["w2"]).astype(jnp.float32)


def loss_fn(params: Dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean((mlp(params, x) - y) ** 2)


def train(name: str, steps: int, lr: float, batch: int) -> Dict[str, float]:
  """Trains one configuration; returns its final loss, stale fraction and bytes per parameter."""
  teacher = init_params(jax.random.key(1), jnp.float32)
  dtype = jnp.float32 if name == "master" else jnp.bfloat16
  params = init_params(jax.random.key(0), dtype)
  adamw = optax.adamw(lr, weight_decay=1e-4)
  tx = adamw if name == "master" else jaxamp.low_precision_params(adamw, name)
  state = tx.init(params)

  @jax.jit
  def step(params, state, key):
    x = jax.random.normal(key, (batch, IN))
    y = mlp(teacher, x)
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for i in range(steps):
    params, state, loss = step(params, state, jax.random.key(100 + i))
    losses.append(loss)
  count = sum(p.size for p in jax.tree.leaves(params))
  size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((params, state, params)))
  out = {"final_loss": float(np.mean(jax.device_get(losses[-20:]))),
         "bytes_per_param": size / count}
  if name != "master":
    out["stale_fraction"] = float(jaxamp.step_metrics(state)["stale_fraction"])
  return out


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Dict[str, float]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--lr", type=float, default=3e-4)
  parser.add_argument("--batch-size", type=int, default=64)
  args = parser.parse_args(argv)
  results = {name: train(name, args.steps, args.lr, args.batch_size)
             for name in ("master", "nearest", "stochastic", "kahan")}
  base = results["master"]["final_loss"]
  for name, r in results.items():
    stale = f", nearest would lose {r['stale_fraction']:.0%}" if "stale_fraction" in r else ""
    print(f"{name:<10} final loss {r['final_loss']:.5f} ({r['final_loss'] / base:.3f}x master), "
          f"{r['bytes_per_param']:.0f} bytes/param{stale}")
  return results


if __name__ == "__main__":
  main()
