"""Accumulation and in-step microbatching with loss scaling, on sharded params and across devices."""

import functools
import re

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
from tests.multidevice._problem import (BAD_ROW, BAD_STEP, DIN, DOUT, INIT_SCALE, MICRO,  # noqa: F401
                                       STEPS)
from tests._hlo import hlo_collectives

K = 2  # micro-steps per window


_params = _problem.params
_micro_batches = _problem.micro_batches
_loss = _problem.loss


def _tx(axis_name=None):
  scaler = jaxamp.dynamic_loss_scale(optax.sgd(0.05, momentum=0.9), init_scale=INIT_SCALE,
                                     growth_interval=100)
  return jaxamp.accumulate_gradients(scaler, K, axis_name=axis_name)


def _grads(p, s, x, y):
  return jax.grad(lambda q: jaxamp.scale_loss(_loss(q, x, y), s))(p)


def _step(p, s, x, y, tx):
  updates, s = tx.update(_grads(p, s, x, y), s, p)
  return optax.apply_updates(p, updates), s


# One window's scale and skip flag, read after each of its closing micro-steps.
EXPECTED = [(INIT_SCALE, False), (INIT_SCALE / 2, True), (INIT_SCALE / 2, False)]


def _snap(state):
  """The scale and skip flag (of the first device, where stacked), read on the host."""
  scaler = jaxamp.get_loss_scale_state(state)
  return float(np.ravel(scaler.scale)[0]), bool(np.ravel(scaler.skipped)[0])


def _window_trace(snaps):
  return [snap for i, snap in enumerate(snaps) if (i + 1) % K == 0]


@pytest.fixture(scope="module")
def reference():
  tx = _tx()
  step = jax.jit(functools.partial(_step, tx=tx))
  params, state, states = _params(), tx.init(_params()), []
  for x, y in _micro_batches():
    params, state = step(params, state, x, y)
    states.append(_snap(state))
  assert _window_trace(states) == EXPECTED
  return jax.tree.map(np.asarray, params)


def _assert_close(tree, ref, rtol=1e-5):
  for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(a), b, rtol=rtol, atol=1e-6)


LAYOUTS = {
    "data_parallel": ({"w": P(), "b": P()}, (8,), ("data",), P("data")),
    "fsdp": ({"w": P("data"), "b": P()}, (8,), ("data",), P("data")),
    "2d": ({"w": P("data", "model"), "b": P("model")}, (4, 2), ("data", "model"), P("data")),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_jit_sharded_state_follows_params_and_matches_one_device(layout, reference,
                                                                 count_traces):
  spec, shape, names, batch_spec = LAYOUTS[layout]
  mesh = jax.make_mesh(shape, names)
  tx = _tx()
  step_fn, traces = count_traces(functools.partial(_step, tx=tx))
  step = jax.jit(step_fn, donate_argnums=(0, 1))
  with jax.set_mesh(mesh):
    params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), _params(), spec)
    state = tx.init(params)
    states = []
    for x, y in _micro_batches():
      put = lambda a: jax.device_put(a, NamedSharding(mesh, batch_spec))
      params, state = step(params, state, put(x), put(y))
      states.append(_snap(state))
  assert traces["n"] == 1
  assert _window_trace(states) == EXPECTED
  _assert_close(params, reference)
  follows = lambda tree: [leaf.sharding.is_equivalent_to(NamedSharding(mesh, s), leaf.ndim)
                          for leaf, s in zip(jax.tree.leaves(tree), jax.tree.leaves(spec))]
  assert all(follows(params))
  assert all(follows(state.acc_grads))  # the accumulator is sharded like the params
  scaler = jaxamp.get_loss_scale_state(state)
  assert all(follows(scaler.inner_state[0].trace))  # so is the momentum
  for leaf in (state.mini_step, scaler.scale, scaler.skipped):
    assert leaf.sharding.is_fully_replicated


