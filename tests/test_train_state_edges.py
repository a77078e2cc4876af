"""Edge cases of clipping, the train state and the state readers, against plain models.

The total norm is compared with a NumPy model of ``torch.nn.utils.get_total_norm`` (the
norm of the per-leaf norms) for every order PyTorch accepts, ``-inf`` and 0 included; the
train state's ``value_and_grad`` with ``axis_name`` with the mean of the per-device
gradients of the scaled loss.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from tests._floats import enable_x64
from jaxamp._src import clipping


def _torch_total_norm(leaves, order):
  """The norm of the per-leaf norms, in float64 (PyTorch's get_total_norm)."""
  def vnorm(x):
    x = np.abs(np.asarray(x, np.float64).ravel())
    if order == math.inf:
      return x.max()
    if order == -math.inf:
      return x.min()
    if order == 0:
      return float(np.count_nonzero(x))
    return np.sum(x ** order) ** (1.0 / order)
  norms = [vnorm(x) for x in leaves]
  return norms[0] if len(norms) == 1 else vnorm(np.array(norms))


GRADS = {"a": jnp.array([[3.0, -0.5], [0.0, 2.0]], jnp.float32),
         "b": jnp.array([-4.0, 0.25, 1.5], jnp.float32),
         "n": jnp.array([7, 8], jnp.int32)}  # integer leaves take no part


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, 0.5, 0.0, math.inf, -math.inf, "inf",
                                       "-inf", " Infinity", "-infinity", "+inf"])
def test_total_norm_of_every_order_is_the_norm_of_the_leaf_norms(norm_type):
  order = {"inf": math.inf, "-inf": -math.inf, " Infinity": math.inf, "-infinity": -math.inf,
           "+inf": math.inf}.get(norm_type, norm_type)
  expected = _torch_total_norm([GRADS["a"], GRADS["b"]], order)
  got = jax.jit(lambda g: jaxamp.total_grad_norm(g, norm_type))(GRADS)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(float(got), expected, rtol=2e-6)
  # One leaf: its own norm.
  one = jaxamp.total_grad_norm({"b": GRADS["b"]}, norm_type)
  np.testing.assert_allclose(float(one), _torch_total_norm([GRADS["b"]], order), rtol=2e-6)


def test_minus_inf_norm_is_the_smallest_magnitude_and_clips_by_it():
  # The smallest |g| over all leaves is 0.25: a bound of 0.125 halves every gradient.
  grads = {"a": GRADS["a"] + 1.0, "b": GRADS["b"]}
  tx = jaxamp.clip_grad_norm(0.125, "-inf")
  clipped, state = jax.jit(tx.update)(grads, tx.init(grads))
  assert float(state.total_norm) == 0.25
  coef = np.float32(0.125) / (np.float32(0.25) + np.float32(1e-6))
  np.testing.assert_allclose(clipped["b"], np.asarray(grads["b"]) * coef, rtol=1e-6)


def test_total_norm_of_a_tree_without_floats_is_zero():
  assert float(jaxamp.total_grad_norm({"n": jnp.arange(3)})) == 0.0
  assert float(jaxamp.total_grad_norm({"e": jnp.zeros([0])})) == 0.0


def test_clip_grad_norm_keeps_integer_leaves_and_half_precision_dtypes():
  grads = {"h": jnp.array([6.0, 8.0], jnp.bfloat16), "n": jnp.array([5, 6], jnp.int32)}
  tx = jaxamp.clip_grad_norm(5.0)
  clipped, state = tx.update(grads, tx.init(grads))
  assert float(state.total_norm) == 10.0
  assert clipped["h"].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(clipped["h"], np.float32), [3.0, 4.0], rtol=1e-2)
  np.testing.assert_array_equal(clipped["n"], grads["n"])


@pytest.mark.parametrize("bad", ["l2", "nan", math.nan])
def test_unknown_norm_orders_are_refused(bad):
  with pytest.raises(ValueError, match="norm_type"):
    jaxamp.clip_grad_norm(1.0, bad)


