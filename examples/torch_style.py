"""A PyTorch-style AMP loop: ``jaxamp.GradScaler`` stepping a ``jaxamp.OptimWrapper``.

The loop is PyTorch's recipe for mixed precision with gradient accumulation
and clipping, line for line::

    # PyTorch                                        # jaxamp
    with torch.autocast("cuda", torch.float16):      loss_fn = jaxamp.autocast(fn, jnp.float16)
        loss = fn(model(x), y) / accum
    scaler.scale(loss).backward()                    opt.backward(scaler.scale(loss_fn), x, y)
    if (i + 1) % accum == 0:
        scaler.unscale_(optimizer)                   scaler.unscale_(opt)
        clip_grad_norm_(model.parameters(), 1.0)     (clip_grad=dict(max_norm=1.0) in the wrapper)
        scaler.step(optimizer)                       scaler.step(opt)
        scaler.update()                              scaler.update()
        optimizer.zero_grad()                        opt.zero_grad()

The wrapper owns the float32 master parameters, the optax state and the
accumulated gradients; the scaler holds the scale. No call waits for the
device: the skip decision stays on it. ``scaler.state_dict()`` is PyTorch's
format, so a scaler state saved by PyTorch loads here and the other way round.

Run: ``python examples/torch_style.py [--steps 200] [--accumulate 2] [--dtype float16]``
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, Optional, Sequence

import jax
import jax.numpy as jnp
import optax

import jaxamp

IN, HIDDEN, CLASSES = 32, 128, 10


def init_params(key: jax.Array) -> Dict[str, jax.Array]:
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (IN, HIDDEN)) * IN**-0.5, "b1": jnp.zeros((1, HIDDEN)),
          "w2": jax.random.normal(k2, (HIDDEN, CLASSES)) * HIDDEN**-0.5,
          "b2": jnp.zeros((1, CLASSES))}


def cross_entropy(params: Dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
  logits = jax.nn.relu(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
  parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--dtype", default="float16", help="compute dtype")
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--log-every", type=int, default=50)
  args = parser.parse_args(argv)

  key_params, key_teacher, key_data = jax.random.split(jax.random.key(args.seed), 3)
  teacher = jax.random.normal(key_teacher, (IN, CLASSES))

  def batch(i):
    x = jax.random.normal(jax.random.fold_in(key_data, i), (args.batch_size, IN))
    return x, jnp.argmax(x @ teacher, axis=-1)

  # --8<-- [start:loop]
  accum = args.accumulate

  def loss_fn(params, x, y):  # one function object for the whole run: compiled once
    loss = cross_entropy(params, x, y)
    return loss / accum, loss  # (what is differentiated, what is logged)

  loss_fn = jaxamp.autocast(loss_fn, args.dtype)  # torch.autocast("cuda", dtype)
  opt = jaxamp.OptimWrapper(optax.adamw(args.lr), init_params(key_params),
                            clip_grad=dict(max_norm=1.0))
  scaler = jaxamp.GradScaler(init_scale=2.0**16, growth_interval=100)
  grad_norm = jax.jit(jaxamp.total_grad_norm)

  losses, grad_norms = [], []
  for i in range(args.steps * accum):
    x, y = batch(i)
    # scaler.scale(loss).backward(): only the first output is scaled.
    _, loss = opt.backward(scaler.scale(loss_fn, has_aux=True), x, y, has_aux=True)
    if (i + 1) % accum == 0:
      scaler.unscale_(opt)                   # opt.grads are unscaled from here on
      grad_norms.append(grad_norm(opt.grads))
      scaler.step(opt)                       # clips, then steps unless inf/nan
      scaler.update()
      opt.zero_grad()
      losses.append(loss)
  # --8<-- [end:loop]
      step = len(losses)
      if step % args.log_every == 0:
        print(f"step {step:4d}  loss {float(losses[-1]):.4f}  "
              f"grad norm {float(grad_norms[-1]):.3f}  scale {scaler.get_scale():g}")

  state = scaler.state_dict()
  print(f"scaler.state_dict(): {state}")
  restored = jaxamp.GradScaler()
  restored.load_state_dict(state)  # PyTorch's format, both ways
  return {"first_loss": float(losses[0]), "final_loss": float(losses[-1]),
          "scale": scaler.get_scale(), "state_dict": state,
          "restored_scale": restored.get_scale()}


if __name__ == "__main__":
  main()
