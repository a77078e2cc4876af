"""Edge cases of the facades, against the behaviour of the originals.

Paddle's ``unscale_`` accepts float16 gradients (PyTorch's refuses them); mmengine's
``flat_decay_mult`` applies to one-dimensional parameters only, not to scalars; an
``AmpOptimWrapper`` with hysteresis saves and restores the overflows it has counted. The
scalers check the values Flax's fp8 layers return without unscaling them, and their stall
report reads the flag every ``stall_check_every`` updates and names every bad leaf. A loss
call's static arguments are told apart as ``jax.jit`` tells them (unhashable ones by identity),
and a loss written anew in every iteration is reported once.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.linen import fp8_ops
from flax.training import train_state as flax_train_state

import jaxamp
from tests.test_amp_optim_wrapper import bad_loss, w_params, X
from tests.test_diagnostics import _torch_loop
from tests.test_grad_scaler import Holder

OWG = fp8_ops.OVERWRITE_WITH_GRADIENT


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


def test_backward_all_adds_each_wrappers_gradient_with_aux_and_keyword_arguments():
  wrappers = jaxamp.OptimWrapperDict(a=jaxamp.OptimWrapper(optax.sgd(0.1), {"w": jnp.ones(2)}),
                                     b=jaxamp.OptimWrapper(optax.sgd(0.1), {"v": jnp.ones(1)}))

  def loss(ps, x, *, k):
    return jnp.sum(ps["a"]["w"] * x) * k + 3.0 * jnp.sum(ps["b"]["v"]), {"k": k}

  x = jnp.array([1.0, 2.0])
  out, aux = wrappers.backward_all(loss, x, has_aux=True, k=2.0)
  assert float(out) == 9.0 and aux == {"k": 2.0}
  np.testing.assert_array_equal(wrappers["a"].grads["w"], [2.0, 4.0])
  np.testing.assert_array_equal(wrappers["b"].grads["v"], [3.0])
  wrappers.backward_all(lambda ps, x: jnp.sum(ps["a"]["w"] * x), x)  # plain: added, unscaled
  np.testing.assert_array_equal(wrappers["a"].grads["w"], [3.0, 6.0])
  np.testing.assert_array_equal(wrappers["b"].grads["v"], [3.0])


def test_a_missing_name_error_reads_as_given():
  from jaxamp._src.facade.errors import AssertionKeyError
  assert str(AssertionKeyError("no wrapper 'c'")) == "no wrapper 'c'"
  assert str(AssertionKeyError()) == ""


@pytest.mark.parametrize("bad", [2.5, "4", True])
def test_count_status_refuses_a_max_counts_that_is_not_an_int(bad):
  wrapper = jaxamp.OptimWrapper(optax.sgd(0.1), {"w": jnp.ones(2)})
  with pytest.raises(TypeError, match="max_counts must be an int"):
    wrapper.initialize_count_status(None, 0, bad)


def test_torch_repr_tells_an_enabled_scaler_from_a_disabled_one():
  assert repr(jaxamp.GradScaler(enabled=False)) == "GradScaler(enabled=False)"
  assert "growth_interval=2000" in repr(jaxamp.GradScaler())


def test_a_stall_names_only_the_leaves_that_hold_inf_or_nan():
  with pytest.raises(jaxamp.StalledError, match=r"\(in \['dec'\]\)"):
    _torch_loop(40, stall_after=8, stall_check_every=2, on_stall="raise")


def _torch_adam_amsgrad(grads, lr=0.1, b1=0.9, b2=0.999, eps=1e-8):
  """PyTorch's Adam with amsgrad=True on one scalar, in float64."""
  p, m, v, v_max = 1.0, 0.0, 0.0, 0.0
  for t, g in enumerate(grads, 1):
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    v_max = max(v_max, v)
    p -= lr / (1 - b1**t) * m / (np.sqrt(v_max) / np.sqrt(1 - b2**t) + eps)
  return p


def _linear(p, g):
  return jnp.sum(p["w"]) * g


def test_adam_with_amsgrad_divides_by_the_largest_second_moment():
  wrapper = jaxamp.build_optim_wrapper({"w": jnp.ones(1)}, dict(
      optimizer=dict(type="Adam", lr=0.1, amsgrad=True)))
  grads = [1.0, 0.01, 0.01]  # the second moment falls after the first step
  for g in grads:
    wrapper.update_params(_linear, jnp.float32(g))
  np.testing.assert_allclose(float(wrapper.params["w"][0]), _torch_adam_amsgrad(grads),
                             rtol=1e-5)


def test_a_state_dict_with_a_python_number_for_a_scalar_leaf_loads_in_the_leafs_dtype():
  # A checkpoint written through JSON or by hand holds plain numbers for the step counts.
  wrapper = jaxamp.OptimWrapper(optax.adam(0.1), {"w": jnp.ones(2)})
  state_dict = wrapper.state_dict()
  adam, empty = state_dict["state"]
  state_dict["state"] = (adam._replace(count=5), empty)
  wrapper.load_state_dict(state_dict)
  count = wrapper.opt_state[0].count
  assert count.dtype == jnp.int32 and int(count) == 5


def test_a_bad_beta_is_refused_naming_which_one():
  wrapper = jaxamp.build_optim_wrapper({"w": jnp.ones(2)}, dict(
      optimizer=dict(type="Adam", lr=0.1)))
  with pytest.raises(TypeError, match=r"betas\[0\]"):
    wrapper.param_groups[0]["betas"] = ("x", 0.999)
  generic = jaxamp.OptimWrapper(optax.inject_hyperparams(optax.adam)(learning_rate=0.1),
                                {"w": jnp.ones(2)})
  with pytest.raises(TypeError, match=r"\]: betas must be a pair"):
    generic.param_groups[0]["betas"] = 0.9


def test_setting_a_hyperparameter_the_state_does_not_hold_names_where():
  wrapper = jaxamp.OptimWrapper(optax.sgd(0.1), {"w": jnp.ones(2)})
  with pytest.raises(ValueError, match=r"^param_groups\[0\]\['lr'\]: this optimizer"):
    wrapper.param_groups[0]["lr"] = 0.5
  state_dict = wrapper.state_dict()
  state_dict["param_groups"][0]["lr"] = 0.5
  with pytest.raises(ValueError, match=r"^state_dict\['param_groups'\]\[0\]\['lr'\]: this"):
    wrapper.load_state_dict(state_dict)


def test_an_optim_wrapper_dict_points_to_its_wrappers():
  wrapper = jaxamp.OptimWrapper(optax.sgd(0.1), {"w": jnp.ones(2)})
  wrappers = jaxamp.OptimWrapperDict(gen=wrapper)
  with pytest.raises(AttributeError, match=r"read wrappers\['gen'\]\.optimizer"):
    _ = wrappers.optimizer
  assert "name: gen\n" + repr(wrapper) in repr(wrappers)


def test_the_longest_matching_custom_key_wins():
  # mmengine tries the custom keys longest first: "head.x" before "x", whatever their order.
  params = {"head": {"x": jnp.ones(2)}, "x": jnp.ones(2)}
  wrapper = jaxamp.build_optim_wrapper(params, dict(
      optimizer=dict(type="SGD", lr=1.0),
      paramwise_cfg=dict(custom_keys={"x": dict(lr_mult=2.0), "head.x": dict(lr_mult=3.0)})))
  wrapper.update_params(_sum_all, jnp.float32(1.0))
  np.testing.assert_allclose(wrapper.params["head"]["x"], [-2.0, -2.0])  # 1 - 3 * 1.0
  np.testing.assert_allclose(wrapper.params["x"], [-1.0, -1.0])  # 1 - 2 * 1.0


