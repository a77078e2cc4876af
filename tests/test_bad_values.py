"""Bad values never corrupt a run: a property-based suite over every public entry point.

Every value that reaches a state from outside (a constructor argument, a
setter, ``GradScaler.update(new_scale)``, a loaded state dict, a restored
optimizer state, a ``build_optim_wrapper`` config) is generated from a pool
of every kind: nan, +-inf, 0, -0, negative, denormal, huge, fractional,
bools, strings, ``None``, numpy and JAX scalars, arrays of the wrong shape,
missing and extra keys, and the state dicts of the other facades. Each call
must end one of two ways:

* **refused**: an exception of a documented type (``TypeError``,
  ``ValueError``, ``KeyError``, ``RuntimeError`` or ``AssertionError``, the
  types the originals raise) whose message names the argument or key, with
  the object's ``state_dict()`` unchanged and its next ordinary iteration
  working; or
* **accepted**: a short run on a descent problem (``sum((w - 1)**2)`` from
  ``w = 0``) ends with finite parameters, a finite positive scale, and a
  lower loss.

The default profile is sized for CI (a few hundred cases in all, compiled
objects reused across cases). The long profile multiplies every budget by
``JAXAMP_BAD_VALUES_LONG`` (e.g. ``JAXAMP_BAD_VALUES_LONG=40 pytest
tests/test_bad_values.py``). With ``JAXAMP_BAD_VALUES_REPORT=<path>`` the
number of cases each entry point ran, refused and accepted is written there
as JSON; with ``JAXAMP_BAD_VALUES_COLLECT=<path>`` failures are recorded
there instead of raised (to survey a whole code base at once).
"""

from __future__ import annotations

import collections
import copy
import json
import math
import os
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import jaxamp

_LONG = int(os.environ.get("JAXAMP_BAD_VALUES_LONG", "1"))
_COUNTS: dict = collections.defaultdict(collections.Counter)
_DOCUMENTED = (TypeError, ValueError, KeyError, RuntimeError, AssertionError)


def _settings(n: int):
  return settings(max_examples=n * _LONG, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module", autouse=True)
def _report():
  yield
  path = os.environ.get("JAXAMP_BAD_VALUES_REPORT")
  if path:
    with open(path, "w", encoding="utf-8") as f:
      json.dump({k: dict(v) for k, v in sorted(_COUNTS.items())}, f, indent=1)
  if _COLLECT:
    with open(_COLLECT, "w", encoding="utf-8") as f:
      json.dump(_FAILURES, f, indent=1)


# -------------------------------------------------------------------------------------------------
# Values of every kind.
# -------------------------------------------------------------------------------------------------

_SPECIAL = [
    math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, -4.0, 5e-324, 1e-40, 1e-45, 1e39, 1e308,
    2.5, 0.5, 1.0, 2.0, 8.0, 2**40, -3, 0, 1, 3, 2**31, True, False, None, "1", "False", "nan",
    [], [8.0, math.nan], [8.0], (2.0,), {}, {"a": 1},
    np.float32(8.0), np.float64(math.nan), np.float16(65504), np.int64(2**40), np.int32(-1),
    np.bool_(True), np.array(8.0), np.array([8.0]), np.ones(2), np.ones((2, 2)), np.array([]),
]


def _jax_values():
  return st.sampled_from(["nan", "zero", "neg", "big", "ok", "vec", "int"]).map({
      "nan": lambda: jnp.float32(math.nan), "zero": lambda: jnp.array(0.0),
      "neg": lambda: jnp.float32(-2.0), "big": lambda: jnp.array(1e30),
      "ok": lambda: jnp.float32(16.0), "vec": lambda: jnp.ones(3),
      "int": lambda: jnp.int32(4)}.__getitem__).map(lambda f: f())


values = st.one_of(
    st.sampled_from(_SPECIAL),
    st.sampled_from(_SPECIAL),
    st.sampled_from(_SPECIAL),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=1e-3, max_value=1e4),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.integers(min_value=0, max_value=3000),
    _jax_values(),
)


# -------------------------------------------------------------------------------------------------
# The descent problem and the assertion.
# -------------------------------------------------------------------------------------------------

W0 = {"w": jnp.zeros(2)}


def loss_fn(params, target):
  return jnp.sum((params["w"] - target) ** 2)


TARGET = jnp.ones(2)


def _loss(params) -> float:
  return float(loss_fn(params, TARGET))


def _mentions(err: BaseException, names: tuple) -> bool:
  text = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
  # PyTorch's and Paddle's own messages spell some names out ("The growth factor must be > 1.0.").
  return any(name in text or name.replace("_", " ") in text for name in names)


