"""The soundness battery on 8 devices: data-parallel ``jit`` and ``shard_map`` with ``axis_name``."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import example, given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxamp
from tests import _soundness as S

settings.load_profile(S.PROFILE)
ROWS = 16  # two rows per device


@st.composite
def batches(draw):
  x = np.ones((ROWS, S.N), np.float32)
  for _ in range(draw(st.integers(0, 2))):
    x[draw(st.integers(0, ROWS - 1)), draw(st.integers(0, S.N - 1))] = draw(
        st.sampled_from(S.VALUES))
  return jnp.asarray(x), draw(st.sampled_from(S.SCALES))


def _hidden_overflow():
  x = np.ones((ROWS, S.N), np.float32)
  x[11] = [1.779, -3.37, 1.209, 1.717]  # on device 5
  return jnp.asarray(x), 2.0**127


def _loss(p, x):
  return jnp.sum(p["g"][None, :] * x) / ROWS


@pytest.mark.parametrize("way", ["jit", "shard_map"])
def test_data_parallel_steps_skip_exactly_when_the_eager_rule_says(mesh, way):
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9), init_scale=2.0**16,
                                 axis_name="data" if way == "shard_map" else None)

  def step(params, state, x):
    grads = jax.grad(lambda p: jaxamp.scale_loss(_loss(p, x), state))(params)
    if way == "shard_map":
      grads = jax.lax.psum(grads, "data")
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, grads

  if way == "jit":
    compiled = jax.jit(step)
  else:
    compiled = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data")),
                                     out_specs=(P(), P(), P())))
  params = S.params0()
  base = tx.init(params)

  @given(batches())
  @example(_hidden_overflow())
  def check(case):
    x, scale = case
    state = jaxamp.set_loss_scale(base, scale)
    with jax.set_mesh(mesh):
      new_params, new_state, grads = compiled(
          params, state, jax.device_put(x, NamedSharding(mesh, P("data"))))
    with jax.disable_jit():
      eager_tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9), init_scale=2.0**16)
      eager_grads = jax.grad(lambda p: jaxamp.scale_loss(_loss(p, x), state))(params)
      _, eager_state = eager_tx.update(eager_grads, state, params)
    S.check_step((params, state.inner_state), (new_params, new_state.inner_state), grads,
                 bool(new_state.skipped), new_state.scale,
                 (bool(eager_state.skipped), eager_state.scale, eager_grads), scale)

  check()
