"""Data parallel and fully sharded training: one global decision, the same result as one device."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp._src import compat
from tests.multidevice import _problem
from tests.multidevice._problem import BAD_STEP

INIT_SCALE = 2.0**10
BATCH = 32  # 4 examples per device
BAD_ROW = 13  # row 13 of step BAD_STEP sits in device 3's micro-batch
_loss = _problem.loss


def _params():
  return jax.tree.map(jnp.asarray, _problem.params())


def _batches(steps=4):
  return _problem.micro_batches(rows=BATCH, steps=steps, bad_row=BAD_ROW, seed=1)


def _tx(axis_name=None):
  return jaxamp.dynamic_loss_scale(optax.sgd(0.05, momentum=0.9), init_scale=INIT_SCALE, growth_interval=100,
                                   axis_name=axis_name)


def _step(p, s, x, y, tx, axis_name=None):
  if axis_name is not None:
    # Per-device gradients of the device's micro-batch (without the cast, shard_map
    # would already sum the gradients of the replicated params), then their mean.
    p_local = compat.pcast_varying(p, axis_name)
    grads = jax.grad(lambda q: jaxamp.scale_loss(_loss(q, x, y), s))(p_local)
    grads = lax.pmean(grads, axis_name)
  else:
    grads = jax.grad(lambda q: jaxamp.scale_loss(_loss(q, x, y), s))(p)
  updates, s = tx.update(grads, s, p)
  return optax.apply_updates(p, updates), s


def _run(step, params, state, put=lambda a: a):
  """Runs the steps; returns final params and per-step (scale, skipped) as host values."""
  trace = []
  for x, y in _batches():
    params, state = step(params, state, put(x), put(y))
    trace.append((float(state.scale), bool(state.skipped)))
  return params, state, trace


EXPECTED_TRACE = [(INIT_SCALE, False), (INIT_SCALE, False), (INIT_SCALE / 2, True),
                  (INIT_SCALE / 2, False)]


@pytest.fixture(scope="module")
def reference():
  """The run on one device."""
  tx = _tx()
  step = jax.jit(functools.partial(_step, tx=tx))
  params, _, trace = _run(step, _params(), tx.init(_params()))
  assert trace == EXPECTED_TRACE
  return params


def _copies(x):
  """Every device's copy of a (replicated) jax.Array, as numpy arrays."""
  return [np.asarray(s.data) for s in x.addressable_shards]


def _assert_replicated_identical(tree):
  for leaf in jax.tree.leaves(tree):
    copies = _copies(leaf)
    assert len(copies) == 8
    for c in copies[1:]:
      np.testing.assert_array_equal(c, copies[0])


def _assert_close(tree, ref):
  for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_shard_map_one_device_overflows_every_device_skips(mesh, reference, count_traces):
  tx = _tx("data")
  step_fn, traces = count_traces(functools.partial(_step, tx=tx, axis_name="data"))

  def step_per_device(p, s, x, y):
    p, s = step_fn(p, s, x, y)
    # Each device's own view of the decision, gathered along the data axis.
    return p, s, jnp.stack([s.skipped.astype(jnp.float32), s.scale])[None]

  sharded = jax.jit(jax.shard_map(step_per_device, mesh=mesh,
                                  in_specs=(P(), P(), P("data"), P("data")),
                                  out_specs=(P(), P(), P("data"))))
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))
  params = jax.device_put(_params(), NamedSharding(mesh, P()))
  # Placed like the step's outputs, so that the second call does not recompile.
  state = jax.device_put(tx.init(params), NamedSharding(mesh, P()))
  before_bad = None
  for i, (x, y) in enumerate(_batches()):
    if i == BAD_STEP:
      before_bad = jax.tree.map(np.asarray, params)
    params, state, views = sharded(params, state, put(x), put(y))
    views = np.asarray(views)
    skipped, scale = EXPECTED_TRACE[i][1], EXPECTED_TRACE[i][0]
    np.testing.assert_array_equal(views[:, 0], [float(skipped)] * 8)
    np.testing.assert_array_equal(views[:, 1], [scale] * 8)  # backed off once, everywhere
    _assert_replicated_identical(params)
    _assert_replicated_identical(state)
    if i == BAD_STEP:
      jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, params), before_bad)
  assert int(state.skipped_steps) == 1
  assert traces["n"] == 1
  _assert_close(params, reference)


