"""Cost of loss scaling in a sharded training step, and the collectives it adds.

On 8 simulated CPU devices (``--devices``), times a whole training step of a
small MLP (forward, backward, update; params and optimizer state donated) in
three layouts:

- ``dp``: data parallel under ``jit``: params replicated, batch sharded
  (``NamedSharding``);
- ``fsdp``: fully sharded under ``jit``: params and optimizer state sharded
  along their first axis, batch sharded;
- ``shard_map``: data parallel under ``shard_map``: per-device gradients,
  ``lax.pmean``, ``axis_name="data"``;

each as ``adam`` (plain ``optax.adam``, no loss scaling: the baseline) and
``jaxamp`` (``scale_loss`` + ``jaxamp.dynamic_loss_scale(adam)``), and prints
the ratio and every collective in each compiled step. The expected extra
communication: none where the finite check reads gradients that are already
reduced (data parallel: they come out of the gradient all-reduce), one
all-reduce of one boolean per gradient leaf where they are sharded (FSDP).

Run: ``python benchmarks/bench_sharding.py [--devices 8] [--width 512] [--rounds 10]
[--json PATH]``.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.record import add_json_args  # noqa: E402 (imports no jax)


def _parse(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
  parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
  parser.add_argument("--width", type=int, default=512, help="hidden width of the MLP")
  parser.add_argument("--batch", type=int, default=64, help="global batch size")
  parser.add_argument("--rounds", type=int, default=10, help="interleaved timing rounds")
  parser.add_argument("--inner", type=int, default=3, help="calls per variant per round")
  add_json_args(parser)
  return parser.parse_args(argv)


ARGS = _parse(sys.argv[1:] if __name__ == "__main__" else [])
# The device count is fixed when jax starts: set it before the first import.
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split()
     if not f.startswith("--xla_force_host_platform_device_count")]
    + [f"--xla_force_host_platform_device_count={ARGS.devices}"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxamp  # noqa: E402
from benchmarks.common import device_summary, interleaved_medians, print_ratios  # noqa: E402
from benchmarks.record import write_json  # noqa: E402
from tests._hlo import hlo_collectives  # noqa: E402

INIT_SCALE = 2.0**10


def make_params(width: int, din: int = 256, dout: int = 256):
  rng = np.random.default_rng(0)
  shapes = {"w1": (din, width), "w2": (width, width), "w3": (width, dout)}
  # Host (numpy) arrays: every variant gets buffers of its own, which it donates.
  params = {k: (rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32)
            for k, s in shapes.items()}
  params.update({f"b{i}": np.zeros((n,), np.float32)
                 for i, n in ((1, width), (2, width), (3, dout))})
  return params


def loss_fn(p, x, y):
  h = jax.nn.relu(x @ p["w1"] + p["b1"])
  h = jax.nn.relu(h @ p["w2"] + p["b2"])
  return jnp.mean((h @ p["w3"] + p["b3"] - y) ** 2)


def make_step(scaled: bool, axis_name=None):
  """``(tx, step)``: the plain adam step or the jaxamp one."""
  adam = optax.adam(1e-3)
  tx = jaxamp.dynamic_loss_scale(adam, init_scale=INIT_SCALE, axis_name=axis_name) if scaled \
      else adam

  def step(params, state, x, y):
    if scaled:
      objective = lambda q: jaxamp.scale_loss(loss_fn(q, x, y), state)
    else:
      objective = lambda q: loss_fn(q, x, y)
    if axis_name is None:
      grads = jax.grad(objective)(params)
    else:
      grads = jax.grad(objective)(lax.pcast(params, axis_name, to="varying"))
      grads = lax.pmean(grads, axis_name)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return tx, step


def build(layout: str, scaled: bool, mesh, params, x, y):
  """Compiles one variant; returns its zero-argument runner and its collectives."""
  if layout == "fsdp":
    spec = {k: P("data") if k.startswith("w") else P() for k in params}
  else:
    spec = {k: P() for k in params}
  shard = lambda t, s: jax.tree.map(lambda a, si: jax.device_put(a, NamedSharding(mesh, si)), t, s)
  p = shard(params, spec)
  if layout == "shard_map":
    tx, step = make_step(scaled, axis_name="data")
    state = jax.device_put(tx.init(params), NamedSharding(mesh, P()))
    fn = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                       out_specs=(P(), P()))
  else:
    tx, step = make_step(scaled)
    with jax.set_mesh(mesh):
      state = tx.init(p)  # follows the params' shardings
    fn = step
  jitted = jax.jit(fn, donate_argnums=(0, 1))
  with jax.set_mesh(mesh):
    collectives = hlo_collectives(jitted.lower(p, state, x, y).compile().as_text())
  box = {"params": p, "state": state}

  def run():
    with jax.set_mesh(mesh):
      box["params"], box["state"] = jitted(box["params"], box["state"], x, y)
    jax.block_until_ready(box["params"])

  return run, collectives


def _operands(shape: str) -> tuple:
  """The array shapes of a collective's result, layouts dropped, in a canonical order."""
  return tuple(sorted(re.findall(r"\w+\[[^\]]*\]", shape)))