def _same(a: Any, b: Any) -> bool:
  """Equality of state dicts holding Python values and arrays (nan equal to nan)."""
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  if ta != tb or len(la) != len(lb):
    return False
  for x, y in zip(la, lb):
    if isinstance(x, str) or isinstance(y, str):
      if x != y:
        return False
      continue
    x, y = np.asarray(x), np.asarray(y)
    if x.shape != y.shape or x.dtype != y.dtype:
      return False
    if not np.array_equal(x, y, equal_nan=np.issubdtype(x.dtype, np.inexact)):
      return False
  return True


def sane(value: Any, low: float, high: float) -> bool:
  """Whether an accepted ``value`` must let the run descend: anything but a legal, useless one.

  A learning rate of 0 or of 1e38, or a momentum of 5, is legal (the
  originals' constructors accept it) and stalls or diverges on any problem:
  that is the user's choice, and only a finite, positive scale is asserted
  then. A value outside the legal range (nan, negative) that is accepted
  must still give a descending run: that is what catches ascent.
  """
  try:
    number = float(np.asarray(value).reshape(()))
  except (TypeError, ValueError):
    return True
  if isinstance(value, (bool, str)) or not math.isfinite(number) or number < 0:
    return True
  return low <= number < high


_COLLECT = os.environ.get("JAXAMP_BAD_VALUES_COLLECT")
_FAILURES: list = []


def check(entry: str, call: Callable[[], Any], names: tuple, *,
          snapshot: Callable[[], Any] = lambda: None,
          run: Callable[[Any], tuple[Any, float]], descent: bool = True,
          loaded: Any = None) -> None:
  """:func:`_check`; with ``JAXAMP_BAD_VALUES_COLLECT=<path>``, failures are recorded, not raised.

  ``loaded``: for a load, the dict loaded; an accepted load must restore it
  as given (:func:`_as_loaded`).
  """
  if not _COLLECT:
    _check(entry, call, names, snapshot=snapshot, run=run, descent=descent, loaded=loaded)
    return
  try:
    _check(entry, call, names, snapshot=snapshot, run=run, descent=descent, loaded=loaded)
  except Exception as err:  # noqa: BLE001 (the collecting mode records every failure)
    _FAILURES.append({"entry": entry, "error": f"{type(err).__name__}: {err}"[:300]})


def _as_loaded(loaded: Any, current: Any) -> bool:
  """Whether ``current`` (a ``state_dict()``) holds what ``loaded`` held: same keys, same values.

  A load that is accepted must restore what it was given: not ``"False"``
  as ``True``, not the first element of a longer scale, not fewer members.
  """
  if isinstance(loaded, dict) or isinstance(current, dict):
    if not (isinstance(loaded, dict) and isinstance(current, dict)):
      return False
    return set(loaded) == set(current) and all(_as_loaded(loaded[k], current[k])
                                                 for k in loaded)
  try:
    a = np.asarray(loaded).reshape(-1)
    b = np.asarray(current).reshape(-1)
  except (TypeError, ValueError):
    return False
  if a.shape != b.shape or a.dtype.kind in "OUS" or b.dtype.kind in "OUS":
    return False
  if a.dtype == np.bool_ or b.dtype == np.bool_:
    return a.dtype == b.dtype and bool(np.all(a == b))
  return bool(np.all((a.astype(np.float64) == b.astype(np.float64))
                     | (np.isnan(a.astype(np.float64)) & np.isnan(b.astype(np.float64)))))


def _check(entry: str, call: Callable[[], Any], names: tuple, *,
          snapshot: Callable[[], Any] = lambda: None,
          run: Callable[[Any], tuple[Any, float]], descent: bool = True,
          loaded: Any = None) -> None:
  """Runs ``call``; asserts either a clean refusal or an uncorrupted, descending run.

  ``run(result)`` takes what ``call`` returned (``None`` when it was
  refused), trains a few steps on the descent problem and returns
  ``(params, scale)``. ``descent=False`` asserts only a finite, positive
  scale after an accepted call: for a legal value the run cannot descend
  with (a learning rate of 0, or of 1e38, which overflows the parameters as
  it would in PyTorch).
  """
  before = snapshot()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
      result = call()
    except _DOCUMENTED as err:
      _COUNTS[entry]["refused"] += 1
      assert _mentions(err, names), f"{entry}: {type(err).__name__}({err}) names none of {names}"
      assert _same(snapshot(), before), f"{entry}: refused, but the state changed"
      result = None
      refused = True
    else:
      _COUNTS[entry]["accepted"] += 1
      refused = False
      if loaded is not None:
        assert _as_loaded(loaded, snapshot()), f"{entry}: accepted, but not restored as given"
    params, scale = run(result)
  _COUNTS[entry]["cases"] += 1
  assert math.isfinite(scale) and scale > 0, f"{entry}: scale {scale}"
  if refused or descent:
    leaves = jax.tree.leaves(params)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in leaves), f"{entry}: non-finite params"
    assert _loss(params) < _loss(W0), f"{entry}: no descent ({_loss(params)})"


