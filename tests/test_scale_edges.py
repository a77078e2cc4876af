"""Edge cases of dynamic loss scaling, against PyTorch's rule written in plain Python.

PyTorch unscales by ``float32(1 / scale)`` (computed in float64, then rounded), which for
scales of 2^126 and more is a denormal; it grows the scale only while the product stays
finite, and backs off after ``hysteresis`` consecutive overflows (Paddle's
``decr_every_n_nan_or_inf``).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from tests._floats import enable_x64

F32_MAX = float(np.finfo(np.float32).max)


def _torch_unscale(scaled, scale):
  inv = np.float32(1.0 / np.float64(np.float32(scale)))
  return np.asarray(scaled, np.float32) * inv  # NumPy keeps denormals


@pytest.mark.parametrize("scale", [1.5 * 2.0**126, 1.25 * 2.0**126, 2.0**126 * 1.75,
                                   1.5 * 2.0**127, 3.0 * 2**100])
def test_huge_and_tiny_scales_unscale_like_pytorch(scale):
  scaled = np.array([2.0**127, -(2.0**120) * 3, 2.0**100 + 2.0**80, 2.0**30], np.float32)
  tx = jaxamp.dynamic_loss_scale(optax.sgd(1.0), init_scale=scale, growth_interval=10)
  params = {"w": jnp.zeros(4, jnp.float32)}
  updates, state = jax.jit(tx.update)({"w": jnp.asarray(scaled)}, tx.init(params), params)
  assert not bool(state.skipped)
  # Within PyTorch's own rounding: above 2^126 its reciprocal is a denormal, with fewer bits.
  np.testing.assert_allclose(-np.asarray(updates["w"]), _torch_unscale(scaled, scale),
                             rtol=2.0**-20)


def _torch_growth(scale, growth_factor, max_scale):
  with np.errstate(over="ignore"):
    grown = np.float32(np.float64(scale) * growth_factor)
  return float(min(grown, np.float32(max_scale))) if np.isfinite(grown) else scale


@pytest.mark.parametrize("init_scale,max_scale", [(1.5 * 2.0**126, None), (2.0**126, 2.0**127),
                                                   (1.5 * 2.0**126, 2.0**127),
                                                   (F32_MAX / 3, None)])
def test_growth_near_the_top_of_float32_stops_where_pytorch_stops(init_scale, max_scale):
  tx = jaxamp.dynamic_loss_scale(optax.sgd(1.0), init_scale=init_scale, growth_interval=1,
                                 growth_factor=2.0, max_scale=max_scale)
  params = {"w": jnp.zeros(1, jnp.float32)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  expected = init_scale
  for _ in range(3):
    _, state = step({"w": jnp.ones(1, jnp.float32)}, state, params)
    expected = _torch_growth(expected, 2.0, F32_MAX if max_scale is None else max_scale)
    assert float(state.scale) == expected
    assert math.isfinite(float(state.scale))


def _paddle_rule(found_infs, scale, hysteresis, growth_interval, backoff, growth, min_scale):
  """The scale after each step: Paddle's update_loss_scaling with incr/decr counters."""
  good = bad = 0
  out = []
  for found in found_infs:
    if found:
      good = 0
      bad += 1
      if bad == hysteresis:
        scale = max(float(np.float32(scale * backoff)), min_scale)
        bad = 0
    else:
      bad = 0
      good += 1
      if good == growth_interval:
        scale = float(np.float32(scale * growth))
        good = 0
    out.append(scale)
  return out


