"""The facades keep the shardings of sharded params, and agree with the functional core on syncs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp
from tests.multidevice import _problem
from tests.multidevice._problem import (BAD_ROW, BAD_STEP, DIN, DOUT, INIT_SCALE, MICRO,  # noqa: F401
                                       STEPS)

SPEC = {"w": P("data"), "b": P()}  # w fully sharded, b replicated


_params = _problem.params
_micro_batches = _problem.micro_batches
loss_fn = _problem.loss


def _amp_run(params, put):
  wrapper = jaxamp.AmpOptimWrapper(optax.sgd(0.05, momentum=0.9), params, accumulative_counts=2,
                                   loss_scale=dict(init_scale=INIT_SCALE, growth_interval=100))
  scales, grad_shardings = [], []
  for x, y in _micro_batches():
    wrapper.update_params(loss_fn, put(x), put(y))
    if wrapper.grads is not None:
      grad_shardings.append(jax.tree.map(lambda g: g.sharding, wrapper.grads))
    scales.append(wrapper.get_scale())
  return wrapper, scales, grad_shardings


def _torch_run(params, put, donate=False):
  opt = jaxamp.OptimWrapper(optax.sgd(0.05, momentum=0.9), params, donate=donate)
  scaler = jaxamp.GradScaler(init_scale=INIT_SCALE, growth_interval=100)
  scales = []
  for x, y in _micro_batches():
    opt.zero_grad()
    opt.backward(scaler.scale(loss_fn), put(x), put(y))
    scaler.step(opt)
    scaler.update()
    scales.append(scaler.get_scale())
  return opt, scales


@pytest.fixture(scope="module")
def one_device():
  torch = _torch_run(_params(), lambda a: a)
  return {"amp": _amp_run(_params(), lambda a: a)[:2], "torch": torch, "torch_donate": torch}


def _follows(tree, shardings):
  return all(leaf.sharding.is_equivalent_to(s, leaf.ndim)
             for leaf, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))


def _assert_close(tree, ref):
  for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
@pytest.mark.parametrize("facade", ["amp", "torch", "torch_donate"])
def test_facades_keep_the_params_shardings(one_device, facade, axis_type):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), SPEC)
  params = jax.tree.map(jax.device_put, _params(), shardings)
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))
  with jax.set_mesh(mesh):
    if facade == "amp":
      wrapper, scales, grad_shardings = _amp_run(params, put)
      # The gradients accumulated between two steps are sharded like the params.
      assert grad_shardings and all(
          g.is_equivalent_to(ref, np.ndim(p))
          for tree in grad_shardings
          for g, ref, p in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings),
                               jax.tree.leaves(_params())))
    else:
      wrapper, scales = _torch_run(params, put, donate=facade == "torch_donate")
      # The last step's gradients, read unscaled (a donating holder unscales them in place).
      assert _follows(wrapper.grads, shardings)
  ref_wrapper, ref_scales = one_device[facade]
  assert scales == ref_scales
  # The bad micro-batch's step (for AmpOptimWrapper, the window it closes) backs off once.
  backoff = BAD_STEP + 1 if facade == "amp" else BAD_STEP
  assert scales == [INIT_SCALE] * backoff + [INIT_SCALE / 2] * (STEPS - backoff)
  assert _follows(wrapper.params, shardings)
  _assert_close(wrapper.params, ref_wrapper.params)
  momentum = [leaf for leaf in jax.tree.leaves(wrapper.opt_state) if np.ndim(leaf) == 2]
  assert momentum and all(not m.sharding.is_fully_replicated for m in momentum)


@pytest.mark.parametrize("acc, max_counts", [(3, 10), (4, 10), (4, 3), (2, -1)])
def test_should_sync_is_the_step_on_which_the_deferred_all_reduce_runs(acc, max_counts):
  """OptimWrapper.should_sync() before a call == accumulate_gradients closing its window on it.

  The deferred all-reduce (``axis_name``) runs exactly in the closing branch,
  so the two agree on when gradients cross the devices.
  """
  calls = 10 if max_counts == -1 else max_counts
  wrapper = jaxamp.OptimWrapper(optax.sgd(0.1), {"w": jnp.zeros(2)}, accumulative_counts=acc)
  if max_counts != -1:
    wrapper.initialize_count_status(None, 0, max_counts)
  tx = jaxamp.accumulate_gradients(optax.sgd(0.1), acc, axis_name="data",
                                   total_steps=None if max_counts == -1 else max_counts)
  step = jax.pmap(lambda s, g: tx.update(g, s)[1], axis_name="data")
  state = jax.tree.map(lambda a: jnp.broadcast_to(a, (8,) + a.shape), tx.init({"w": jnp.zeros(2)}))
  loss_fn = lambda p, x: jnp.sum(p["w"] * x)  # noqa: E731
  syncs, closes = [], []
  for _ in range(calls):
    syncs.append(wrapper.should_sync())
    wrapper.update_params(loss_fn, jnp.ones(2))
    state = step(state, {"w": jnp.ones((8, 2))})
    closes.append(bool(np.asarray(jaxamp.get_accumulation_state(state).updated)[0]))
  assert syncs == closes
  assert any(syncs)
