"""Edge cases of the facades, against the behaviour of the originals.

Paddle's ``unscale_`` accepts float16 gradients (PyTorch's refuses them); mmengine's
``flat_decay_mult`` applies to one-dimensional parameters only, not to scalars; an
``AmpOptimWrapper`` with hysteresis saves and restores the overflows it has counted.
"""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from tests.test_amp_optim_wrapper import bad_loss, w_params, X
from tests.test_grad_scaler import Holder


def test_paddle_unscale_divides_float16_gradients_in_their_dtype():
  scaler = jaxamp.paddle.GradScaler(init_loss_scaling=8.0)
  opt = Holder({"w": jnp.zeros(3, jnp.float16)}, optax.sgd(1.0))
  opt.grads = {"w": jnp.array([8.0, -4.0, 1.0], jnp.float16)}
  scaler.unscale_(opt)
  assert opt.grads["w"].dtype == jnp.float16
  np.testing.assert_array_equal(opt.grads["w"], np.array([1.0, -0.5, 0.125], np.float16))


def test_torch_unscale_refuses_float16_gradients():
  scaler = jaxamp.GradScaler(init_scale=8.0)
  scaler.scale(jnp.float32(1.0))
  opt = Holder({"w": jnp.zeros(3, jnp.float16)}, optax.sgd(1.0))
  opt.grads = {"w": jnp.array([8.0, -4.0, 1.0], jnp.float16)}
  with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
    scaler.unscale_(opt)


def test_flat_decay_mult_skips_scalar_parameters():
  params = {"temperature": jnp.ones([]), "pos": jnp.ones(3), "dense": {"kernel": jnp.ones((2, 2))}}
  wrapper = jaxamp.build_optim_wrapper(params, dict(
      optimizer=dict(type="SGD", lr=0.1, weight_decay=0.01),
      paramwise_cfg=dict(flat_decay_mult=0.5)))
  decay = {name: group["weight_decay"] for group in wrapper.param_groups
           for name in group["params"]}
  assert decay == pytest.approx({"temperature": 0.01, "pos": 0.005, "dense.kernel": 0.01})


def test_hysteresis_tracker_is_saved_and_restored():
  def make():
    return jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(),
                                  loss_scale=dict(init_scale=8.0, hysteresis=2))
  wrapper = make()
  wrapper.update_params(bad_loss, X, jnp.asarray(True))  # one overflow: no back-off yet
  assert wrapper.get_scale() == 8.0
  saved = wrapper.state_dict()
  assert saved["loss_scaler"]["_hysteresis_tracker"] == 1
  restored = make()
  restored.load_state_dict(saved)
  restored.update_params(bad_loss, X, jnp.asarray(True))  # the second overflow backs off
  assert restored.get_scale() == 4.0
  fresh = make()
  fresh.update_params(bad_loss, X, jnp.asarray(True))
  assert fresh.get_scale() == 8.0
