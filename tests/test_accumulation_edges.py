"""Edge cases of gradient accumulation and micro-batching, against a pure-Python model.

The model of ``accumulate_gradients`` (mmengine's window counting): windows close after
micro-steps k, 2k, ... and at ``total_steps``; the last, shorter window divides by its own
length; a window whose mean is not finite is dropped and counted; a call past
``total_steps`` changes nothing but the micro-step count.
"""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from tests._floats import enable_x64


def _model(grads, k, total_steps=None):
  """Per call: (the sgd(1.0) update, whether a window closed, windows dropped so far)."""
  out, window, dropped = [], [], 0
  for i, g in enumerate(grads):
    if total_steps is not None and i >= total_steps:
      out.append((0.0, False, dropped))
      continue
    window.append(g)
    closes = len(window) == k or (total_steps is not None and i + 1 == total_steps)
    if not closes:
      out.append((0.0, False, dropped))
      continue
    mean = sum(window) / len(window)
    window = []
    if not math.isfinite(mean):
      dropped += 1
      out.append((0.0, True, dropped))
    else:
      out.append((-mean, True, dropped))
  return out


@pytest.mark.parametrize("k,total_steps", [(3, 7), (3, 6), (2, None), (4, 3)])
def test_windows_the_short_last_window_and_calls_past_the_end_follow_the_model(k, total_steps):
  grads = [1.0, 2.0, 4.0, 8.0, math.nan, 16.0, 32.0, 64.0, 128.0]
  tx = jaxamp.accumulate_gradients(optax.sgd(1.0), k, total_steps=total_steps,
                                   raise_past_end=False)
  params = {"w": jnp.zeros([], jnp.float32)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  for i, (g, (want, closed, dropped)) in enumerate(zip(grads, _model(grads, k, total_steps))):
    before = state
    updates, state = step({"w": jnp.float32(g)}, state, params)
    np.testing.assert_allclose(float(updates["w"]), want, rtol=1e-6, err_msg=f"call {i}")
    assert bool(state.updated) == closed, i
    assert int(jaxamp.skipped_steps(state)) == dropped, i
    assert int(state.micro_step) == i + 1
    if total_steps is not None and i >= total_steps:
      # Past the end nothing moves: not the window, its count, nor the accumulator.
      assert int(state.mini_step) == int(before.mini_step)
      assert int(state.gradient_step) == int(before.gradient_step)
      np.testing.assert_array_equal(state.acc_grads["w"], before.acc_grads["w"])


def test_an_overflowing_window_sum_is_dropped_and_counted_in_step_metrics():
  # Each micro-batch is finite, so the loss scaler outside applies them; their sum overflows
  # float32, so the accumulator drops the window, and step_metrics counts it as a skip.
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # the per-micro-step nesting is warned about
    tx = jaxamp.dynamic_loss_scale(jaxamp.accumulate_gradients(optax.sgd(1.0), 2),
                                   init_scale=1.0, growth_interval=100)
    params = {"w": jnp.zeros([2], jnp.float32)}
    state = tx.init(params)
  step = jax.jit(tx.update)
  for g in (3e38, 3e38, 1.0, 3.0):
    updates, state = step({"w": jnp.full([2], g, jnp.float32)}, state, params)
  metrics = jaxamp.step_metrics(state)
  assert int(metrics["skipped_steps"]) == 1
  assert not bool(metrics["skipped"])  # the loss scaler itself skipped nothing
  np.testing.assert_array_equal(updates["w"], [-2.0, -2.0])


def test_half_precision_gradients_accumulate_in_float32():
  # bfloat16 holds 256 + 1 as 256: a bfloat16 accumulator would lose the small gradients.
  tx = jaxamp.accumulate_gradients(optax.sgd(1.0), 4, average=False)
  params = {"w": jnp.zeros([], jnp.bfloat16)}
  state = tx.init(params)
  assert state.acc_grads["w"].dtype == jnp.float32
  step = jax.jit(tx.update)
  for g in (256.0, 1.0, 1.0, 1.0):
    updates, state = step({"w": jnp.asarray(g, jnp.bfloat16)}, state, params)
  assert updates["w"].dtype == jnp.bfloat16
  assert float(updates["w"]) == float(jnp.asarray(-259.0, jnp.bfloat16))
  # A float64-free explicit accumulator dtype is honoured.
  tx = jaxamp.accumulate_gradients(optax.sgd(1.0), 2, accumulator_dtype=jnp.bfloat16)
  assert tx.init(params).acc_grads["w"].dtype == jnp.bfloat16


def test_float8_gradients_accumulate_and_a_window_with_a_nan_is_dropped():
  tx = jaxamp.accumulate_gradients(optax.sgd(1.0), 2, accumulator_dtype=jnp.float32)
  params = {"w": jnp.zeros(2, jnp.float8_e5m2)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  for grads in ([1.0, 2.0], [3.0, 4.0], [1.0, np.nan], [1.0, 1.0]):
    updates, state = step({"w": jnp.array(grads, jnp.float32).astype(jnp.float8_e5m2)}, state,
                          params)
    if grads[0] == 3.0:
      np.testing.assert_array_equal(np.asarray(updates["w"], np.float32), [-2.0, -3.0])
  np.testing.assert_array_equal(np.asarray(updates["w"], np.float32), [0.0, 0.0])


def _loss(params, batch):
  return jnp.sum(params["w"] * batch["x"]).astype(jnp.float32)


def test_microbatch_gradients_of_half_precision_params_accumulate_in_float32():
  params = {"w": jnp.ones([], jnp.bfloat16)}
  batch = {"x": jnp.asarray([256.0, 1.0, 1.0, 1.0], jnp.bfloat16)}
  loss, grads = jax.jit(jaxamp.microbatch_value_and_grad(_loss, 4))(params, batch)
  assert grads["w"].dtype == jnp.bfloat16 and loss.dtype == jnp.float32
  # The mean of the four micro-batch gradients, formed in float32, rounded once.
  assert float(grads["w"]) == float(jnp.asarray(259.0 / 4, jnp.bfloat16))
  assert float(loss) == 259.0 / 4
  # A bfloat16 accumulator is what the user asks for with accumulator_dtype.
  _, low = jax.jit(jaxamp.microbatch_value_and_grad(_loss, 4, accumulator_dtype=jnp.bfloat16))(
      params, batch)
  assert float(low["w"]) == 64.0


def test_microbatch_value_and_grad_matches_the_whole_batch():
  params = {"w": jnp.array([0.5, -1.0], jnp.float32)}
  x = jnp.arange(12.0, dtype=jnp.float32).reshape(6, 2)
  loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
  want_loss, want = jax.value_and_grad(loss_fn)(params, {"x": x})
  for n in (1, 2, 3):
    loss, grads = jax.jit(jaxamp.microbatch_value_and_grad(loss_fn, n))(params, {"x": x})
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    np.testing.assert_allclose(grads["w"], want["w"], rtol=1e-6)
  (loss, aux), grads = jax.jit(jaxamp.microbatch_value_and_grad(
      lambda p, b: (loss_fn(p, b), jnp.sum(b["x"])), 3, has_aux=True))(params, {"x": x})
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  assert aux.shape[0] == 3  # one aux per micro-batch


def test_microbatch_loss_scale_may_be_an_integer():
  fn = jaxamp.microbatch_value_and_grad(lambda p, x: jnp.mean(p["w"] * x), 2)
  loss, grads = fn({"w": jnp.float32(3.0)}, jnp.array([1.0, 2.0, 3.0, 4.0]), loss_scale=8)
  np.testing.assert_allclose(float(loss), 7.5)  # unscaled
  np.testing.assert_allclose(float(grads["w"]), 2.5 * 8)


def _fp8_loss(p, x):
  # Flax's fp8 layers put their statistics under "_overwrite_with_gradient"; their "gradient"
  # is the new value, and micro-batches combine them by maximum, as one whole batch would.
  return jnp.mean(p["w"] * x) + jnp.sum(p["_overwrite_with_gradient"]["amax"] * jnp.max(x))


def test_microbatched_fp8_statistics_are_the_maximum_over_the_micro_batches():
  params = {"w": jnp.float32(1.0), "_overwrite_with_gradient": {"amax": jnp.zeros(1)}}
  x = jnp.array([-5.0, 2.0, -3.0, 1.0])  # micro-batches [-5, -3] and [2, 1]
  _, grads = jax.jit(jaxamp.microbatch_value_and_grad(_fp8_loss, 2))(params, x)
  np.testing.assert_array_equal(grads["_overwrite_with_gradient"]["amax"], [2.0])  # max(-3, 2)
  np.testing.assert_allclose(float(grads["w"]), float(jnp.mean(x)))  # the mean, as before


def test_microbatched_fp8_statistics_are_the_maximum_over_the_devices():
  params = {"w": jnp.float32(1.0), "_overwrite_with_gradient": {"amax": jnp.zeros(1)}}
  xs = jnp.array([[-5.0, 2.0, -3.0, 1.0], [4.0, -1.0, 7.0, 0.0]])  # one batch per device
  fn = jaxamp.microbatch_value_and_grad(_fp8_loss, 2, axis_name="d")
  _, grads = jax.jit(jax.vmap(fn, in_axes=(None, 0), axis_name="d"))(params, xs)
  np.testing.assert_array_equal(grads["_overwrite_with_gradient"]["amax"], [[7.0], [7.0]])
  np.testing.assert_allclose(grads["w"], [float(jnp.mean(xs))] * 2, rtol=1e-6)


def _complex_updates(accumulator_dtype, grads):
  tx = jaxamp.accumulate_gradients(optax.sgd(1.0), len(grads), accumulator_dtype=accumulator_dtype)
  params = {"w": jnp.zeros(1, jnp.complex64)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  for g in grads:
    updates, state = step({"w": jnp.asarray([g], jnp.complex64)}, state, params)
  return updates["w"]


def test_complex_gradients_accumulate_with_their_imaginary_parts():
  got = _complex_updates(jnp.float32, [1 + 2j, 3 + 4j])
  assert got.dtype == jnp.complex64
  np.testing.assert_array_equal(got, np.asarray([-2 - 3j], np.complex64))
  # accumulator_dtype=float64 (under x64) sums complex64 leaves in complex128: the ones survive.
  with enable_x64(True):
    got = _complex_updates(jnp.float64, [2.0**24 * (1 + 1j), 1 + 1j, 1 + 1j, 1 + 1j])
  want = -np.float32((2.0**24 + 3) / 4)
  assert want != -(2.0**22)
  np.testing.assert_array_equal(got, np.asarray([want * (1 + 1j)], np.complex64))


# ---- inside shard_map (a one-device mesh: JAX types what varies over its axis all the same)


def _scaled_by_value():
  """An inner transformation that reads an extra argument, as optax's line searches do."""
  return optax.GradientTransformationExtraArgs(
      lambda params: optax.EmptyState(),
      lambda updates, state, params=None, *, value, **extra: (
          jax.tree.map(lambda g: -value * g, updates), state))


@pytest.mark.parametrize("case", ["replicated", "per_device_params", "varying_extra_arg",
                                  "per_shard_decision"])
def test_inside_shard_map_the_updates_vary_over_what_they_are_computed_from(case):
  """Each case declares, through out_specs, the axes the updates vary over, as a user would:

  all-reduced gradients with replicated parameters give replicated updates; per-device
  parameters (weight decay reads them), a per-device extra argument, or gradients each shard
  decides on alone (axis_name=()) give per-device updates, also on a dropped window.
  """
  mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  P = jax.sharding.PartitionSpec
  momentum = optax.sgd(0.5, momentum=0.9)
  inner = {"replicated": momentum,
           "per_device_params": optax.chain(optax.add_decayed_weights(0.1), momentum),
           "varying_extra_arg": _scaled_by_value(), "per_shard_decision": optax.sgd(0.5)}[case]
  axis_name = () if case == "per_shard_decision" else "data"
  tx = jaxamp.accumulate_gradients(inner, 2, axis_name=axis_name)
  plain = jaxamp.accumulate_gradients(inner, 2)
  params = {"w": jnp.array([1.0, 2.0])}
  state, plain_state = tx.init(params), plain.init(params)
  # The accumulator holds each device's partial sums; the momentum is per device too where
  # the updates are.
  per_device = lambda tree: jax.tree.map(lambda _: P("data"), tree)  # noqa: E731
  specs = jax.tree.map(lambda _: P(), state)._replace(acc_grads=per_device(state.acc_grads))
  if case == "per_device_params":
    specs = specs._replace(inner_state=per_device(state.inner_state))
  param_spec = P("data") if case == "per_device_params" else P()
  update_spec = P() if case == "replicated" else P("data")
  extra = lambda v: {"value": v} if case == "varying_extra_arg" else {}  # noqa: E731
  step = jax.jit(jax.shard_map(
      lambda p, s, g, v: tx.update(g, s, p, **extra(v[0])), mesh=mesh,
      in_specs=(param_spec, specs, P("data"), P("data")), out_specs=(update_spec, specs)))
  for g in ([1.0, 3.0], [np.inf, 1.0], [2.0, 2.0], [1.0, 1.0], [0.5, -1.0], [2.0, 2.0]):
    grads, value = {"w": jnp.array(g)}, jnp.array([0.5])
    updates, state = step(params, state, grads, value)
    want, plain_state = plain.update(grads, plain_state, params, **extra(value[0]))
    np.testing.assert_allclose(updates["w"], want["w"], rtol=1e-6)
  assert int(state.skipped_windows) == int(plain_state.skipped_windows) == 1


@pytest.mark.parametrize("name, make", [
    ("accumulate_gradients", lambda: jaxamp.accumulate_gradients(optax.sgd(0.1), 2)),
    ("dynamic_loss_scale", lambda: jaxamp.dynamic_loss_scale(optax.sgd(0.1))),
    ("static_loss_scale", lambda: jaxamp.static_loss_scale(optax.sgd(0.1), 8.0)),
])
def test_a_transformation_initialized_on_flax_fp8_variables_says_which_it_is(name, make):
  variables = {"params": {"w": jnp.ones(2)},
               "_overwrite_with_gradient": {"amax": jnp.zeros(4)}}
  with pytest.raises(ValueError, match=rf"^{name} was initialized on parameters holding "
                                       r"Flax's fp8 collection '_overwrite_with_gradient'"):
    make().init(variables)


def test_an_accumulator_dtype_is_refused_by_name():
  with pytest.raises(ValueError,
                     match=r"^accumulator_dtype must be None or a floating-point dtype, got int32"):
    jaxamp.accumulate_gradients(optax.sgd(0.1), 2, accumulator_dtype=jnp.int32)


def test_integer_leaves_keep_their_dtype_and_are_summed_whatever_the_accumulator_dtype():
  # An integer leaf (a counter kept among the parameters) has no mean to take: its window
  # sum passes through, in its own dtype, beside float leaves averaged in accumulator_dtype.
  identity = optax.GradientTransformation(lambda p: optax.EmptyState(),
                                          lambda u, s, p=None: (u, s))
  tx = jaxamp.accumulate_gradients(identity, 2, accumulator_dtype=jnp.float32)
  params = {"w": jnp.zeros(2, jnp.bfloat16), "n": jnp.zeros(2, jnp.int32)}
  state = tx.init(params)
  assert state.acc_grads["n"].dtype == jnp.int32 and state.acc_grads["w"].dtype == jnp.float32
  for n in (3, 4):
    updates, state = tx.update({"w": jnp.full(2, n, jnp.bfloat16),
                                "n": jnp.full(2, n, jnp.int32)}, state)
  assert updates["n"].dtype == jnp.int32 and updates["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(updates["n"], [7, 7])
  np.testing.assert_array_equal(updates["w"], np.full(2, 3.5, np.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_a_half_precision_accumulator_averages_the_short_last_window_in_its_own_dtype(dtype):
  # Windows of 2, 2 and a last one of 1 (total_steps=5), summed and averaged in half precision.
  tx = jaxamp.accumulate_gradients(optax.sgd(1.0), 2, total_steps=5, accumulator_dtype=dtype)
  state = tx.init({"w": jnp.zeros(2, dtype)})
  grads = [1.0, 2.0, 3.0, 5.0, 7.0]
  got = []
  for g in grads:
    updates, state = tx.update({"w": jnp.full(2, g, dtype)}, state)
    assert updates["w"].dtype == dtype
    got.append(float(updates["w"][0]))
  assert got == [0.0, -1.5, 0.0, -4.0, -7.0]


@pytest.mark.parametrize("axes, axis_name, unnamed", [
    (("data",), None, r"\('data',\)"),
    (("data", "model"), "data", r"\('model',\)"),
], ids=["no_axis_name", "one_of_two_axes"])
def test_inside_shard_map_a_window_varying_over_an_axis_not_named_is_refused(
    axes, axis_name, unnamed):
  # The devices would each decide on their own window: refused, naming the axis to add.
  mesh = jax.make_mesh((1,) * len(axes), axes,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(axes))
  P = jax.sharding.PartitionSpec
  tx = jaxamp.accumulate_gradients(optax.sgd(0.5), 1, axis_name=axis_name)
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  specs = jax.tree.map(lambda _: P(), state)._replace(
      acc_grads=jax.tree.map(lambda _: P(axes), state.acc_grads))
  step = jax.jit(jax.shard_map(lambda g, s: tx.update(g, s, params), mesh=mesh,
                               in_specs=(P(axes), specs), out_specs=(P(axes), specs)))
  with pytest.raises(ValueError, match=rf"vary over the shard_map mesh axes {unnamed}"):
    step({"w": jnp.ones(2)}, state)


def test_a_scaler_inside_an_accumulator_gets_the_parameters():
  # Weight decay reads the parameters: the scaler's inner update must be given them.
  inner = optax.chain(optax.add_decayed_weights(0.5), optax.sgd(1.0))
  tx = jaxamp.accumulate_gradients(jaxamp.dynamic_loss_scale(inner, init_scale=1.0), 1)
  params = {"w": jnp.array([2.0, 4.0])}
  updates, _ = jax.jit(tx.update)({"w": jnp.zeros(2)}, tx.init(params), params)
  np.testing.assert_allclose(updates["w"], [-1.0, -2.0])


def test_with_one_micro_step_per_window_a_call_past_total_steps_is_refused():
  tx = jaxamp.accumulate_gradients(optax.sgd(1.0), 1, total_steps=2)
  params = {"w": jnp.zeros(2)}

  def body(state, g):
    updates, state = tx.update({"w": jnp.full(2, g)}, state, params)
    return state, updates["w"]

  # A lax.scan body: the state keeps its structure from one step to the next.
  state, updates = jax.lax.scan(body, tx.init(params), jnp.array([1.0, 2.0]))
  np.testing.assert_array_equal(updates[:, 0], [-1.0, -2.0])
  with pytest.raises(RuntimeError, match=r"micro-step 3 is past total_steps=2"):
    jax.block_until_ready(jax.jit(tx.update)({"w": jnp.ones(2)}, state, params))


def test_with_x64_an_update_gives_counters_restored_as_int64_their_int32_type_back():
  # A checkpoint restored without a target may hold int64 counters: one update brings the
  # state back to the types tx.init gives, so the next step does not compile again.
  with enable_x64(True):
    tx = jaxamp.accumulate_gradients(optax.sgd(0.1), 2)
    params = {"w": jnp.zeros(2)}
    fresh = tx.init(params)
    restored = jax.tree.map(
        lambda x: np.asarray(x, np.int64) if jnp.issubdtype(x.dtype, jnp.integer) else x, fresh)
    _, state = jax.jit(tx.update)({"w": jnp.ones(2)}, restored, params)
  assert jax.tree.map(lambda x: x.dtype, state) == jax.tree.map(lambda x: x.dtype, fresh)
