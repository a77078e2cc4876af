"""PyTorch's "Automatic Mixed Precision examples", section by section, ported to jaxamp.

Each function below is one section of PyTorch's AMP examples note, written as
literally as JAX allows: ``jaxamp.GradScaler`` for ``torch.amp.GradScaler``,
``jaxamp.OptimWrapper`` for a model and its optimizer, ``jaxamp.autocast`` for
``torch.autocast``, and a loss *function* where PyTorch calls ``backward()``
on a loss tensor. The PyTorch lines are in the comments.

Run: ``python examples/amp_recipes.py [--steps 20]``
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Dict, Optional, Sequence

import jax
import jax.numpy as jnp
import optax

import jaxamp

IN, HIDDEN, OUT = 8, 32, 4


def init(key: jax.Array) -> Dict[str, jax.Array]:
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (IN, HIDDEN)) / IN**0.5, "b1": jnp.zeros(HIDDEN),
          "w2": jax.random.normal(k2, (HIDDEN, OUT)) / HIDDEN**0.5}


def model(params: Dict[str, jax.Array], x: jax.Array) -> jax.Array:
  return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]


# with torch.autocast(device_type="cuda", dtype=torch.float16): output = model(input); loss = ...
@jaxamp.autocast
def loss_fn(params: Dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean((model(params, x) - y) ** 2)


def batches(steps: int, batch: int = 16) -> list:
  key = jax.random.key(1)
  out = []
  for _ in range(steps):
    key, kx = jax.random.split(key)
    x = jax.random.normal(kx, (batch, IN))
    out.append((x, jnp.sin(x[:, :OUT])))
  return out


def typical(data: list) -> float:
  """Typical mixed precision training."""
  opt = jaxamp.OptimWrapper(optax.sgd(0.1), init(jax.random.key(0)))
  scaler = jaxamp.GradScaler()                       # scaler = torch.amp.GradScaler()
  for x, y in data:
    opt.zero_grad()                                  # optimizer.zero_grad()
    loss = opt.backward(scaler.scale(loss_fn), x, y)  # scaler.scale(loss).backward()
    scaler.step(opt)                                 # scaler.step(optimizer)
    scaler.update()                                  # scaler.update()
  return float(loss)


def gradient_clipping(data: list, max_norm: float = 0.5) -> float:
  """Working with unscaled gradients: gradient clipping."""
  opt = jaxamp.OptimWrapper(optax.sgd(0.1), init(jax.random.key(0)))
  scaler = jaxamp.GradScaler()
  for x, y in data:
    opt.zero_grad()
    loss = opt.backward(scaler.scale(loss_fn), x, y)
    scaler.unscale_(opt)                             # scaler.unscale_(optimizer)
    jaxamp.clip_grad_norm_(opt, max_norm)            # clip_grad_norm_(model.parameters(), ...)
    scaler.step(opt)
    scaler.update()
  return float(loss)


def gradient_accumulation(data: list, iters_to_accumulate: int = 2) -> float:
  """Working with scaled gradients: gradient accumulation."""
  opt = jaxamp.OptimWrapper(optax.sgd(0.1), init(jax.random.key(0)))
  scaler = jaxamp.GradScaler()
  accumulated = lambda p, x, y: loss_fn(p, x, y) / iters_to_accumulate  # noqa: E731
  for i, (x, y) in enumerate(data):
    loss = opt.backward(scaler.scale(accumulated), x, y)  # loss = loss / iters_to_accumulate
    if (i + 1) % iters_to_accumulate == 0:
      scaler.step(opt)
      scaler.update()
      opt.zero_grad()
  return float(loss) * iters_to_accumulate


def gradient_penalty(data: list) -> float:
  """Working with scaled gradients: gradient penalty."""
  opt = jaxamp.OptimWrapper(optax.sgd(0.05), init(jax.random.key(0)))
  scaler = jaxamp.GradScaler()

  def penalized(params, x, y):
    # scaled_grads = torch.autograd.grad(outputs=scaler.scale(loss), inputs=..., create_graph=True)
    scaled_grads = jax.grad(lambda p: scaler.scale(loss_fn(p, x, y)))(params)
    inv_scale = 1.0 / scaler.get_scale()             # the scale of this (traced) call
    grads = jax.tree.map(lambda g: g * inv_scale, scaled_grads)
    grad_norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
    return loss_fn(params, x, y) + grad_norm

  for x, y in data:
    opt.zero_grad()
    loss = opt.backward(scaler.scale(penalized), x, y)
    scaler.step(opt)
    scaler.update()
  return float(loss)


def multiple_models(data: list) -> float:
  """Working with multiple models, losses and optimizers (one scaler, one backward per loss)."""
  wrappers = jaxamp.OptimWrapperDict(
      a=jaxamp.OptimWrapper(optax.sgd(0.1), init(jax.random.key(0))),
      b=jaxamp.OptimWrapper(optax.sgd(0.1, momentum=0.9), init(jax.random.key(2))))
  scaler = jaxamp.GradScaler()

  def loss0(ps, x, y):  # loss0 = loss_fn(2 * output0 + 3 * output1, target)
    return loss_fn(ps["a"], x, y) + loss_fn(ps["b"], x, y)

  def loss1(ps, x, y):  # loss1 = loss_fn(3 * output0 - 5 * output1, target)
    return jnp.mean((model(ps["a"], x) - model(ps["b"], x)) ** 2)

  for x, y in data:
    wrappers.zero_grad()
    loss = wrappers.backward_all(scaler.scale(loss0), x, y)  # scaler.scale(loss0).backward()
    wrappers.backward_all(scaler.scale(loss1), x, y)         # scaler.scale(loss1).backward()
    scaler.unscale_(wrappers["a"])  # to inspect or modify a's gradients first, as PyTorch allows
    scaler.step(wrappers["a"])
    scaler.step(wrappers["b"])
    scaler.update()
  return float(loss)


def save_and_resume(data: list) -> float:
  """Saving/resuming: the scaler's state dict goes with the model's and the optimizer's."""
  half = len(data) // 2
  opt = jaxamp.OptimWrapper(optax.adam(1e-2), init(jax.random.key(0)))
  scaler = jaxamp.GradScaler()
  for x, y in data[:half]:
    opt.zero_grad()
    opt.backward(scaler.scale(loss_fn), x, y)
    scaler.step(opt)
    scaler.update()
  checkpoint = {"params": opt.params, "optimizer": opt.state_dict(),
                "scaler": scaler.state_dict()}  # torch.save({..., "scaler": scaler.state_dict()})
  resumed = jaxamp.OptimWrapper(optax.adam(1e-2), checkpoint["params"])
  resumed.load_state_dict(checkpoint["optimizer"])
  resumed_scaler = jaxamp.GradScaler()
  resumed_scaler.load_state_dict(checkpoint["scaler"])  # scaler.load_state_dict(checkpoint["scaler"])
  for x, y in data[half:]:
    resumed.zero_grad()
    loss = resumed.backward(resumed_scaler.scale(loss_fn), x, y)
    resumed_scaler.step(resumed)
    resumed_scaler.update()
  return float(loss)


