"""Edge cases of the Paddle-style GradScaler facade, each a behaviour a user relies on.

A bad argument, setter value or state dict entry is refused under its own name (Paddle's
``AssertionError`` for the ratios) and leaves the scaler as it was; a disabled scaler still
answers its getters and setters; a loss function with an auxiliary output has only its loss
scaled, and code inside a scaled loss scales by that call's scale; an iteration without
gradients is a good one; ``step`` uses a holder's one-call unscale-and-apply; the stall report
reads its flag every ``stall_check_every`` updates (10 by default); and nothing recompiles.
"""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from tests._floats import enable_x64

W0 = {"w": jnp.array([1.0, -2.0], jnp.float32)}
X = jnp.array([0.5, 1.0], jnp.float32)
NAN = {"w": jnp.full(2, jnp.nan, jnp.float32)}


def _loss(p, x):
  return jnp.sum(p["w"] * x)


def _wrapper():
  return jaxamp.OptimWrapper(optax.sgd(0.5), W0)


def _iteration(scaler, opt, x=X):
  opt.backward(scaler.scale(_loss), x)
  scaler.minimize(opt)
  opt.zero_grad()


def _settings(scaler):
  """What a user can read of a scaler: its getters and its state dict (arrays as lists)."""
  sd = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in scaler.state_dict().items()}
  return (sd, scaler.is_enable(), scaler.is_use_dynamic_loss_scaling(),
          scaler.get_init_loss_scaling(), scaler.get_incr_ratio(), scaler.get_decr_ratio(),
          scaler.get_incr_every_n_steps(), scaler.get_decr_every_n_nan_or_inf())


@contextlib.contextmanager
def _compilations():
  """The XLA compilations that happen inside the block (one entry each)."""
  seen = []

  def listener(event, duration, **kwargs):
    del duration, kwargs
    if event == "/jax/core/compile/backend_compile_duration":
      seen.append(event)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield seen
  finally:
    unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None)
    if unregister is None:  # jax before 0.8 has only the private spelling
      from jax._src import monitoring  # pylint: disable=g-import-not-at-top
      unregister = monitoring._unregister_event_duration_listener_by_callback
    unregister(listener)


# -- refused values ---------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(enable="yes"), TypeError, "enable must be a bool, got 'yes'"),
    (dict(use_dynamic_loss_scaling=1), TypeError, "use_dynamic_loss_scaling must be a bool"),
    (dict(stall_after=0), ValueError, "stall_after must be an int >= 1, got 0"),
    (dict(init_loss_scaling=-1.0), ValueError, "init_loss_scaling must be a positive"),
])
def test_a_bad_constructor_argument_is_refused_under_its_own_name(kwargs, error, message):
  with pytest.raises(error, match="^" + re.escape(message)):
    jaxamp.paddle.GradScaler(**kwargs)


@pytest.mark.parametrize("enable", [True, False])
def test_a_ratio_setter_refuses_paddles_bad_values_with_its_assertion_and_changes_nothing(enable):
  # Paddle asserts new_incr_ratio > 1 and new_decr_ratio < 1, enabled or not.
  scaler = jaxamp.paddle.GradScaler(enable=enable, init_loss_scaling=8.0, incr_every_n_steps=1)
  before = _settings(scaler)
  for setter, value, message in [
      ("set_incr_ratio", 1.0, "The new_incr_ratio must be > 1.0."),
      ("set_decr_ratio", 1.0, "The new_decr_ratio must be < 1.0."),
      ("set_decr_ratio", 1.5, "The new_decr_ratio must be < 1.0."),
  ]:
    with pytest.raises(AssertionError, match="^" + re.escape(message) + "$"):
      getattr(scaler, setter)(value)
    assert _settings(scaler) == before


def test_a_refused_setter_value_is_named_and_leaves_the_scale_and_the_rule_as_they_were():
  scaler = jaxamp.paddle.GradScaler(init_loss_scaling=8.0, incr_every_n_steps=1)
  opt = _wrapper()
  _iteration(scaler, opt)  # 8 -> 16
  before = _settings(scaler)
  with pytest.raises(ValueError, match=r"^new_init_loss_scaling must be a positive"):
    scaler.set_init_loss_scaling(-1.0)
  with pytest.raises(ValueError, match=r"^decr_ratio must be in the open interval \(0, 1\)"):
    scaler.set_decr_ratio(0.0)  # Paddle takes it, and a bad step would zero the scale
  assert _settings(scaler) == before
  opt.grads = NAN
  scaler.minimize(opt)
  assert scaler.state_dict()["scale"].tolist() == [8.0]  # backed off by the kept 0.5