def _sum_all(p, k):
  return sum(jnp.sum(leaf) for leaf in jax.tree.leaves(p)) * k


def test_a_scaler_state_without_a_hysteresis_tracker_loads_as_no_overflow_counted():
  # PyTorch's GradScaler state (what mmengine saves) has no tracker: none counted yet.
  def make():
    return jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(),
                                  loss_scale=dict(init_scale=8.0, hysteresis=2))
  saved = make().state_dict()
  del saved["loss_scaler"]["_hysteresis_tracker"]
  restored = make()
  restored.load_state_dict(saved)
  restored.update_params(bad_loss, X, jnp.asarray(True))  # the first overflow: no back-off
  assert restored.get_scale() == 8.0


def test_scale_factors_may_be_concrete_scalar_arrays():
  scaler = jaxamp.GradScaler(init_scale=2.0, growth_factor=jnp.float32(4.0))
  assert float(scaler.get_growth_factor()) == 4.0
  paddle = jaxamp.paddle.GradScaler(incr_ratio=np.float32(3.0), decr_ratio=jnp.float32(0.25))
  assert float(paddle.get_decr_ratio()) == 0.25


def _loss_with_config(p, x, config):
  return jnp.sum(p["w"] * x) * config[0]


def test_an_equal_static_argument_built_afresh_each_step_compiles_once():
  # A tuple made anew at every step is equal to the last one: no recompilation (which would
  # warn, and warnings are errors here), and the same result.
  wrapper = jaxamp.OptimWrapper(optax.sgd(0.1), {"w": jnp.ones(2)})
  for step in range(3):
    wrapper.update_params(_loss_with_config, jnp.ones(2), tuple([2.0, str(step // 10)]))
  np.testing.assert_allclose(wrapper.params["w"], [1.0 - 3 * 0.2] * 2, rtol=1e-6)
  from tests._tracing import trace_counts
  assert dict(trace_counts(wrapper)) == {"fused": 1}


def test_params_on_an_explicit_mesh_keep_their_sharding_through_a_step():
  from jax.sharding import AxisType, NamedSharding, PartitionSpec
  mesh = jax.make_mesh((1,), ("d",), axis_types=(AxisType.Explicit,))
  sharding = NamedSharding(mesh, PartitionSpec("d"))
  params = {"w": jax.device_put(jnp.ones(2), sharding)}
  wrapper = jaxamp.OptimWrapper(optax.inject_hyperparams(optax.sgd)(learning_rate=0.5), params)
  for _ in range(3):  # the same shardings at every step: one compilation
    wrapper.update_params(_sum_all, jnp.float32(1.0))
  assert wrapper.params["w"].sharding == sharding
  np.testing.assert_array_equal(wrapper.params["w"], [-0.5, -0.5])


# -- the gradients a scaler unscales and checks ---------------------------------------------------


class _Fp8Dense(nn.Module):
  """One fp8 layer without bias: an overflowing output gradient saturates in e5m2, so that the
  kernel's gradient stays finite and only the returned amax is inf."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, use_bias=False, dot_general_cls=functools.partial(
        fp8_ops.Fp8DirectDotGeneralOp, amax_history_length=4))(x)


def _fp8_loss(v, x):
  return jnp.mean(_Fp8Dense().apply(v, x) ** 2)


def _flax_sgd_on_unscaled(variables, grads, scale):
  """flax's TrainState with sgd(0.1) on the unscaled param gradients, the fp8 values as returned."""
  unscaled = {**grads, "params": jax.tree.map(lambda g: g / scale, grads["params"])}
  return flax_train_state.TrainState.create(
      apply_fn=None, params=variables, tx=optax.sgd(0.1)).apply_gradients(grads=unscaled).params


@pytest.mark.parametrize("unscale_first", [True, False])
@pytest.mark.parametrize("overflow", [False, True])
def test_unscale_checks_the_values_flax_fp8_layers_return_and_leaves_them_unscaled(overflow,
                                                                                 unscale_first):
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 8))
  variables = jax.jit(_Fp8Dense().init)(jax.random.PRNGKey(1), x)
  scale = 2.0**126 if overflow else 2.0**16  # 2**126: the output gradients overflow float32
  x = x * 1e6 if overflow else x
  grads = jax.jit(jax.grad(lambda v: scale * _fp8_loss(v, x)))(variables)
  returned = grads[OWG]["Dense_0"]["Fp8DirectDotGeneralOp_0"]
  assert np.isfinite(returned["output_grad_amax_history"][0]) != overflow
  assert np.all(np.isfinite(grads["params"]["Dense_0"]["kernel"]))  # saturated: finite
  wrapper = jaxamp.OptimWrapper(optax.sgd(0.1), variables)
  scaler = jaxamp.GradScaler(init_scale=scale)
  wrapper.backward(scaler.scale(_fp8_loss), x)
  if unscale_first:
    scaler.unscale_(wrapper)  # PyTorch's recipe: unscale (to clip, say), then step
  scaler.step(wrapper)  # (alone, it unscales, checks and steps in one call)
  scaler.update()
  if overflow:  # skipped, as for an inf gradient: nothing written, the scale backs off
    want, want_scale = variables, scale / 2
  else:  # flax's TrainState on the unscaled gradients, the fp8 values as returned
    want = _flax_sgd_on_unscaled(variables, grads, scale)
    want_scale = scale
  assert scaler.get_scale() == want_scale
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6), wrapper.params, want)


@pytest.mark.parametrize("overflow", [False, True])
def test_amp_optim_wrapper_skips_on_an_overflow_only_flax_fp8_layers_return(overflow):
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 8))
  variables = jax.jit(_Fp8Dense().init)(jax.random.PRNGKey(1), x)
  scale = 2.0**126 if overflow else 2.0**16
  x = x * 1e6 if overflow else x
  grads = jax.jit(jax.grad(lambda v: scale * _fp8_loss(v, x)))(variables)
  wrapper = jaxamp.AmpOptimWrapper(optax.sgd(0.1), variables,
                                   loss_scale=dict(init_scale=scale, growth_interval=100))
  wrapper.update_params(_fp8_loss, x)
  if overflow:  # skipped, fp8 values included; the scale backs off
    want, want_scale = variables, scale / 2
  else:
    want = _flax_sgd_on_unscaled(variables, grads, scale)
    want_scale = scale
  assert wrapper.get_scale() == want_scale
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6), wrapper.params, want)


def test_amp_optim_wrapper_keeps_flax_fp8_values_on_a_step_skipped_for_another_gradient():
  # An inf gradient outside the fp8 layer skips the step: the fp8 values it returned, finite,
  # are not written either (as every other variable).
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 8))
  variables = jax.jit(_Fp8Dense().init)(jax.random.PRNGKey(1), x)
  variables = {**variables, "params": {**variables["params"], "b": jnp.zeros((), jnp.float32)}}

  def loss(v, x, bad):
    return _fp8_loss(v, x) + v["params"]["b"] * jnp.where(bad, jnp.float32(jnp.inf),
                                                          jnp.float32(1.0))

  wrapper = jaxamp.AmpOptimWrapper(optax.sgd(0.1), variables, loss_scale=dict(init_scale=2.0**16))
  wrapper.update_params(loss, x, jnp.asarray(True))
  assert wrapper.get_scale() == 2.0**15
  jax.tree.map(np.testing.assert_array_equal, wrapper.params, variables)
  # The next, finite step writes the values it returns (a skip in the past does not stop it).
  returned = jax.jit(jax.grad(lambda v: 2.0**15 * loss(v, x, False)))(variables)[OWG]
  wrapper.update_params(loss, x, jnp.asarray(False))
  jax.tree.map(np.testing.assert_array_equal, wrapper.params[OWG], returned)