def disabled_scaler(data: list, use_amp: bool = False) -> float:
  """A run that can switch AMP off: ``enabled=use_amp`` makes every scaler call a pass-through."""
  opt = jaxamp.OptimWrapper(optax.sgd(0.1), init(jax.random.key(0)))
  scaler = jaxamp.GradScaler(enabled=use_amp)
  plain = jaxamp.autocast(loss_fn.__wrapped__, enabled=use_amp)  # autocast(..., enabled=use_amp)
  for x, y in data:
    opt.zero_grad()
    loss = opt.backward(scaler.scale(plain), x, y)
    scaler.step(opt)
    scaler.update()
  return float(loss)


RECIPES: Dict[str, Callable[[list], float]] = {
    "typical": typical, "gradient_clipping": gradient_clipping,
    "gradient_accumulation": gradient_accumulation, "gradient_penalty": gradient_penalty,
    "multiple_models": multiple_models, "save_and_resume": save_and_resume,
    "disabled_scaler": disabled_scaler,
}


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=20)
  args = parser.parse_args(argv)
  data = batches(args.steps)
  first = float(loss_fn(init(jax.random.key(0)), *data[0]))
  results = {name: recipe(data) for name, recipe in RECIPES.items()}
  for name, loss in results.items():
    print(f"{name:<22} final loss {loss:.4f}")
  return {"first_loss": first, "final_losses": results}


if __name__ == "__main__":
  main()
