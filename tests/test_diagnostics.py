"""Overflow diagnostics: which leaves overflowed, stalled runs, and step metrics."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Block:
  kernel: jax.Array
  bias: jax.Array


def _poisoned(params, where, value):
  """Gradients of ones, with ``value`` at element 0 of the leaves whose path contains ``where``."""
  def leaf(path, p):
    g = jnp.ones_like(p)
    return g.ravel().at[0].set(value).reshape(p.shape) if where in jax.tree_util.keystr(path) else g
  return jax.tree_util.tree_map_with_path(leaf, params)


@pytest.mark.parametrize("params,where,path", [
    ({"dec": {"w": jnp.ones((2, 3))}, "enc": jnp.ones(4)}, "dec", "['dec']['w']"),
    ([jnp.ones(3), jnp.ones((2, 2)), jnp.ones(1)], "[1]", "[1]"),
    ({"block": Block(jnp.ones((3, 3)), jnp.zeros(3))}, "bias", "['block'].bias"),
])
def test_skip_report_names_the_leaves_under_jit(params, where, path):
  tx = jaxamp.dynamic_loss_scale(optax.sgd(1e-3, momentum=0.9))
  state = tx.init(params)
  step = jax.jit(tx.update)
  _, state = step(_poisoned(params, where, jnp.nan), state, params)
  assert jaxamp.skip_report(state, params) == [path]
  _, state = step(jax.tree.map(jnp.ones_like, params), state, params)
  assert jaxamp.skip_report(state, params) == []


def test_skip_report_names_inf_and_nan_leaves_and_ignores_integer_leaves():
  params = {"a": jnp.ones(4), "n": jnp.zeros(2, jnp.int32), "z": jnp.ones((2, 2))}
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))
  with pytest.warns(UserWarning, match="non-floating"):
    state = tx.init(params)
  grads = {"a": jnp.array([jnp.inf, -jnp.inf, jnp.nan, 1.0]), "n": jnp.zeros(2, jnp.int32),
           "z": jnp.ones((2, 2))}
  with pytest.warns(UserWarning, match="non-floating"), jax.numpy_dtype_promotion("standard"):
    _, state = jax.jit(tx.update)(grads, state, params)
  assert jaxamp.skip_report(state, params) == ["['a']"]


def test_an_overflowing_sum_of_finite_values_reports_nothing():
  params = {"w": jnp.ones(8)}
  tx = jaxamp.dynamic_loss_scale(optax.sgd(1e-40), init_scale=1.0)
  state = tx.init(params)
  _, state = jax.jit(tx.update)({"w": jnp.full(8, 3e38)}, state, params)
  assert not bool(state.skipped) and jaxamp.skip_report(state, params) == []


def test_skip_report_through_accumulation_names_every_bad_micro_step():
  params = {"a": jnp.ones(3), "b": jnp.ones(3), "c": jnp.ones(3)}
  tx = jaxamp.accumulate_gradients(jaxamp.dynamic_loss_scale(optax.sgd(0.1)), 3)
  state = tx.init(params)
  step = jax.jit(tx.update)
  for bad in ["a", "c", None]:  # two bad micro-steps, then the window closes on a good one
    grads = _poisoned(params, bad, jnp.inf) if bad else jax.tree.map(jnp.ones_like, params)
    _, state = step(grads, state, params)
  assert bool(jaxamp.get_loss_scale_state(state).skipped)
  assert jaxamp.skip_report(state, params) == ["['a']", "['c']"]


def test_skip_report_needs_the_params_of_the_gradients():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))
  state = tx.init({"w": jnp.ones(2)})
  with pytest.raises(ValueError, match="params has 2 floating leaves"):
    jaxamp.skip_report(state, {"w": jnp.ones(2), "v": jnp.ones(1)})
  with pytest.raises(ValueError, match="No loss-scale state"):
    jaxamp.skip_report(optax.sgd(0.1).init({"w": jnp.ones(2)}), {"w": jnp.ones(2)})


def _nan_run(tx, steps):
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  stalled_at = None
  for i in range(steps):
    _, state = step({"w": jnp.array([jnp.nan, 1.0])}, state, params)
    if stalled_at is None and bool(jaxamp.stalled(state)):
      stalled_at = i + 1
  return state, stalled_at, step


def test_a_run_that_skips_every_step_stalls_after_stall_after_steps():
  state, stalled_at, step = _nan_run(jaxamp.dynamic_loss_scale(optax.sgd(0.1), stall_after=7,
                                                             on_stall="ignore"), 12)
  assert stalled_at == 7 and int(state.skip_streak) == 12
  assert step._cache_size() == 1  # no recompilation
  # A good step ends the stall.
  _, state = step({"w": jnp.ones(2)}, state, {"w": jnp.ones(2)})
  assert not bool(state.stalled) and int(state.skip_streak) == 0


def test_a_skip_at_min_scale_is_a_stall_at_once():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=4.0, min_scale=1.0, on_stall="ignore")
  _, stalled_at, _ = _nan_run(tx, 5)
  assert stalled_at == 3  # 4 -> 2 -> 1, then a skip that cannot back off


def test_a_static_scale_stalls_on_the_streak_only():
  _, stalled_at, _ = _nan_run(jaxamp.static_loss_scale(optax.sgd(0.1), 1.0, stall_after=4,
                                                                on_stall="ignore"), 6)
  assert stalled_at == 4


def test_stall_after_is_validated():
  with pytest.raises(ValueError, match="stall_after must be an int >= 1"):
    jaxamp.dynamic_loss_scale(optax.sgd(0.1), stall_after=0)


def test_step_metrics_are_device_scalars_and_include_a_recorded_grad_norm():
  tx = jaxamp.dynamic_loss_scale(optax.chain(jaxamp.clip_grad_norm(1.0), optax.sgd(0.1)),
                                 init_scale=4.0)
  params = {"w": jnp.ones(2)}
  state = tx.init(params)

  @jax.jit
  def step(state, grads):
    _, state = tx.update(grads, state, params)
    return state, jaxamp.step_metrics(state)  # inside jit: no host sync needed

  state, metrics = step(state, {"w": jnp.array([12.0, 16.0])})
  logged = jax.device_get(metrics)
  assert set(logged) == {"loss_scale", "skipped", "skipped_steps", "skip_streak", "stalled",
                         "grad_norm"}
  assert float(logged["grad_norm"]) == pytest.approx(5.0)
  assert float(logged["loss_scale"]) == 4.0 and not bool(logged["skipped"])
  state, metrics = step(state, {"w": jnp.array([jnp.inf, 1.0])})
  assert int(metrics["skipped_steps"]) == 1 and int(metrics["skip_streak"]) == 1
  assert float(metrics["loss_scale"]) == 2.0


# ------------------------------------------------------------------------------- the facades

W = {"enc": jnp.ones(3), "dec": jnp.ones(2)}


def _nan_loss(p, x):
  return jnp.sum(p["enc"] * x) + jnp.sum(p["dec"]) * jnp.nan  # dec's gradient is nan


def _torch_loop(steps, **kwargs):
  opt = jaxamp.OptimWrapper(optax.sgd(0.1), W)
  scaler = jaxamp.GradScaler(**kwargs)
  for _ in range(steps):
    opt.zero_grad()
    opt.backward(scaler.scale(_nan_loss), jnp.ones(3))
    scaler.step(opt)
    scaler.update()
  return scaler


def _paddle_loop(steps, **kwargs):
  opt = jaxamp.OptimWrapper(optax.sgd(0.1), W)
  scaler = jaxamp.paddle.GradScaler(**kwargs)
  for _ in range(steps):
    opt.backward(scaler.scale(_nan_loss), jnp.ones(3))
    scaler.minimize(opt)
    opt.zero_grad()
  return scaler


def _mmengine_loop(steps, **kwargs):
  wrapper = jaxamp.AmpOptimWrapper(optax.sgd(0.1), W, **kwargs)
  for _ in range(steps):
    wrapper.update_params(_nan_loss, jnp.ones(3))
  return wrapper


LOOPS = {"torch": _torch_loop, "paddle": _paddle_loop, "mmengine": _mmengine_loop}


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_loop_that_is_nan_at_every_scale_is_reported_by_default(loop):
  with pytest.warns(jaxamp.StallWarning, match=r"steps were skipped.*\['dec'\]") as record:
    LOOPS[loop](80, stall_after=20, stall_check_every=5)
  assert len(record) == 1  # once per stall, not once per check


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_the_stall_can_raise_or_be_ignored(loop):
  with pytest.raises(jaxamp.StalledError, match=r"\['dec'\]"):
    LOOPS[loop](60, stall_after=10, stall_check_every=3, on_stall="raise")
  LOOPS[loop](60, stall_after=10, stall_check_every=3, on_stall="ignore")  # no warning


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_the_default_facades_report_within_stall_after_plus_check_every_steps(loop):
  with pytest.warns(jaxamp.StallWarning):
    LOOPS[loop](jaxamp.dynamic_loss_scale.__kwdefaults__["stall_after"] + 12)


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_facades_give_step_metrics(loop):
  source = LOOPS[loop](3, on_stall="ignore")
  metrics = jax.device_get(jaxamp.step_metrics(source))
  assert int(metrics["skipped_steps"]) == 3 and int(metrics["skip_streak"]) == 3
  assert bool(metrics["skipped"]) and not bool(metrics["stalled"])


def test_a_facade_with_an_unknown_on_stall_is_refused():
  with pytest.raises(ValueError, match="on_stall must be one of"):
    jaxamp.GradScaler(on_stall="shout")


# ------------------------------------------------------------------ state dicts and checkpoints


def test_the_new_fields_round_trip_through_flax_serialization():
  from flax import serialization
  params = {"w": jnp.ones(3)}
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9))
  state = tx.init(params)
  _, state = jax.jit(tx.update)({"w": jnp.array([1.0, jnp.nan, jnp.inf])}, state, params)
  restored = serialization.from_bytes(tx.init(params), serialization.to_bytes(state))
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(a, b)
  assert jaxamp.skip_report(restored, params) == ["['w']"]


def test_an_old_checkpoint_fails_clearly_and_upgrades(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  params = {"w": jnp.ones(3)}
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9))
  state = tx.init(params)
  _, state = jax.jit(tx.update)({"w": jnp.ones(3)}, state, params)
  # What an earlier jaxamp wrote: the loss-scale state without the diagnostic fields.
  old = {k: v for k, v in state._asdict().items()
         if k not in ("skip_streak", "stalled", "nonfinite_leaves")}
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "old", old)
  checkpointer.wait_until_finished()
  with pytest.raises(Exception, match="stalled"):  # orbax names the missing fields
    checkpointer.restore(tmp_path / "old", tx.init(params))
  upgraded = jaxamp.upgrade_opt_state(checkpointer.restore(tmp_path / "old"), tx.init(params))
  assert jax.tree.structure(upgraded) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(upgraded), jax.tree.leaves(state)):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="expected the fields of LossScaleState"):
    jaxamp.upgrade_opt_state([1, 2], tx.init(params))


def _stalling_step(on_stall):
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0, stall_after=3,
                                 on_stall=on_stall)
  params = {"w": jnp.ones(2)}

  @jax.jit
  def step(state, x):
    grads = jax.grad(lambda p: jaxamp.scale_loss(jnp.sum(p["w"] * x), state))(params)
    return tx.update(grads, state, params)[1]

  return step, tx.init(params)


def test_the_functional_core_warns_once_when_a_run_stalls():
  step, state = _stalling_step("warn")
  good, bad = jnp.ones(2), jnp.array([1.0, jnp.nan])
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for x in [good] * 3 + [bad] * 6 + [good] + [bad] * 2:
      state = step(state, x)
      jax.effects_barrier()
  stalls = [w for w in caught if issubclass(w.category, jaxamp.StallWarning)]
  # One warning, on the third skip in a row; none on the good steps, the later skips of the
  # same stall, or the two skips after the good step (a streak below stall_after).
  assert len(stalls) == 1 and len(caught) == 1
  assert str(stalls[0].message).startswith(
      "jaxamp.dynamic_loss_scale: 3 consecutive steps were skipped")
  assert "skip_report" in str(stalls[0].message)
  assert "dynamic_loss_scale(..., on_stall='record')" in str(stalls[0].message)
  assert step._cache_size() == 1  # no recompilation


def test_a_stall_warning_made_an_error_surfaces_as_a_runtime_error():
  # Under filterwarnings=error (this suite's setting) the warning raised inside the host
  # callback reaches the caller as an error that carries its text (XLA:CPU reports a failed
  # pure_callback as a ValueError; other backends as a JaxRuntimeError).
  step, state = _stalling_step("warn")
  with pytest.raises((jax.errors.JaxRuntimeError, ValueError), match="StallWarning"):
    for _ in range(4):
      state = step(state, jnp.array([jnp.nan, 1.0]))
    jax.block_until_ready(state)
    jax.effects_barrier()


@pytest.mark.parametrize("on_stall", ["warn", "record", "ignore"])
def test_the_step_has_no_effect_so_jit_dispatches_it_through_its_fast_path(on_stall):
  # A jitted function with an effect (jax.debug.callback) is dispatched through JAX's Python
  # path on every call; the stall warning's callback is pure to JAX, its result the flag.
  step, state = _stalling_step(on_stall)
  assert not jax.make_jaxpr(step)(state, jnp.ones(2)).effects
  assert (jax.make_jaxpr(step)(state, jnp.ones(2)).jaxpr.pretty_print().count("pure_callback")
          == (on_stall == "warn"))


def _host_callbacks(step, *args) -> int:
  """Host callbacks in the jaxpr of ``step`` and custom calls to one in its lowered program."""
  jaxpr = jax.make_jaxpr(step)(*args).jaxpr.pretty_print()
  lowered = step.lower(*args).as_text()
  return jaxpr.count("callback") + sum("callback" in line for line in lowered.splitlines()
                                       if "custom_call" in line)


@pytest.mark.parametrize("make", [
    lambda **kw: jaxamp.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9), **kw),
    lambda **kw: jaxamp.static_loss_scale(optax.sgd(0.1, momentum=0.9), 4.0, **kw),
], ids=["dynamic", "static"])
def test_the_default_step_holds_no_host_callback(make):
  # XLA:CPU runs a program that holds a host callback synchronously, even where the callback's
  # branch is not taken; by default the stall is only recorded in the state.
  params = {"w": jnp.ones(3)}

  def stepper(tx):
    @jax.jit
    def step(state, x):
      grads = jax.grad(lambda p: jaxamp.scale_loss(jnp.sum(p["w"] * x), state))(params)
      return tx.update(grads, state, params)[1]

    return step, tx.init(params)

  step, state = stepper(make())
  assert _host_callbacks(step, state, jnp.ones(3)) == 0
  step, state = stepper(make(on_stall="warn"))  # the opt-in, which the count must see
  assert _host_callbacks(step, state, jnp.ones(3)) > 0


def test_by_default_a_stalled_run_is_recorded_in_the_state_and_step_metrics_without_a_warning():
  step, state = _stalling_step("record")
  default = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0, stall_after=3)
  assert default.init({"w": jnp.ones(2)}).stalled.dtype == state.stalled.dtype
  for _ in range(3):
    state = step(state, jnp.array([jnp.nan, 1.0]))  # warnings are errors in this suite
  metrics = jax.device_get(jaxamp.step_metrics(state))
  assert bool(jaxamp.stalled(state)) and metrics["stalled"] and metrics["skip_streak"] == 3


def test_under_vmap_only_the_run_that_stalls_warns_once():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0, stall_after=3, on_stall="warn")
  params = {"w": jnp.ones(2)}
  step = jax.jit(jax.vmap(lambda g, s: tx.update({"w": g}, s, params)[1]))
  states = jax.vmap(lambda _: tx.init(params))(jnp.arange(2))
  grads = jnp.array([[jnp.nan, 1.0], [1.0, 1.0]])  # the first run never gets a finite step
  with warnings.catch_warnings(record=True) as logged:
    warnings.simplefilter("always")
    for _ in range(5):
      states = step(grads, states)
    jax.block_until_ready(states)
  assert [type(w.message) for w in logged] == [jaxamp.StallWarning]
  assert str(logged[0].message).startswith("jaxamp.dynamic_loss_scale: 3 consecutive steps")
  np.testing.assert_array_equal(states.stalled, [True, False])


def test_on_stall_ignore_records_the_stall_without_a_warning():
  step, state = _stalling_step("ignore")
  for _ in range(4):
    state = step(state, jnp.array([jnp.nan, 1.0]))
  assert bool(state.stalled)


@pytest.mark.parametrize("factory", [
    lambda v: jaxamp.dynamic_loss_scale(optax.sgd(0.1), on_stall=v),
    lambda v: jaxamp.static_loss_scale(optax.sgd(0.1), 2.0, on_stall=v),
])
def test_on_stall_is_validated(factory):
  with pytest.raises(ValueError,
                     match=r"on_stall must be one of \('record', 'warn', 'ignore'\), got 'raise'"):
    factory("raise")