@pytest.mark.parametrize("axis_name", ["data", ("data",)], ids=["name", "tuple"])
def test_pmap_one_device_overflows_every_device_skips(reference, axis_name):
  tx = _tx(axis_name)
  step = jax.pmap(functools.partial(_step, tx=tx, axis_name=axis_name), axis_name="data")
  stack = lambda t: jax.tree.map(lambda a: jnp.broadcast_to(a, (8,) + a.shape), t)
  params = stack(_params())
  state = stack(tx.init(_params()))
  split = lambda a: a.reshape((8, -1) + a.shape[1:])
  trace = []
  for x, y in _batches():
    params, state = step(params, state, split(x), split(y))
    scales, skipped = np.asarray(state.scale), np.asarray(state.skipped)
    assert len(set(scales.tolist())) == 1 and len(set(skipped.tolist())) == 1
    trace.append((float(scales[0]), bool(skipped[0])))
  assert trace == EXPECTED_TRACE
  for leaf in jax.tree.leaves(params):
    leaf = np.asarray(leaf)
    for row in leaf[1:]:
      np.testing.assert_array_equal(row, leaf[0])
  _assert_close(jax.tree.map(lambda a: a[0], params), reference)


def test_shard_map_over_two_axes_with_a_tuple_of_axis_names(mesh2d, reference):
  names = ("data", "model")
  tx = _tx(names)
  step = jax.jit(jax.shard_map(functools.partial(_step, tx=tx, axis_name=names), mesh=mesh2d,
                               in_specs=(P(), P(), P(names), P(names)), out_specs=(P(), P())))
  params = jax.device_put(_params(), NamedSharding(mesh2d, P()))
  state = jax.device_put(tx.init(_params()), NamedSharding(mesh2d, P()))
  put = lambda a: jax.device_put(a, NamedSharding(mesh2d, P(names)))
  params, state, trace = _run(step, params, state, put)
  assert trace == EXPECTED_TRACE
  _assert_replicated_identical(params)
  _assert_close(params, reference)


@pytest.mark.parametrize("layout", ["data_parallel", "fsdp"])
def test_jit_named_sharding_matches_one_device(mesh, reference, layout, count_traces):
  tx = _tx()
  step_fn, traces = count_traces(functools.partial(_step, tx=tx))
  step = jax.jit(step_fn, donate_argnums=(0, 1))
  spec = {"w": P(), "b": P()} if layout == "data_parallel" else {"w": P("data"), "b": P()}
  with jax.set_mesh(mesh):
    params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), _params(), spec)
    state = tx.init(params)
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))
    params, state, trace = _run(step, params, state, put)
  assert trace == EXPECTED_TRACE
  assert traces["n"] == 1
  for leaf, s in zip(jax.tree.leaves(params), jax.tree.leaves(spec)):
    assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, s), leaf.ndim)
  _assert_close(params, reference)


@pytest.mark.parametrize("way", ["jit", "shard_map"])
def test_fsdp_inf_in_one_shard_of_one_gradient_skips_everywhere(mesh, way):
  """Only device 5's shard of w's gradient is inf; every other value is finite."""
  spec = {"w": P("data"), "b": P()}
  shard = lambda t, s: jax.tree.map(lambda a, si: jax.device_put(a, NamedSharding(mesh, si)), t, s)
  params = shard({"w": np.ones((16, 4), np.float32), "b": np.ones((4,), np.float32)}, spec)
  coef = {"w": np.ones((16, 4), np.float32), "b": np.ones((4,), np.float32)}
  bad = {"w": coef["w"].copy(), "b": coef["b"]}
  bad["w"][11, 2] = np.inf  # rows 10..11 live on device 5
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0,
                                 axis_name="data" if way == "shard_map" else None)

  def step(p, s, c):
    loss = lambda q: jaxamp.scale_loss(
        sum(jnp.sum(q[k] * c[k]) for k in ("w", "b")), s)
    updates, s = tx.update(jax.grad(loss)(p), s, p)
    return optax.apply_updates(p, updates), s

  if way == "jit":
    fn = jax.jit(step)
  else:
    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, P(), spec),
                               out_specs=(spec, P())))
  with jax.set_mesh(mesh):
    state = jax.device_put(tx.init(params), NamedSharding(mesh, P()))
    before = [np.asarray(s.data) for leaf in jax.tree.leaves(params) for s in leaf.addressable_shards]
    params, state = fn(params, state, shard(bad, spec))
    after = [np.asarray(s.data) for leaf in jax.tree.leaves(params) for s in leaf.addressable_shards]
    assert bool(state.skipped) and float(state.scale) == 4.0
    for a, b in zip(after, before):  # every shard of every device left bit-identical
      np.testing.assert_array_equal(a, b)
    params, state = fn(params, state, shard(coef, spec))
  assert not bool(state.skipped) and float(state.scale) == 4.0
  np.testing.assert_allclose(np.asarray(params["w"]), 0.9, rtol=1e-6)
  assert params["w"].sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2)