def test_a_holder_with_an_empty_gradient_tree_has_no_inf_checks_recorded():
  # PyTorch's step raises when no parameter has a gradient: an empty tree holds none either.
  scaler = jaxamp.GradScaler()
  scaler.scale(jnp.float32(1.0))
  opt = Holder({"w": jnp.ones(2)}, optax.sgd(1.0))
  opt.grads = {}
  with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
    scaler.step(opt)
  assert opt.applied == 0


def test_unscale_leaves_the_arrays_a_holder_without_donation_was_given_readable():
  scaler = jaxamp.GradScaler(init_scale=8.0)
  scaler.scale(jnp.float32(1.0))
  opt = Holder({"w": jnp.zeros(2)}, optax.sgd(1.0))
  scaled = {"w": jnp.array([8.0, -4.0])}
  opt.grads = scaled  # the holder has no `donate`: its gradients may be the user's arrays
  scaler.unscale_(opt)
  np.testing.assert_array_equal(opt.grads["w"], [1.0, -0.5])
  np.testing.assert_array_equal(scaled["w"], [8.0, -4.0])


def test_paddle_steps_float16_gradients_in_one_call():
  # Paddle's step accepts float16 gradients; the wrapper unscales, checks and applies at once.
  opt = jaxamp.OptimWrapper(optax.sgd(0.5), {"w": jnp.ones(2, jnp.float16)})
  scaler = jaxamp.paddle.GradScaler(init_loss_scaling=1024.0)
  loss = lambda p, x: jnp.sum(p["w"] * x).astype(jnp.float32)  # noqa: E731
  opt.backward(scaler.scale(loss), jnp.array([1.0, 2.0], jnp.float16))
  scaler.step(opt)
  scaler.update()
  assert opt.params["w"].dtype == jnp.float16
  np.testing.assert_array_equal(opt.params["w"], np.array([0.5, 0.0], np.float16))  # 1 - 0.5 * g


# -- the stall report of the facades -----------------------------------------------------------


def test_a_run_stalled_from_its_first_steps_is_reported_with_its_streak():
  # stall_after <= stall_check_every: the first read of the flag already finds the stall.
  with pytest.raises(jaxamp.StalledError, match=r"^2 consecutive steps were skipped"):
    _torch_loop(6, stall_after=2, stall_check_every=2, on_stall="raise")


def _stall_message(holders, grads, steps=4):
  """What a GradScaler reporting at once raises after ``steps`` iterations with ``grads``."""
  scaler = jaxamp.GradScaler(stall_after=1, stall_check_every=1, on_stall="raise")
  scaler.scale(jnp.float32(1.0))
  with pytest.raises(jaxamp.StalledError) as raised:
    for _ in range(steps):
      for holder, g in zip(holders, grads):
        holder.grads = g
        scaler.step(holder)
      scaler.update()
      jax.block_until_ready(scaler.state)  # the flag is read by the next update at the latest
  return str(raised.value)


@pytest.mark.parametrize("n", [8, 9])
def test_the_stall_report_accounts_for_every_bad_leaf_once(n):
  # The report names the bad leaves, or names some and counts the others: never one twice,
  # never a finite one, never "and 0 more".
  bad = {f"b{i}": jnp.array([jnp.nan]) for i in range(n)}
  holder = Holder({**bad, "ok": jnp.ones(1)}, optax.sgd(0.1))
  message = _stall_message([holder], [{**bad, "ok": jnp.ones(1)}])
  found = re.search(r"\(in (.*?)(?: and (\d+) more)?\), and lowering", message)
  assert found, message
  named = found.group(1).split(", ")
  more = 0 if found.group(2) is None else int(found.group(2))
  assert len(set(named)) == len(named) and set(named) <= {f"['{k}']" for k in bad}
  assert len(named) + more == n and (found.group(2) is None or more > 0)


def test_the_stall_report_tells_which_of_two_optimizers_held_the_bad_leaves():
  first, second = Holder({"w": jnp.ones(2)}, optax.sgd(0.1)), Holder({"w": jnp.ones(2)},
                                                                       optax.sgd(0.1))
  message = _stall_message([first, second], [{"w": jnp.ones(2)}, {"w": jnp.full(2, jnp.nan)}])
  assert "(in optimizer 1: ['w'])" in message


def test_the_stall_report_passes_over_integer_gradient_leaves():
  # A holder may keep integer state (a counter) among its parameters: never inf or nan.
  params = {"w": jnp.ones(2), "count": jnp.zeros(2, jnp.int32)}
  tx = optax.masked(optax.sgd(0.1), {"w": True, "count": False})
  message = _stall_message([Holder(params, tx)],
                           [{"w": jnp.array([jnp.nan, 1.0]), "count": jnp.ones(2, jnp.int32)}])
  assert "(in ['w'])" in message


def test_a_step_refused_for_an_object_without_gradients_leaves_the_stall_report_working():
  scaler = jaxamp.GradScaler(stall_after=1, stall_check_every=1, on_stall="raise")
  scaler.scale(jnp.float32(1.0))
  opt = Holder({"w": jnp.ones(2)}, optax.sgd(0.1))
  with pytest.raises(jaxamp.StalledError, match=r"\['w'\]"):
    for _ in range(4):
      with pytest.raises(AttributeError):
        scaler.step(object())  # not an optimizer holder: refused
      opt.grads = {"w": jnp.full(2, jnp.nan)}
      scaler.step(opt)
      scaler.update()
      jax.block_until_ready(scaler.state)


@pytest.mark.parametrize("make", [
    lambda **kw: jaxamp.GradScaler(**kw),
    lambda **kw: jaxamp.paddle.GradScaler(**kw),
    lambda **kw: jaxamp.AmpOptimWrapper(optax.sgd(0.1), {"w": jnp.ones(1)}, **kw),
])
def test_a_bad_stall_check_every_is_refused_by_its_name(make):
  with pytest.raises(ValueError, match=r"^stall_check_every must be an int >= 1, got 0"):
    make(stall_check_every=0)


@pytest.mark.parametrize("bad_steps", [2, 3])
def test_the_stall_flag_is_read_at_every_stall_check_every_th_update(bad_steps):
  # Read at updates 3, 6, ...: a stall over updates 1-2 has ended by the first read, one over
  # updates 1-3 is found there.
  scaler = jaxamp.GradScaler(stall_after=1, stall_check_every=3, on_stall="raise")
  scaler.scale(jnp.float32(1.0))
  opt = Holder({"w": jnp.ones(2)}, optax.sgd(0.1))
  reported = False
  for i in range(7):
    opt.grads = {"w": jnp.full(2, jnp.nan if i < bad_steps else 1.0)}
    scaler.step(opt)
    try:
      scaler.update()
    except jaxamp.StalledError:
      reported = True
      break
    jax.block_until_ready(scaler.state)  # the flag kept is computed by the next update
  assert reported == (bad_steps == 3)


# -- the static arguments of a loss call, and the warning that every iteration compiles ----------


def _dot_loss(p, x):
  return jnp.sum(p["w"] * x)