@pytest.mark.parametrize("hysteresis,growth_interval", [(1, 1), (2, 3), (3, 2)])
def test_scale_follows_the_rule_with_hysteresis(hysteresis, growth_interval):
  found = [True, False, True, True, False, False, False, True, True, True, False, True]
  tx = jaxamp.dynamic_loss_scale(optax.sgd(1.0), init_scale=2.0**10, hysteresis=hysteresis,
                                 growth_interval=growth_interval, backoff_factor=0.25,
                                 growth_factor=4.0, min_scale=2.0**5)
  params = {"w": jnp.zeros(1, jnp.float32)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  want = _paddle_rule(found, 2.0**10, hysteresis, growth_interval, 0.25, 4.0, 2.0**5)
  skipped = 0
  for i, bad in enumerate(found):
    g = jnp.full(1, jnp.inf if bad else 1.0, jnp.float32)
    updates, state = step({"w": g}, state, params)
    skipped += bad
    assert float(state.scale) == want[i], i
    assert bool(state.skipped) == bad
    assert int(state.skipped_steps) == skipped
    np.testing.assert_array_equal(updates["w"], [-0.0] if bad else [-1.0 / float(
        want[i - 1] if i else 2.0**10)])


def test_static_scale_never_moves_but_still_skips():
  tx = jaxamp.static_loss_scale(optax.sgd(1.0), 2.0**20)
  params = {"w": jnp.zeros(1, jnp.float32)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  for g in (jnp.inf, 2.0**20, jnp.nan, 2.0**21):
    updates, state = step({"w": jnp.full(1, g, jnp.float32)}, state, params)
    assert float(state.scale) == 2.0**20
  assert int(state.skipped_steps) == 2
  np.testing.assert_array_equal(updates["w"], [-2.0])


def test_all_finite_over_an_axis_is_false_on_every_device_when_one_overflows():
  f = jax.vmap(lambda x: jaxamp.all_finite({"x": x}, axis_name="d"), axis_name="d")
  np.testing.assert_array_equal(f(jnp.array([[1.0, 2.0], [jnp.inf, 0.0]])), [False, False])
  np.testing.assert_array_equal(f(jnp.ones((2, 2))), [True, True])


def test_complex_gradients_accumulate_both_parts():
  tx = jaxamp.accumulate_gradients(optax.sgd(1.0), 2)
  state = tx.init({"w": jnp.zeros(2, jnp.complex64)})
  grads = [np.array([1 + 2j, 3j], np.complex64), np.array([3 + 0j, 1 - 1j], np.complex64)]
  for g in grads:
    updates, state = tx.update({"w": jnp.asarray(g)}, state)
  np.testing.assert_array_equal(updates["w"], -(grads[0] + grads[1]) / 2)


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_with_axis_name_one_device_overflowing_skips_the_step_on_every_device(dynamic):
  inner = optax.sgd(1.0)
  tx = (jaxamp.dynamic_loss_scale(inner, init_scale=4.0, axis_name="d") if dynamic
        else jaxamp.static_loss_scale(inner, 4.0, axis_name="d"))
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  grads = {"w": jnp.array([[4.0, 8.0], [jnp.inf, 4.0]])}  # device 1 overflows
  step = jax.vmap(tx.update, in_axes=(0, None, None), axis_name="d")
  updates, new = jax.jit(step)(grads, state, params)
  np.testing.assert_array_equal(updates["w"], np.zeros((2, 2)))
  np.testing.assert_array_equal(new.scale, [2.0, 2.0] if dynamic else [4.0, 4.0])
  np.testing.assert_array_equal(new.skipped, [True, True])
  np.testing.assert_array_equal(new.skipped_steps, [1, 1])


@pytest.mark.parametrize("make", [jaxamp.dynamic_loss_scale,
                                  lambda tx, **kw: jaxamp.static_loss_scale(tx, 2.0, **kw)],
                         ids=["dynamic", "static"])
@pytest.mark.parametrize("bad, error", [(0, ValueError), (1.5, TypeError)])
def test_a_bad_stall_after_is_refused_by_name(make, bad, error):
  with pytest.raises(error, match=r"^stall_after must be an int"):
    make(optax.sgd(1.0), stall_after=bad)


def test_min_scale_equal_to_max_scale_pins_the_scale():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(1.0), init_scale=2.0**10, growth_interval=1,
                                 min_scale=2.0**10, max_scale=2.0**10, on_stall="ignore")
  params = {"w": jnp.zeros(1, jnp.float32)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  for g in (1.0, jnp.inf, 1.0):
    _, state = step({"w": jnp.full(1, g, jnp.float32)}, state, params)
    assert float(state.scale) == 2.0**10


def test_a_state_that_holds_the_gradient_itself_is_kept_on_a_skipped_step():
  """An inner update may return an input unchanged as its new state (here the gradient)."""
  inner = optax.GradientTransformation(lambda p: {"last": jax.tree.map(jnp.zeros_like, p)},
                                       lambda u, s, p=None: (u, {"last": u}))
  tx = jaxamp.dynamic_loss_scale(inner, init_scale=1.0)
  params = {"w": jnp.ones(2, jnp.float32)}
  step = jax.jit(tx.update)
  _, state = step({"w": jnp.array([1.0, 2.0])}, tx.init(params), params)
  _, state = step({"w": jnp.array([jnp.inf, 2.0])}, state, params)
  assert bool(state.skipped)
  np.testing.assert_array_equal(state.inner_state["last"]["w"], [1.0, 2.0])


@pytest.mark.parametrize("make", [
    lambda tx: jaxamp.dynamic_loss_scale(tx, init_scale=1.0, stall_after=3, on_stall="warn"),
    lambda tx: jaxamp.static_loss_scale(tx, 1.0, stall_after=3, on_stall="warn"),
], ids=["dynamic_loss_scale", "static_loss_scale"])
def test_the_stall_warning_names_the_transformation_to_reconfigure(make, request):
  name = request.node.callspec.id
  tx = make(optax.sgd(1.0))
  params = {"w": jnp.zeros(1, jnp.float32)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  with pytest.warns(jaxamp.StallWarning, match=rf"jaxamp\.{name}: .*Pass {name}\(\.\.\., "):
    for _ in range(3):
      _, state = step({"w": jnp.full(1, jnp.nan, jnp.float32)}, state, params)
    jax.effects_barrier()


def test_by_default_the_scale_doubles_after_2000_finite_steps_as_in_pytorch():
  # torch.amp.GradScaler's defaults: init_scale 2**16, growth_interval 2000, growth_factor 2.
  tx = jaxamp.dynamic_loss_scale(optax.sgd(1.0))
  params = {"w": jnp.zeros(1, jnp.float32)}
  grads = {"w": jnp.ones(1, jnp.float32)}

  @jax.jit
  def run(state):
    def step(state, _):
      _, state = tx.update(grads, state, params)
      return state, state.scale
    return jax.lax.scan(step, state, None, length=2001)[1]

  scales = np.asarray(run(tx.init(params)))
  np.testing.assert_array_equal(scales[:1999], 2.0**16)
  np.testing.assert_array_equal(scales[1999:], 2.0**17)


@pytest.mark.parametrize("name, make", [
    ("dynamic_loss_scale", jaxamp.dynamic_loss_scale),
    ("static_loss_scale", lambda tx: jaxamp.static_loss_scale(tx, 8.0)),
])
def test_a_scaler_around_an_accumulator_warns_naming_the_nesting_to_use_instead(name, make):
  tx = make(jaxamp.accumulate_gradients(optax.sgd(1.0), 2))
  with pytest.warns(UserWarning, match=rf"^jaxamp\.{name}\(\.\.\.\) wraps "
                                       r"jaxamp\.accumulate_gradients\(\.\.\.\)") as record:
    tx.init({"w": jnp.zeros(2)})
  assert f"jaxamp.accumulate_gradients(jaxamp.{name}(inner), every_k)" in str(record[0].message)


def test_with_x64_enabled_the_scale_stays_float32_through_growth_and_backoff():
  # The state that init gives has the dtype of the one update returns (a scan carry keeps it).
  with enable_x64(True):
    tx = jaxamp.dynamic_loss_scale(optax.sgd(1.0), init_scale=8.0, growth_interval=1)
    params = {"w": jnp.zeros(1, jnp.float32)}
    state = tx.init(params)
    for g, want in ((1.0, 16.0), (np.inf, 8.0)):
      _, state = jax.jit(tx.update)({"w": jnp.full(1, g, jnp.float32)}, state, params)
      assert state.scale.dtype == jnp.float32 and float(state.scale) == want


def test_a_single_integer_gradient_is_named_as_the_root_in_the_warning():
  tx = jaxamp.dynamic_loss_scale(optax.identity())
  count = jnp.zeros(2, jnp.int32)
  with pytest.warns(UserWarning, match=r"leaf <root> has non-floating dtype int32"):
    tx.update(count, tx.init(count), count)


@pytest.mark.parametrize("name", ["min_scale", "max_scale"])
@pytest.mark.parametrize("bad, error, says", [(float("inf"), ValueError, "finite"),
                                              ("big", TypeError, "a real number")])
def test_a_bad_scale_bound_is_refused_by_name(name, bad, error, says):
  with pytest.raises(error, match=rf"^{name} must be {says}"):
    jaxamp.dynamic_loss_scale(optax.sgd(1.0), **{name: bad})


@pytest.mark.parametrize("dtype, scaled_dtype", [
    (jnp.float64, jnp.float64), (jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32),
    (jnp.int32, jnp.float32)])
def test_with_x64_a_scaled_loss_keeps_a_wide_dtype_and_promotes_the_rest_to_float32(
    dtype, scaled_dtype):
  with enable_x64(True):
    state = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0).init({"w": jnp.zeros(2)})
    scaled = jaxamp.scale_loss(jnp.asarray(3, dtype), state)
  assert scaled.dtype == scaled_dtype and float(scaled) == 24.0


def test_a_complex_loss_is_scaled_with_both_parts():
  # A holomorphic objective: the loss is complex, and scaling must not drop its imaginary part.
  state = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=4.0).init({"w": jnp.zeros(2)})
  scaled = jaxamp.scale_loss(jnp.complex64(1.5 - 2j), state)
  assert scaled.dtype == jnp.complex64 and complex(scaled) == 6 - 8j


def test_inside_shard_map_gradients_varying_over_an_axis_not_named_are_refused():
  # One device is enough: JAX types what varies over the mesh axis all the same.
  mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  P = jax.sharding.PartitionSpec
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  step = jax.jit(jax.shard_map(lambda g, s: tx.update(g, s, params), mesh=mesh,
                               in_specs=(P("data"), P()), out_specs=(P("data"), P())))
  with pytest.raises(ValueError, match=r"vary over the shard_map mesh axes \('data',\)"):
    step({"w": jnp.ones(2)}, state)


def test_a_scaler_over_parameters_without_a_floating_leaf_keeps_its_state_types():
  # An integer-only tree (a step counter held as a parameter): the state's flag vector stays
  # an empty bool vector, so the update can be the body of a lax.scan.
  tx = jaxamp.dynamic_loss_scale(optax.identity())
  params = {"step": jnp.zeros([], jnp.int32)}

  def body(state, _):
    return tx.update(params, state, params)[1], None

  with pytest.warns(UserWarning, match="neither unscaled nor checked"):
    state, _ = jax.lax.scan(body, tx.init(params), None, length=2)
  assert state.nonfinite_leaves.shape == (0,) and state.nonfinite_leaves.dtype == jnp.bool_


def test_a_skipped_step_leaves_integer_parameters_unchanged():
  tx = jaxamp.dynamic_loss_scale(optax.identity())
  params = {"w": jnp.ones(2), "n": jnp.array([3, 4], jnp.int32)}
  grads = {"w": jnp.array([1.0, jnp.nan]), "n": jnp.array([1, 1], jnp.int32)}
  with pytest.warns(UserWarning, match="neither unscaled nor checked"):
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  np.testing.assert_array_equal(optax.apply_updates(params, updates)["n"], [3, 4])
