"""Edge cases of the state readers and writers, against the states ``tx.init`` and ``tx.update`` build.

Restoring a checkpoint without a target (``upgrade_opt_state``) must give the state
``tx.init`` gives, with the restored values kept in the template's dtypes and every
malformed node refused with a message that starts with the node's path; ``step_metrics``,
``set_loss_scale``, ``keep_if_skipped`` and ``skip_report``'s structure check are held to
what their docstrings promise.
"""

import collections
import functools
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp._src.state import declare_skipping_state
from tests._floats import enable_x64


def _same(a: Any, b: Any) -> bool:
  """Same tree structure, and leaf by leaf the same shape, dtype and values."""
  la, da = jax.tree.flatten(a)
  lb, db = jax.tree.flatten(b)
  return da == db and all(
      jnp.shape(x) == jnp.shape(y) and jnp.result_type(x) == jnp.result_type(y)
      and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def _as_restored(tree: Any, tuples_as_dicts: bool = False) -> Any:
  """``tree`` as a restore without a target gives it: dicts of fields, lists (or dicts) for tuples.

  Leaves become numpy arrays, as orbax returns them.
  """
  if isinstance(tree, tuple) and hasattr(tree, "_fields"):
    return {f: _as_restored(getattr(tree, f), tuples_as_dicts) for f in tree._fields}
  if isinstance(tree, (list, tuple)):
    items = [_as_restored(x, tuples_as_dicts) for x in tree]
    return {str(i): x for i, x in enumerate(items)} if tuples_as_dicts else items
  if isinstance(tree, dict):
    return {k: _as_restored(v, tuples_as_dicts) for k, v in tree.items()}
  if tree is None:
    return None
  return np.asarray(tree)


PARAMS = {"w": jnp.array([[1.0, -2.0, 0.5], [0.25, 3.0, -1.0]]), "b": jnp.array([0.5, -0.5])}
GRADS = {"w": jnp.array([[0.1, 0.2, -0.3], [0.4, -0.5, 0.6]]), "b": jnp.array([1.0, -1.0])}


def _saved(tx, params=PARAMS):
  """A state of ``tx`` as a run leaves it: ``tx.init``'s, with every number changed.

  (Computed without stepping: the tests read states, and eager steps are slow.)
  """
  def change(leaf):
    leaf = jnp.asarray(leaf)
    if leaf.dtype == jnp.bool_:
      return jnp.logical_not(leaf)
    if jnp.issubdtype(leaf.dtype, jnp.floating):  # betas stay in [0, 1), moments >= 0
      return (leaf * 0.5 + 0.25).astype(leaf.dtype)
    return (leaf * 3 + 2).astype(leaf.dtype)

  state = jax.tree.map(change, tx.init(params))
  return jaxamp.validate_opt_state(state)  # still a state a run could reach


def _adam_tx():
  return jaxamp.dynamic_loss_scale(optax.adam(1e-2), init_scale=256.0)


# -------------------------------------------------------------------------------------------------
# upgrade_opt_state: what is restored comes back as the state it was.


@pytest.mark.parametrize("make_tx", [
    _adam_tx,
    lambda: jaxamp.accumulate_gradients(
        jaxamp.dynamic_loss_scale(optax.chain(jaxamp.clip_grad_norm(1.0), optax.sgd(0.1, 0.9))),
        2),
    lambda: optax.chain(optax.identity(), jaxamp.dynamic_loss_scale(
        optax.inject_hyperparams(optax.adam)(learning_rate=1e-3))),
], ids=["adam", "accumulate-chain", "outer-chain-inject"])
@pytest.mark.parametrize("form", ["state", "orbax", "tuples-as-dicts"])
def test_upgrade_of_a_saved_state_gives_the_state_back(make_tx, form):
  tx = make_tx()
  saved = _saved(tx)
  template = tx.init(PARAMS)
  restored = {"state": saved, "orbax": _as_restored(saved),
              "tuples-as-dicts": _as_restored(saved, tuples_as_dicts=True)}[form]
  assert _same(jaxamp.upgrade_opt_state(restored, template), saved)


class _LossScaleStateV1(NamedTuple):
  """A loss-scale state as an earlier release wrote it (before skip_streak, stalled, ...)."""

  scale: Any
  growth_tracker: Any
  overflow_count: Any
  skipped: Any
  skipped_steps: Any
  inner_state: Any


def test_upgrade_of_an_old_named_tuple_keeps_its_values_and_fills_the_new_fields():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1, 0.9))
  template = tx.init(PARAMS)
  trace = {"w": np.full((2, 3), 0.5, np.float64), "b": np.array([1, -1], np.int64)}
  old = _LossScaleStateV1(scale=np.float64(1024.0), growth_tracker=np.int64(7),
                          overflow_count=0, skipped=np.bool_(True), skipped_steps=3,
                          inner_state=(optax.TraceState(trace=trace), optax.EmptyState()))
  state = jaxamp.upgrade_opt_state(old, template)
  expected = template._replace(
      scale=jnp.float32(1024.0), growth_tracker=jnp.int32(7), skipped=jnp.bool_(True),
      skipped_steps=jnp.int32(3),
      inner_state=(optax.TraceState(trace={"w": jnp.full((2, 3), 0.5, jnp.float32),
                                           "b": jnp.array([1.0, -1.0], jnp.float32)}),
                   optax.EmptyState()))
  assert _same(state, expected)


