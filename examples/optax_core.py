"""Mixed-precision training with jaxamp's functional core: an optax chain in one jitted step.

A small MLP classifies a synthetic dataset (a fixed random "teacher" labels
Gaussian inputs). The float32 master parameters are cast to float16 inside the
loss (``jaxamp.mixed_precision``), and the optimizer is plain optax wrapped by
jaxamp::

    accumulate_gradients(                        # --accumulate micro-batches per step
        dynamic_loss_scale(                      # unscale, check, step or skip, adjust
            chain(clip_by_global_norm(1.0),      # clips the unscaled window mean
                  adamw(lr))),
        every_k)

Every micro-step is one call of the jitted ``train_step``; the scale, the skip
flag and the window state travel in the optimizer state, so nothing syncs the
host except the periodic log line.

Run: ``python examples/optax_core.py [--steps 300] [--accumulate 2] [--dtype float16]``
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Dict, Optional, Sequence

import jax
import jax.numpy as jnp
import optax

import jaxamp

IN, HIDDEN, CLASSES = 32, 128, 10


def init_params(key: jax.Array) -> Dict[str, jax.Array]:
  k1, k2 = jax.random.split(key)
  return {
      "w1": jax.random.normal(k1, (IN, HIDDEN)) * IN**-0.5,
      "b1": jnp.zeros((1, HIDDEN)),
      "w2": jax.random.normal(k2, (HIDDEN, CLASSES)) * HIDDEN**-0.5,
      "b2": jnp.zeros((1, CLASSES)),
  }


def logits_fn(params: Dict[str, jax.Array], x: jax.Array) -> jax.Array:
  hidden = jax.nn.gelu(x @ params["w1"] + params["b1"])
  return hidden @ params["w2"] + params["b2"]


def loss_fn(params: Dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
  logits = logits_fn(params, x).astype(jnp.float32)  # reduce in float32
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_batch(key: jax.Array, teacher: jax.Array, size: int):
  x = jax.random.normal(key, (size, IN))
  return x, jnp.argmax(x @ teacher, axis=-1)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
  parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
  parser.add_argument("--batch-size", type=int, default=128, help="examples per micro-batch")
  parser.add_argument("--dtype", default="float16", help="compute dtype: float16, bfloat16, float32")
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--log-every", type=int, default=50, help="optimizer steps between logs")
  args = parser.parse_args(argv)

  key_params, key_teacher, key_data, key_eval = jax.random.split(jax.random.key(args.seed), 4)
  teacher = jax.random.normal(key_teacher, (IN, CLASSES))
  params = init_params(key_params)

  tx = jaxamp.accumulate_gradients(
      jaxamp.dynamic_loss_scale(
          optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.lr, weight_decay=1e-4)),
          growth_interval=100),
      args.accumulate)
  opt_state = tx.init(params)
  compute_loss = jaxamp.mixed_precision(loss_fn, f"params=float32,compute={args.dtype}")

  def train_step(params, opt_state, micro_step):
    x, y = make_batch(jax.random.fold_in(key_data, micro_step), teacher, args.batch_size)

    def scaled_loss(p):
      loss = compute_loss(p, x, y)
      return jaxamp.scale_loss(loss, opt_state), loss

    grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    scale_state = jaxamp.get_loss_scale_state(opt_state)
    metrics = {"loss": loss, "scale": scale_state.scale, "skipped": scale_state.skipped_steps}
    return params, opt_state, metrics

  train_step = jax.jit(train_step, donate_argnums=(0, 1))

  x_eval, y_eval = make_batch(key_eval, teacher, 2048)
  start = time.perf_counter()
  losses = []
  micro_step = 0
  for step in range(1, args.steps + 1):
    for _ in range(args.accumulate):
      params, opt_state, metrics = train_step(params, opt_state, micro_step)
      micro_step += 1
    losses.append(metrics["loss"])
    if step % args.log_every == 0 or step == args.steps:
      print(f"step {step:5d}  loss {float(metrics['loss']):.4f}  "
            f"scale {float(metrics['scale']):9.1f}  skipped {int(metrics['skipped'])}")
  seconds = time.perf_counter() - start

  accuracy = jnp.mean(jnp.argmax(logits_fn(params, x_eval), -1) == y_eval)
  result = {
      "first_loss": float(losses[0]),
      "final_loss": float(losses[-1]),
      "accuracy": float(accuracy),
      "scale": float(metrics["scale"]),
      "skipped_steps": int(metrics["skipped"]),
      "optimizer_steps": int(jaxamp.get_accumulation_state(opt_state).gradient_step),
      "steps_per_second": args.steps / seconds,
  }
  print(f"held-out accuracy {result['accuracy']:.3f}, {result['skipped_steps']} skipped steps, "
        f"{result['steps_per_second']:.0f} optimizer steps/s")
  return result


if __name__ == "__main__":
  main()
