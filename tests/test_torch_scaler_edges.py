"""Edge cases of the PyTorch-style GradScaler facade, each a behaviour a user relies on."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from tests.test_grad_scaler import Holder

_NONFINITE_NORM = ("The total norm of order {} for gradients from `parameters` is non-finite, so "
                   "it cannot be clipped. To disable this error and scale the gradients by the "
                   "non-finite norm anyway, set `error_if_nonfinite=False`")


def _started(**kwargs):
  """A scaler whose state exists (PyTorch creates it on the first scale())."""
  scaler = jaxamp.GradScaler(**kwargs)
  scaler.scale(jnp.float32(1.0))
  return scaler


def _wrapper(grads, params=None):
  opt = jaxamp.OptimWrapper(optax.sgd(0.5), params or {"w": jnp.zeros(2)})
  opt.grads = grads
  return opt


# -- construction ------------------------------------------------------------------------------


def test_constructor_errors_name_the_argument_and_the_type_error_stays_a_type_error():
  with pytest.raises(TypeError, match=r"^enabled must be a bool, got 1"):
    jaxamp.GradScaler(enabled=1)
  with pytest.raises(TypeError, match=r"^init_scale must be a real number"):
    jaxamp.GradScaler(init_scale="big")
  with pytest.raises(ValueError, match=r"^init_scale must be a positive, finite number, got 0.0"):
    jaxamp.GradScaler(init_scale=0.0)
  with pytest.raises(ValueError, match=r"^stall_after must be an int >= 1, got 0"):
    jaxamp.GradScaler(stall_after=0)


def _stall_messages(steps, **kwargs):
  """The StallWarnings of ``steps`` iterations whose gradients are all nan."""
  scaler = _started(stall_after=1, **kwargs)
  opt = Holder({"w": jnp.ones(2)}, optax.sgd(0.1))
  with pytest.warns(jaxamp.StallWarning) as record:
    for _ in range(steps):
      opt.grads = {"w": jnp.full(2, jnp.nan)}
      scaler.step(opt)
      scaler.update()
      jax.block_until_ready(scaler.state)  # the flag kept is read by the next update at the latest
  return [str(w.message) for w in record if issubclass(w.category, jaxamp.StallWarning)]


def test_the_stall_flag_is_read_every_ten_updates_by_default_or_every_stall_check_every():
  # The report gives the streak of the update whose flag it read.
  messages = _stall_messages(12)
  assert len(messages) == 1 and messages[0].startswith("10 consecutive steps were skipped")
  messages = _stall_messages(5, stall_check_every=3)
  assert len(messages) == 1 and messages[0].startswith("3 consecutive steps were skipped")


# -- scale -------------------------------------------------------------------------------------


def test_scale_keeps_named_tuples_with_their_fields():
  Outputs = collections.namedtuple("Outputs", ["loss", "extra"])
  scaler = jaxamp.GradScaler(init_scale=4.0)
  out = scaler.scale(Outputs(jnp.float32(1.0), [jnp.float32(2.0), Outputs(jnp.float32(3.0),
                                                                          jnp.float32(0.5))]))
  assert type(out) is Outputs and type(out.extra[1]) is Outputs
  assert jax.tree.map(float, out) == Outputs(4.0, [8.0, Outputs(12.0, 2.0)])


def test_scale_of_an_array_inside_a_jitted_function_is_refused_naming_scale():
  scaler = _started(init_scale=4.0)
  with pytest.raises(RuntimeError, match=r"^GradScaler\.scale was called while JAX traces"):
    jax.jit(scaler.scale)(jnp.float32(1.0))


def test_a_scaled_loss_built_inside_a_scaled_loss_keeps_the_scale_of_that_call():
  # The inner function multiplies by the (traced) scale of the call it was built in, also once it
  # leaves that call; the compiled step is reused as the scale changes.
  scaler = _started(init_scale=4.0)

  def loss_fn(params, x):
    return jnp.sum(params * x), scaler.scale(jnp.sum)

  @jax.jit
  def grads_and_inner(scaled, params, x):
    return jax.grad(scaled, has_aux=True)(params, x)

  params, x = jnp.ones(2), jnp.array([1.0, 2.0])
  for new_scale in (4.0, 16.0):
    scaler.update(new_scale=new_scale)
    grads, inner = grads_and_inner(scaler.scale(loss_fn, has_aux=True), params, x)
    np.testing.assert_array_equal(grads, new_scale * x)
    assert float(inner(params)) == 2.0 * new_scale


# -- step / update -----------------------------------------------------------------------------


@pytest.mark.parametrize("enabled", [True, False])
def test_step_forwards_positional_and_keyword_arguments_to_apply_gradients(enabled):
  # PyTorch: scaler.step(opt, *args, **kwargs) calls opt.step(*args, **kwargs); enabled, the
  # skip decision still comes from the optimizer's own (unscaled) gradients.
  own = {"w": jnp.array([1.0, -2.0])}
  for call in (lambda s, o: s.step(o, own), lambda s, o: s.step(o, grads=own)):
    scaler = _started(init_scale=4.0, enabled=enabled)
    opt = _wrapper({"w": jnp.array([8.0, 8.0])})
    call(scaler, opt)
    np.testing.assert_array_equal(opt.params["w"], -0.5 * own["w"])
    scaler.update()
  scaler = _started(init_scale=4.0)
  opt = _wrapper({"w": jnp.array([jnp.inf, 8.0])})
  scaler.step(opt, own)
  np.testing.assert_array_equal(opt.params["w"], np.zeros(2))  # skipped on opt's inf


def test_step_of_an_optimizer_wrapper_refuses_float16_gradients():
  scaler = _started(init_scale=4.0)
  opt = _wrapper({"w": jnp.ones(2, jnp.float16)}, {"w": jnp.ones(2, jnp.float16)})
  with pytest.raises(ValueError, match=r"^Attempting to unscale FP16 gradients\.$"):
    scaler.step(opt)
  np.testing.assert_array_equal(opt.params["w"], np.ones(2, np.float16))


def test_bad_values_from_update_and_load_state_dict_are_named():
  scaler = _started(init_scale=4.0)
  with pytest.raises(ValueError, match=r"^new_scale must be a positive, finite number, got 0.0"):
    scaler.update(new_scale=0.0)
  saved = scaler.state_dict()
  with pytest.raises(ValueError,
                     match=r"^state_dict\['scale'\] must be a positive, finite number, got -1.0"):
    scaler.load_state_dict({**saved, "scale": -1.0})
  assert scaler.state_dict() == saved


# -- clip_grad_norm_ ---------------------------------------------------------------------------


def test_clip_grad_norm_defaults_to_the_2_norm_without_raising_on_inf():
  # torch.nn.utils.clip_grad_norm_(params, max_norm): norm_type=2.0, error_if_nonfinite=False.
  opt = _wrapper({"w": jnp.array([3.0, 4.0])})
  assert float(jaxamp.clip_grad_norm_(opt, 10.0)) == 5.0
  np.testing.assert_array_equal(opt.grads["w"], np.array([3.0, 4.0]))
  opt = _wrapper({"w": jnp.array([jnp.inf, 1.0])})
  assert np.isposinf(jaxamp.clip_grad_norm_(opt, 1.0))


def test_clip_grad_norm_checks_its_flags_by_name_and_accepts_foreach():
  for foreach in (None, True, False):
    opt = _wrapper({"w": jnp.array([3.0, 4.0])})
    assert float(jaxamp.clip_grad_norm_(opt, 10.0, foreach=foreach)) == 5.0
  opt = _wrapper({"w": jnp.array([3.0, 4.0])})
  with pytest.raises(ValueError, match=r"^max_norm must be a number >= 0"):
    jaxamp.clip_grad_norm_(opt, -1.0)
  with pytest.raises(TypeError, match=r"^error_if_nonfinite must be a bool, got 'yes'"):
    jaxamp.clip_grad_norm_(opt, 1.0, error_if_nonfinite="yes")
  with pytest.raises(TypeError, match=r"^foreach must be a bool, got 'yes'"):
    jaxamp.clip_grad_norm_(opt, 1.0, foreach="yes")
  np.testing.assert_array_equal(opt.grads["w"], np.array([3.0, 4.0]))


def test_clip_grad_norm_error_if_nonfinite_raises_pytorchs_error_naming_the_order():
  opt = _wrapper({"w": jnp.array([3.0, 4.0])})
  assert float(jaxamp.clip_grad_norm_(opt, 1.0, norm_type=1.0, error_if_nonfinite=True)) == 7.0
  np.testing.assert_allclose(opt.grads["w"], np.array([3.0, 4.0]) / 7.0, rtol=1e-5)
  for norm_type, order in ((1.0, "1.0"), ("inf", "inf")):
    opt = _wrapper({"w": jnp.array([jnp.inf, 1.0])})
    with pytest.raises(RuntimeError) as raised:
      jaxamp.clip_grad_norm_(opt, 1.0, norm_type=norm_type, error_if_nonfinite=True)
    assert str(raised.value) == _NONFINITE_NORM.format(order)
    np.testing.assert_array_equal(opt.grads["w"], np.array([np.inf, 1.0]))
