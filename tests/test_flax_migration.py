"""From flax's DynamicScale to jaxamp.TrainState: subclassing, serialization, and the same run."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import serialization
from flax.training import dynamic_scale as flax_dynamic_scale
from flax.training import train_state as flax_train_state

import jaxamp


class StateWithStats(jaxamp.TrainState):  # the flax way: no decorators
  batch_stats: Any


def test_a_subclass_needs_no_decorators_and_serializes_with_flax():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9), init_scale=8.0)
  state = StateWithStats.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx,
                                batch_stats={"mean": jnp.zeros(2)})
  state = jax.jit(lambda s: s.apply_gradients(grads={"w": jnp.array([8.0, jnp.inf])}))(state)
  names = {jax.tree_util.keystr(p[:1]) for p, _ in jax.tree_util.tree_leaves_with_path(state)}
  assert names == {".step", ".params", ".opt_state", ".batch_stats"}
  restored = serialization.from_bytes(
      StateWithStats.create(apply_fn=None, params={"w": jnp.zeros(2)}, tx=tx,
                            batch_stats={"mean": jnp.ones(2)}),
      serialization.to_bytes(state))
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(a, b)
  assert set(serialization.to_state_dict(state)) == {"step", "params", "opt_state", "batch_stats"}
  with pytest.raises(ValueError, match=r"lacks the fields \['batch_stats'\]"):
    serialization.from_state_dict(state, {"step": 0, "params": {}, "opt_state": {}})


GROWTH = 3  # flax's growth_interval
GRADS_SCALE = [1.0, 1.0, np.inf, 1.0, 1.0, 1.0, 1.0, np.nan, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]


def _loss(params, k):
  bad = jnp.asarray(GRADS_SCALE)[k]
  return jnp.sum(jnp.sin(params["w"] * (k + 1.0))) * bad + jnp.sum(params["b"] ** 2)


def test_a_dynamic_scale_run_is_reproduced_step_for_step():
  params = {"w": jnp.linspace(-1.0, 1.0, 4), "b": jnp.array([0.5, -0.25])}
  tx = optax.sgd(0.05, momentum=0.9)

  # flax's imagenet train step, as written there.
  @jax.jit
  def flax_step(state, dynamic_scale, k):
    grad_fn = dynamic_scale.value_and_grad(lambda p: _loss(p, k))
    dynamic_scale, is_fin, _, grads = grad_fn(state.params)
    new_state = state.apply_gradients(grads=grads)
    new_state = new_state.replace(
        opt_state=jax.tree.map(lambda a, b: jnp.where(is_fin, a, b), new_state.opt_state,
                               state.opt_state),
        params=jax.tree.map(lambda a, b: jnp.where(is_fin, a, b), new_state.params,
                            state.params))
    return new_state, dynamic_scale, is_fin

  # The port: growth_interval one more than flax's (flax grows on the (N+1)-th good step).
  @jax.jit
  def jaxamp_step(state, k):
    _, grads = state.value_and_grad(lambda p: _loss(p, k))(state.params)
    return state.apply_gradients(grads=grads)

  fstate = flax_train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
  dyn = flax_dynamic_scale.DynamicScale(growth_interval=GROWTH, scale=jnp.float32(2.0**10),
                                        fin_steps=jnp.int32(0))
  jstate = jaxamp.TrainState.create(
      apply_fn=None, params=params,
      tx=jaxamp.dynamic_loss_scale(tx, init_scale=2.0**10, growth_interval=GROWTH + 1))
  with jax.numpy_dtype_promotion("standard"):
    for k in range(len(GRADS_SCALE)):
      fstate, dyn, is_fin = flax_step(fstate, dyn, k)
      jstate = jaxamp_step(jstate, k)
      assert float(jstate.loss_scale) == float(dyn.scale), k
      assert bool(jaxamp.get_loss_scale_state(jstate.opt_state).skipped) == (not bool(is_fin)), k
      for a, b in zip(jax.tree.leaves(jstate.params), jax.tree.leaves(fstate.params)):
        np.testing.assert_allclose(a, b, atol=1e-6, err_msg=f"step {k}")
  # flax's step counts every call; jaxamp's counts the applied steps.
  assert int(fstate.step) == len(GRADS_SCALE) and int(jstate.step) == len(GRADS_SCALE) - 2