def _key(op: str, shape: str) -> str:
  parts = _operands(shape)
  return f"{op} of " + (parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")")


def describe(collectives) -> str:
  if not collectives:
    return "none"
  counts = collections.Counter(_key(op, shape) for op, shape, _ in collectives)
  return "; ".join(f"{n} x {what}" if n > 1 else what for what, n in counts.items())


def added(base, other) -> str:
  """What ``other`` communicates beyond ``base``: extra arrays, and the change in op count.

  XLA combines collectives into tuple-shaped ops as it sees fit, so the
  arrays carried (the payload) are compared, not the ops.
  """
  def payload(found):
    return collections.Counter((op, a) for op, shape, _ in found for a in _operands(shape))

  extra = payload(other)
  extra.subtract(payload(base))
  parts = [f"{op} of {a}" + (f" x{n}" if n > 1 else "") for (op, a), n in sorted(extra.items())
           if n > 0]
  missing = [f"{op} of {a}" for (op, a), n in extra.items() if n < 0]
  ops = collections.Counter(op for op, _, _ in other)
  ops.subtract(collections.Counter(op for op, _, _ in base))
  text = ", ".join(parts) if parts else "nothing"
  if missing:
    text += f" (and lacks {', '.join(missing)})"
  changes = [f"{n:+d} {op} op{'s' if abs(n) > 1 else ''}" for op, n in ops.items() if n]
  return text + (f"; {', '.join(changes)}" if changes else "; same number of ops")


def main() -> None:
  args = ARGS
  mesh = jax.make_mesh((args.devices,), ("data",))
  params = make_params(args.width)
  n = sum(a.size for a in jax.tree.leaves(params))
  rng = np.random.default_rng(1)
  batch = NamedSharding(mesh, P("data"))
  x = jax.device_put(jnp.asarray(rng.standard_normal((args.batch, 256)), jnp.float32), batch)
  y = jax.device_put(jnp.asarray(rng.standard_normal((args.batch, 256)), jnp.float32), batch)
  print(f"{device_summary()}; MLP with {n:,} float32 params in {len(params)} leaves, batch "
        f"{args.batch}; {args.rounds} rounds x {args.inner} calls")

  results = {"devices": args.devices, "params": n, "leaves": len(params), "batch": args.batch}
  for layout in ("dp", "fsdp", "shard_map"):
    runners, found = {}, {}
    for name, scaled in (("adam", False), ("jaxamp", True)):
      runners[name], found[name] = build(layout, scaled, mesh, params, x, y)
    medians = interleaved_medians(runners, rounds=args.rounds, inner=args.inner)
    step = print_ratios(medians, "adam", f"{layout}: training step, median "
                        f"{medians['adam'] * 1e3:.2f} ms for plain adam")
    for name in runners:
      print(f"  collectives in the {name} step: {describe(found[name])}")
    print(f"  added by jaxamp: {added(found['adam'], found['jaxamp'])}")
    results[layout] = {"step": step, "collectives": {k: describe(v) for k, v in found.items()},
                       "added": added(found["adam"], found["jaxamp"])}
  write_json(args.json, results, args.append)


if __name__ == "__main__":
  main()