@pytest.mark.parametrize("scaled", [False, True])
def test_a_loss_written_inside_the_loop_warns_once_that_every_iteration_compiles(scaled):
  opt = jaxamp.OptimWrapper(optax.sgd(0.1), {"w": jnp.ones(2)})
  scaler = jaxamp.GradScaler()
  with pytest.warns(RuntimeWarning, match="every iteration compiles") as caught:
    for step in range(4):
      batch = jnp.ones(2) * (1.0 + step)
      if scaled:  # opt.backward(scaler.scale(lambda ...)): the batch is closed over
        opt.zero_grad()
        opt.backward(scaler.scale(lambda p: _dot_loss(p, batch)))
        scaler.step(opt)
        scaler.update()
      else:  # no argument at all: only the parameters are traced
        opt.update_params(lambda p: _dot_loss(p, batch))
  assert len(caught) == 1


def _weighted(weight):
  return lambda p, x: weight * _dot_loss(p, x)


def test_losses_one_factory_makes_over_different_values_do_not_warn():
  # Each is made once, outside the loop: each compiles once (filterwarnings = error).
  from tests._tracing import trace_counts
  opt = jaxamp.OptimWrapper(optax.sgd(0.1), {"w": jnp.zeros(2)})
  losses = [_weighted(1.0), _weighted(2.0)]
  for step in range(4):
    opt.update_params(losses[step % 2], jnp.ones(2))
  np.testing.assert_allclose(opt.params["w"], [-0.6, -0.6], rtol=1e-6)  # -0.1 * (1 + 2 + 1 + 2)
  assert trace_counts(opt)["fused"] == 2


@dataclasses.dataclass
class _Config:
  """A configuration object: a dataclass with eq and not frozen is unhashable."""

  weight: float


def _config_loss(p, x, config):
  return config.weight * _dot_loss(p, x)


def test_an_unhashable_static_argument_is_told_apart_by_identity():
  from tests._tracing import trace_counts
  opt = jaxamp.OptimWrapper(optax.sgd(0.1), {"w": jnp.zeros(2)})
  config = _Config(1.0)
  for _ in range(2):  # the same object: one compilation
    opt.update_params(_config_loss, jnp.ones(2), config)
  assert trace_counts(opt)["fused"] == 1
  config.weight = 2.0
  # A new object runs with its own values, even where an object seen before now equals it.
  opt.update_params(_config_loss, jnp.ones(2), _Config(2.0))
  np.testing.assert_allclose(opt.params["w"], [-0.4, -0.4], rtol=1e-6)  # -0.1 * (1 + 1 + 2)


class _Table:
  """A static argument hashed by its name and compared by its values, which may fail."""

  def __init__(self, name, values):
    self.name, self.values = name, np.asarray(values, np.float32)

  def __hash__(self):
    return hash(self.name)

  def __eq__(self, other):
    if self.values.shape != other.values.shape:
      raise ValueError("tables of different shapes cannot be compared")
    return bool(np.all(self.values == other.values))


def _table_loss(p, x, table):
  return float(table.values.sum()) * _dot_loss(p, x)


def test_a_static_argument_whose_comparison_fails_is_a_new_one():
  opt = jaxamp.OptimWrapper(optax.sgd(0.1), {"w": jnp.zeros(2)})
  opt.update_params(_table_loss, jnp.ones(2), _Table("t", [1.0]))
  opt.update_params(_table_loss, jnp.ones(2), _Table("t", [1.0, 2.0]))  # its own values
  np.testing.assert_allclose(opt.params["w"], [-0.4, -0.4], rtol=1e-6)  # -0.1 * (1 + 3)


def test_initialize_count_status_names_the_argument_that_is_not_an_int():
  wrapper = jaxamp.OptimWrapper(optax.sgd(0.1), {"w": jnp.ones(2)}, accumulative_counts=2)
  with pytest.raises(TypeError, match=r"^init_counts must be an int, got 1\.5"):
    wrapper.initialize_count_status(None, 1.5, 10)
  with pytest.raises(TypeError, match=r"^max_counts must be an int, got True"):
    wrapper.initialize_count_status(None, 0, True)


def test_backward_all_with_a_scaled_loss_runs_the_gradient_penalty_recipe():
  wrappers = jaxamp.OptimWrapperDict(a=jaxamp.OptimWrapper(optax.sgd(0.1), {"w": jnp.ones(2)}),
                                     b=jaxamp.OptimWrapper(optax.sgd(0.1), {"v": jnp.ones(1)}))
  scaler = jaxamp.GradScaler(init_scale=4.0)
  x = jnp.array([1.0, 2.0])

  def loss(ps, x):
    # PyTorch's gradient penalty: scaled inner gradients, unscaled by the scale of this call.
    g = jax.grad(scaler.scale(lambda p: jnp.sum(p["a"]["w"] ** 2 * x)))(ps)["a"]["w"]
    g = g / scaler.get_scale()
    return jnp.sum(ps["a"]["w"] * x) + 3.0 * jnp.sum(ps["b"]["v"]) + jnp.sum(g ** 2)

  out = wrappers.backward_all(scaler.scale(loss), x)
  assert float(out) == 26.0  # 3 + 3 + |2 w x|^2, not scaled
  # d/dw (w . x + 4 |w x|^2) = x + 8 w x^2 = [9, 34], times the scale 4.
  np.testing.assert_allclose(wrappers["a"].grads["w"], [36.0, 136.0], rtol=1e-6)
  np.testing.assert_allclose(wrappers["b"].grads["v"], [12.0], rtol=1e-6)


@pytest.mark.parametrize("member", ["inner_count", "grads", "optimizer", "params"])
def test_optim_wrapper_dict_members_of_one_wrapper_say_which_to_read(member):
  two = jaxamp.OptimWrapperDict(gen=jaxamp.OptimWrapper(optax.sgd(0.1), {"w": jnp.ones(2)}),
                                disc=jaxamp.OptimWrapper(optax.sgd(0.1), {"w": jnp.ones(2)}))
  with pytest.raises(AttributeError, match=re.escape(f"(read wrappers['gen'].{member})")):
    getattr(two, member)
  one = jaxamp.OptimWrapperDict(disc=jaxamp.OptimWrapper(optax.sgd(0.1), {"w": jnp.ones(2)}))
  with pytest.raises(AttributeError, match=re.escape(f"(read wrappers['disc'].{member})")):
    getattr(one, member)
  with pytest.raises(AttributeError, match=re.escape(f"(read wrapper.{member})")):
    getattr(jaxamp.OptimWrapperDict(), member)
  assert not hasattr(two, member)
  assert "each wrapper" in help_text(getattr(jaxamp.OptimWrapperDict, member))


@pytest.mark.parametrize("method", ["update_params", "backward", "step", "apply_gradients"])
def test_optim_wrapper_dict_per_wrapper_methods_are_documented_as_such(method):
  wrappers = jaxamp.OptimWrapperDict(gen=jaxamp.OptimWrapper(optax.sgd(0.1), {"w": jnp.ones(2)}))
  with pytest.raises(NotImplementedError, match=f"`{method}` should be called by each optimizer"):
    getattr(wrappers, method)()
  assert "each wrapper" in help_text(getattr(jaxamp.OptimWrapperDict, method))


def help_text(obj):
  import pydoc
  return pydoc.render_doc(obj, renderer=pydoc.plaintext)


def test_optim_wrapper_dict_repr_lists_each_named_wrapper():
  gen = jaxamp.OptimWrapper(optax.sgd(0.1), {"w": jnp.ones(2)})
  disc = jaxamp.OptimWrapper(optax.sgd(0.1), {"w": jnp.ones(3)})
  assert repr(jaxamp.OptimWrapperDict(gen=gen, disc=disc)) == (
      "name: gen\n" + repr(gen) + "name: disc\n" + repr(disc))
  assert repr(jaxamp.OptimWrapperDict()) == ""