def test_check_total_norm_raises_only_for_a_non_finite_norm():
  clipping.check_total_norm(jnp.float32(3.0))
  for bad in (math.inf, math.nan):
    with pytest.raises(RuntimeError, match="non-finite"):
      clipping.check_total_norm(jnp.float32(bad), "inf")


def _loss(params, x):
  return jnp.sum(params["w"] * x) ** 2


def test_value_and_grad_with_axis_name_averages_the_scaled_gradients_over_devices():
  params = {"w": jnp.array([1.0, -2.0])}
  state = jaxamp.TrainState.create(
      apply_fn=None, params=params,
      tx=jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0))
  xs = jnp.array([[1.0, 0.5], [2.0, -1.0]])  # one batch per (vmapped) device
  loss, grads = jax.jit(jax.vmap(state.value_and_grad(_loss, axis_name="d"), in_axes=(None, 0),
                                 axis_name="d"))(params, xs)
  per_device = [2 * np.dot(params["w"], x) * np.asarray(x) * 8.0 for x in xs]
  for i in range(2):
    np.testing.assert_allclose(loss[i], _loss(params, xs[i]), rtol=1e-6)  # unscaled
    np.testing.assert_allclose(grads["w"][i], (per_device[0] + per_device[1]) / 2, rtol=1e-6)
  # Without axis_name each device keeps its own gradients.
  _, own = jax.jit(jax.vmap(state.value_and_grad(_loss), in_axes=(None, 0)))(params, xs)
  np.testing.assert_allclose(own["w"][1], per_device[1], rtol=1e-6)


def test_value_and_grad_with_aux_returns_the_unscaled_loss_and_the_aux():
  params = {"w": jnp.array([1.0, 2.0])}
  state = jaxamp.TrainState.create(
      apply_fn=None, params=params,
      tx=jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=4.0))
  (loss, aux), grads = state.value_and_grad(
      lambda p: (jnp.sum(p["w"] ** 2), {"n": 3}), has_aux=True)(params)
  assert float(loss) == 5.0 and aux == {"n": 3}
  np.testing.assert_array_equal(grads["w"], [8.0, 16.0])


def test_step_metrics_report_the_mean_stale_fraction_of_the_bfloat16_leaves():
  params = {"small": jnp.ones(4, jnp.bfloat16), "large": jnp.ones(4, jnp.bfloat16)}
  tx = jaxamp.low_precision_params(optax.sgd(1.0), "kahan")
  state = tx.init(params)
  # An update of 1e-4 is lost when added to 1.0 in bfloat16; an update of 0.5 is not.
  grads = {"small": jnp.full(4, 1e-4, jnp.bfloat16), "large": jnp.full(4, 0.5, jnp.bfloat16)}
  _, state = jax.jit(tx.update)(grads, state, params)
  metrics = jaxamp.step_metrics(state)
  np.testing.assert_array_equal(metrics["stale_fraction_per_leaf"], [0.0, 1.0])  # tree order
  assert float(metrics["stale_fraction"]) == 0.5
  assert "loss_scale" not in metrics


class _WithStats(jaxamp.TrainState):
  stats: dict


def _stats_state():
  params = {"w": jnp.array([1.0, 2.0])}
  return _WithStats.create(apply_fn=None, params=params, stats={"mean": jnp.zeros(2)},
                           tx=jaxamp.dynamic_loss_scale(optax.sgd(0.5), init_scale=2.0))


