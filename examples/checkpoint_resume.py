"""Checkpoint in the middle of an accumulation window with orbax, resume, and match bit for bit.

Everything jaxamp keeps is a pytree of typed arrays: the loss scale and its
counters, the half-filled gradient accumulator, the inner optimizer state. So
an ordinary orbax checkpoint of ``{params, opt_state, micro_step}`` captures a
run exactly, even between two micro-batches of one window.

The script trains twice with the same data order:

1. uninterrupted, for ``--micro-steps`` micro-steps;
2. interrupted after ``--stop-at`` micro-steps (in the middle of a window),
   saved with ``orbax.checkpoint.CheckpointManager``; then everything is
   rebuilt from scratch (optimizer, jitted step, state restored from disk
   against an abstract target) and trained to the end.

It injects an overflow into two micro-batches (one before and one after the
interruption), so the resumed run must also carry over the skip and back-off
bookkeeping, and finally checks that both runs end bit-identical: every leaf
of the parameters and of the optimizer state.

Run: ``python examples/checkpoint_resume.py [--micro-steps 40] [--stop-at 13] [--accumulate 4]``
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import jaxamp

IN, HIDDEN, OUT = 16, 64, 4


def init_params(key: jax.Array) -> Dict[str, jax.Array]:
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (IN, HIDDEN)) * IN**-0.5,
          "w2": jax.random.normal(k2, (HIDDEN, OUT)) * HIDDEN**-0.5}


def loss_fn(params, x, y):
  pred = jnp.tanh(x @ params["w1"]) @ params["w2"]
  return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


def build(args: argparse.Namespace) -> Tuple[optax.GradientTransformation, Callable]:
  """The optimizer and the jitted micro-step. Called once per (re)started run."""
  tx = jaxamp.accumulate_gradients(
      jaxamp.dynamic_loss_scale(optax.adamw(1e-3), growth_interval=3),
      args.accumulate, total_steps=args.micro_steps)
  compute_loss = jaxamp.mixed_precision(loss_fn, "c=f16")
  data_key = jax.random.key(args.seed + 1)
  poisoned = jnp.asarray(args.poison, jnp.int32)

  def train_step(state):
    params, opt_state, micro_step = state["params"], state["opt_state"], state["micro_step"]
    # The data depend on the micro-step only, so a resumed run sees the same batches.
    kx, ky = jax.random.split(jax.random.fold_in(data_key, micro_step))
    x = jax.random.normal(kx, (args.batch_size, IN))
    y = jax.random.normal(ky, (args.batch_size, OUT))
    # A deliberate overflow in the listed micro-batches.
    blowup = jnp.where(jnp.any(micro_step == poisoned), jnp.float32(jnp.inf), jnp.float32(1.0))

    def scaled_loss(p):
      return jaxamp.scale_loss(compute_loss(p, x, y) * blowup, opt_state)

    grads = jax.grad(scaled_loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return {"params": optax.apply_updates(params, updates), "opt_state": opt_state,
            "micro_step": micro_step + 1}

  return tx, jax.jit(train_step, donate_argnums=0)


def fresh_state(tx: optax.GradientTransformation, seed: int) -> Dict[str, Any]:
  params = init_params(jax.random.key(seed))
  return {"params": params, "opt_state": tx.init(params), "micro_step": jnp.zeros([], jnp.int32)}


def train(step: Callable, state: Dict[str, Any], until: int) -> Dict[str, Any]:
  while int(state["micro_step"]) < until:
    state = step(state)
  return state


def bit_identical(a: Any, b: Any) -> bool:
  """Same tree structure and the same bytes in every leaf."""
  if jax.tree.structure(a) != jax.tree.structure(b):
    return False
  return all(np.asarray(x).dtype == np.asarray(y).dtype
             and np.asarray(x).tobytes() == np.asarray(y).tobytes()
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--micro-steps", type=int, default=40, help="micro-batches in the run")
  parser.add_argument("--stop-at", type=int, default=13,
                      help="micro-steps before the interruption (not a multiple of --accumulate)")
  parser.add_argument("--accumulate", type=int, default=4, help="micro-batches per window")
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--poison", type=int, nargs="*", default=[6, 25],
                      help="micro-steps whose loss is made inf")
  parser.add_argument("--checkpoint-dir", default=None,
                      help="a new folder to save in (default: a temporary one, deleted afterwards)")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  if args.stop_at % args.accumulate == 0 or not 0 < args.stop_at < args.micro_steps:
    parser.error("--stop-at must fall inside a window: not a multiple of --accumulate, "
                 "and between 0 and --micro-steps")

  # 1. The uninterrupted run.
  tx, step = build(args)
  reference = train(step, fresh_state(tx, args.seed), args.micro_steps)

  with tempfile.TemporaryDirectory() as tmp:
    directory = pathlib.Path(args.checkpoint_dir or tmp).resolve()
    # 2a. Train up to the interruption and save.
    tx, step = build(args)
    state = train(step, fresh_state(tx, args.seed), args.stop_at)
    window_fill = int(jaxamp.get_accumulation_state(state["opt_state"]).mini_step)
    with ocp.CheckpointManager(directory) as manager:
      manager.save(args.stop_at, args=ocp.args.StandardSave(state))
      manager.wait_until_finished()
    del state, tx, step

    # 2b. A new start: rebuild everything, restore against an abstract target.
    tx, step = build(args)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, fresh_state(tx, args.seed))
    with ocp.CheckpointManager(directory) as manager:
      restored_step = manager.latest_step()
      state = manager.restore(restored_step, args=ocp.args.StandardRestore(abstract))
  resumed = train(step, state, args.micro_steps)

  scale_state = jaxamp.get_loss_scale_state(resumed["opt_state"])
  result = {
      "bit_identical": bit_identical(reference, resumed),
      "restored_at": int(restored_step),
      "window_fill_at_save": window_fill,
      "scale": float(scale_state.scale),
      "skipped_steps": int(scale_state.skipped_steps),
  }
  print(f"saved after micro-step {result['restored_at']} with {window_fill} of "
        f"{args.accumulate} micro-batches in the open window")
  print(f"final scale {result['scale']:g}, {result['skipped_steps']} skipped optimizer steps")
  print(f"resumed run bit-identical to the uninterrupted one: {result['bit_identical']}")
  return result


if __name__ == "__main__":
  main()
