"""One process of the multi-host test: ``python worker.py PROCESS_ID NUM_PROCESSES PORT OUT_JSON``.

Every process joins ``jax.distributed`` over loopback with 2 CPU devices of its
own (CPU collectives between processes go through gloo), holds its own rows
of every global batch, and trains the same small model three ways: data
parallel under ``jit`` with ``NamedSharding``, data parallel under
``shard_map`` (``axis_name``), and with fully sharded parameters under
``jit``. One row of process 1's data overflows at step ``BAD_STEP``. Each
process writes, for each way, the loss scale and skip flag after every step
and the final parameters, plus a run of the same steps on one local device,
for tests/multidevice/test_multihost.py to compare.
"""

from __future__ import annotations

import json
import sys

STEPS, BAD_STEP = 4, 2
ROWS_PER_PROCESS, DIN, DOUT = 8, 8, 4
INIT_SCALE = 1024.0


def main(process_id: int, num_processes: int, port: int, out_path: str) -> None:
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_num_cpu_devices", 2)
  jax.config.update("jax_numpy_dtype_promotion", "strict")
  jax.config.update("jax_numpy_rank_promotion", "raise")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                             num_processes=num_processes, process_id=process_id,
                             initialization_timeout=60)
  try:
    result = _train(process_id, num_processes)
  finally:
    jax.distributed.shutdown()
  with open(out_path, "w", encoding="utf-8") as f:
    json.dump(result, f)


def _train(process_id: int, num_processes: int) -> dict:
  # Imported here, after main() has configured jax for several processes.
  import functools

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax import lax
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxamp
  from jaxamp._src import compat

  assert jax.process_count() == num_processes and jax.device_count() == 2 * num_processes
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  rows = ROWS_PER_PROCESS * num_processes

  rng = np.random.default_rng(0)
  params0 = {"w": (rng.standard_normal((DIN, DOUT)) * 0.3).astype(np.float32),
             "b": np.zeros((DOUT,), np.float32)}
  batches = []
  for step in range(STEPS):
    x = rng.standard_normal((rows, DIN)).astype(np.float32)
    y = rng.standard_normal((rows, DOUT)).astype(np.float32)
    if step == BAD_STEP:
      x[ROWS_PER_PROCESS + 1, 0] = 1e20  # a row held by process 1 only
    batches.append((x, y))
  mine = slice(process_id * ROWS_PER_PROCESS, (process_id + 1) * ROWS_PER_PROCESS)

  def loss_fn(p, x, y):
    return jnp.mean((x @ p["w"] + p["b"][None, :] - y) ** 2)

  def make_tx(axis_name=None):
    return jaxamp.dynamic_loss_scale(optax.sgd(0.05, momentum=0.9), init_scale=INIT_SCALE,
                                     growth_interval=100, axis_name=axis_name)

  def step(p, s, x, y, tx, axis_name=None):
    if axis_name is not None:
      local = compat.pcast_varying(p, axis_name)
      grads = jax.grad(lambda q: jaxamp.scale_loss(loss_fn(q, x, y), s))(local)
      grads = lax.pmean(grads, axis_name)
    else:
      grads = jax.grad(lambda q: jaxamp.scale_loss(loss_fn(q, x, y), s))(p)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s

  def global_batch(a):
    return jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), a[mine])

  def run(step_fn, params, state, put):
    trace = []
    for x, y in batches:
      params, state = step_fn(params, state, put(x), put(y))
      # The scale and the flag are replicated: every process reads its own copy.
      trace.append([float(np.asarray(state.scale)), bool(np.asarray(state.skipped))])
    full = multihost_utils.process_allgather(params, tiled=True)
    out = {"trace": trace, "params": {k: np.asarray(v).tolist() for k, v in full.items()}}
    # Whether the final momentum is sharded like the final params.
    momentum = state.inner_state[0].trace
    out["state_follows_params"] = all(
        momentum[k].sharding.is_equivalent_to(params[k].sharding, params[k].ndim) for k in params)
    return out

  def place(tree, specs):
    return jax.tree.map(
        lambda a, s: jax.make_array_from_callback(np.shape(a), NamedSharding(mesh, s),
                                                  lambda idx: np.asarray(a)[idx]),
        tree, specs)

  out = {"process_index": jax.process_index()}
  replicated = {"w": P(), "b": P()}
  with jax.set_mesh(mesh):
    tx = make_tx()
    params = place(params0, replicated)
    state = place(tx.init(params0), jax.tree.map(lambda _: P(), tx.init(params0)))
    out["jit_data_parallel"] = run(jax.jit(functools.partial(step, tx=tx)), params, state,
                                   global_batch)

    fsdp = {"w": P("data"), "b": P()}
    params = place(params0, fsdp)
    state = tx.init(params)  # follows the parameters' shardings
    out["jit_fsdp"] = run(jax.jit(functools.partial(step, tx=tx)), params, state, global_batch)
    out["fsdp_params_sharded"] = not params["w"].sharding.is_fully_replicated

    tx = make_tx("data")
    sm = jax.jit(jax.shard_map(functools.partial(step, tx=tx, axis_name="data"), mesh=mesh,
                               in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P())))
    params = place(params0, replicated)
    state = place(tx.init(params0), jax.tree.map(lambda _: P(), tx.init(params0)))
    out["shard_map"] = run(sm, params, state, global_batch)

  # The same steps on one local device, on the whole batch.
  tx = make_tx()
  local = jax.jit(functools.partial(step, tx=tx), device=jax.local_devices()[0])
  params, state = params0, tx.init(params0)
  trace = []
  for x, y in batches:
    params, state = local(params, state, x, y)
    trace.append([float(state.scale), bool(state.skipped)])
  out["one_device"] = {"trace": trace,
                       "params": {k: np.asarray(v).tolist() for k, v in params.items()}}
  return out


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