def _payload(found, op):
  """The arrays carried by the ``op`` collectives, as a sorted list of shapes (layouts dropped)."""
  return sorted(a for o, shape, _ in found if o == op for a in re.findall(r"\w+\[[^\]]*\]", shape))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_jit_sharded_step_communicates_only_what_the_plain_step_does(layout):
  """Against plain momentum SGD: the same gathers, and at most scalars more all-reduced."""
  spec, shape, names, batch_spec = LAYOUTS[layout]
  mesh = jax.make_mesh(shape, names)
  found = {}
  with jax.set_mesh(mesh):
    params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), _params(), spec)
    x, y = (jax.device_put(a, NamedSharding(mesh, batch_spec)) for a in _micro_batches()[0])
    plain = optax.sgd(0.05, momentum=0.9)
    for name, tx, scaled in (("plain", plain, False), ("jaxamp", _tx(), True)):
      def step(p, s, x, y, tx=tx, scaled=scaled):
        g = _grads(p, s, x, y) if scaled else jax.grad(_loss)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s
      text = jax.jit(step).lower(params, tx.init(params), x, y).compile().as_text()
      # A conditional's branch runs only on the steps that take it: the stall warning's, for
      # one, broadcasts its host callback's flag to every device on the step where the run
      # stalls, and never on another step.
      branches = set(re.findall(r"%([\w.\-]+)", " ".join(
          re.findall(r"branch_computations=\{([^}]*)\}", text))))
      collectives = hlo_collectives(text)
      found[name] = [c for c in collectives if c[2] not in branches]
      found[name + " branches"] = [c for c in collectives if c[2] in branches]
  assert _payload(found["jaxamp"], "all-gather") == _payload(found["plain"], "all-gather")
  assert {op for op, _, _ in found["jaxamp"]} <= {"all-reduce", "all-gather"}
  extra = list(_payload(found["jaxamp"], "all-reduce"))
  for a in _payload(found["plain"], "all-reduce"):
    extra.remove(a)  # every gradient all-reduce of the plain step is still there
  assert all(a.endswith("[]") for a in extra), extra  # plus the finite check's scalars
  if layout == "data_parallel":
    assert not extra  # the check reads the already all-reduced gradients
  assert not found["plain branches"]
  assert {op for op, _, _ in found["jaxamp branches"]} <= {"all-reduce"}
  assert all(a.endswith("[]") for a in _payload(found["jaxamp branches"], "all-reduce"))


# ----------------------------------------------------------------------------- no_sync


def _local_grads(p, s, x, y, axis_name):
  """This device's gradients (not summed over the devices)."""
  return _grads(compat.pcast_varying(p, axis_name), s, x, y)


def _pmap_run(deferred: bool):
  tx = _tx("data" if deferred else None)

  def step(p, s, x, y):
    g = _local_grads(p, s, x, y, "data")
    if not deferred:
      g = lax.pmean(g, "data")  # an all-reduce on every micro-step
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  pstep = jax.pmap(step, axis_name="data")
  stack = lambda t: jax.tree.map(lambda a: jnp.broadcast_to(a, (8,) + a.shape), t)
  params, state, states = stack(_params()), stack(tx.init(_params())), []
  split = lambda a: a.reshape((8, -1) + a.shape[1:])
  for x, y in _micro_batches():
    params, state = pstep(params, state, split(x), split(y))
    states.append(_snap(state))
  return pstep, params, state, states


@pytest.fixture(scope="module")
def pmap_runs():
  return {deferred: _pmap_run(deferred) for deferred in (True, False)}


def test_pmap_deferred_all_reduce_equals_all_reduce_every_micro_step(pmap_runs, reference):
  _, deferred, _, states_d = pmap_runs[True]
  _, eager, _, states_e = pmap_runs[False]
  assert _window_trace(states_d) == _window_trace(states_e) == EXPECTED
  for tree in (deferred, eager):
    for leaf in jax.tree.leaves(tree):  # every device holds the same params
      leaf = np.asarray(leaf)
      for row in leaf[1:]:
        np.testing.assert_array_equal(row, leaf[0])
  first = lambda t: jax.tree.map(lambda a: np.asarray(a)[0], t)
  _assert_close(first(deferred), first(eager), rtol=1e-6)
  _assert_close(first(deferred), reference)


def _branch_computations(hlo: str) -> set:
  """Names of the computations run as branches of a conditional."""
  names = set()
  for m in re.finditer(r"conditional\(.*?(?:branch_computations=\{([^}]*)\}|"
                       r"true_computation=(\S+?), false_computation=(\S+?)[,\s])", hlo):
    for group in m.groups():
      if group:
        names.update(n.strip().lstrip("%") for n in group.split(","))
  return names


def _gradient_all_reduces(hlo: str):
  """The all-reduces that carry a gradient-shaped array: ``(shape, computation)``."""
  return [(shape, where) for op, shape, where in hlo_collectives(hlo)
          if op == "all-reduce" and f"f32[{DIN},{DOUT}]" in shape]


