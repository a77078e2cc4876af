"""Cost of the PyTorch-style loop (GradScaler + OptimWrapper) against the functional core.

One training step of an MLP (about ``--hidden``^2 * 2 + ... parameters, a few
million by default) with Adam and dynamic loss scaling, written four ways:

- ``core``: the functional core, one jitted step with params and optimizer
  state donated: ``jax.grad`` of ``jaxamp.scale_loss(loss)``, then
  ``jaxamp.dynamic_loss_scale(adam).update`` and ``optax.apply_updates``;
- ``torch_style``: ``opt.zero_grad(); opt.backward(scaler.scale(loss_fn), x, y);
  scaler.step(opt); scaler.update()`` with ``jaxamp.GradScaler`` and
  ``jaxamp.OptimWrapper``;
- ``paddle_style``: the same with ``jaxamp.paddle.GradScaler`` and ``minimize``;
- ``torch_donate``, ``paddle_donate``: the same loops with
  ``OptimWrapper(..., donate=True)`` (params and optimizer state updated in
  place, as the core's are);
- ``adam``: the core step without loss scaling, for scale;
- ``torch_no_watch``: ``torch_style`` with ``on_stall='ignore'``, to show
  what watching for a stalled run costs.

Each is printed as a ratio to ``core`` (target for the donating loops: 1.10x).

Where the difference comes from: the PyTorch-style loop runs three jitted
calls (backward, the holder's step, the scale update) where the core runs
one, so the gradients are written out by the backward call and read back by
the step. Without ``unscale_``, ``step`` unscales, checks and applies in one
call (``OptimWrapper.apply_scaled_gradients``), with no unscaled copy
kept between calls (XLA:CPU still writes one to a temporary inside the call,
for the check's reduction), and the skip is selected where the optimizer
computes its new state, so a skippable step costs no copy. Without donation
each step also allocates fresh buffers for params and optimizer state, which
the donated core does not. The gap shrinks as the backward pass grows
(``--batch``).

Run: ``python benchmarks/bench_grad_scaler.py [--hidden N] [--batch B] [--rounds R] [--json PATH]``.
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

INIT_SCALE = 2.0**16
GROWTH_INTERVAL = 2000


def _copy(tree):
  return jax.tree.map(jnp.array, tree)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--hidden", type=int, default=1024)
  parser.add_argument("--depth", type=int, default=3)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--inner", type=int, default=5)
  add_json_args(parser)
  args = parser.parse_args()

  params0, x, y = mlp_problem(args.hidden, args.depth, args.batch)
  n_params = sum(leaf.size for leaf in jax.tree.leaves(params0))

  # -- the functional core: one jitted, donated step.
  tx = jaxamp.dynamic_loss_scale(optax.adam(1e-4), init_scale=INIT_SCALE,
                                 growth_interval=GROWTH_INTERVAL)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def core_step(params, state, x, y):
    grads = jax.grad(lambda p: jaxamp.scale_loss(loss_fn(p, x, y), state))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  plain_tx = optax.adam(1e-4)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def adam_step(params, state, x, y):
    grads = jax.grad(loss_fn)(params, x, y)
    updates, state = plain_tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  core = {"params": _copy(params0)}
  core["state"] = tx.init(core["params"])
  plain = {"params": _copy(params0)}
  plain["state"] = plain_tx.init(plain["params"])

  def run_core():
    core["params"], core["state"] = core_step(core["params"], core["state"], x, y)
    jax.block_until_ready(core["params"])

  def run_adam():
    plain["params"], plain["state"] = adam_step(plain["params"], plain["state"], x, y)
    jax.block_until_ready(plain["params"])

  # -- the PyTorch-style loop (default holder, and one with donate=True).
  def torch_style(donate, on_stall="warn"):
    opt = jaxamp.OptimWrapper(optax.adam(1e-4), _copy(params0), donate=donate)
    scaler = jaxamp.GradScaler(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL,
                               on_stall=on_stall)

    def run():
      opt.zero_grad()
      opt.backward(scaler.scale(loss_fn), x, y)
      scaler.step(opt)
      scaler.update()
      jax.block_until_ready(opt.params)

    return run

  # -- the Paddle-style loop.
  def paddle_style(donate):
    popt = jaxamp.OptimWrapper(optax.adam(1e-4), _copy(params0), donate=donate)
    pscaler = jaxamp.paddle.GradScaler(init_loss_scaling=INIT_SCALE,
                                       incr_every_n_steps=GROWTH_INTERVAL)

    def run():
      popt.backward(pscaler.scale(loss_fn), x, y)
      pscaler.minimize(popt)
      popt.zero_grad()
      jax.block_until_ready(popt.params)

    return run

  print(f"MLP {x.shape[1]}-{args.hidden}x{args.depth}-{y.shape[1]}: {n_params / 1e6:.2f}M params, "
        f"batch {args.batch}, adam; {device_summary()}")
  medians = interleaved_medians(
      {"core": run_core, "torch_style": torch_style(False),
       "torch_donate": torch_style(True), "paddle_style": paddle_style(False),
       "paddle_donate": paddle_style(True), "adam": run_adam,
       "torch_no_watch": torch_style(False, on_stall="ignore")},
      rounds=args.rounds, inner=args.inner)
  for name, value in medians.items():
    print(f"  {name:<13} {value * 1e3:8.2f} ms")
  loops = print_ratios(medians, "core", "GradScaler loops against the functional core",
                       targets={"torch_donate": 1.10, "paddle_donate": 1.10})
  write_json(args.json, {"params": n_params, "batch": args.batch, "loops": loops}, args.append)


if __name__ == "__main__":
  main()