def test_params_on_an_auto_mesh_keep_their_sharding_through_steps():
  from jax.sharding import NamedSharding, PartitionSpec
  from tests._tracing import trace_counts
  mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  sharding = NamedSharding(mesh, PartitionSpec("d"))
  wrapper = jaxamp.OptimWrapper(optax.sgd(0.5, momentum=0.9),
                                {"w": jax.device_put(jnp.ones(2), sharding)})
  for _ in range(3):
    wrapper.update_params(_sum_all, jnp.float32(1.0))
  assert wrapper.params["w"].sharding == sharding
  assert dict(trace_counts(wrapper)) == {"fused": 1}  # the same shardings at every step
  np.testing.assert_allclose(wrapper.params["w"], [1.0 - 0.5 * (1 + 1.9 + 2.71)] * 2, rtol=1e-6)
  # Gradients of a contraction over a batch sharded along the parameter's axis come back
  # replicated from jax.grad; the wrapper's gradients keep the parameter's sharding.
  x = jax.device_put(jnp.ones((8, 2)), NamedSharding(mesh, PartitionSpec("d", None)))
  wrapper.zero_grad()
  wrapper.backward(lambda p, x: jnp.sum(x @ p["w"]), x)
  assert wrapper.grads["w"].sharding == sharding
  np.testing.assert_array_equal(wrapper.grads["w"], [8.0, 8.0])


def test_the_state_of_a_parameter_off_the_mesh_stays_with_it():
  from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding
  mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  params = {"w": jax.device_put(jnp.ones(2), NamedSharding(mesh, PartitionSpec("d"))),
            "b": jnp.ones(3)}
  wrapper = jaxamp.OptimWrapper(optax.sgd(0.5, momentum=0.9), params)
  trace = [leaf for leaf in jax.tree.leaves(wrapper.opt_state) if leaf.shape == (3,)]
  assert len(trace) == 1 and isinstance(trace[0].sharding, SingleDeviceSharding)
  wrapper.update_params(_sum_all, jnp.float32(1.0))  # steps with both placements
  np.testing.assert_allclose(wrapper.params["b"], [0.5] * 3)
  np.testing.assert_allclose(wrapper.params["w"], [0.5] * 2)


@pytest.mark.parametrize("norm_type, norm", [(1, 7.0), ("inf", 4.0), (2.0, 5.0)])
def test_clip_grad_norm_uses_the_configured_norm_type(norm_type, norm):
  wrapper = jaxamp.build_optim_wrapper({"w": jnp.zeros(2)}, dict(
      optimizer=dict(type="SGD", lr=1.0), clip_grad=dict(max_norm=1.0, norm_type=norm_type)))
  wrapper.update_params(lambda p, g: jnp.sum(p["w"] * g), jnp.array([3.0, 4.0]))
  # torch.nn.utils.clip_grad_norm_: the gradients [3, 4] times max_norm / their norm.
  np.testing.assert_allclose(wrapper.params["w"], [-3.0 / norm, -4.0 / norm], rtol=1e-6)


def test_clip_grad_errors_name_the_entry_at_fault():
  params = {"w": jnp.zeros(2)}
  with pytest.raises(AssertionError, match=r"^If `clip_grad` is not None, it should be a `dict`"):
    jaxamp.OptimWrapper(optax.sgd(0.1), params, clip_grad=[1.0])
  with pytest.raises(ValueError, match=r"^clip_grad\['max_norm'\] must be a number >= 0"):
    jaxamp.OptimWrapper(optax.sgd(0.1), params, clip_grad=dict(max_norm=-1.0))
  with pytest.raises(ValueError, match=r"^clip_grad\['clip_value'\] must be a number >= 0"):
    jaxamp.OptimWrapper(optax.sgd(0.1), params, clip_grad=dict(type="value", clip_value=-1.0))
  with pytest.raises(TypeError, match=r"^error_if_nonfinite must be a bool, got 'yes'"):
    jaxamp.OptimWrapper(optax.sgd(0.1), params,
                        clip_grad=dict(max_norm=1.0, error_if_nonfinite="yes"))


def test_a_param_group_is_a_mapping_of_its_keys_before_and_after_a_load():
  wrapper = jaxamp.build_optim_wrapper({"w": jnp.zeros(2)}, dict(
      optimizer=dict(type="SGD", lr=0.1, momentum=0.9)))
  group = wrapper.param_groups[0]
  group["initial_lr"] = 0.1
  keys = list(group)
  assert len(group) == len(keys) == len(set(keys)) and keys[0] == "params"
  assert "lr" in keys and "initial_lr" in keys
  assert repr(group) == f"ParamGroup({dict(group)!r})" and "'params': ['w']" in repr(group)
  with pytest.raises(ValueError, match="'params' of a parameter group cannot be changed"):
    group["params"] = ["v"]
  assert group["params"] == ["w"] and list(group) == keys
  wrapper.load_state_dict(wrapper.state_dict())  # the saved group's names are no extra entry
  assert list(group) == keys and len(group) == len(keys)


def test_param_group_entries_load_and_groups_of_unknown_leaves_list_none():
  def build():
    return jaxamp.build_optim_wrapper({"w": jnp.zeros(2)}, dict(optimizer=dict(type="SGD", lr=0.1)))
  saved = build()
  saved.param_groups[0]["initial_lr"] = 0.05
  fresh = build()
  fresh.load_state_dict(saved.state_dict())
  assert fresh.param_groups[0]["initial_lr"] == 0.05
  # Two injected optimizers: which leaves each group holds is not known.
  tx = optax.multi_transform({"a": optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
                              "b": optax.inject_hyperparams(optax.sgd)(learning_rate=0.2)},
                             {"a": "a", "b": "b"})
  wrapper = jaxamp.OptimWrapper(tx, {"a": jnp.zeros(2), "b": jnp.zeros(3)})
  assert [group["params"] for group in wrapper.optimizer.param_groups] == [None, None]
  assert wrapper.get_lr()["lr"] == pytest.approx([0.1, 0.2])


def test_tree_errors_name_the_leaf_and_show_the_structure_up_to_300_characters():
  with pytest.raises(TypeError, match=r"^params leaf <root> has dtype int32"):
    jaxamp.OptimWrapper(optax.sgd(0.1), jnp.zeros(2, jnp.int32))
  with pytest.raises(TypeError, match=r"^params leaf \['b'\] has dtype int32"):
    jaxamp.OptimWrapper(optax.sgd(0.1), {"a": jnp.zeros(2), "b": jnp.zeros(2, jnp.int32)})
  base = len(str(jax.tree.structure({"": 0})))
  for size in (base + 1, 300, 301, 500):  # the length of the structure's text
    params = {"k" * (size - base): jnp.zeros(2)}
    text = str(jax.tree.structure(params))
    assert len(text) == size
    wrapper = jaxamp.OptimWrapper(optax.sgd(0.1), params)
    shown = text if len(text) <= 300 else text[:300] + "..."
    with pytest.raises(ValueError) as info:
      wrapper.params = [jnp.zeros(2)]
    assert f"expected {shown}, got " in str(info.value)