# -------------------------------------------------------------------------------------------------
# The functional core.
# -------------------------------------------------------------------------------------------------

_FACTORY_ARGS = {
    "dynamic_loss_scale": ("init_scale", "growth_factor", "backoff_factor", "growth_interval",
                           "hysteresis", "min_scale", "max_scale", "stall_after"),
    "static_loss_scale": ("scale", "stall_after"),
    "clip_grad_norm": ("max_norm",),
    "clip_grad_value": ("clip_value",),
    "accumulate_gradients": ("every_k", "total_steps"),
}


def _build_tx(factory: str, kwargs: dict):
  sgd = optax.sgd(0.1)
  if factory == "dynamic_loss_scale":
    return jaxamp.dynamic_loss_scale(sgd, **kwargs)
  if factory == "static_loss_scale":
    return jaxamp.static_loss_scale(sgd, kwargs.pop("scale", 8.0), **kwargs)
  if factory == "clip_grad_norm":
    kwargs.setdefault("max_norm", 1.0)
    return jaxamp.dynamic_loss_scale(optax.chain(jaxamp.clip_grad_norm(**kwargs), sgd),
                                     init_scale=8.0)
  if factory == "clip_grad_value":
    kwargs.setdefault("clip_value", 1.0)
    return jaxamp.dynamic_loss_scale(optax.chain(jaxamp.clip_grad_value(**kwargs), sgd),
                                     init_scale=8.0)
  kwargs.setdefault("every_k", 1)
  return jaxamp.accumulate_gradients(jaxamp.dynamic_loss_scale(sgd, init_scale=8.0),
                                     raise_past_end=False, **kwargs)


def _step(tx, params, state):
  scale = jaxamp.loss_scale(state)
  grads = jax.grad(lambda p: loss_fn(p, TARGET) * scale)(params)
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


_JITTED_STEPS: dict = {}


def _run_tx(tx, state=None, steps: int = 2, *, reuse: bool = False) -> tuple[Any, float]:
  """Trains ``steps`` steps; ``reuse=True`` compiles the step once per ``tx`` (a shared one)."""
  params = W0
  state = tx.init(params) if state is None else state
  step = (_JITTED_STEPS.setdefault(id(tx), jax.jit(lambda p, s: _step(tx, p, s))) if reuse
          else lambda p, s: _step(tx, p, s))
  for _ in range(steps):
    params, state = step(params, state)
  return params, float(jaxamp.loss_scale(state))


_DEFAULT_TXS: dict = {}


def _default_tx(factory: str):
  if factory not in _DEFAULT_TXS:
    _DEFAULT_TXS[factory] = _build_tx(factory, {})
  return _DEFAULT_TXS[factory]


@_settings(40)
@given(factory=st.sampled_from(sorted(_FACTORY_ARGS)), data=st.data())
def test_functional_factories(factory, data):
  name = data.draw(st.sampled_from(_FACTORY_ARGS[factory]))
  value = data.draw(values)
  kwargs = {name: value}

  def run(tx):
    if tx is None:
      return _run_tx(_default_tx(factory), reuse=True)
    return _run_tx(tx)

  # A window longer than the run, or a bound that clips everything away, cannot descend.
  descent = (not (name == "every_k" and not sane(value, 0, 3))
             and not (name in ("max_norm", "clip_value") and not sane(value, 1e-3, math.inf)))
  check(f"{factory}({name}=)", lambda: _build_tx(factory, dict(kwargs)), (name,), run=run,
        descent=descent)


_TEMPLATE_TX = jaxamp.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9), init_scale=8.0)
_TEMPLATE = _TEMPLATE_TX.init(W0)
_RESTORED = {
    "scale": 8.0, "growth_tracker": 5, "overflow_count": 0, "skipped": False,
    "skipped_steps": 3, "skip_streak": 0, "stalled": False,
    "nonfinite_leaves": np.zeros(1, bool),
    "inner_state": [{"trace": {"w": np.zeros(2, np.float32)}}, {}]}
_OTHER_DICTS = [
    jaxamp.GradScaler(init_scale=8.0).state_dict(), jaxamp.paddle.GradScaler().state_dict(),
    None, [1, 2], {}, "state",
]


@_settings(25)
@given(key=st.sampled_from(sorted(_RESTORED) + ["trace", "extra", "missing", "other"]),
       value=values, data=st.data())