@pytest.mark.parametrize("inner", [None, [None, None], [{}, {}], ({}, None)])
def test_upgrade_accepts_nothing_for_a_chain_of_empty_states(inner):
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))
  template = tx.init(PARAMS)
  old = _as_restored(template._replace(scale=jnp.float32(64.0)))
  old["inner_state"] = inner
  state = jaxamp.upgrade_opt_state(old, template)
  assert _same(state, template._replace(scale=jnp.float32(64.0)))


def test_upgrade_refuses_values_for_an_empty_state():
  template = jaxamp.dynamic_loss_scale(optax.sgd(0.1)).init(PARAMS)
  old = _as_restored(template)
  old["inner_state"] = [{"trace": {"w": np.zeros((2, 3), np.float32)}}, {}]
  with pytest.raises(ValueError, match=r"^state\.inner_state\[0\]: expected an empty EmptyState"):
    jaxamp.upgrade_opt_state(old, template)


def test_upgrade_refuses_nothing_for_a_stateful_chain():
  template = _adam_tx().init(PARAMS)
  old = _as_restored(template)
  old["inner_state"] = None
  with pytest.raises(ValueError,
                     match=r"^state\.inner_state: expected a sequence of 2 entries, got NoneType"):
    jaxamp.upgrade_opt_state(old, template)


def test_upgrade_refuses_nothing_for_a_moment():
  template = _adam_tx().init(PARAMS)
  old = _as_restored(template)
  old["inner_state"][0]["mu"] = None
  with pytest.raises(ValueError, match=r"^state\.inner_state\[0\]\.mu: expected a dict with keys "
                                       r"\['b', 'w'\], got NoneType"):
    jaxamp.upgrade_opt_state(old, template)


def test_upgrade_names_the_path_of_a_bad_moment():
  template = _adam_tx().init(PARAMS)
  old = _as_restored(template)
  old["inner_state"][0]["mu"]["w"] = "zeros"
  with pytest.raises(TypeError, match=r"^state\.inner_state\[0\]\.mu\['w'\] must be"):
    jaxamp.upgrade_opt_state(old, template)


def test_upgrade_refuses_an_unexpected_key_of_a_params_like_dict():
  template = _adam_tx().init(PARAMS)
  old = _as_restored(template)
  old["inner_state"][0]["nu"]["v"] = np.zeros(2, np.float32)
  with pytest.raises(ValueError,
                     match=r"^state\.inner_state\[0\]\.nu: unexpected keys \['v'\] \(accepted: "
                           r"\['b', 'w'\]\)"):
    jaxamp.upgrade_opt_state(old, template)


def test_upgrade_fills_a_hyperparameter_injected_since_from_the_template():
  # The old run injected the learning rate only; the new one injects b1 too.
  old_tx = jaxamp.dynamic_loss_scale(optax.inject_hyperparams(optax.adam, static_args="b1")(
      learning_rate=5e-3, b1=0.8))
  new_tx = jaxamp.dynamic_loss_scale(
      optax.inject_hyperparams(optax.adam)(learning_rate=1e-3, b1=0.7))
  saved = _saved(old_tx)
  state = jaxamp.upgrade_opt_state(_as_restored(saved), new_tx.init(PARAMS))
  hyper = state.inner_state.hyperparams
  assert "b1" not in saved.inner_state.hyperparams
  assert sorted(hyper) == sorted(new_tx.init(PARAMS).inner_state.hyperparams)
  assert float(hyper["learning_rate"]) == float(saved.inner_state.hyperparams["learning_rate"])
  assert float(hyper["b1"]) == np.float32(0.7)  # the template's
  assert _same(state.inner_state.inner_state, saved.inner_state.inner_state)