def test_a_loaded_optimizer_state_is_placed_where_the_parameters_are():
  from jax.sharding import NamedSharding, PartitionSpec
  mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  sharding = NamedSharding(mesh, PartitionSpec("d"))
  wrapper = jaxamp.OptimWrapper(optax.sgd(0.5, momentum=0.9),
                                {"w": jax.device_put(jnp.ones(2), sharding)})
  saved = wrapper.state_dict()
  for leaves in (jax.tree.map(np.asarray, saved["state"]),  # numpy, and single-device arrays
                 jax.tree.map(lambda x: jnp.asarray(np.asarray(x)) + 1, saved["state"])):
    wrapper.load_state_dict(dict(saved, state=leaves))
    for got, want in zip(jax.tree.leaves(wrapper.opt_state), jax.tree.leaves(leaves)):
      if np.ndim(want) == 1:
        assert got.sharding == sharding
      np.testing.assert_array_equal(got, want)


def test_param_names_drop_a_variables_value_attribute_but_name_the_root():
  from flax import struct

  @struct.dataclass
  class Var:  # a variable box, as Flax's: its leaf is its value attribute
    value: jax.Array

  @struct.dataclass
  class RawVar:
    raw_value: jax.Array

  def names(params):
    sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    return jaxamp.OptimWrapper(sgd, params).param_groups[0]["params"]

  assert names(jnp.zeros(2)) == ["<root>"]
  assert names(Var(jnp.zeros(2))) == ["value"]  # a bare box at the root keeps its attribute
  assert names({"a": Var(jnp.zeros(2)), "b": {"c": RawVar(jnp.zeros(2))}}) == ["a", "b.c"]


def test_numpy_params_set_on_a_wrapper_go_where_the_parameters_are():
  from jax.sharding import NamedSharding, PartitionSpec
  mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  sharding = NamedSharding(mesh, PartitionSpec("d"))
  wrapper = jaxamp.OptimWrapper(optax.sgd(0.5), {"w": jax.device_put(jnp.ones(2), sharding)})
  wrapper.params = {"w": np.array([2.0, 3.0], np.float32)}
  assert wrapper.params["w"].sharding == sharding
  np.testing.assert_array_equal(wrapper.params["w"], [2.0, 3.0])


# -- loss functions wrapped by scaler.scale and scale_loss ----------------------------------------


def _weighted_loss(p, x, *, weight):
  return weight * _dot_loss(p, x), {"weight": weight}


@pytest.mark.parametrize("make", [lambda: jaxamp.GradScaler(init_scale=4.0),
                                  lambda: jaxamp.paddle.GradScaler(init_loss_scaling=4.0)],
                         ids=["torch", "paddle"])
def test_a_scaled_loss_function_takes_keyword_arguments_and_scales_only_the_loss(make):
  scaled = make().scale(_weighted_loss, has_aux=True)
  grads, aux = jax.grad(scaled, has_aux=True)({"w": jnp.ones(2)}, jnp.array([1.0, 2.0]), weight=3.0)
  np.testing.assert_allclose(grads["w"], [12.0, 24.0])  # 4 * 3 * x
  assert aux == {"weight": 3.0}


def test_a_divided_loss_function_takes_keyword_arguments_and_divides_only_the_loss():
  opt = jaxamp.OptimWrapper(optax.sgd(0.1), {"w": jnp.ones(2)}, accumulative_counts=4)
  loss, aux = opt.scale_loss(_weighted_loss)({"w": jnp.ones(2)}, jnp.array([1.0, 2.0]), weight=2.0)
  assert float(loss) == 1.5 and aux == {"weight": 2.0}  # 2 * 3 / 4


def test_a_divided_scaled_loss_follows_the_scale_as_it_changes():
  opt = jaxamp.OptimWrapper(optax.sgd(0.1), {"w": jnp.zeros(2)}, accumulative_counts=2)
  scaler = jaxamp.GradScaler(init_scale=4.0)
  for scale in (4.0, 16.0):
    opt.zero_grad()
    opt.backward(opt.scale_loss(scaler.scale(_dot_loss)), jnp.ones(2))
    np.testing.assert_allclose(opt.grads["w"], [scale / 2] * 2)
    scaler.update(16.0)


def test_a_scaled_divided_loss_divides_the_last_short_window_by_its_own_size():
  opt = jaxamp.OptimWrapper(optax.sgd(0.1), {"w": jnp.zeros(2)}, accumulative_counts=2)
  opt.initialize_count_status(None, 0, 3)  # windows of 2 calls, then of 1
  scaler = jaxamp.GradScaler(init_scale=4.0)
  for factor in (2.0, 2.0, 1.0):
    opt.zero_grad()
    opt.backward(scaler.scale(opt.scale_loss(_dot_loss)), jnp.ones(2))
    np.testing.assert_allclose(opt.grads["w"], [4.0 / factor] * 2)


def test_divided_loss_functions_are_equal_when_they_wrap_the_same_function():
  opt = jaxamp.OptimWrapper(optax.sgd(0.1), {"w": jnp.zeros(2)})
  f, g = opt.scale_loss(_dot_loss), opt.scale_loss(_dot_loss)
  assert f == g and hash(f) == hash(g)
  assert f != opt.scale_loss(_weighted_loss)
  assert f != jaxamp.GradScaler().scale(_dot_loss)  # not the same kind of wrapper


@pytest.mark.parametrize("dtype, want", [(jnp.float16, jnp.float32), (jnp.float32, jnp.float32),
                                         (jnp.float64, jnp.float64)])
def test_a_divided_loss_keeps_its_precision_with_64_bit_floats_on(dtype, want):
  from tests._floats import enable_x64
  opt = jaxamp.OptimWrapper(optax.sgd(0.1), {"w": jnp.zeros(2)}, accumulative_counts=4)
  divided = opt.scale_loss(lambda p: jnp.asarray(3.0, dtype))
  with enable_x64():
    loss = divided({"w": jnp.zeros(2)})
  assert loss.dtype == want and float(loss) == 0.75


def _half_loss(p, x):
  return _dot_loss(p, x).astype(jnp.float16)


def test_a_half_precision_loss_is_divided_in_float32_under_strict_promotion():
  # conftest sets jax_numpy_dtype_promotion=strict, where float16 and float32 do not mix implicitly.
  opt = jaxamp.OptimWrapper(optax.sgd(1.0), {"w": jnp.zeros(2)}, accumulative_counts=2)
  loss = opt.scale_loss(_half_loss)({"w": jnp.ones(2)}, jnp.array([1.0, 2.0]))
  assert loss.dtype == jnp.float32 and float(loss) == 1.5
  opt.update_params(_half_loss, jnp.array([1.0, 2.0]))
  opt.update_params(_half_loss, jnp.array([1.0, 2.0]))
  np.testing.assert_allclose(opt.params["w"], [-1.0, -2.0])  # the mean of the window's gradients


# -- the scalers' device state, read by jaxamp's state queries ------------------------------------


@pytest.mark.parametrize("make", [lambda: jaxamp.GradScaler(init_scale=4.0),
                                  lambda: jaxamp.paddle.GradScaler(init_loss_scaling=4.0)],
                         ids=["torch", "paddle"])
def test_a_scaler_state_passes_validation_and_skip_report_refuses_to_name_leaves(make):
  scaler = make()
  assert jaxamp.validate_opt_state(scaler.state) is scaler.state
  # The facades do not flag leaves (their stall report does): no silent "no bad leaves".
  with pytest.raises(ValueError, match="counts 0"):
    jaxamp.skip_report(scaler.state, {"w": jnp.ones(2)})


def test_an_infinite_growth_factor_is_refused_by_its_name():
  with pytest.raises(ValueError, match="growth_factor must be finite, got inf"):
    jaxamp.GradScaler(growth_factor=float("inf"))
  scaler = jaxamp.paddle.GradScaler()
  with pytest.raises(ValueError, match="new_incr_ratio must be finite, got inf"):
    scaler.set_incr_ratio(float("inf"))
  assert scaler.get_incr_ratio() == 2.0  # a refused call leaves the scaler unchanged


