"""An mmengine-style config through ``jaxamp.build_optim_wrapper``, with a Flax Linen model.

The ``optim_wrapper`` section of an mmengine config carries over unchanged:
an ``AmpOptimWrapper`` with AdamW, no weight decay on norms and biases, a
10x smaller learning rate for the backbone, gradient clipping, gradient
accumulation and dynamic loss scaling in float16. The loop is mmengine's
``update_params`` loop; the only change is that the wrapper receives the loss
*function* and its arguments (JAX has no ``loss.backward()``).

The run length is not a multiple of ``accumulative_counts``: after
``initialize_count_status`` the last window is shorter and its loss factor is
its own length, exactly as in mmengine.

Run: ``python examples/mmengine_config.py [--iters 250] [--accumulate 4] [--dtype float16]``
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jaxamp

IN, HIDDEN, CLASSES = 32, 128, 10


class Backbone(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(HIDDEN, name="fc1")(x)
    x = nn.LayerNorm(name="norm")(x)
    return nn.gelu(nn.Dense(HIDDEN, name="fc2")(x))


class Classifier(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(CLASSES, name="head")(Backbone(name="backbone")(x))


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--iters", type=int, default=250, help="training iterations (micro-batches)")
  parser.add_argument("--accumulate", type=int, default=4, help="accumulative_counts")
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--dtype", default="float16", help="AmpOptimWrapper dtype")
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--log-every", type=int, default=50)
  args = parser.parse_args(argv)

  key_init, key_teacher, key_data = jax.random.split(jax.random.key(args.seed), 3)
  teacher = jax.random.normal(key_teacher, (IN, CLASSES))
  model = Classifier()
  params = model.init(key_init, jnp.zeros((1, IN)))["params"]

  def batch(i):
    x = jax.random.normal(jax.random.fold_in(key_data, i), (args.batch_size, IN))
    return x, jnp.argmax(x @ teacher, axis=-1)

  # --8<-- [start:config]
  optim_wrapper = dict(
      type="AmpOptimWrapper",
      optimizer=dict(type="AdamW", lr=args.lr, weight_decay=0.05),
      paramwise_cfg=dict(norm_decay_mult=0.0, bias_decay_mult=0.0,
                         custom_keys={"backbone": dict(lr_mult=0.1)}),
      clip_grad=dict(max_norm=1.0),
      accumulative_counts=args.accumulate,
      loss_scale="dynamic",
      dtype=args.dtype,
  )
  # --8<-- [end:config]
  # --8<-- [start:loop]
  def loss_fn(params, x, y):
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()

  wrapper = jaxamp.build_optim_wrapper(params, optim_wrapper)
  wrapper.initialize_count_status(None, 0, args.iters)  # what mmengine's runner calls
  losses = []
  for i in range(args.iters):
    x, y = batch(i)
    losses.append(wrapper.update_params(loss_fn, x, y))  # scale, backward, step when due
  # --8<-- [end:loop]
    if (i + 1) % args.log_every == 0 or i + 1 == args.iters:
      print(f"iter {i + 1:4d}  loss {float(losses[-1]):.4f}  lr {wrapper.get_lr()['lr']}  "
            f"scale {wrapper.get_scale():g}  grad_norm {float(wrapper.last_grad_norm):.3f}")

  groups = [(g["params"], g["lr"], g["weight_decay"]) for g in wrapper.optimizer.param_groups]
  for names, lr, weight_decay in groups:
    print(f"group lr={lr:g} weight_decay={weight_decay:g}: {', '.join(names)}")
  state = wrapper.state_dict()
  print(f"state_dict()['loss_scaler']: {state['loss_scaler']}")
  return {"first_loss": float(losses[0]), "final_loss": float(losses[-1]),
          "inner_count": wrapper.inner_count, "grads_cleared": wrapper.grads is None,
          "param_groups": groups, "loss_scaler": state["loss_scaler"],
          "scale": wrapper.get_scale()}


if __name__ == "__main__":
  main()