def test_upgrade_of_params_with_an_empty_subtree():
  params = {"w": jnp.ones(3), "frozen": {}}
  tx = _adam_tx()
  saved = _saved(tx, params)
  template = tx.init(params)
  old = _as_restored(saved)
  old["inner_state"][0]["mu"]["frozen"] = None  # how some writers store an empty dict
  assert _same(jaxamp.upgrade_opt_state(old, template), saved)
  old["inner_state"][0]["mu"]["frozen"] = {"x": np.float32(1.0)}
  with pytest.raises(ValueError,
                     match=r"^state\.inner_state\[0\]\.mu\['frozen'\]: unexpected keys \['x'\]"):
    jaxamp.upgrade_opt_state(old, template)


def test_upgrade_of_params_with_a_none_leaf():
  # Equinox models without a bias hold None there; the moments mirror it.
  params = {"w": jnp.ones(3), "bias": None}
  tx = _adam_tx()
  saved = _saved(tx, params)
  template = tx.init(params)
  for empty in (None, {}, []):
    old = _as_restored(saved)
    old["inner_state"][0]["mu"]["bias"] = empty
    assert _same(jaxamp.upgrade_opt_state(old, template), saved)
  old["inner_state"][0]["mu"]["bias"] = np.float32(1.0)
  with pytest.raises(ValueError, match=r"^state\.inner_state\[0\]\.mu\['bias'\]: expected nothing"):
    jaxamp.upgrade_opt_state(old, template)


class _Tag:
  """A state node with no arrays (a user transformation's marker), registered as a pytree."""

  def __eq__(self, other):
    return isinstance(other, _Tag)

  def __hash__(self):
    return 0


jax.tree_util.register_pytree_node(_Tag, lambda t: ((), None), lambda aux, children: _Tag())


def test_upgrade_keeps_a_node_without_arrays():
  tagged = optax.GradientTransformation(lambda params: _Tag(),
                                        lambda updates, state, params=None: (updates, state))
  tx = jaxamp.dynamic_loss_scale(optax.chain(tagged, optax.sgd(0.1)))
  template = tx.init(PARAMS)
  old = _as_restored(template._replace(inner_state=()))
  old["inner_state"] = [None, [{}, {}]]
  state = jaxamp.upgrade_opt_state(old, template)
  assert isinstance(state.inner_state[0], _Tag)
  assert _same(state, template)


def test_upgrade_reshapes_a_value_of_the_right_size():
  # Paddle writes its scale as a one-element array; a flat moment has the leaf's size.
  template = _adam_tx().init(PARAMS)
  old = _as_restored(template)
  old["scale"] = [2048.0]
  old["inner_state"][0]["mu"]["w"] = np.arange(6, dtype=np.float32)
  state = jaxamp.upgrade_opt_state(old, template)
  assert state.scale.shape == () and float(state.scale) == 2048.0
  np.testing.assert_array_equal(state.inner_state[0].mu["w"],
                                np.arange(6, dtype=np.float32).reshape(2, 3))
  old["inner_state"][0]["mu"]["w"] = np.arange(5, dtype=np.float32)
  with pytest.raises(ValueError, match=r"^state\.inner_state\[0\]\.mu\['w'\]: expected shape"):
    jaxamp.upgrade_opt_state(old, template)


def test_upgrade_of_the_state_of_ordered_dict_params():
  params = collections.OrderedDict(w=jnp.ones(3), b=jnp.zeros(2))
  tx = _adam_tx()
  saved = _saved(tx, params)
  upgraded = jaxamp.upgrade_opt_state(saved, tx.init(params))
  assert _same(upgraded, saved)
  assert isinstance(upgraded.inner_state[0].mu, collections.OrderedDict)


# -------------------------------------------------------------------------------------------------
# step_metrics