def test_pmap_deferred_all_reduce_sits_in_the_emitting_branch(pmap_runs):
  args = lambda run: (run[1], run[2]) + tuple(
      a.reshape((8, -1) + a.shape[1:]) for a in _micro_batches()[0])
  hlo_d = pmap_runs[True][0].lower(*args(pmap_runs[True])).compile().as_text()
  hlo_e = pmap_runs[False][0].lower(*args(pmap_runs[False])).compile().as_text()
  deferred, eager = _gradient_all_reduces(hlo_d), _gradient_all_reduces(hlo_e)
  # Every micro-step: the gradients' all-reduce in the entry computation.
  assert eager and all(where == "ENTRY" for _, where in eager)
  # Deferred: the same all-reduce, but only inside the branch that closes a window,
  # so it runs on 1 micro-step out of K.
  branches = _branch_computations(hlo_d)
  assert len(deferred) == len(eager)
  assert all(where != "ENTRY" and where in branches for _, where in deferred)


def test_shard_map_per_device_accumulator_equals_all_reduce_every_micro_step(reference):
  """In shard_map: params and scale replicated; deferred, the accumulator is kept per device."""
  mesh = jax.make_mesh((8,), ("data",))
  results = {}
  for deferred in (True, False):
    tx = _tx("data" if deferred else None)
    state = tx.init(_params())
    specs = jax.tree.map(lambda _: P(), state)
    if deferred:
      # Each device's partial sums: the accumulator gets a leading device axis.
      specs = specs._replace(acc_grads=jax.tree.map(lambda _: P("data"), state.acc_grads))
      state = state._replace(acc_grads=jax.tree.map(
          lambda a: np.broadcast_to(a, (8,) + a.shape), state.acc_grads))

    def step(p, s, x, y, tx=tx, deferred=deferred):
      if deferred:
        s = s._replace(acc_grads=jax.tree.map(lambda a: a[0], s.acc_grads))
      g = _local_grads(p, s, x, y, "data")
      if not deferred:
        g = lax.pmean(g, "data")  # an all-reduce on every micro-step
      u, s = tx.update(g, s, p)
      if deferred:
        s = s._replace(acc_grads=jax.tree.map(lambda a: a[None], s.acc_grads))
      return optax.apply_updates(p, u), s

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                               out_specs=(P(), specs)))
    params = jax.device_put(_params(), NamedSharding(mesh, P()))
    state = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), state, specs)
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))
    states = []
    for x, y in _micro_batches():
      params, state = fn(params, state, put(x), put(y))
      states.append(_snap(state))
    assert _window_trace(states) == EXPECTED
    hlo = fn.lower(params, state, put(x), put(y)).compile().as_text()
    results[deferred] = (params, _gradient_all_reduces(hlo), _branch_computations(hlo))
  _assert_close(results[True][0], jax.tree.map(np.asarray, results[False][0]), rtol=1e-6)
  _assert_close(results[True][0], reference)
  assert results[False][1] and all(where == "ENTRY" for _, where in results[False][1])
  assert len(results[True][1]) == len(results[False][1])
  assert all(where in results[True][2] for _, where in results[True][1])


# ----------------------------------------------------------------------------- microbatching


@pytest.mark.parametrize("axis_name", ["data", ("data",)], ids=["name", "tuple"])
def test_shard_map_microbatching_reduces_once(axis_name):
  mesh = jax.make_mesh((8,), ("data",))
  rng = np.random.default_rng(3)
  x = rng.standard_normal((64, DIN)).astype(np.float32)  # 8 rows per device
  y = rng.standard_normal((64, DOUT)).astype(np.float32)
  fn = jaxamp.microbatch_value_and_grad(lambda p, b: _loss(p, b["x"], b["y"]), 4,
                                        axis_name=axis_name)
  sm = jax.jit(jax.shard_map(lambda p, b: fn(p, b, loss_scale=8.0), mesh=mesh,
                             in_specs=(P(), P("data")), out_specs=(P(), P())))
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))
  params = jax.device_put(_params(), NamedSharding(mesh, P()))
  batch = {"x": put(x), "y": put(y)}
  loss, grads = sm(params, batch)
  want_loss, want = jax.value_and_grad(lambda p: 8.0 * _loss(p, x, y))(_params())
  np.testing.assert_allclose(float(loss) * 8.0, float(want_loss), rtol=1e-5)
  _assert_close(grads, jax.tree.map(np.asarray, want))
  found = hlo_collectives(sm.lower(params, batch).compile().as_text())
  # Only after the scan, never per micro-step. jax 0.7 leaves the loss's and the gradients'
  # all-reduces apart; from 0.8 on they are one.
  assert found and all(op == "all-reduce" and where == "ENTRY" for op, _, where in found)
  assert len(found) == 1 or jax.__version_info__ < (0, 8)
