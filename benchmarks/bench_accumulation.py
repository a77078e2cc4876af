"""Cost of gradient accumulation: jaxamp.accumulate_gradients against optax.MultiSteps.

Times one micro-step (``tx.update`` + ``optax.apply_updates``, params and
optimizer state donated) on about ``--size`` parameters in 30 leaves, with
adam inside and ``k = --every-k`` micro-steps per optimizer step:

- ``jaxamp``: ``jaxamp.accumulate_gradients(adam, k)``;
- ``jaxamp total_steps``: the same with ``total_steps`` set (the past-the-end
  host callback is in the program, never run, but it costs JAX's fast
  dispatch path);
- ``jaxamp total_steps, no callback``: ``raise_past_end=False``;
- ``MultiSteps``: ``optax.MultiSteps(adam, k)``;
- ``adam``: one plain adam step per call, for scale.

The mean time per micro-step is measured on whole windows (the calls of each
timing sample are a multiple of ``k``); the closing (emitting) and the
accumulating micro-steps are also timed on their own, by setting the state's
``mini_step`` before each call, next to a bare in-place ``acc + g`` (the
read-add-write an accumulating micro-step cannot avoid; the full micro-step
also writes the zero updates and applies them to the parameters). Then the compiled memory of each step
(``jax.jit(step, donate_argnums=(0, 1)).lower(...).compile().memory_analysis()``)
and the size of the optimizer state that persists between steps.

Run: ``python benchmarks/bench_accumulation.py [--size N] [--every-k K] [--rounds R]
[--json PATH]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Dict

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jaxamp  # noqa: E402
from benchmarks.common import (add_param_args, device_summary,  # noqa: E402
                               interleaved_medians, make_params, print_ratios)
from benchmarks.record import add_json_args, write_json  # noqa: E402


def make_step(tx: optax.GradientTransformation):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def make_runner(tx, params, grads, calls: int = 1,
                mini_step: int | None = None) -> Callable[[], None]:
  """A zero-argument function running ``calls`` donated micro-steps on its own params and state.

  With ``mini_step``, the state's ``mini_step`` is set before each call, so
  that every call is the same kind of micro-step (accumulating or closing).
  """
  jitted = jax.jit(make_step(tx), donate_argnums=(0, 1))
  box = {"params": jax.tree.map(jnp.copy, params)}
  box["state"] = jax.jit(tx.init)(box["params"])

  def run():
    for _ in range(calls):
      state = box["state"]
      if mini_step is not None:  # a fresh scalar each call: the state is donated
        state = state._replace(mini_step=jnp.asarray(mini_step, jnp.int32))
      box["params"], box["state"] = jitted(box["params"], state, grads)
    jax.block_until_ready(box["params"])

  return run


def make_floor(params, grads, calls: int) -> Callable[[], None]:
  """The least an accumulating micro-step can do: ``acc + g``, in place."""
  jitted = jax.jit(lambda acc, grads: jax.tree.map(jnp.add, acc, grads), donate_argnums=0)
  box = {"acc": jax.tree.map(jnp.zeros_like, params)}

  def run():
    for _ in range(calls):
      box["acc"] = jitted(box["acc"], grads)
    jax.block_until_ready(box["acc"])

  return run


def tree_bytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree))


def memory_row(tx, params, grads) -> Dict[str, int]:
  state = jax.eval_shape(tx.init, params)
  compiled = jax.jit(make_step(tx), donate_argnums=(0, 1)).lower(params, state, grads).compile()
  mem = compiled.memory_analysis()
  row = {"state": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))}
  if mem is not None:
    row.update(argument=mem.argument_size_in_bytes, output=mem.output_size_in_bytes,
               temp=mem.temp_size_in_bytes, alias=mem.alias_size_in_bytes)
  return row


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  add_param_args(parser)
  parser.add_argument("--every-k", type=int, default=4, help="micro-steps per optimizer step")
  parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
  parser.add_argument("--windows", type=int, default=2,
                      help="whole windows per timing sample of the mean micro-step")
  add_json_args(parser)
  args = parser.parse_args(argv)
  k = args.every_k

  params = make_params(args.size, args.leaves, shapes=args.shapes)
  keys = iter(jax.random.split(jax.random.key(1), len(params)))
  grads = jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape, p.dtype) * 1e-3, params)
  n = sum(p.size for p in jax.tree.leaves(params))
  print(f"{device_summary()}; {n:,} float32 params in {len(params)} {args.shapes} leaves; "
        f"k = {k}, adam inside; {args.rounds} rounds")

  adam = optax.adam(1e-3)
  variants = {
      "jaxamp": jaxamp.accumulate_gradients(adam, k),
      "jaxamp total_steps": jaxamp.accumulate_gradients(adam, k, total_steps=2**30),
      "jaxamp total_steps, no callback": jaxamp.accumulate_gradients(
          adam, k, total_steps=2**30, raise_past_end=False),
      "MultiSteps": optax.MultiSteps(adam, k),
  }
  calls = k * args.windows

  # Mean time per micro-step, over whole windows.
  steps = {name: make_runner(tx, params, grads, calls) for name, tx in variants.items()}
  steps["adam"] = make_runner(adam, params, grads, calls)
  mean = {name: t / calls for name, t in
          interleaved_medians(steps, rounds=args.rounds, inner=1).items()}
  mean_table = print_ratios(mean, "MultiSteps", "Mean time per micro-step",
                            targets={name: 0.6 for name in variants if name.startswith("jaxamp")})

  # Accumulating and closing micro-steps on their own.
  kinds = {}
  for name in ("jaxamp", "MultiSteps"):
    kinds[f"{name} accumulating"] = make_runner(variants[name], params, grads, k, mini_step=0)
    kinds[f"{name} closing"] = make_runner(variants[name], params, grads, k, mini_step=k - 1)
  kinds["adam"] = make_runner(adam, params, grads, k)
  kinds["acc + g alone"] = make_floor(params, grads, k)
  by_kind = {name: t / k for name, t in
             interleaved_medians(kinds, rounds=args.rounds, inner=1).items()}
  kind_table = print_ratios(by_kind, "adam", "Time per micro-step by kind")

  print("\nMedian milliseconds per micro-step")
  for name, value in {**mean, **by_kind}.items():
    print(f"  {name:<32} {value * 1e3:8.3f}")

  # Compiled memory.
  rows = {name: memory_row(tx, params, grads) for name, tx in variants.items()}
  fields = ("state", "argument", "output", "temp", "alias")
  print("\nCompiled memory of one donated micro-step (MB = 1e6 bytes; params and grads "
        f"{tree_bytes(params) / 1e6:.1f} MB each)")
  print(f"  {'':<32}" + "".join(f"{f:>11}" for f in fields))
  for name, row in rows.items():
    print(f"  {name:<32}" + "".join(f"{row.get(f, float('nan')) / 1e6:11.2f}" for f in fields))
  base = rows["MultiSteps"]
  for name in (n for n in rows if n.startswith("jaxamp")):
    row = rows[name]
    ratios = {f: row[f] / base[f] for f in ("state", "temp") if f in row and base.get(f)}
    print(f"  {name} / MultiSteps: " + ", ".join(f"{f} {r:.3f}x (target <= 1.00)"
                                                 for f, r in ratios.items()))
  write_json(args.json, {"params": n, "leaves": len(params), "k": k, "mean": mean_table,
                         "by_kind": kind_table, "memory": rows}, args.append)


if __name__ == "__main__":
  main()