def test_step_metrics_of_a_scaled_low_precision_state_has_both_parts():
  params = {"h": jnp.ones(4, jnp.bfloat16), "f": jnp.ones(2)}
  tx = jaxamp.dynamic_loss_scale(jaxamp.low_precision_params(optax.sgd(1e-3), "kahan"),
                                 init_scale=32.0)
  metrics = jaxamp.step_metrics(tx.init(params))
  assert sorted(metrics) == ["loss_scale", "skip_streak", "skipped", "skipped_steps",
                             "stale_fraction", "stale_fraction_per_leaf", "stalled"]
  assert float(metrics["loss_scale"]) == 32.0
  assert metrics["stale_fraction_per_leaf"].shape == (1,)


def test_step_metrics_of_a_state_without_either_state_is_refused():
  with pytest.raises(ValueError, match="^No loss-scale state found"):
    jaxamp.step_metrics(optax.adam(1e-3).init(PARAMS))


def _low_precision_without_bfloat16_leaves():
  return jaxamp.step_metrics(jaxamp.low_precision_params(optax.sgd(1e-3)).init(PARAMS))


@pytest.mark.parametrize("x64", [False, True])
def test_stale_fraction_without_bfloat16_leaves_is_a_float32_zero(x64):
  with enable_x64(x64):
    metrics = _low_precision_without_bfloat16_leaves()
  assert sorted(metrics) == ["stale_fraction", "stale_fraction_per_leaf"]
  assert metrics["stale_fraction"].shape == () and metrics["stale_fraction"].dtype == jnp.float32
  assert float(metrics["stale_fraction"]) == 0.0
  assert metrics["stale_fraction_per_leaf"].shape == (0,)


# -------------------------------------------------------------------------------------------------
# set_loss_scale


@pytest.mark.parametrize("x64", [False, True])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float16, jnp.bfloat16])
def test_set_loss_scale_to_a_traced_scalar_stores_a_float32_scale(dtype, x64):
  with enable_x64(x64):
    state = jaxamp.dynamic_loss_scale(optax.sgd(0.1)).init(PARAMS)
    new = jax.jit(jaxamp.set_loss_scale)(state, jnp.asarray(512, dtype))
  assert new.scale.dtype == jnp.float32 and float(new.scale) == 512.0
  assert _same(new, state._replace(scale=jnp.float32(512.0)))


@pytest.mark.parametrize("scale", [[1024.0], (1024.0,), np.array([1024.0]), [[1024.0]]])
def test_set_loss_scale_refuses_every_non_scalar(scale):
  state = jaxamp.dynamic_loss_scale(optax.sgd(0.1)).init(PARAMS)
  with pytest.raises(ValueError, match=r"^scale must be a scalar, got an array of shape \("):
    jaxamp.set_loss_scale(state, scale)


# -------------------------------------------------------------------------------------------------
# keep_if_skipped


@functools.cache
def _applied_step():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))
  before = tx.init(PARAMS)
  _, after = jax.jit(tx.update)(GRADS, before, PARAMS)
  assert bool(jaxamp.update_applied(before, after))
  return before, after


def test_keep_if_skipped_keeps_old_statistics_after_an_applied_step_that_made_them_nan():
  before, after = _applied_step()
  old = {"mean": jnp.zeros(2), "var": jnp.ones(2), "count": jnp.int32(4)}
  new = {"mean": jnp.array([0.5, jnp.nan]), "var": jnp.full(2, 2.0), "count": jnp.int32(5)}
  assert _same(jaxamp.keep_if_skipped(new, old, before, after), old)
  finite = {"mean": jnp.array([0.5, 0.25]), "var": jnp.full(2, 2.0), "count": jnp.int32(5)}
  assert _same(jaxamp.keep_if_skipped(finite, old, before, after), finite)


def test_keep_if_skipped_returns_the_old_dtypes():
  before, after = _applied_step()
  old = {"ema": jnp.zeros(3, jnp.bfloat16), "rng": jax.random.key(0)}
  new = {"ema": jnp.array([0.5, 1.5, -2.0], jnp.float32), "rng": jax.random.key(1)}
  kept = jaxamp.keep_if_skipped(new, old, before, after)
  assert kept["ema"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(kept["ema"], np.float32), [0.5, 1.5, -2.0])
  assert jnp.array_equal(jax.random.key_data(kept["rng"]), jax.random.key_data(new["rng"]))


# -------------------------------------------------------------------------------------------------
# skip_report: params of another structure than the state's are refused.