def test_set_incr_ratio_takes_any_ratio_above_one_and_the_scale_grows_by_it():
  scaler = jaxamp.paddle.GradScaler(init_loss_scaling=8.0, incr_every_n_steps=1)
  scaler.set_incr_ratio(1.5)
  assert scaler.get_incr_ratio() == 1.5
  _iteration(scaler, _wrapper())
  assert scaler.state_dict()["scale"].tolist() == [12.0]


@pytest.mark.parametrize("key,value,error,message", [
    ("incr_every_n_steps", 0, ValueError,
     "state_dict['incr_every_n_steps'] must be an int >= 1, got 0"),
    ("incr_ratio", 1.0, ValueError, "state_dict['incr_ratio'] must be > 1, got 1.0"),
    ("scale", -1.0, ValueError, "state_dict['scale'] must be a positive, finite number"),
    ("decr_count", -1, ValueError, "state_dict['decr_count'] must be an int >= 0, got -1"),
    ("use_dynamic_loss_scaling", "False", TypeError,
     "state_dict['use_dynamic_loss_scaling'] must be a bool"),
])
def test_a_refused_state_dict_names_its_key_and_changes_nothing(key, value, error, message):
  scaler = jaxamp.paddle.GradScaler(init_loss_scaling=8.0, incr_every_n_steps=3)
  _iteration(scaler, _wrapper())
  good = scaler.state_dict()
  before = _settings(scaler)
  with pytest.raises(error, match="^" + re.escape(message)):
    scaler.load_state_dict({**good, key: value})
  assert _settings(scaler) == before


# -- a disabled scaler --------------------------------------------------------------------------


def test_a_disabled_scaler_reports_no_dynamic_scaling_and_takes_a_new_init_loss_scaling():
  scaler = jaxamp.paddle.GradScaler(enable=False)
  assert scaler.is_use_dynamic_loss_scaling() is False  # Paddle's answer, a bool
  scaler.set_init_loss_scaling(1024.0)
  assert scaler.get_init_loss_scaling() == 1024.0
  x = jnp.float32(2.0)
  assert scaler.scale(x) is x  # still nothing is scaled


# -- scaled losses ------------------------------------------------------------------------------


def _loss_with_aux(p, x):
  return _loss(p, x), {"n": jnp.float32(3.0)}


def test_a_scaled_loss_with_aux_scales_only_the_loss():
  scaler = jaxamp.paddle.GradScaler(init_loss_scaling=8.0)
  scaled = scaler.scale(_loss_with_aux, has_aux=True)
  value, aux = scaled(W0, X)
  assert float(value) == 8.0 * float(_loss(W0, X)) and float(aux["n"]) == 3.0
  opt = _wrapper()
  _, aux = opt.backward(scaled, X, has_aux=True)
  assert float(aux["n"]) == 3.0
  np.testing.assert_array_equal(opt.grads["w"], 8.0 * np.asarray(X))
  scaler.minimize(opt)
  np.testing.assert_array_equal(opt.params["w"], np.asarray(W0["w"]) - 0.5 * np.asarray(X))


def test_inside_a_scaled_loss_scale_multiplies_by_the_scale_of_that_call():
  scaler = jaxamp.paddle.GradScaler(init_loss_scaling=4.0, incr_every_n_steps=1)

  def loss(p, x):
    return _loss(p, x), scaler.scale(jnp.float32(1.0))

  opt = _wrapper()
  for want in (4.0, 8.0, 16.0):  # compiled once: the scale is traced, not frozen
    _, seen = opt.backward(scaler.scale(loss, has_aux=True), X, has_aux=True)
    assert float(seen) == want
    scaler.minimize(opt)
    opt.zero_grad()


# -- iterations ---------------------------------------------------------------------------------


