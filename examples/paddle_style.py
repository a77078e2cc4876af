"""A Paddle-style AMP loop: ``jaxamp.paddle.GradScaler.minimize`` and its hysteresis.

Paddle's recipe, line for line::

    # Paddle                                         # jaxamp
    with paddle.amp.auto_cast():                     loss_fn = jaxamp.autocast(fn, jnp.float16)
        loss = fn(model(x), y)
    scaled = scaler.scale(loss)
    scaled.backward()                                opt.backward(scaler.scale(loss_fn), x, y)
    scaler.minimize(optimizer, scaled)               scaler.minimize(opt)
    optimizer.clear_grad()                           opt.zero_grad()

Paddle backs the scale off only after ``decr_every_n_nan_or_inf``
consecutive non-finite steps (hysteresis). Every non-finite step is still
skipped. To show it, the script makes the loss of a few chosen iterations
inf: an isolated overflow is skipped without touching the scale, two in a
row halve it.

Run: ``python examples/paddle_style.py [--steps 120] [--overflow-at 40 80 81]``
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp

IN, HIDDEN, OUT = 16, 64, 1


def init_params(key: jax.Array) -> Dict[str, jax.Array]:
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (IN, HIDDEN)) * IN**-0.5,
          "w2": jax.random.normal(k2, (HIDDEN, OUT)) * HIDDEN**-0.5}


def mse(params: Dict[str, jax.Array], x: jax.Array, y: jax.Array, blowup: jax.Array):
  pred = jnp.tanh(x @ params["w1"]) @ params["w2"]
  loss = jnp.mean((pred.astype(jnp.float32) - y) ** 2) * blowup
  return loss, loss  # (what is scaled and differentiated, what is logged)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=120)
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--overflow-at", type=int, nargs="*", default=[40, 80, 81],
                      help="iterations whose loss is made inf")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--log-every", type=int, default=20)
  args = parser.parse_args(argv)

  key_params, key_teacher, key_data = jax.random.split(jax.random.key(args.seed), 3)
  teacher = jax.random.normal(key_teacher, (IN, OUT))
  params = init_params(key_params)

  # --8<-- [start:loop]
  loss_fn = jaxamp.autocast(mse, jnp.float16)             # paddle.amp.auto_cast()
  opt = jaxamp.OptimWrapper(optax.sgd(0.05, momentum=0.9), params)
  scaler = jaxamp.paddle.GradScaler(init_loss_scaling=1024.0, incr_every_n_steps=1000,
                                    decr_every_n_nan_or_inf=2)

  scales, losses = [], []
  for i in range(args.steps):
    x = jax.random.normal(jax.random.fold_in(key_data, i), (args.batch_size, IN))
    blowup = jnp.float32(np.inf if i in args.overflow_at else 1.0)
    _, loss = opt.backward(scaler.scale(loss_fn, has_aux=True), x, jnp.tanh(0.25 * x @ teacher),
                           blowup, has_aux=True)           # scaler.scale(loss).backward()
    scaler.minimize(opt)                                   # unscale, skip or step, update
    opt.zero_grad()                                        # optimizer.clear_grad()
    scales.append(scaler.state.scale)                      # a device scalar: no sync
    losses.append(loss)
  # --8<-- [end:loop]
    if (i + 1) % args.log_every == 0:
      print(f"iteration {i + 1:4d}  loss {float(losses[-1]):.4f}  scale {float(scales[-1]):g}")

  state = scaler.state_dict()
  print(f"scaler.state_dict(): {state}")
  return {"scales": [float(s) for s in scales], "losses": [float(v) for v in losses],
          "state_dict": state}


if __name__ == "__main__":
  main()