def _nan_step(tx, params):
  """``tx``'s state after a step whose gradients were all nan (set, not computed: it is fast)."""
  state = tx.init(params)
  return state._replace(nonfinite_leaves=jnp.ones_like(state.nonfinite_leaves))


_MESSAGE = "^params has another tree structure than the parameters the optimizer state"


@pytest.mark.parametrize("inner", [
    optax.adam(1e-3),
    optax.chain(optax.scale_by_adam(), optax.scale_by_schedule(lambda count: -1e-3)),
], ids=["adam", "adam-then-schedule"])
def test_skip_report_refuses_params_of_another_dict_structure(inner):
  params = {"a": jnp.ones(2), "b": jnp.ones(3)}
  state = _nan_step(jaxamp.dynamic_loss_scale(inner), params)
  assert jaxamp.skip_report(state, params) == ["['a']", "['b']"]
  with pytest.raises(ValueError, match=_MESSAGE):
    jaxamp.skip_report(state, {"x": jnp.ones(2), "y": jnp.ones(3)})


@pytest.mark.parametrize("inject", [
    lambda tx: tx(learning_rate=1e-3),
    lambda tx: tx(learning_rate=optax.linear_schedule(1e-3, 1e-4, 100)),
], ids=["fixed", "scheduled"])
def test_skip_report_looks_into_injected_hyperparameters_states(inject):
  params = {"a": jnp.ones(2), "b": jnp.ones(3)}
  state = _nan_step(jaxamp.dynamic_loss_scale(inject(optax.inject_hyperparams(optax.adam))),
                    params)
  assert jaxamp.skip_report(state, params) == ["['a']", "['b']"]
  with pytest.raises(ValueError, match=_MESSAGE):
    jaxamp.skip_report(state, {"x": jnp.ones(2), "y": jnp.ones(3)})


def test_skip_report_refuses_a_list_for_tuple_params():
  params = (jnp.ones(2), jnp.ones(3))
  state = _nan_step(jaxamp.dynamic_loss_scale(optax.adam(1e-3)), params)
  assert jaxamp.skip_report(state, params) == ["[0]", "[1]"]
  with pytest.raises(ValueError, match=_MESSAGE):
    jaxamp.skip_report(state, list(params))


@pytest.mark.parametrize("inner", [
    optax.scale_by_schedule(lambda count: -0.1),
    optax.sgd(optax.linear_schedule(0.1, 0.01, 100)),  # (EmptyState(), ScaleByScheduleState(count))
    optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),  # hyperparams={'learning_rate': ()}
    optax.inject_hyperparams(optax.sgd)(learning_rate=optax.linear_schedule(0.1, 0.01, 100)),
], ids=["schedule", "sgd-schedule", "injected", "injected-schedule"])
def test_skip_report_of_a_one_scalar_model_with_a_step_counter(inner):
  # The step count has the parameter's shape, but it is not a tree of moments.
  params = {"w": jnp.ones(())}
  state = _nan_step(jaxamp.dynamic_loss_scale(inner), params)
  assert jaxamp.skip_report(state, params) == ["['w']"]


@pytest.mark.filterwarnings("ignore:params leaf .* has non-floating dtype")
def test_skip_report_of_a_flattened_optimizer():
  # optax.flatten keeps moments as flat vectors (here a lone leaf, in a TraceState): no tree in
  # the state has the parameters' structure, and none is taken for it.
  params = {"w": jnp.ones(3)}
  state = _nan_step(jaxamp.dynamic_loss_scale(optax.flatten(optax.trace(0.9))), params)
  assert jaxamp.skip_report(state, params) == ["['w']"]


@pytest.mark.filterwarnings("ignore:params leaf .* has non-floating dtype")
def test_skip_report_refuses_params_of_another_structure_with_integer_leaves():
  params = {"a": jnp.ones(2), "n": jnp.zeros(3, jnp.int32)}
  state = _nan_step(jaxamp.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9)), params)
  assert jaxamp.skip_report(state, params) == ["['a']"]
  with pytest.raises(ValueError, match=_MESSAGE):
    jaxamp.skip_report(state, {"x": jnp.ones(2), "y": jnp.zeros(3, jnp.int32)})


# -------------------------------------------------------------------------------------------------
# declare_skipping_state: an accumulator leaves the skipping to a declared transformation.


class _SkipCountState(NamedTuple):
  skipped: jax.Array