@pytest.mark.parametrize("make", [lambda: jaxamp.GradScaler(init_scale=4.0),
                                  lambda: jaxamp.paddle.GradScaler(init_loss_scaling=4.0)],
                         ids=["torch", "paddle"])
def test_a_state_dict_with_missing_or_foreign_keys_is_refused_by_the_argument_name(make):
  scaler = make()
  saved = scaler.state_dict()
  with pytest.raises(KeyError, match=r"state_dict lacks the keys \['scale'\]"):
    scaler.load_state_dict({k: v for k, v in saved.items() if k != "scale"})
  with pytest.raises(ValueError, match=r"state_dict has unexpected keys \['lr'\]"):
    scaler.load_state_dict({**saved, "lr": 0.1})
  assert float(scaler.state.scale) == 4.0  # a refused load leaves the scaler unchanged


def test_a_traced_loss_scaling_factor_is_refused_as_one():
  msg = "growth_factor must be a real number: .*loss-scaling hyperparameters select code"
  with pytest.raises(TypeError, match=msg):
    jax.jit(lambda r: jaxamp.GradScaler(growth_factor=r))(jnp.float32(3.0))
  scaler = jaxamp.paddle.GradScaler()
  with pytest.raises(TypeError, match="new_incr_ratio must be a real number: .*loss-scaling"):
    jax.jit(scaler.set_incr_ratio)(jnp.float32(3.0))


def test_adam_betas_and_rmsprop_alpha_read_back_as_written_and_bad_ones_are_refused():
  adam = jaxamp.build_optim_wrapper({"w": jnp.ones(2)},
                                    dict(optimizer=dict(type="Adam", lr=0.1, betas=(0.8, 0.95))))
  assert adam.param_groups[0]["betas"] == pytest.approx((0.8, 0.95))
  adam.param_groups[0]["betas"] = (0.7, 0.9)
  assert adam.param_groups[0]["betas"] == pytest.approx((0.7, 0.9))
  with pytest.raises(TypeError, match="betas must be a pair of numbers"):
    adam.param_groups[0]["betas"] = (0.7, 0.9, 0.99)
  with pytest.raises(ValueError, match=r"betas\[1\]"):
    adam.param_groups[0]["betas"] = (0.7, float("nan"))
  assert adam.param_groups[0]["betas"] == pytest.approx((0.7, 0.9))
  rms = jaxamp.build_optim_wrapper({"w": jnp.ones(2)},
                                   dict(optimizer=dict(type="RMSprop", lr=0.1, alpha=0.9)))
  assert rms.param_groups[0]["alpha"] == pytest.approx(0.9)
  rms.param_groups[0]["alpha"] = 0.8
  assert rms.param_groups[0]["alpha"] == pytest.approx(0.8)
  with pytest.raises(ValueError, match="alpha"):
    rms.param_groups[0]["alpha"] = float("inf")


# -- hyperparameters written and read through param_groups ----------------------------------------


def _torch_adam(grads, lr, b1, b2, eps=1e-8):
  """PyTorch's Adam on one scalar starting at 1, in float64 (optax's adam is the same rule)."""
  p, m, v = 1.0, 0.0, 0.0
  for t, g in enumerate(grads, 1):
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    p -= lr / (1 - b1**t) * m / (np.sqrt(v) / np.sqrt(1 - b2**t) + eps)
  return p


def _torch_rmsprop(grads, lr, alpha, eps=1e-8):
  """PyTorch's RMSprop (no momentum, not centered) on one scalar starting at 1, in float64."""
  p, v = 1.0, 0.0
  for g in grads:
    v = alpha * v + (1 - alpha) * g * g
    p -= lr * g / (np.sqrt(v) + eps)
  return p


_GRADS = [1.0, 0.1, 0.5]  # changing gradients: the betas and alpha change every step


def _lion(grads, lr, b1, b2):
  """optax's lion (no weight decay) on one scalar starting at 1, in float64."""
  p, m = 1.0, 0.0
  for g in grads:
    p -= lr * np.sign(b1 * m + (1 - b1) * g)
    m = b2 * m + (1 - b2) * g
  return p


def test_betas_written_through_a_param_group_drive_the_next_steps():
  adam = jaxamp.build_optim_wrapper({"w": jnp.ones(1)}, dict(optimizer=dict(type="Adam", lr=0.1)))
  adam.param_groups[0]["betas"] = (0.6, 0.8)
  for g in _GRADS:
    adam.update_params(_linear, jnp.float32(g))
  np.testing.assert_allclose(float(adam.params["w"][0]), _torch_adam(_GRADS, 0.1, 0.6, 0.8),
                             rtol=1e-5)
  # An injected optax optimizer's b1 and b2 read as betas. (Lion: optax's adam with injected
  # betas takes b1 ** count, which mixes float32 and int32 and needs standard promotion.)
  lion = jaxamp.OptimWrapper(
      optax.inject_hyperparams(optax.lion)(learning_rate=0.1, weight_decay=0.0),
      {"w": jnp.ones(1)})
  lion.param_groups[0]["betas"] = (0.6, 0.8)
  grads = [1.0, -0.1, -0.2, -0.5]  # the signs of the updates tell (0.6, 0.8) from other betas
  for g in grads:
    lion.update_params(_linear, jnp.float32(g))
  np.testing.assert_allclose(float(lion.params["w"][0]), _lion(grads, 0.1, 0.6, 0.8), rtol=1e-5)


def test_rmsprop_alpha_written_through_a_param_group_drives_the_next_steps():
  wrapper = jaxamp.build_optim_wrapper({"w": jnp.ones(1)},
                                       dict(optimizer=dict(type="RMSprop", lr=0.01)))
  wrapper.param_groups[0]["alpha"] = 0.8
  for g in _GRADS:
    wrapper.update_params(_linear, jnp.float32(g))
  np.testing.assert_allclose(float(wrapper.params["w"][0]), _torch_rmsprop(_GRADS, 0.01, 0.8),
                             rtol=1e-5)


def test_param_groups_read_the_hyperparameters_a_loaded_state_holds():
  # Groups saved without their betas/alpha: the loaded optax state holds the saved values, and
  # param_groups read them from there (not the values this wrapper was built with).
  for cfg, key, saved_value in [(dict(type="Adam", lr=0.1, betas=(0.6, 0.8)), "betas", (0.6, 0.8)),
                                (dict(type="RMSprop", lr=0.1, alpha=0.7), "alpha", 0.7)]:
    saved = jaxamp.build_optim_wrapper({"w": jnp.ones(2)}, dict(optimizer=cfg))
    state_dict = saved.state_dict()
    del state_dict["param_groups"][0][key]
    fresh = jaxamp.build_optim_wrapper({"w": jnp.ones(2)},
                                       dict(optimizer=dict(type=cfg["type"], lr=0.1)))
    fresh.load_state_dict(state_dict)
    assert fresh.param_groups[0][key] == pytest.approx(saved_value)


@pytest.mark.parametrize("cfg, key", [(dict(type="SGD", lr=0.1, momentum=0.9), "lr"),
                                      (dict(type="SGD", lr=0.1, momentum=0.9), "momentum"),
                                      (dict(type="Adam", lr=0.1), "eps"),
                                      (dict(type="RMSprop", lr=0.1), "alpha")])