def test_upgrade_opt_state(key, value, data):
  restored = copy.deepcopy(_RESTORED)
  names: tuple = (key,)
  if key == "trace":
    restored["inner_state"][0]["trace"]["w"] = value
    names = ("trace",)
  elif key == "extra":
    restored["unexpected"] = value
    names = ("unexpected",)
  elif key == "missing":
    del restored[data.draw(st.sampled_from(sorted(_RESTORED)))]
  elif key == "other":
    restored = data.draw(st.sampled_from(_OTHER_DICTS))
    names = ("state", "LossScaleState", "field", "key")
  else:
    restored[key] = value
  template_before = jax.tree.map(np.asarray, _TEMPLATE)

  def run(state):
    assert _same(jax.tree.map(np.asarray, _TEMPLATE), template_before)
    return _run_tx(_TEMPLATE_TX, state if state is not None else _TEMPLATE, reuse=True)

  check("upgrade_opt_state", lambda: jaxamp.upgrade_opt_state(restored, _TEMPLATE),
        names + ("state",), run=run)


@_settings(10)
@given(value=values)
def test_set_loss_scale(value):
  check("set_loss_scale", lambda: jaxamp.set_loss_scale(_TEMPLATE, value), ("scale",),
        run=lambda s: _run_tx(_TEMPLATE_TX, s if s is not None else _TEMPLATE, reuse=True))


# -------------------------------------------------------------------------------------------------
# PyTorch's GradScaler.
# -------------------------------------------------------------------------------------------------

_HOLDER = jaxamp.OptimWrapper(optax.sgd(0.1), W0)


def _torch_iterations(scaler, steps: int = 2) -> tuple[Any, float]:
  _HOLDER.params = W0
  _HOLDER.zero_grad()
  for _ in range(steps):
    _HOLDER.backward(scaler.scale(loss_fn), TARGET)
    scaler.step(_HOLDER)
    scaler.update()
    _HOLDER.zero_grad()
  return _HOLDER.params, float(scaler.get_scale())


_TORCH_ARGS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled",
               "stall_after", "stall_check_every", "device")


@_settings(15)
@given(name=st.sampled_from(_TORCH_ARGS), value=values)
def test_torch_constructor(name, value):
  def run(scaler):
    return _torch_iterations(scaler if scaler is not None else jaxamp.GradScaler(init_scale=8.0))

  check("GradScaler()", lambda: jaxamp.GradScaler(**{name: value}), (name,), run=run)


def _torch_scaler():
  scaler = jaxamp.GradScaler(init_scale=8.0, growth_interval=3)
  _torch_iterations(scaler, 1)
  return scaler


@_settings(15)
@given(setter=st.sampled_from(["set_growth_factor", "set_backoff_factor", "set_growth_interval",
                               "update"]), value=values)
def test_torch_setters_and_update(setter, value):
  scaler = _torch_scaler()
  if setter == "update":
    # update(new_scale) ends an iteration: give it one to end.
    _HOLDER.backward(scaler.scale(loss_fn), TARGET)
    scaler.step(_HOLDER)
    _HOLDER.zero_grad()
    names: tuple = ("new_scale",)
  else:
    names = ("factor", "interval", "growth", "backoff")
  def run(result):
    if setter == "update" and result is None and value is not None:
      scaler.update()  # the refused update(new_scale) left the iteration open, as it was
    return _torch_iterations(scaler)

  check(f"GradScaler.{setter}", lambda: getattr(scaler, setter)(value) or "done", names,
        snapshot=scaler.state_dict, run=run)


_TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def _mutated(base: dict, data, keys, entry_names=None) -> tuple[Any, tuple]:
  """``base`` with one key set to a generated value, deleted or added, or another dict."""
  kind = data.draw(st.sampled_from(["set", "set", "set", "missing", "extra", "other"]))
  out = dict(base)
  if kind == "set":
    key = data.draw(st.sampled_from(keys))
    out[key] = data.draw(values)
    return out, (key,)
  if kind == "missing":
    key = data.draw(st.sampled_from(keys))
    del out[key]
    return out, (key,)
  if kind == "extra":
    out["unexpected_key"] = data.draw(values)
    return out, ("unexpected_key",)
  other = data.draw(st.sampled_from(_OTHER_DICTS))
  return other, ("state_dict", "empty", "keys") + tuple(keys) + tuple(entry_names or ())


@_settings(25)
@given(data=st.data())
def test_torch_load_state_dict(data):
  scaler = _torch_scaler()
  sd, names = _mutated(scaler.state_dict(), data, _TORCH_KEYS)
  check("GradScaler.load_state_dict", lambda: scaler.load_state_dict(sd), names,
        snapshot=scaler.state_dict, run=lambda _: _torch_iterations(scaler), loaded=sd)


