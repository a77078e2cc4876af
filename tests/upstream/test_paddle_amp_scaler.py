"""Paddle's ``TestAmpScaler`` (test_imperative_auto_mixed_precision.py), ported to jaxamp.paddle.

``fluid.dygraph.AmpScaler`` and ``paddle.amp.GradScaler`` are both
``jaxamp.paddle.GradScaler``; ``SimpleConv`` (``num_channels=3,
num_filters=64, filter_size=7, stride=2, act='relu'``) is a convolution
pytree; ``optimizer.minimize(loss)`` and ``optimizer.step()`` are the holder's
``step()``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jaxamp

GradScaler = jaxamp.paddle.GradScaler


def _simple_conv(seed=10):
  rng = np.random.default_rng(seed)
  bound = 1 / np.sqrt(3 * 7 * 7)
  return {"weight": jnp.asarray(rng.uniform(-bound, bound, (64, 3, 7, 7)), jnp.float32)}


def _loss(params, data):
  out = lax.conv_general_dilated(data, params["weight"], (2, 2), "SAME")
  return jnp.mean(jax.nn.relu(out))


def _optimizer(params):
  return jaxamp.OptimWrapper(optax.sgd(0.01), params)


class TestAmpScaler:

  def test_scale(self):
    data = jnp.asarray(np.random.default_rng(0).random((10, 1024)), jnp.float32)
    scaler = GradScaler(init_loss_scaling=1024)
    scaled_data = scaler.scale(data)
    assert np.array_equal(np.asarray(scaled_data), np.asarray(data) * 1024)

  def _run_simple_conv(self, inp_np, use_scaler, minimize):
    optimizer = _optimizer(_simple_conv())
    scaler = GradScaler(init_loss_scaling=1024)
    data = jnp.asarray(inp_np)
    if use_scaler:
      scaled_loss = scaler.scale(_loss)
      optimizer.backward(scaled_loss, data)
      grads = optimizer.grads
      if minimize:
        scaler.minimize(optimizer, scaled_loss)
      else:
        scaler.step(optimizer)
        scaler.update()
      grads = jax.tree.map(lambda g: g / 1024, grads)
    else:
      optimizer.backward(_loss, data)
      grads = optimizer.grads
      optimizer.step()
    return optimizer.params, grads

  def test_minimize(self):
    inp_np = np.random.default_rng(1).random((1, 3, 128, 128)).astype(np.float32)
    outs_with_scaler = self._run_simple_conv(inp_np, True, minimize=True)
    outs_no_scaler = self._run_simple_conv(inp_np, False, minimize=True)
    # (optimize_ops is [] in dygraph mode: minimize returns None here.)
    # check each grad
    np.testing.assert_allclose(outs_with_scaler[1]["weight"], outs_no_scaler[1]["weight"],
                               rtol=1e-05)
    # check each parameter
    np.testing.assert_allclose(outs_with_scaler[0]["weight"], outs_no_scaler[0]["weight"],
                               rtol=1e-05)

  def test_step(self):
    inp_np = np.random.default_rng(2).random((1, 3, 128, 128)).astype(np.float32)
    outs_with_scaler = self._run_simple_conv(inp_np, True, minimize=False)
    outs_no_scaler = self._run_simple_conv(inp_np, False, minimize=False)
    # check each parameter
    np.testing.assert_allclose(outs_with_scaler[0]["weight"], outs_no_scaler[0]["weight"],
                               rtol=1e-05)

  def test_nan_inf(self):
    inp_np = np.random.default_rng(3).random((1, 3, 128, 128)).astype(np.float32)
    inp_np[0][1][2][3] = np.nan
    optimizer = _optimizer(_simple_conv())
    params_init = jax.tree.map(np.asarray, optimizer.params)
    scaler = GradScaler(init_loss_scaling=1024)
    data = jnp.asarray(inp_np)
    scaled_loss = scaler.scale(_loss)
    optimizer.backward(scaled_loss, data)
    scaler.minimize(optimizer, scaled_loss)
    assert bool(scaler._last_found_inf)  # Paddle: scaler._found_inf == 1
    # param not update when tensor contains nan or inf
    np.testing.assert_array_equal(optimizer.params["weight"], params_init["weight"])

  def test_step_update_exception(self):
    def prepare():
      rng = np.random.default_rng(4)
      model = {"weight": jnp.asarray(rng.uniform(-0.1, 0.1, (2, 3, 3, 3)), jnp.float32)}
      optimizer = _optimizer(model)
      scaler = GradScaler(init_loss_scaling=1024)
      data = jnp.asarray(rng.random((10, 3, 32, 32)), jnp.float32)
      optimizer.backward(scaler.scale(_loss), data)
      return optimizer, scaler

    def func1():
      optimizer, scaler = prepare()
      scaler.unscale_(optimizer)
      scaler.unscale_(optimizer)

    with pytest.raises(RuntimeError):
      func1()

    def func2():
      optimizer, scaler = prepare()
      scaler.step(optimizer)
      scaler.unscale_(optimizer)

    with pytest.raises(RuntimeError):
      func2()

    def func3():
      optimizer, scaler = prepare()
      scaler.step(optimizer)
      scaler.step(optimizer)

    with pytest.raises(RuntimeError):
      func3()

  def test_get_and_set(self):
    scaler = GradScaler(enable=True, init_loss_scaling=1024, incr_ratio=2.0, decr_ratio=0.5,
                        incr_every_n_steps=1000, decr_every_n_nan_or_inf=2,
                        use_dynamic_loss_scaling=True)
    assert scaler.is_enable() is True
    assert scaler.get_init_loss_scaling() == 1024
    assert scaler.get_incr_ratio() == 2.0
    assert scaler.get_decr_ratio() == 0.5
    assert scaler.get_incr_every_n_steps() == 1000
    assert scaler.get_decr_every_n_nan_or_inf() == 2
    assert scaler.is_use_dynamic_loss_scaling() is True
    scaler.set_decr_every_n_nan_or_inf(4)
    assert scaler.get_decr_every_n_nan_or_inf() == 4
    scaler.set_decr_ratio(0.1)
    assert scaler.get_decr_ratio() == 0.1
    scaler.set_incr_every_n_steps(200)
    assert scaler.get_incr_every_n_steps() == 200
    scaler.set_incr_ratio(3.0)
    assert scaler.get_incr_ratio() == 3.0
    scaler.set_init_loss_scaling(100)
    assert scaler.get_init_loss_scaling() == 100

  def test_state_dict_and_load_state_dict(self):
    scaler1 = GradScaler(enable=True, init_loss_scaling=14, incr_ratio=233.0, decr_ratio=0.523,
                         incr_every_n_steps=1090, decr_every_n_nan_or_inf=20,
                         use_dynamic_loss_scaling=True)
    scaler_state = scaler1.state_dict()
    scaler2 = GradScaler(enable=True)
    scaler2.load_state_dict(scaler_state)
    assert scaler2.get_init_loss_scaling() == 14
    assert scaler2.get_incr_ratio() == 233.0
    assert scaler2.get_decr_ratio() == 0.523
    assert scaler2.get_incr_every_n_steps() == 1090
    assert scaler2.get_decr_every_n_nan_or_inf() == 20

    scaler3 = GradScaler(enable=False)
    scaler3.load_state_dict(scaler_state)
    assert scaler3.is_enable() is False

  def test_state_dict_and_load_state_dict_error(self):
    def test_error():
      state_empty = {}
      scaler = GradScaler(enable=True)
      scaler.load_state_dict(state_empty)

    with pytest.raises(RuntimeError):
      test_error()
