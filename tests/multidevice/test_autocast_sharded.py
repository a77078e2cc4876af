"""autocast under shard_map and under jit with sharded arrays (8 simulated devices)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp._src import compat
from tests.multidevice import _problem

F16, F32 = jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)


def _eqns(jaxpr):
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in compat.jaxprs_in_params(eqn.params):
      yield from _eqns(sub)


def _dot_dtypes(fn, *args):
  return [tuple(v.aval.dtype for v in e.invars) for e in _eqns(jax.make_jaxpr(fn)(*args))
          if e.primitive.name == "dot_general"]


def _data():
  params = jax.tree.map(jnp.asarray, _problem.params())
  x, y = (jnp.asarray(a) for a in _problem.micro_batches(steps=1, bad_row=-1)[0])
  return params, x, y


def test_autocast_inside_and_around_shard_map(auto_mesh):
  params, x, y = _data()

  def local_loss(p, x, y):
    return lax.pmean(_problem.loss(p, x, y), "data")

  sharded = jax.shard_map(local_loss, mesh=auto_mesh, in_specs=(P(), P("data"), P("data")),
                          out_specs=P())
  ref_loss, ref_grads = jax.value_and_grad(_problem.loss)(params, x, y)
  for fn in (jaxamp.autocast(sharded),  # autocast around shard_map: entered
             jax.shard_map(jaxamp.autocast(local_loss), mesh=auto_mesh,
                           in_specs=(P(), P("data"), P("data")), out_specs=P())):
    loss, grads = jax.jit(jax.value_and_grad(fn))(params, x, y)
    assert loss.dtype == F32 and all(g.dtype == F32 for g in jax.tree.leaves(grads))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-2)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
      np.testing.assert_allclose(g, r, rtol=2e-2, atol=2e-2)
    dots = _dot_dtypes(jax.value_and_grad(fn), params, x, y)
    assert dots and all(d == (F16, F16) for d in dots)


def test_autocast_under_jit_with_sharded_arrays(mesh):
  with jax.set_mesh(mesh):
    params, x, y = _data()
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    y = jax.device_put(y, NamedSharding(mesh, P("data")))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    loss, grads = jax.jit(jax.value_and_grad(jaxamp.autocast(_problem.loss)))(params, x, y)
    ref_loss, ref_grads = jax.value_and_grad(_problem.loss)(params, x, y)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-2)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
      assert g.dtype == F32
      np.testing.assert_allclose(g, r, rtol=2e-2, atol=2e-2)
    dots = _dot_dtypes(jax.value_and_grad(jaxamp.autocast(_problem.loss)), params, x, y)
    assert dots and all(d == (F16, F16) for d in dots)
