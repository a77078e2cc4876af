"""Cost of the mmengine-style loop (AmpOptimWrapper.update_params) against the functional core.

One training step of an MLP (a few million parameters by default) with
AdamW, clipping at norm 1, dynamic loss scaling and a low-precision compute
dtype, written as:

- ``core``: the functional core in one jitted step, params and optimizer
  state donated: ``jax.grad`` of the mixed-precision loss times the scale,
  then ``jaxamp.dynamic_loss_scale(optax.chain(jaxamp.clip_grad_norm(1.0),
  optax.adamw(1e-3))).update`` and ``optax.apply_updates``;
- ``amp_wrapper``: ``jaxamp.AmpOptimWrapper(..., cast='whole').update_params(loss_fn, x, y)``
  with the same transformation and the same (whole) casting as the core
  (``accumulative_counts=1``);
- ``amp_wrapper_donate``, ``amp_wrapper_acc4_donate``: the same with
  ``donate=True`` (the wrapper's params, state and gradient buffer donated);
- ``amp_wrapper_acc4`` (per micro-batch): the wrapper with
  ``accumulative_counts=4``, against ``core_acc4``, the functional core with
  ``jaxamp.accumulate_gradients(..., 4)`` in one jitted donated step.

Ratios are printed against ``core`` (and ``core_acc4``); the target for
``amp_wrapper`` is 1.10x. On XLA:CPU the donated wrapper's program runs
about 1.5x slower under the default concurrency-optimized scheduler; run
with ``XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false`` to
see the program itself (docs/benchmarks.md).

Run: ``python benchmarks/bench_optim_wrapper.py [--hidden N] [--batch B] [--dtype bfloat16]
[--json PATH]``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jaxamp  # noqa: E402
from benchmarks.common import (device_summary, interleaved_medians,  # noqa: E402
                               mlp_loss as loss_fn, mlp_problem, print_ratios)
from benchmarks.record import add_json_args, write_json  # noqa: E402
from tests._tracing import install as count_traces, trace_counts  # noqa: E402


def main() -> None:
  count_traces()
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--hidden", type=int, default=1024)
  parser.add_argument("--depth", type=int, default=3)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--inner", type=int, default=4)
  add_json_args(parser)
  args = parser.parse_args()

  params0, x, y = mlp_problem(args.hidden, args.depth, args.batch)
  n_params = sum(leaf.size for leaf in jax.tree.leaves(params0))
  policy = jaxamp.Policy(jnp.float32, args.dtype, jnp.float32)
  mp_loss = jaxamp.mixed_precision(loss_fn, policy)

  def inner():
    return optax.chain(jaxamp.clip_grad_norm(1.0), optax.adamw(1e-3))

  def core(tx):
    """A zero-argument step of the functional core with ``tx``, carrying its own donated state."""

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, x, y):
      scale = jaxamp.loss_scale(opt_state)
      loss, grads = jax.value_and_grad(lambda p: mp_loss(p, x, y) * scale)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss / scale

    box = {"params": jax.tree.map(jnp.array, params0)}
    box["state"] = tx.init(box["params"])

    def run():
      box["params"], box["state"], loss = step(box["params"], box["state"], x, y)
      jax.block_until_ready((box["params"], loss))

    return run

  variants = {"core": core(jaxamp.dynamic_loss_scale(inner()))}

  def amp_wrapper(donate, **kw):
    wrapper = jaxamp.AmpOptimWrapper(optax.adamw(1e-3), jax.tree.map(jnp.array, params0),
                                     clip_grad=dict(max_norm=1.0), dtype=args.dtype,
                                     cast="whole", donate=donate, **kw)

    def run():
      loss = wrapper.update_params(loss_fn, x, y)
      jax.block_until_ready((wrapper.params, wrapper.grads, loss))

    return wrapper, run

  wrapper, variants["amp_wrapper"] = amp_wrapper(False)
  _, variants["amp_wrapper_donate"] = amp_wrapper(True)

  variants["core_acc4"] = core(jaxamp.accumulate_gradients(jaxamp.dynamic_loss_scale(inner()), 4))

  _, variants["amp_wrapper_acc4"] = amp_wrapper(False, accumulative_counts=4)
  _, variants["amp_wrapper_acc4_donate"] = amp_wrapper(True, accumulative_counts=4)

  print(f"{device_summary()}; MLP with {n_params / 1e6:.2f}M parameters, batch {args.batch}, "
        f"compute dtype {args.dtype}")
  medians = interleaved_medians(variants, rounds=args.rounds, inner=args.inner)
  for name, seconds in medians.items():
    print(f"  {name:<24} {seconds * 1e3:8.2f} ms/step")
  acc1 = print_ratios({k: medians[k] for k in ("core", "amp_wrapper", "amp_wrapper_donate")},
                      "core", "AmpOptimWrapper.update_params, accumulative_counts=1",
                      targets={"amp_wrapper": 1.10, "amp_wrapper_donate": 1.10})
  acc4 = print_ratios({k: medians[k] for k in ("core_acc4", "amp_wrapper_acc4",
                                               "amp_wrapper_acc4_donate")}, "core_acc4",
                      "accumulative_counts=4, per micro-batch")
  counts = dict(trace_counts(wrapper))
  assert all(v == 1 for v in counts.values()), counts
  write_json(args.json, {"params": n_params, "batch": args.batch, "dtype": args.dtype,
                         "acc1": acc1, "acc4": acc4}, args.append)


if __name__ == "__main__":
  main()