def test_a_negative_hyperparameter_written_later_is_refused_as_at_construction(cfg, key):
  with pytest.raises(ValueError):  # PyTorch's constructors refuse it
    jaxamp.build_optim_wrapper({"w": jnp.ones(2)}, dict(optimizer=dict(cfg, **{key: -0.5})))
  wrapper = jaxamp.build_optim_wrapper({"w": jnp.ones(2)}, dict(optimizer=cfg))
  before = wrapper.param_groups[0][key]
  with pytest.raises(ValueError, match=rf"^param_groups\[0\]\['{key}'\]: .*>= 0, got -0.5"):
    wrapper.param_groups[0][key] = -0.5
  assert wrapper.param_groups[0][key] == before


def _sgd_with_b1(learning_rate, b1):
  """An optax optimizer whose hyperparameters include a b1 but no b2."""
  return optax.sgd(learning_rate, momentum=b1)


def test_an_injected_optax_optimizer_lists_its_scalar_hyperparameters_by_pytorch_names():
  adam = jaxamp.OptimWrapper(optax.inject_hyperparams(optax.adam)(learning_rate=0.1),
                             {"w": jnp.ones(2)})
  group = adam.param_groups[0]
  assert set(group) == {"params", "lr", "betas", "eps", "eps_root"}  # b1, b2 read as betas
  assert group["lr"] == pytest.approx(0.1) and group["betas"] == pytest.approx((0.9, 0.999))
  # A b1 without a b2 is no pair: it keeps its optax name.
  sgd = jaxamp.OptimWrapper(optax.inject_hyperparams(_sgd_with_b1)(learning_rate=0.1, b1=0.5),
                            {"w": jnp.ones(2)})
  assert dict(sgd.param_groups[0]) == {"params": ["w"], "lr": 0.1, "b1": 0.5}
  sgd.update_params(_linear, jnp.float32(1.0))
  sgd.param_groups[0]["b1"] = 0.25
  sgd.update_params(_linear, jnp.float32(1.0))  # momentum 0.25: the buffer goes 1, 1.25
  np.testing.assert_allclose(sgd.params["w"], [1.0 - 0.1 * (1.0 + 1.25)] * 2, rtol=1e-6)
  # A hyperparameter given per coordinate is no group entry; the state still saves and loads.
  decay = jnp.array([0.0, 0.5])
  adamw = jaxamp.OptimWrapper(
      optax.inject_hyperparams(optax.adamw)(learning_rate=0.1, weight_decay=decay),
      {"w": jnp.ones(2)})
  assert "weight_decay" not in adamw.param_groups[0]
  adamw.load_state_dict(adamw.state_dict())
  np.testing.assert_array_equal(adamw.opt_state.hyperparams["weight_decay"], [0.0, 0.5])


def test_a_hyperparameter_written_between_steps_compiles_nothing_again():
  from jax.sharding import AxisType, NamedSharding, PartitionSpec
  from tests._floats import enable_x64
  from tests._tracing import trace_counts
  mesh = jax.make_mesh((1,), ("d",), axis_types=(AxisType.Explicit,))
  on_mesh = {"w": jax.device_put(jnp.ones(2), NamedSharding(mesh, PartitionSpec("d")))}
  # On an explicit mesh (placements are part of the traced types), and with 64-bit floats on
  # (a Python float would be float64 there): the written value keeps the state's placement and
  # dtype, so the step is traced once.
  for params, x64 in [(on_mesh, False), ({"w": jnp.ones(2, jnp.float32)}, True)]:
    with enable_x64(x64):
      wrapper = jaxamp.build_optim_wrapper(params, dict(optimizer=dict(type="SGD", lr=0.5)))
      wrapper.update_params(_linear, jnp.float32(1.0))
      wrapper.param_groups[0]["lr"] = 0.25
      wrapper.update_params(_linear, jnp.float32(1.0))
      assert dict(trace_counts(wrapper)) == {"fused": 1}
      np.testing.assert_allclose(wrapper.params["w"], [0.25, 0.25])


# -- the parameter and state trees users hand to a wrapper ----------------------------------------


def test_numpy_params_given_to_a_wrapper_are_copied_to_the_device():
  for make in (lambda p: jaxamp.OptimWrapper(optax.sgd(0.5), p),
               lambda p: jaxamp.build_optim_wrapper(p, dict(optimizer=dict(type="SGD", lr=0.5)))):
    mine = np.ones(2, np.float32)
    wrapper = make({"w": mine})
    mine[:] = 7.0  # the caller's array is the caller's own
    assert isinstance(wrapper.params["w"], jax.Array)
    np.testing.assert_array_equal(wrapper.params["w"], [1.0, 1.0])
    wrapper.params = {"w": mine}  # so is one given to the setter
    mine[:] = 3.0
    np.testing.assert_array_equal(wrapper.params["w"], [7.0, 7.0])


def test_a_loaded_state_casts_numbers_only_and_refuses_other_leaves_by_name():
  wrapper = jaxamp.OptimWrapper(optax.adam(0.1), {"w": jnp.ones(2)})
  saved = wrapper.state_dict()
  adam, empty = saved["state"]

  def load(count):
    wrapper.load_state_dict(dict(saved, state=(adam._replace(count=count), empty)))

  load(np.int64(5))  # a number (Python or numpy scalar) is cast to the leaf's dtype
  assert wrapper.opt_state[0].count.dtype == jnp.int32 and int(wrapper.opt_state[0].count) == 5
  # An array is loaded in its leaf's dtype only, a float is no count, and a string no array.
  with pytest.raises(ValueError, match=r"\.count must have shape \(\) and dtype int32, got shape "
                                       r"\(\) and dtype int64"):
    load(np.asarray(6, np.int64))
  with pytest.raises(ValueError, match=r"\.count must have shape \(\) and dtype int32, got shape "
                                       r"\(\) and dtype float64"):
    load(6.0)
  with pytest.raises(TypeError, match=r"\.count must be an array, got str"):
    load("6")
  assert int(wrapper.opt_state[0].count) == 5  # the refused loads changed nothing


def test_an_optimizer_whose_init_returns_numpy_arrays_loads_a_saved_state():
  # optax allows any arrays in a state: this one starts as numpy, and leaves each step on the device.
  def init(params):
    del params
    return {"seen": np.zeros([], np.int32)}

  def update(updates, state, params=None):
    del params
    return jax.tree.map(lambda g: -0.1 * g, updates), {"seen": state["seen"] + 1}

  wrapper = jaxamp.OptimWrapper(optax.GradientTransformation(init, update), {"w": jnp.ones(2)})
  saved = wrapper.state_dict()
  wrapper.load_state_dict(dict(saved, state={"seen": 3}))
  wrapper.update_params(_linear, jnp.float32(1.0))
  assert int(wrapper.opt_state["seen"]) == 4
  np.testing.assert_allclose(wrapper.params["w"], [0.9, 0.9])


@pytest.mark.parametrize("make", [lambda: jaxamp.GradScaler(init_scale=4.0),
                                  lambda: jaxamp.paddle.GradScaler(init_loss_scaling=4.0)],
                         ids=["torch", "paddle"])
def test_a_scaled_loss_with_aux_passed_to_a_jitted_step_scales_only_the_loss(make):
  scaled = make().scale(_weighted_loss, has_aux=True)

  @jax.jit
  def step(loss_fn, params, x):  # the scaled loss is an argument: its scale comes in traced
    return jax.grad(loss_fn, has_aux=True)(params, x, weight=3.0)

  grads, aux = step(scaled, {"w": jnp.ones(2)}, jnp.array([1.0, 2.0]))
  np.testing.assert_allclose(grads["w"], [12.0, 24.0])  # 4 * 3 * x
  assert aux == {"weight": 3.0}