def test_a_skipped_step_keeps_the_previous_statistics_and_an_applied_one_takes_the_new():
  state = _stats_state()
  step = jax.jit(lambda s, g, m: s.apply_gradients(grads={"w": g}, stats={"mean": m}))
  state = step(state, jnp.array([2.0, 4.0]), jnp.array([1.0, 1.0]))  # applied
  np.testing.assert_array_equal(state.stats["mean"], [1.0, 1.0])
  np.testing.assert_array_equal(state.params["w"], [0.5, 1.0])
  assert int(state.step) == 1
  state = step(state, jnp.array([jnp.inf, 4.0]), jnp.array([9.0, 9.0]))  # skipped
  np.testing.assert_array_equal(state.stats["mean"], [1.0, 1.0])
  np.testing.assert_array_equal(state.params["w"], [0.5, 1.0])
  assert int(state.step) == 1
  # A field given with another structure is replaced as given.
  other = state.apply_gradients(grads={"w": jnp.array([jnp.nan, 0.0])},
                                stats={"mean": jnp.ones(2), "var": jnp.ones(2)})
  assert set(other.stats) == {"mean", "var"}


def test_opt_state_is_what_tx_init_gives_without_fp8_layers():
  state = _stats_state()
  expected = state.tx.init(state.params)
  assert jax.tree.structure(state.opt_state) == jax.tree.structure(expected)


def test_a_scalar_leaf_counts_in_the_total_norm():
  # A scalar parameter's gradient (a bias, a temperature) is part of the norm like any leaf.
  grads = {"t": jnp.array(3.0), "w": jnp.array([4.0])}
  np.testing.assert_allclose(float(jaxamp.total_grad_norm(grads)), 5.0, rtol=1e-6)
  np.testing.assert_allclose(float(jaxamp.total_grad_norm({"t": jnp.array(-2.0)}, 1.0)), 2.0)


@pytest.mark.parametrize("bad", [None, [2.0], 2j])
def test_a_norm_order_of_the_wrong_type_is_refused_naming_it(bad):
  with pytest.raises(TypeError, match="norm_type"):
    jaxamp.clip_grad_norm(1.0, bad)


def test_set_loss_scale_accepts_a_traced_integer_scale():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))
  state = tx.init({"w": jnp.zeros(2)})
  state = jax.jit(jaxamp.set_loss_scale)(state, jnp.int32(512))
  assert float(jaxamp.loss_scale(state)) == 512.0
  with pytest.raises(TypeError, match="real scalar"):
    jax.jit(jaxamp.set_loss_scale)(state, jnp.array(True))


def test_an_upgraded_state_refuses_a_missing_moment_rather_than_zeroing_it():
  # The momentum of a checkpoint restored as None is not replaced by the template's zeros.
  params = {"w": jnp.zeros(2)}
  template = jaxamp.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9)).init(params)
  old = {"scale": 1024.0, "growth_tracker": 5, "overflow_count": 0, "skipped": False,
         "skipped_steps": 3, "inner_state": [{"trace": None}, {}]}
  with pytest.raises(ValueError, match="trace"):
    jaxamp.upgrade_opt_state(old, template)
  old["inner_state"][0]["trace"] = {"w": [0.5, -1.0]}
  state = jaxamp.upgrade_opt_state(old, template)
  np.testing.assert_array_equal(state.inner_state[0].trace["w"], [0.5, -1.0])


def test_the_train_state_step_metrics_are_those_of_its_optimizer_state():
  state = _stats_state()
  state = state.apply_gradients(grads={"w": jnp.array([jnp.inf, 1.0])}, stats=state.stats)
  metrics = state.step_metrics()
  assert float(metrics["loss_scale"]) == 1.0  # halved from 2 by the skipped step
  assert bool(metrics["skipped"]) and int(metrics["skipped_steps"]) == 1