@_settings(8)
@given(value=values)
def test_torch_clip_grad_norm_(value):
  def call():
    _HOLDER.params = W0
    _HOLDER.grads = jax.grad(loss_fn)(W0, TARGET)
    return jaxamp.clip_grad_norm_(_HOLDER, value)

  def run(_):
    _HOLDER.zero_grad()
    return _torch_iterations(jaxamp.GradScaler(init_scale=8.0))

  check("clip_grad_norm_", call, ("max_norm",), run=run)


def test_step_without_gradients_leaves_the_optimizer_usable():
  scaler = jaxamp.GradScaler(init_scale=8.0)
  _HOLDER.zero_grad()
  scaler.scale(loss_fn)
  with pytest.raises(AssertionError, match="No inf checks"):
    scaler.step(_HOLDER)
  params, scale = _torch_iterations(scaler, 2)  # PyTorch raises here, on every later iteration
  assert _loss(params) < _loss(W0) and scale == 8.0


# -------------------------------------------------------------------------------------------------
# Paddle's GradScaler.
# -------------------------------------------------------------------------------------------------


def _paddle_iterations(scaler, steps: int = 2) -> tuple[Any, float]:
  _HOLDER.params = W0
  _HOLDER.zero_grad()
  for _ in range(steps):
    _HOLDER.backward(scaler.scale(loss_fn), TARGET)
    scaler.minimize(_HOLDER)
    _HOLDER.zero_grad()
  return _HOLDER.params, float(np.asarray(scaler.state.scale))


_PADDLE_ARGS = ("enable", "init_loss_scaling", "incr_ratio", "decr_ratio", "incr_every_n_steps",
                "decr_every_n_nan_or_inf", "use_dynamic_loss_scaling", "stall_after")


@_settings(15)
@given(name=st.sampled_from(_PADDLE_ARGS), value=values)
def test_paddle_constructor(name, value):
  def run(scaler):
    return _paddle_iterations(scaler if scaler is not None else jaxamp.paddle.GradScaler())

  check("paddle.GradScaler()", lambda: jaxamp.paddle.GradScaler(**{name: value}), (name,),
        run=run)


@_settings(15)
@given(setter=st.sampled_from(["set_init_loss_scaling", "set_incr_ratio", "set_decr_ratio",
                               "set_incr_every_n_steps", "set_decr_every_n_nan_or_inf"]),
       value=values)
def test_paddle_setters(setter, value):
  scaler = jaxamp.paddle.GradScaler(init_loss_scaling=8.0, incr_every_n_steps=3)
  _paddle_iterations(scaler, 1)
  check(f"paddle.GradScaler.{setter}", lambda: getattr(scaler, setter)(value),
        (setter[len("set_"):], "new_" + setter[len("set_"):]),
        snapshot=scaler.state_dict, run=lambda _: _paddle_iterations(scaler))


_PADDLE_KEYS = ("scale", "incr_ratio", "decr_ratio", "incr_every_n_steps",
                "decr_every_n_nan_or_inf", "incr_count", "decr_count", "use_dynamic_loss_scaling")


@_settings(25)
@given(data=st.data())
def test_paddle_load_state_dict(data):
  scaler = jaxamp.paddle.GradScaler(init_loss_scaling=8.0, incr_every_n_steps=3)
  _paddle_iterations(scaler, 1)
  sd, names = _mutated(scaler.state_dict(), data, _PADDLE_KEYS)
  check("paddle.GradScaler.load_state_dict", lambda: scaler.load_state_dict(sd), names,
        snapshot=scaler.state_dict, run=lambda _: _paddle_iterations(scaler), loaded=sd)


# -------------------------------------------------------------------------------------------------
# mmengine's wrappers.
# -------------------------------------------------------------------------------------------------

_AMP = jaxamp.build_optim_wrapper(W0, dict(
    type="AmpOptimWrapper", optimizer=dict(type="SGD", lr=0.1, momentum=0.5),
    loss_scale=dict(init_scale=8.0, growth_interval=3), clip_grad=dict(max_norm=10.0)))
_AMP_GOOD = _AMP.state_dict()


def _wrapper_iterations(wrapper, steps: int = 2) -> tuple[Any, float]:
  wrapper.params = W0
  wrapper.zero_grad()
  for _ in range(steps):
    wrapper.update_params(loss_fn, TARGET)
  scale = wrapper.get_scale() if isinstance(wrapper, jaxamp.AmpOptimWrapper) else 1.0
  return wrapper.params, scale


def _restore_amp():
  _AMP.load_state_dict(_AMP_GOOD)


