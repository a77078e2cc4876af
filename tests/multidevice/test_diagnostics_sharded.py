"""skip_report under shard_map: every device holds the same per-leaf counts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxamp


def test_every_device_reports_the_same_leaves_under_shard_map(mesh):
  params = {"b": jnp.zeros((4,)), "w": jnp.zeros((4, 4))}
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), axis_name="data")
  state = tx.init(params)
  x = np.ones((16, 4), np.float32)
  x[11, 2] = 3e38  # rows 10..11 live on device 5: its w gradient overflows

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P("data")),
                     out_specs=(P(), P()))
  def step(p, s, x):
    def loss(q):
      return jaxamp.scale_loss(jnp.sum((x @ q["w"] + q["b"][None, :]) * 1e3), s)
    g = jax.grad(loss)(p)
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  x = jax.device_put(x, NamedSharding(mesh, P("data")))
  _, state = step(params, state, x)
  assert jaxamp.skip_report(state, params) == ["['w']"]
  shards = [np.asarray(s.data) for s in state.nonfinite_leaves.addressable_shards]
  assert len(shards) == 8 and all((s == shards[0]).all() for s in shards)
  assert step._cache_size() == 1
