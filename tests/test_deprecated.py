"""The names kept for one release warn with a DeprecationWarning and still do what they did."""

import jax.numpy as jnp
import optax
import pytest

import jaxamp

PARAMS = {"w": jnp.zeros(2)}


def test_get_loss_scale_warns_and_reads_the_scale():
  state = jaxamp.set_loss_scale(jaxamp.dynamic_loss_scale(optax.sgd(0.1)).init(PARAMS), 8.0)
  with pytest.warns(DeprecationWarning, match="jaxamp.get_loss_scale is deprecated.*loss_scale"):
    scale = jaxamp.get_loss_scale(state)
  assert float(scale) == float(jaxamp.loss_scale(state)) == 8.0
  with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="No loss-scale state"):
    jaxamp.get_loss_scale(optax.sgd(0.1).init(PARAMS))


def test_has_updated_warns_and_reads_the_window_flag():
  tx = optax.chain(optax.identity(), jaxamp.accumulate_gradients(optax.sgd(1.0), 2))
  state = tx.init(PARAMS)
  flags = []
  for _ in range(3):
    _, state = tx.update({"w": jnp.ones(2)}, state, PARAMS)
    with pytest.warns(DeprecationWarning, match="has_updated is deprecated.*update_applied"):
      flags.append(bool(jaxamp.has_updated(state)))
  assert flags == [False, True, False]
  with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="No accumulation state"):
    jaxamp.has_updated(optax.sgd(1.0).init(PARAMS))


def test_the_warning_points_at_the_caller():
  state = jaxamp.static_loss_scale(optax.sgd(0.1), 4.0).init(PARAMS)
  with pytest.warns(DeprecationWarning) as record:
    jaxamp.get_loss_scale(state)
  assert record[0].filename == __file__