def _amp_snapshot():
  return _AMP.state_dict()


@_settings(25)
@given(data=st.data())
def test_amp_optim_wrapper_load_state_dict(data):
  _restore_amp()
  good = _AMP.state_dict()
  where = data.draw(st.sampled_from(["loss_scaler", "param_groups", "state", "top"]))
  sd = dict(good)
  descent = True
  if where == "loss_scaler":
    sd["loss_scaler"], names = _mutated(good["loss_scaler"], data, _TORCH_KEYS, ("loss_scaler",))
    names = names + ("loss_scaler",)
  elif where == "param_groups":
    group = dict(good["param_groups"][0])
    key = data.draw(st.sampled_from(["lr", "momentum", "dampening", "weight_decay", "nesterov",
                                     "params"]))
    group[key] = value = data.draw(values)
    sd["param_groups"] = [group]
    names = (key, "param_groups", "parameter group")
    descent = key in ("nesterov", "params") or sane(value, *_SANE[key])
  elif where == "state":
    leaves, treedef = jax.tree.flatten(good["state"])
    index = data.draw(st.integers(0, len(leaves) - 1))
    leaves[index] = data.draw(values)
    sd["state"] = jax.tree.unflatten(treedef, leaves)
    names = ("state",)
  else:
    sd, names = _mutated(good, data, ("state", "param_groups", "loss_scaler"))
  try:
    check("AmpOptimWrapper.load_state_dict", lambda: _AMP.load_state_dict(sd), names,
          snapshot=_amp_snapshot, run=lambda _: _wrapper_iterations(_AMP), descent=descent)
  finally:
    _restore_amp()


@_settings(10)
@given(key=st.sampled_from(["lr", "momentum", "weight_decay", "dampening"]), value=values)
def test_param_group_setters(key, value):
  _restore_amp()

  def call():
    _AMP.param_groups[0][key] = value

  try:
    check("param_groups[0][key] = value", call, (key,), snapshot=_amp_snapshot,
          run=lambda _: _wrapper_iterations(_AMP), descent=sane(value, *_SANE[key]))
  finally:
    _restore_amp()


# Where a hyperparameter lets this problem descend in three steps.
_SANE = {"lr": (1e-3, 0.9), "momentum": (0.0, 0.9), "weight_decay": (0.0, 1.0),
         "dampening": (0.0, 1.0), "lr_mult": (1e-2, 5.0), "bias_lr_mult": (0.0, math.inf)}

_GEN = jaxamp.OptimWrapper(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), W0)
_DISC = jaxamp.OptimWrapper(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
                            {"w": jnp.zeros(3)})
_DICT = jaxamp.OptimWrapperDict(gen=_GEN, disc=_DISC)
_DICT_GOOD = _DICT.state_dict()


@_settings(15)
@given(data=st.data())
def test_optim_wrapper_dict_load_state_dict(data):
  _DICT.load_state_dict(_DICT_GOOD)
  kind = data.draw(st.sampled_from(["missing", "extra", "member", "lr", "other"]))
  sd = dict(_DICT_GOOD)
  descent = True
  if kind == "missing":
    del sd[data.draw(st.sampled_from(["gen", "disc"]))]
    names: tuple = ("gen", "disc")
  elif kind == "extra":
    sd["critic"] = _DICT_GOOD["gen"]
    names = ("critic",)
  elif kind == "member":
    sd["disc"] = data.draw(st.sampled_from(_OTHER_DICTS + [_DICT_GOOD["gen"]]))
    names = ("state_dict", "state", "keys")
  elif kind == "lr":
    sd["gen"] = {"state": _DICT_GOOD["gen"]["state"],
                 "param_groups": [dict(_DICT_GOOD["gen"]["param_groups"][0],
                                       lr=data.draw(values))]}
    names = ("lr",)
    descent = sane(sd["gen"]["param_groups"][0]["lr"], *_SANE["lr"])
  else:
    sd = data.draw(st.sampled_from(_OTHER_DICTS))
    names = ("state_dict", "gen", "disc", "OptimWrapperDict")
  try:
    check("OptimWrapperDict.load_state_dict", lambda: _DICT.load_state_dict(sd), names,
          snapshot=lambda: {k: {} for k in _DICT.state_dict()} if kind == "missing" else (
              _DICT.state_dict()),
          run=lambda _: _wrapper_iterations(_GEN), descent=descent,
          loaded={k: {} for k in sd} if kind == "missing" else None)
  finally:
    _DICT.load_state_dict(_DICT_GOOD)