def test_an_iteration_without_gradients_is_a_good_one_and_compiles_nothing_new():
  # Paddle unscales no gradient, finds no inf, steps nothing, and counts a good iteration.
  scaler = jaxamp.paddle.GradScaler(init_loss_scaling=8.0, incr_every_n_steps=1,
                                    decr_ratio=0.375)  # a rule no other test compiles
  opt = _wrapper()
  _iteration(scaler, opt)  # 8 -> 16, compiles the step and the update
  with _compilations() as compiled:
    scaler.minimize(opt)  # opt.grads is None
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
  assert compiled == []
  assert scaler.state_dict()["scale"].tolist() == [64.0]
  np.testing.assert_array_equal(opt.params["w"], np.asarray(W0["w"]) - 0.5 * np.asarray(X))


def test_updates_without_a_step_compile_once():
  # Paddle's update() with nothing stepped repeats the last flag: a good iteration at first.
  scaler = jaxamp.paddle.GradScaler(init_loss_scaling=8.0, incr_every_n_steps=1,
                                    decr_ratio=0.625)  # a rule no other test compiles
  scaler.update()
  with _compilations() as compiled:
    scaler.update()
    scaler.update()
  assert compiled == []
  assert scaler.state_dict()["scale"].tolist() == [64.0]


class _CountingWrapper(jaxamp.OptimWrapper):
  """An OptimWrapper that records which of its stepping methods a scaler calls."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.calls = []

  def apply_scaled_gradients(self, scale):
    self.calls.append("apply_scaled_gradients")
    return super().apply_scaled_gradients(scale)

  def apply_gradients(self, grads=None, *, skip=None):
    self.calls.append("apply_gradients")
    return super().apply_gradients(grads, skip=skip)


def test_step_unscales_and_applies_in_the_holders_one_call_unless_unscale_came_first():
  scaler = jaxamp.paddle.GradScaler(init_loss_scaling=8.0)
  opt = _CountingWrapper(optax.sgd(0.5), W0)
  for how in ("minimize", "step", "unscale_"):
    opt.backward(scaler.scale(_loss), X)
    if how == "minimize":
      scaler.minimize(opt)
    else:
      if how == "unscale_":
        scaler.unscale_(opt)  # the user sees the unscaled gradients: two calls
      scaler.step(opt)
      scaler.update()
    opt.zero_grad()
  assert opt.calls == ["apply_scaled_gradients", "apply_scaled_gradients", "apply_gradients"]
  np.testing.assert_array_equal(opt.params["w"], np.asarray(W0["w"]) - 1.5 * np.asarray(X))


def test_with_x64_enabled_a_new_init_loss_scaling_is_still_a_float32_scale():
  with enable_x64(True):
    scaler = jaxamp.paddle.GradScaler(init_loss_scaling=8.0)
    scaler.set_init_loss_scaling(4.0)
    assert scaler.state.scale.dtype == jnp.float32
    assert scaler.scale(jnp.float32(0.5)).dtype == jnp.float32


# -- the stall report ---------------------------------------------------------------------------


def _stalled_at(bad, updates, **kwargs):
  """The update (1-based) that raised the stall, or None; the first ``bad`` updates are bad."""
  scaler = jaxamp.paddle.GradScaler(stall_after=1, on_stall="raise", **kwargs)
  opt = _wrapper()
  for i in range(1, updates + 1):
    opt.grads = NAN if i <= bad else {"w": X}
    try:
      scaler.minimize(opt)
    except jaxamp.StalledError:
      return i
    jax.block_until_ready(scaler.state)  # the flag kept is computed by the next update
  return None


def test_the_stall_flag_is_read_every_stall_check_every_updates_ten_by_default():
  # The flag of every stall_check_every-th update is read: a stall over updates 1-2 is found
  # with stall_check_every=2; with the default (10) one over updates 1-10 is, at update 10 or
  # (when its flag was not computed yet) 11, and a stall that ends sooner is not.
  assert _stalled_at(2, 4, stall_check_every=2) in (2, 3)
  assert _stalled_at(2, 4, stall_check_every=3) is None
  assert _stalled_at(10, 12) in (10, 11)
  assert _stalled_at(9, 12) is None