def _skip_counter():
  """Skips non-finite steps itself (zero updates) and counts them."""
  def update(updates, state, params=None):
    del params
    ok = jaxamp.all_finite(updates)
    zeros = jax.tree.map(jnp.zeros_like, updates)
    return (jax.tree.map(lambda u, z: jnp.where(ok, u, z), updates, zeros),
            _SkipCountState(state.skipped + jnp.where(ok, 0, 1).astype(jnp.int32)))
  return optax.GradientTransformation(lambda params: _SkipCountState(jnp.zeros([], jnp.int32)),
                                      update)


def test_accumulation_leaves_non_finite_windows_to_a_declared_skipping_transformation():
  # Declared here, not at import: a declaration is a call the test makes (idempotent).
  assert declare_skipping_state(_SkipCountState) is _SkipCountState
  tx = jaxamp.accumulate_gradients(_skip_counter(), 2)
  state = tx.init(PARAMS)
  update = jax.jit(tx.update)
  for grads in (GRADS, jax.tree.map(lambda g: g * jnp.nan, GRADS)):
    _, state = update(grads, state, PARAMS)
  assert int(state.inner_state.skipped) == 1  # the window reached it
  assert int(state.skipped_windows) == 0  # and the accumulator did not drop it
  assert int(jaxamp.skipped_steps(state)) == 0
  assert int(state.gradient_step) == 1


# -------------------------------------------------------------------------------------------------
# The scale a train state without a loss scaler reads.


@pytest.mark.parametrize("x64", [False, True])
def test_train_state_without_a_loss_scaler_reads_a_float32_scale_of_one(x64):
  with enable_x64(x64):
    state = jaxamp.TrainState.create(apply_fn=lambda p, x: x, params=PARAMS, tx=optax.sgd(0.1))
    scale = state.loss_scale
  assert scale.shape == () and scale.dtype == jnp.float32 and float(scale) == 1.0


@pytest.mark.parametrize("scaler_first", [True, False])
def test_a_scaler_beside_a_stateful_transformation_in_a_chain_is_refused_naming_both(
    scaler_first):
  scaler = jaxamp.dynamic_loss_scale(optax.identity())
  parts = (scaler, optax.adam(1e-3)) if scaler_first else (optax.adam(1e-3), scaler)
  state = optax.chain(*parts).init({"w": jnp.zeros(2)})
  where = ("chain entry 1, after the scaler at entry 0" if scaler_first
           else "chain entry 0, before the scaler at entry 1")
  with pytest.raises(ValueError, match=rf"beside a transformation that holds state \({where}\)"):
    jaxamp.loss_scale(state)


@pytest.mark.parametrize("wrap", [
    lambda tx: optax.chain(optax.identity(), tx),
    lambda tx: optax.multi_transform({"a": tx}, {"w": "a"}),
], ids=["chain", "multi_transform"])
@pytest.mark.parametrize("broken", [
    lambda: optax.MultiSteps(jaxamp.dynamic_loss_scale(optax.adam(0.1)), 2),
    lambda: optax.apply_if_finite(jaxamp.dynamic_loss_scale(optax.adam(0.1)), 3),
], ids=["multisteps", "apply_if_finite"])
def test_a_broken_composition_nested_in_another_transformation_is_refused(wrap, broken):
  state = wrap(broken()).init({"w": jnp.zeros(2)})
  with pytest.raises(ValueError, match="cannot work"):
    jaxamp.loss_scale(state)


_DLS = lambda inner: jaxamp.dynamic_loss_scale(inner, init_scale=8.0)  # noqa: E731
_MISUSED = {
    "chain_after": (lambda: optax.chain(_DLS(optax.identity()), optax.adam(0.1)),
                    "jaxamp.dynamic_loss_scale(optax.chain(...))"),
    "chain_before": (lambda: optax.chain(optax.adam(0.1), _DLS(optax.identity())),
                     "jaxamp.dynamic_loss_scale(optax.chain(...))"),
    "multisteps": (lambda: optax.MultiSteps(_DLS(optax.adam(0.1)), 2),
                   "jaxamp.accumulate_gradients"),
    "apply_if_finite": (lambda: optax.apply_if_finite(_DLS(optax.adam(0.1)), 3),
                        "jaxamp.dynamic_loss_scale(inner) alone"),
    "schedule_free": (lambda: optax.contrib.schedule_free(_DLS(optax.sgd(0.1)), 0.1),
                      "jaxamp.dynamic_loss_scale(optax.contrib.schedule_free("),
    "partition": (lambda: optax.partition({"a": _DLS(optax.sgd(0.1)), "b": optax.adam(0.1)},
                                          {"w": "a", "v": "b"}),
                  "jaxamp.dynamic_loss_scale(optax.partition(...))"),
    "lookahead": (lambda: optax.lookahead(_DLS(optax.sgd(0.1)), 2, 0.5),
                  "holds state of its own"),
}
_PARAMS2 = {"w": jnp.ones(2), "v": jnp.ones(2)}