def test_stale_report_names_each_bfloat16_leaf_with_its_lost_fraction():
  params = {"a": jnp.ones(4, jnp.bfloat16), "b": jnp.ones(2, jnp.bfloat16), "f": jnp.ones(2)}
  tx = jaxamp.low_precision_params(optax.sgd(1.0), "kahan")
  # Half of a's updates (1e-4 on 1.0) are lost in bfloat16; none of b's (0.5); a zero update
  # is not counted as lost.
  grads = {"a": jnp.array([1e-4, 1e-4, 0.5, 0.0], jnp.bfloat16),
           "b": jnp.full(2, 0.5, jnp.bfloat16), "f": jnp.ones(2)}
  _, state = jax.jit(tx.update)(grads, tx.init(params), params)
  assert jaxamp.stale_report(state, params) == {"['a']": 0.5, "['b']": 0.0}


def test_a_train_state_of_bfloat16_params_takes_low_precision_steps_under_strict_promotion():
  # The suite runs under strict dtype promotion; the float32 updates of low_precision_params
  # still reach bfloat16 params, rounded to nearest (1 - 0.5 * 0.25 = 0.875 is exact).
  params = {"w": jnp.ones(2, jnp.bfloat16)}
  state = jaxamp.TrainState.create(
      apply_fn=None, params=params,
      tx=jaxamp.low_precision_params(optax.sgd(0.5), "nearest"))
  state = state.apply_gradients(grads={"w": jnp.full(2, 0.25, jnp.bfloat16)})
  assert state.params["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(state.params["w"], np.float32), [0.875, 0.875])


class _Box:
  """A user's state container: a pytree registered without keys."""

  def __init__(self, items):
    self.items = items


jax.tree_util.register_pytree_node(_Box, lambda b: (b.items, None), lambda _, c: _Box(list(c)))


def test_a_loss_scale_inside_a_pytree_without_keys_is_found():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=64.0)
  state = _Box([{"m": jnp.zeros(3)}, (tx.init({"w": jnp.zeros(2)}),)])
  assert float(jaxamp.loss_scale(state)) == 64.0


# -- clipping arguments, dtypes under x64, empty leaves --------------------------------------------

def test_bad_clipping_arguments_are_refused_under_their_own_names():
  # The message starts with the argument's name, as the user wrote it.
  with pytest.raises(TypeError, match=r"^norm_type must be a real number"):
    jaxamp.clip_grad_norm(1.0, [2.0])
  with pytest.raises(ValueError, match=r"^max_norm must be a number >= 0"):
    jaxamp.clip_grad_norm(-1.0)
  with pytest.raises(ValueError, match=r"^clip_value must be a number >= 0"):
    jaxamp.clip_grad_value(-1.0)


def test_with_x64_enabled_the_total_norm_and_its_state_stay_float32():
  # The documented float32 norm, whichever default dtype JAX has: the state that init gives
  # has the dtype of the one update returns (a lax.scan carry of it keeps its type).
  with enable_x64(True):
    grads = {"a": jnp.array([3.0, 0.0], jnp.float32), "h": jnp.array([4.0], jnp.float16)}
    tx = jaxamp.clip_grad_norm(1.0)
    state = tx.init(grads)
    clipped, new_state = jax.jit(tx.update)(grads, state)
    assert state.total_norm.dtype == new_state.total_norm.dtype == jnp.float32
    assert float(new_state.total_norm) == 5.0
    coef = np.float32(1.0) / (np.float32(5.0) + np.float32(1e-6))
    np.testing.assert_allclose(clipped["a"], np.float32([3.0, 0.0]) * coef, rtol=1e-6)
    assert clipped["h"].dtype == jnp.float16
    assert jaxamp.total_grad_norm(grads).dtype == jnp.float32
    assert jaxamp.total_grad_norm({"n": jnp.arange(3)}).dtype == jnp.float32


def test_an_empty_leaf_takes_no_part_in_a_minus_inf_norm():
  # An empty leaf has no magnitudes: the smallest one over the tree is that of the other leaves.
  grads = {"a": jnp.array([3.0, -4.0]), "e": jnp.zeros([0])}
  assert float(jaxamp.total_grad_norm(grads, "-inf")) == 3.0
  assert float(jaxamp.total_grad_norm({"e": jnp.zeros([0, 2])}, "-inf")) == 0.0