_CONFIG_KEYS = {
    "optimizer.lr": ("lr", "learning rate"), "optimizer.momentum": ("momentum",),
    "optimizer.weight_decay": ("weight_decay",), "clip_grad.max_norm": ("max_norm",),
    "clip_grad.clip_value": ("clip_value",), "loss_scale": ("loss_scale", "GradScaler"),
    "loss_scale.init_scale": ("init_scale",), "loss_scale.growth_interval": ("growth_interval",),
    "accumulative_counts": ("accumulative_counts",), "custom_keys.lr_mult": ("lr_mult",),
    "bias_lr_mult": ("bias_lr_mult",),
}


def _config(key: str, value: Any) -> dict:
  cfg: dict = dict(type="AmpOptimWrapper", optimizer=dict(type="SGD", lr=0.1),
                   loss_scale=dict(init_scale=8.0))
  head, _, tail = key.partition(".")
  if head == "optimizer":
    cfg["optimizer"][tail] = value
  elif head == "clip_grad":
    cfg["clip_grad"] = (dict(max_norm=value) if tail == "max_norm"
                        else dict(type="value", clip_value=value))
  elif key == "loss_scale":
    cfg["loss_scale"] = value
  elif head == "loss_scale":
    cfg["loss_scale"][tail] = value
  elif key == "custom_keys.lr_mult":
    cfg["paramwise_cfg"] = dict(custom_keys={"w": dict(lr_mult=value)})
  elif key == "bias_lr_mult":
    cfg["paramwise_cfg"] = dict(bias_lr_mult=value)
  else:
    cfg[key] = value
  return cfg


@_settings(15)
@given(key=st.sampled_from(sorted(_CONFIG_KEYS)), value=values)
def test_build_optim_wrapper_configs(key, value):
  cfg = _config(key, value)
  if key == "accumulative_counts" and isinstance(value, int) and value > 4:
    value = cfg[key] = 1 + value % 4  # a long window would cost its length in steps
  descent = {"optimizer.lr": sane(value, *_SANE["lr"]),
             "optimizer.momentum": sane(value, *_SANE["momentum"]),
             "optimizer.weight_decay": sane(value, *_SANE["weight_decay"]),
             "custom_keys.lr_mult": sane(value, *_SANE["lr_mult"]),
             "clip_grad.max_norm": sane(value, 1e-3, math.inf),
             "clip_grad.clip_value": sane(value, 1e-3, math.inf)}.get(key, True)

  def run(wrapper):
    if wrapper is None:
      return _wrapper_iterations(_AMP)
    return _wrapper_iterations(wrapper, 2 * wrapper._counter.accumulative_counts)  # noqa: SLF001

  check("build_optim_wrapper", lambda: jaxamp.build_optim_wrapper(W0, cfg), _CONFIG_KEYS[key],
        run=run, descent=descent)


# -------------------------------------------------------------------------------------------------
# The cases that were found by hand, each stated once.
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value,message", [
    ("scale", -4.0, "state.scale must be a positive, finite number"),
    ("scale", 0.0, "state.scale must be a positive, finite number"),
    ("scale", math.nan, "state.scale must be finite"),
    ("scale", 1e39, "state.scale overflows dtype float32"),
    ("growth_tracker", -3, "state.growth_tracker must be an int >= 0"),
    ("skipped_steps", 2.5, "state.skipped_steps must hold whole numbers"),
    ("inner_state", [{}, {}, {}], "state.inner_state: expected 2 entries, got 3"),
    ("extra", 1, "unexpected fields ['extra']"),
])
def test_upgrade_opt_state_refuses_what_init_would(key, value, message):
  tx = jaxamp.dynamic_loss_scale(optax.sgd(1.0))
  template = tx.init({"w": jnp.zeros(1)})
  old = {"scale": 4.0, "growth_tracker": 0, "overflow_count": 0, "skipped": False,
         "skipped_steps": 0, "inner_state": [{}, {}], key: value}
  with pytest.raises(ValueError) as info:
    jaxamp.upgrade_opt_state(old, template)
  assert message in str(info.value)


@pytest.mark.parametrize("build", [
    lambda: jaxamp.clip_grad_norm(math.nan), lambda: jaxamp.clip_grad_norm(-1.0),
    lambda: jaxamp.clip_grad_value(-1.0), lambda: jaxamp.clip_grad_value(math.nan),
    lambda: jaxamp.OptimWrapper(optax.sgd(0.1), W0, clip_grad=dict(max_norm=math.nan)),
    lambda: jaxamp.OptimWrapper(optax.sgd(0.1), W0, clip_grad=dict(type="value",
                                                                    clip_value=-1.0)),
])
def test_clip_bounds_are_checked_at_construction(build):
  with pytest.raises(ValueError, match=r"(max_norm|clip_value).* must be a number >= 0"):
    build()