@pytest.mark.parametrize("name", sorted(_MISUSED))
def test_misused_compositions_are_refused_where_the_state_is_first_built(name):
  make, hint = _MISUSED[name]
  params = (optax.LookaheadParams(_PARAMS2, _PARAMS2) if name == "lookahead" else _PARAMS2)
  state = make().init(params)
  refusals = {
      "TrainState.create": lambda: jaxamp.TrainState.create(apply_fn=None, params=params,
                                                            tx=make()),
      "OptimWrapper": lambda: jaxamp.OptimWrapper(make(), params),
      "accumulate_gradients.init": lambda: jaxamp.accumulate_gradients(make(), 2).init(params),
      "overwrite_with_gradient.init": lambda: jaxamp.overwrite_with_gradient(make()).init(params),
      "validate_opt_state": lambda: jaxamp.validate_opt_state(state),
      "update_applied": lambda: jaxamp.update_applied(state, state),
      "keep_if_skipped": lambda: jaxamp.keep_if_skipped({}, {}, state, state),
      "step_metrics": lambda: jaxamp.step_metrics(state),
  }
  for where, call in refusals.items():
    with pytest.raises(ValueError, match=re.escape(hint)):
      call()
      pytest.fail(f"{where} accepted {name}")


def test_misused_compositions_are_refused_by_the_nnx_optimizer():
  nnx = pytest.importorskip("flax.nnx")
  import jaxamp.nnx  # noqa: PLC0415 (imports flax)
  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="beside a transformation that holds state"):
    jaxamp.nnx.Optimizer(model, _MISUSED["chain_after"][0](), wrt=nnx.Param)


@pytest.mark.parametrize("tx", [
    optax.inject_hyperparams(lambda learning_rate: _DLS(optax.sgd(learning_rate)))(
        learning_rate=0.1),
    optax.masked(_DLS(optax.sgd(0.1)), {"w": True, "v": True}),
    _DLS(optax.contrib.schedule_free(optax.sgd(0.1), 0.1)),
    jaxamp.low_precision_params(_DLS(optax.sgd(0.1, momentum=0.9)), "kahan"),
    optax.partition({"a": _DLS(optax.sgd(0.1)), "b": optax.set_to_zero()}, {"w": "a", "v": "b"}),
], ids=["inject_hyperparams", "masked", "schedule_free_inside", "low_precision", "partition"])
def test_compositions_that_work_are_accepted(tx):
  state = jaxamp.TrainState.create(apply_fn=None, params=_PARAMS2, tx=tx)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 8.0), _PARAMS2)
  state = state.apply_gradients(grads=grads)
  assert int(state.step) == 1
  jaxamp.validate_opt_state(state.opt_state)


def test_a_list_of_optimizer_states_is_not_taken_for_a_chain():
  # Two models' states kept side by side in a list: only optax.chain's tuple is a chain.
  params = {"w": jnp.zeros(2)}
  states = [jaxamp.dynamic_loss_scale(optax.adam(0.1), init_scale=8.0).init(params),
            optax.adam(0.1).init(params)]
  assert float(jaxamp.loss_scale(states)) == 8.0


def test_skipped_steps_is_int32_for_counters_restored_as_int64():
  with enable_x64(True):
    tx = jaxamp.accumulate_gradients(jaxamp.dynamic_loss_scale(optax.sgd(0.1)), 2)
    state = tx.init({"w": jnp.zeros(2)})
    restored = jax.tree.map(
        lambda x: np.asarray(x, np.int64) if jnp.issubdtype(x.dtype, jnp.integer) else x, state)
    count = jaxamp.skipped_steps(restored)
  assert count.dtype == jnp.int32 and int(count) == 0