# -- the train state against flax's ------------------------------------------------------------------

def test_value_and_grad_differentiates_the_argument_named_by_argnums():
  state = jaxamp.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)},
                                   tx=jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=4.0))

  def fun(a, b):
    return jnp.sum(a * b ** 2)

  a, b = jnp.array([1.0, 2.0]), jnp.array([3.0, -1.0])
  loss, grads = state.value_and_grad(fun, argnums=1)(a, b)
  expected_loss, expected = jax.value_and_grad(fun, argnums=1)(a, b)
  np.testing.assert_allclose(loss, expected_loss)
  np.testing.assert_allclose(grads, 4.0 * np.asarray(expected))


def test_an_applied_step_after_a_skipped_one_takes_the_new_statistics():
  state = _stats_state()
  step = jax.jit(lambda s, g, m: s.apply_gradients(grads={"w": g}, stats={"mean": m}))
  state = step(state, jnp.array([jnp.nan, 4.0]), jnp.array([9.0, 9.0]))  # skipped
  np.testing.assert_array_equal(state.stats["mean"], [0.0, 0.0])
  state = step(state, jnp.array([2.0, 4.0]), jnp.array([1.0, 3.0]))  # applied
  assert int(state.step) == 1
  np.testing.assert_array_equal(state.stats["mean"], [1.0, 3.0])


def test_apply_gradients_refuses_an_unknown_field_as_flax_does():
  flax_train_state = pytest.importorskip("flax.training.train_state")
  params, grads = {"w": jnp.ones(2)}, {"w": jnp.ones(2)}
  reference = flax_train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
  with pytest.raises(TypeError):
    reference.apply_gradients(grads=grads, bogus=None)
  state = jaxamp.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
  with pytest.raises(TypeError):
    state.apply_gradients(grads=grads, bogus=None)


def test_fp8_variables_are_stepped_as_flax_train_state_steps_them():
  flax_train_state = pytest.importorskip("flax.training.train_state")
  variables = {"params": {"w": jnp.array([1.0, -2.0])},
               "_overwrite_with_gradient": {"amax": jnp.array([0.5, 0.25])}}
  tx = optax.sgd(0.1, momentum=0.9)
  reference = flax_train_state.TrainState.create(apply_fn=None, params=variables, tx=tx)
  state = jaxamp.TrainState.create(apply_fn=None, params=variables, tx=tx)
  for k in range(1, 3):
    grads = {"params": {"w": jnp.array([0.5, 1.0]) * k},
             "_overwrite_with_gradient": {"amax": jnp.array([3.0, 4.0]) * k}}
    reference = reference.apply_gradients(grads=grads)
    state = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, grads)
  np.testing.assert_allclose(state.params["params"]["w"], reference.params["params"]["w"],
                             rtol=1e-6)
  np.testing.assert_array_equal(state.params["_overwrite_with_gradient"]["amax"], [6.0, 8.0])
  np.testing.assert_array_equal(reference.params["_overwrite_with_gradient"]["amax"], [6.0, 8.0])


def test_a_restored_state_dict_names_the_field_that_does_not_fit_as_flax_does():
  serialization = pytest.importorskip("flax.serialization")
  flax_train_state = pytest.importorskip("flax.training.train_state")
  params = {"w": jnp.ones(2)}
  bad = {"step": 0, "params": {"v": np.ones(2)}, "opt_state": {}}
  reference = flax_train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
  with pytest.raises(ValueError) as flax_error:
    serialization.from_state_dict(reference, bad)
  state = jaxamp.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
  with pytest.raises(ValueError) as error:
    serialization.from_state_dict(state, bad)
  # Both name the path of the field that does not fit (flax prefixes it with "./").
  assert str(flax_error.value).endswith("at path ./params")
  assert str(error.value).endswith("params") and "at path" in str(error.value)
  assert "{'w'}" in str(error.value)