def test_a_loaded_learning_rate_is_checked():
  _restore_amp()
  for lr, message in ((math.nan, "must be a finite number"), (-1.0, ">= 0")):
    sd = _AMP.state_dict()
    sd["param_groups"] = [dict(sd["param_groups"][0], lr=lr)]
    with pytest.raises(ValueError, match=r"param_groups'\]\[0\]\['lr'\].*" + message):
      _AMP.load_state_dict(sd)
    assert _same(_AMP.state_dict(), _AMP_GOOD)


def test_a_counter_beyond_int32_is_refused_before_anything_changes():
  scaler = _torch_scaler()
  before = scaler.state_dict()
  with pytest.raises(ValueError, match=r"_growth_tracker'\] must be an int <= 2147483647"):
    scaler.load_state_dict({**before, "growth_interval": 2000, "_growth_tracker": 2**40})
  assert scaler.state_dict() == before
  paddle = jaxamp.paddle.GradScaler(incr_every_n_steps=3)
  before = paddle.state_dict()
  with pytest.raises(ValueError, match=r"incr_count'\] must be an int <= 2147483647"):
    paddle.load_state_dict({**before, "incr_every_n_steps": 2000, "incr_count": 2**40})
  assert _same(paddle.state_dict(), before)
  _restore_amp()
  sd = _AMP.state_dict()
  sd["loss_scaler"] = dict(sd["loss_scaler"], growth_interval=7, _growth_tracker=2**40)
  with pytest.raises(ValueError, match="_growth_tracker"):
    _AMP.load_state_dict(sd)
  assert _same(_AMP.state_dict(), _AMP_GOOD)


@pytest.mark.parametrize("new_scale", [1e-40, jnp.float32(math.nan), jnp.array(0.0)])
def test_update_new_scale_is_checked(new_scale):
  scaler = _torch_scaler()
  _HOLDER.backward(scaler.scale(loss_fn), TARGET)
  scaler.step(_HOLDER)
  before = scaler.state_dict()
  with pytest.raises(ValueError, match="new_scale"):
    scaler.update(new_scale)
  assert scaler.state_dict() == before


@pytest.mark.parametrize("key,value", [
    ("use_dynamic_loss_scaling", "False"), ("use_dynamic_loss_scaling", None),
    ("scale", [8.0, math.nan]), ("scale", []),
])
def test_paddle_load_refuses_what_paddle_misreads(key, value):
  scaler = jaxamp.paddle.GradScaler()
  before = scaler.state_dict()
  with pytest.raises((TypeError, ValueError), match=key):
    scaler.load_state_dict({**before, key: value})
  assert _same(scaler.state_dict(), before)


@pytest.mark.parametrize("load", [
    lambda: jaxamp.GradScaler().load_state_dict(None),
    lambda: jaxamp.GradScaler().load_state_dict([1, 2]),
    lambda: jaxamp.paddle.GradScaler().load_state_dict(None),
])
def test_a_state_dict_that_is_no_dict_is_named(load):
  with pytest.raises(TypeError, match="state_dict must be a dict"):
    load()


def test_skip_report_refuses_params_of_another_structure():
  params = {"a": jnp.ones(2), "b": jnp.ones(3)}
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9))  # its trace is shaped like params
  _, state = tx.update({"a": jnp.array([1.0, jnp.nan]), "b": jnp.ones(3)}, tx.init(params),
                       params)
  assert jaxamp.skip_report(state, params) == ["['a']"]
  with pytest.raises(ValueError, match="another tree structure"):
    jaxamp.skip_report(state, {"x": jnp.ones(2), "y": jnp.ones(3)})


def test_optim_wrapper_dict_refuses_a_missing_member():
  sd = dict(_DICT_GOOD)
  del sd["disc"]
  with pytest.raises(KeyError, match="disc"):
    _DICT.load_state_dict(sd)


def test_validate_opt_state_checks_a_restored_state():
  tx = jaxamp.dynamic_loss_scale(
      optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9))
  state = tx.init(W0)
  assert jaxamp.validate_opt_state(state, state) is state
  inner = state.inner_state
  bad_lr = state._replace(inner_state=inner._replace(
      hyperparams=dict(inner.hyperparams, learning_rate=jnp.float32(-0.1))))
  with pytest.raises(ValueError, match="learning_rate"):
    jaxamp.validate_opt_state(bad_lr)
  nan_mu = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan) if x.shape == (2,) else x, state)
  with pytest.raises(ValueError, match="inf or nan"):
    jaxamp.validate_opt_state(nan_mu)
  with pytest.raises(ValueError, match="structure"):
    jaxamp.validate_opt_state(state, tx.init({"v": jnp.zeros(2)}))
