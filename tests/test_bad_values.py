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
  lower loss. Where the suite knows the legal values itself (a small model
  of the ranges, below), an accepted value must also be legal as it will be
  stored: ``1e39`` is a finite Python float and an infinite float32, a
  negative second moment or a beta of 1 is no state a run reaches.

Besides every kind of scalar, the strategies draw values finite in Python but
not in float32, betas that float32 rounds to 1, whole arrays of negative
second moments and out-of-range stored betas, gradients and statistics of
other shapes than the parameters, and several keys updated at once.

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
import re
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


F32_MAX = float(np.finfo(np.float32).max)
# Finite in Python, infinite in float32.
float32_overflows = st.one_of(st.floats(min_value=3.5e38, max_value=1e308),
                              st.floats(min_value=-1e308, max_value=-3.5e38))
# Below 1 in Python, 1.0 in float32 (a beta no optimizer can divide by).
rounds_to_one = st.floats(min_value=1 - 2**-25, max_value=1.0, exclude_max=True)

values = st.one_of(
    st.sampled_from(_SPECIAL),
    st.sampled_from(_SPECIAL),
    st.sampled_from(_SPECIAL),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=1e-3, max_value=1e4),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.integers(min_value=0, max_value=3000),
    _jax_values(),
    float32_overflows,
    rounds_to_one,
)


# Hyperparameters, which a float32 state holds: every kind, more often the ones float32 cannot hold.
hyperparameters = st.one_of(values, float32_overflows, st.sampled_from([1e39, -1e39, math.nan]))


def as_float32(x: float) -> float:
  """``x`` as float32 stores it (``inf`` where it overflows)."""
  with np.errstate(over="ignore"):
    return float(np.float32(x))


def number(value: Any) -> Any:
  """``value`` as a float when it is one real number (arrays of one element too), else None."""
  if value is None or isinstance(value, (bool, np.bool_, str)):
    return None
  try:
    array = np.asarray(value)
  except (TypeError, ValueError):
    return None
  if array.dtype.kind not in "iuf" or array.size != 1:
    return None
  return float(array.reshape(()))


def legal_hyperparam(key: str, value: Any) -> bool:
  """Whether PyTorch's range for ``key`` holds ``value`` as a float32 state stores it."""
  x = number(value)
  if x is None or not math.isfinite(x) or not math.isfinite(as_float32(x)):
    return x is None  # not a number: the type check's business, not a range's
  if key.startswith("beta"):
    return 0.0 <= x < 1.0  # stored as 1 - beta, which float32 holds for every beta < 1
  return as_float32(x) >= 0.0


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
          loaded: Any = None, legal: bool = True) -> None:
  """:func:`_check`; with ``JAXAMP_BAD_VALUES_COLLECT=<path>``, failures are recorded, not raised.

  ``loaded``: for a load, the dict loaded; an accepted load must restore it
  as given (:func:`_as_loaded`). ``legal=False``: the suite's own model says
  the value is illegal as stored, so accepting it is a failure.
  """
  kwargs = dict(snapshot=snapshot, run=run, descent=descent, loaded=loaded, legal=legal)
  if not _COLLECT:
    _check(entry, call, names, **kwargs)
    return
  try:
    _check(entry, call, names, **kwargs)
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
          loaded: Any = None, legal: bool = True) -> None:
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
      assert legal, f"{entry}: accepted a value that is illegal as it will be stored"
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
  descent = legal = True
  if where == "loss_scaler":
    sd["loss_scaler"], names = _mutated(good["loss_scaler"], data, _TORCH_KEYS, ("loss_scaler",))
    names = names + ("loss_scaler",)
  elif where == "param_groups":
    group = dict(good["param_groups"][0])
    key = data.draw(st.sampled_from(["lr", "momentum", "dampening", "weight_decay", "nesterov",
                                     "params"]))
    group[key] = value = data.draw(hyperparameters)
    sd["param_groups"] = [group]
    names = (key, "param_groups", "parameter group")
    descent = key in ("nesterov", "params") or sane(value, *_SANE[key])
    legal = key in ("nesterov", "params") or legal_hyperparam(key, value)
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
          snapshot=_amp_snapshot, run=lambda _: _wrapper_iterations(_AMP), descent=descent,
          legal=legal)
  finally:
    _restore_amp()


@_settings(20)
@given(key=st.sampled_from(["lr", "momentum", "weight_decay", "dampening"]), value=hyperparameters)
def test_param_group_setters(key, value):
  _restore_amp()

  def call():
    _AMP.param_groups[0][key] = value

  try:
    check("param_groups[0][key] = value", call, (key,), snapshot=_amp_snapshot,
          run=lambda _: _wrapper_iterations(_AMP), descent=sane(value, *_SANE[key]),
          legal=legal_hyperparam(key, value))
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
  descent = legal = True
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
                                       lr=data.draw(hyperparameters))]}
    names = ("lr",)
    descent = sane(sd["gen"]["param_groups"][0]["lr"], *_SANE["lr"])
    legal = legal_hyperparam("lr", sd["gen"]["param_groups"][0]["lr"])
  else:
    sd = data.draw(st.sampled_from(_OTHER_DICTS))
    names = ("state_dict", "gen", "disc", "OptimWrapperDict")
  try:
    check("OptimWrapperDict.load_state_dict", lambda: _DICT.load_state_dict(sd), names,
          snapshot=lambda: {k: {} for k in _DICT.state_dict()} if kind == "missing" else (
              _DICT.state_dict()),
          run=lambda _: _wrapper_iterations(_GEN), descent=descent,
          loaded={k: {} for k in sd} if kind == "missing" else None, legal=legal)
  finally:
    _DICT.load_state_dict(_DICT_GOOD)


_CONFIG_KEYS = {
    "optimizer.lr": ("lr", "learning rate"), "optimizer.momentum": ("momentum",),
    "optimizer.weight_decay": ("weight_decay",), "optimizer.dampening": ("dampening",),
    "adam.betas": ("beta",), "clip_grad.max_norm": ("max_norm",),
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
  elif head == "adam":
    cfg["optimizer"] = dict(type="Adam", lr=0.1, betas=(0.5, value))
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


@_settings(30)
@given(key=st.sampled_from(sorted(_CONFIG_KEYS)), value=hyperparameters)
def test_build_optim_wrapper_configs(key, value):
  cfg = _config(key, value)
  if key == "accumulative_counts" and isinstance(value, int) and value > 4:
    value = cfg[key] = 1 + value % 4  # a long window would cost its length in steps
  descent = {"optimizer.lr": sane(value, *_SANE["lr"]),
             "optimizer.momentum": sane(value, *_SANE["momentum"]),
             "optimizer.weight_decay": sane(value, *_SANE["weight_decay"]),
             "optimizer.dampening": sane(value, *_SANE["dampening"]),
             "adam.betas": sane(value, 0.0, 0.9999),
             "custom_keys.lr_mult": sane(value, *_SANE["lr_mult"]),
             "clip_grad.max_norm": sane(value, 1e-3, math.inf),
             "clip_grad.clip_value": sane(value, 1e-3, math.inf)}.get(key, True)

  def run(wrapper):
    if wrapper is None:
      return _wrapper_iterations(_AMP)
    return _wrapper_iterations(wrapper, 2 * wrapper._counter.accumulative_counts)  # noqa: SLF001

  legal = {"optimizer.lr": legal_hyperparam("lr", value),
           "optimizer.momentum": legal_hyperparam("momentum", value),
           "optimizer.weight_decay": legal_hyperparam("weight_decay", value),
           "optimizer.dampening": legal_hyperparam("dampening", value),
           "adam.betas": legal_hyperparam("betas", value),
           "custom_keys.lr_mult": legal_hyperparam("lr", 0.1 * (number(value) or 0.0))
           }.get(key, True)
  check("build_optim_wrapper", lambda: jaxamp.build_optim_wrapper(W0, cfg), _CONFIG_KEYS[key],
        run=run, descent=descent, legal=legal)


# -------------------------------------------------------------------------------------------------
# Restored optimizer states: second moments, counts, betas in their stored forms.
# -------------------------------------------------------------------------------------------------

_ADAM = jaxamp.build_optim_wrapper(W0, dict(
    type="AmpOptimWrapper", optimizer=dict(type="Adam", lr=0.1),
    loss_scale=dict(init_scale=8.0, growth_interval=3)))
_ADAM.update_params(loss_fn, TARGET)  # moments and a count a run has
_ADAM_GOOD = _ADAM.state_dict()
_SECOND_MOMENTS = ("exp_avg_sq", "nu")
# Second moments, a count and an injected learning rate (optax's Adam fails strict dtype promotion).
_TS_TX = jaxamp.dynamic_loss_scale(
    optax.chain(optax.scale_by_rms(), optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)),
    init_scale=8.0)


def _filled(shape: tuple, floats=st.floats(width=32)):
  """The whole leaf filled with one float32 value."""
  return floats.map(lambda v: np.full(shape, v, np.float32))


def _leaf_values(shape: tuple, dtype: Any):
  """A scalar of any kind, or the whole leaf filled with one float32 value, or one of shape (1,)."""
  if not np.issubdtype(dtype, np.floating):  # counts: fractional, or of shape (1,)
    return st.one_of(values, st.sampled_from([np.float32(2.5), np.full((1,), 3, dtype)]))
  return st.one_of(values, _filled(shape), _filled(shape, st.sampled_from([0.0, 2.0, 1.0])),
                   st.just(np.full((1,), 8.0, np.float32)))


def _field(path: str) -> str:
  """The field a leaf's path ends in: ``'lr'`` for ``.hyperparams['lr']``, ``'nu'`` for ``.nu['w']``."""
  name = path.rsplit(".", 1)[-1]
  return name.split("'")[1] if name.startswith("hyperparams[") else name.split("[")[0]


def legal_leaf(path: str, value: Any, like: Any) -> bool:
  """Whether ``value`` may stand at ``path`` in a state shaped like ``like`` (the suite's model).

  The tree's shapes and dtypes; finite floats; second moments not negative;
  counts whole in ``[0, 2**31 - 1]``; a scale positive and finite; the
  hyperparameters in PyTorch's ranges, a beta in ``[0, 1)``, stored as
  ``1 - beta`` in ``(0, 1]``.
  """
  array, dtype = np.asarray(value), np.asarray(like).dtype
  if array.dtype.kind in "iuf" and np.can_cast(array.dtype, dtype, "same_kind"):
    with np.errstate(over="ignore", invalid="ignore"):  # cast where the cast keeps the value
      cast = array.astype(dtype)
    as_float = array.astype(np.float64)
    if dtype.kind in "iu" and np.any(cast.astype(np.float64) != as_float):
      return False
    if np.any(np.isfinite(as_float) & ~np.isfinite(cast.astype(np.float64))):
      return False  # finite as given, infinite as stored
    array = cast
  if array.dtype.kind not in "biuf" or array.shape != np.shape(like) or array.dtype != dtype:
    return False
  x = array.astype(np.float64)
  if not np.all(np.isfinite(x)):
    return False
  key = _field(path)
  if key in _SECOND_MOMENTS or key == "count":
    return bool(np.all(x >= 0))
  if key in ("scale",):
    return bool(np.all(x >= float(np.finfo(np.float32).tiny)))
  if key.startswith("one_minus_b"):
    return bool(np.all((x > 0) & (x <= 1)))
  if key in ("b1", "b2"):
    return bool(np.all((x >= 0) & (x < 1)))
  if key in ("learning_rate", "eps", "weight_decay"):
    return bool(np.all(x >= 0))
  return True


def _draw_leaf(data, state: Any) -> tuple[Any, str, bool]:
  """``state`` with one leaf replaced by a drawn value; its path; whether that is legal."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
  moments = [i for i, (path, _) in enumerate(leaves)
             if any(m in jax.tree_util.keystr(path) for m in _SECOND_MOMENTS)]
  if moments and data.draw(st.booleans()):
    # A second moment that is negative: what a conversion that swapped the moments leaves.
    index = data.draw(st.sampled_from(moments))
    value = data.draw(_filled(np.shape(leaves[index][1]),
                              st.floats(max_value=-2.0**-100, width=32)))
  else:
    index = data.draw(st.integers(0, len(leaves) - 1))
    like = leaves[index][1]
    value = data.draw(_leaf_values(np.shape(like), np.asarray(like).dtype))
  path, like = leaves[index]
  new = [leaf for _, leaf in leaves]
  new[index] = value
  where = jax.tree_util.keystr(path)
  return jax.tree_util.tree_unflatten(treedef, new), where, legal_leaf(where, value, like)


@_settings(40)
@given(data=st.data(), keep_betas=st.booleans())
def test_adam_state_leaves_load(data, keep_betas):
  _ADAM.load_state_dict(_ADAM_GOOD)
  state, where, legal = _draw_leaf(data, _ADAM_GOOD["state"])
  group = dict(_ADAM_GOOD["param_groups"][0])
  if not keep_betas:  # the state's stored 1 - beta is then kept as loaded
    del group["betas"]
  sd = dict(_ADAM_GOOD, state=state, param_groups=[group])
  key = _field(where)
  try:
    check("AmpOptimWrapper(Adam).load_state_dict[state]", lambda: _ADAM.load_state_dict(sd),
          ("state", key),
          snapshot=_ADAM.state_dict, run=lambda _: _wrapper_iterations(_ADAM), descent=False,
          legal=legal or (keep_betas and "one_minus_b" in key))
  finally:
    _ADAM.load_state_dict(_ADAM_GOOD)


@jax.jit
def _train_state_step(state):
  grads = jax.grad(lambda p: state.scale_loss(loss_fn(p, TARGET)))(state.params)
  return state.apply_gradients(grads=grads)


@_settings(30)
@given(data=st.data())
def test_train_state_flax_restore(data):
  serialization = pytest.importorskip("flax.serialization")
  target = jaxamp.TrainState.create(apply_fn=None, params=W0, tx=_TS_TX)
  saved = serialization.to_state_dict(target)
  opt_state, where, legal = _draw_leaf(data, target.opt_state)
  saved["opt_state"] = serialization.to_state_dict(opt_state)
  key = _field(where)

  def run(restored):
    state = restored if restored is not None else target
    for _ in range(2):
      state = _train_state_step(state)
    return state.params, float(state.loss_scale)

  def call():
    return serialization.from_state_dict(target, saved)

  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # msgpack and numpy on odd values
    check("flax.serialization into TrainState", call,
          ("state", "step", key), run=run, descent=False,
          legal=legal)


# -------------------------------------------------------------------------------------------------
# Several keys at once: a refusal changes none of them.
# -------------------------------------------------------------------------------------------------

_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "params", "initial_lr")


def _legal_entry(key: str, value: Any) -> bool:
  if key == "betas":
    return (isinstance(value, (tuple, list)) and len(value) == 2
            and all(legal_hyperparam("betas", v) and number(v) is not None for v in value))
  if key == "amsgrad":  # fixed at construction: a value equal to it changes nothing
    built = _ADAM_GOOD["param_groups"][0]["amsgrad"]
    return isinstance(value, (bool, int, float)) and value == built
  if key == "params":
    return False
  return key == "initial_lr" or legal_hyperparam(key, value)


@_settings(40)
@given(data=st.data())
def test_param_group_update_is_atomic(data):
  _ADAM.load_state_dict(_ADAM_GOOD)
  keys = data.draw(st.lists(st.sampled_from(_GROUP_KEYS), min_size=1, max_size=3, unique=True))
  update = {}
  for key in keys:
    if key == "betas":
      update[key] = data.draw(st.one_of(st.tuples(values, values),
                                        st.tuples(st.just(0.9), rounds_to_one), values))
    else:
      update[key] = data.draw(hyperparameters)
  legal = all(_legal_entry(k, v) for k, v in update.items())
  group = _ADAM.param_groups[0]

  def call():
    group.update(update)
    return "done"

  try:
    check("param_groups[0].update", call, tuple(keys) + ("params",),
          snapshot=_ADAM.state_dict, run=lambda _: _wrapper_iterations(_ADAM), descent=False,
          legal=legal)
  finally:
    _ADAM.load_state_dict(_ADAM_GOOD)


# -------------------------------------------------------------------------------------------------
# Two trees combined leaf by leaf: another shape is refused, naming the leaf.
# -------------------------------------------------------------------------------------------------

_SHAPES = [(), (1,), (2,), (3,), (1, 2), (2, 1), (4, 2)]
_SCALED_SGD = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0)


def _combine(entry: str, shape: tuple) -> Any:
  """Combines a tree whose leaf ``'w'`` has ``shape`` with a tree where it has shape ``(2,)``."""
  leaf = jnp.ones(shape)
  if entry == "dynamic_loss_scale.update":
    return _SCALED_SGD.update({"w": leaf}, _SCALED_SGD.init(W0), W0)
  if entry == "TrainState.apply_gradients":
    state = jaxamp.TrainState.create(apply_fn=None, params=W0, tx=_SCALED_SGD)
    return state.apply_gradients(grads={"w": leaf})
  if entry == "accumulate_gradients.update":
    tx = jaxamp.accumulate_gradients(_SCALED_SGD, 2)
    return tx.update({"w": leaf}, tx.init(W0), W0)
  if entry == "keep_if_skipped":
    before = _SCALED_SGD.init(W0)
    _, after = _SCALED_SGD.update({"w": jnp.ones(2)}, before, W0)
    return jaxamp.keep_if_skipped({"w": leaf}, W0, before, after)
  if entry == "overwrite_with_gradient.update":
    variables = {"params": W0, "_overwrite_with_gradient": {"w": jnp.zeros(2)}}
    tx = jaxamp.overwrite_with_gradient(_SCALED_SGD)
    grads = {"params": {"w": jnp.ones(2)}, "_overwrite_with_gradient": {"w": leaf}}
    return tx.update(grads, tx.init(variables), variables)
  params = {"w": jnp.zeros(2, jnp.bfloat16)}
  tx = jaxamp.low_precision_params(optax.sgd(0.1), "kahan")
  return tx.update({"w": leaf.astype(jnp.bfloat16)}, tx.init(params), params)


@_settings(30)
@given(entry=st.sampled_from(["dynamic_loss_scale.update", "TrainState.apply_gradients",
                              "accumulate_gradients.update", "keep_if_skipped",
                              "overwrite_with_gradient.update", "low_precision_params.update"]),
       shape=st.sampled_from(_SHAPES))
def test_trees_of_other_shapes_are_refused(entry, shape):
  check(entry, lambda: _combine(entry, shape), ("['w']",),
        run=lambda _: _run_tx(_TEMPLATE_TX, reuse=True), legal=shape == (2,))


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


# Each value checked as it will be stored (float32), at every entry alike.


@pytest.mark.parametrize("optimizer,key", [
    (dict(type="SGD", lr=1e39), "lr"), (dict(type="SGD", lr=0.1, weight_decay=1e39), "weight_decay"),
    (dict(type="SGD", lr=0.1, momentum=1e39), "momentum"),
    (dict(type="SGD", lr=0.1, momentum=0.9, dampening=math.nan), "dampening"),
    (dict(type="Adagrad", lr=0.1, initial_accumulator_value=1e39), "initial_accumulator_value"),
    (dict(type=optax.adam, learning_rate=1e39), "learning_rate"),
    (dict(type=optax.adam, learning_rate=0.1, b2=0.99999999), "b2"),  # float32 rounds it to 1
])
def test_build_optim_wrapper_checks_values_as_stored(optimizer, key):
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # refused before numpy's overflow warning, not after
    with pytest.raises(ValueError, match=rf"^{key} (overflows dtype float32|must be)"):
      jaxamp.build_optim_wrapper(W0, dict(optimizer=optimizer))


def test_a_beta_below_one_is_stored_as_its_complement():
  # PyTorch's Adam holds 1 - beta: 1 - 0.99999999 is a float32, where 0.99999999 is 1.0.
  wrapper = jaxamp.build_optim_wrapper(W0, dict(optimizer=dict(type="Adam", betas=(0.9,
                                                                                  0.99999999))))
  assert wrapper.param_groups[0]["betas"] == (0.9, 0.99999999)
  wrapper.update_params(loss_fn, TARGET)
  assert bool(jnp.all(jnp.isfinite(wrapper.params["w"])))


@pytest.mark.parametrize("how", ["setter", "load", "update"])
def test_a_learning_rate_float32_cannot_hold_is_refused_everywhere(how):
  _restore_amp()
  with pytest.raises(ValueError, match=r"\['lr'\]: lr overflows dtype float32.*1e\+39"):
    if how == "setter":
      _AMP.param_groups[0]["lr"] = 1e39
    elif how == "update":
      _AMP.param_groups[0].update(lr=1e39)
    else:
      sd = _AMP.state_dict()
      _AMP.load_state_dict(dict(sd, param_groups=[dict(sd["param_groups"][0], lr=1e39)]))
  assert _same(_AMP.state_dict(), _AMP_GOOD)
  params, _ = _wrapper_iterations(_AMP)
  assert _loss(params) < _loss(W0)


def test_param_group_update_is_all_or_nothing():
  _ADAM.load_state_dict(_ADAM_GOOD)
  group = _ADAM.param_groups[0]
  with pytest.raises(ValueError, match=r"\['betas'\]: betas\[1\] must be a number in \[0, 1\)"):
    group.update({"lr": 0.01, "betas": (0.9, 2.0), "initial_lr": 0.5})
  assert group["lr"] == 0.1 and "initial_lr" not in group
  assert _same(_ADAM.state_dict(), _ADAM_GOOD)
  group.update({"lr": 0.01, "betas": (0.8, 0.99)}, initial_lr=0.5)
  assert (group["lr"], group["betas"], group["initial_lr"]) == (0.01, (0.8, 0.99), 0.5)
  _ADAM.load_state_dict(_ADAM_GOOD)


def test_param_group_deletions_say_what_cannot_be_deleted():
  _ADAM.load_state_dict(_ADAM_GOOD)
  group = _ADAM.param_groups[0]
  group["initial_lr"] = 0.1
  for key, why in (("lr", "held in the optimizer state"), ("params", "names the group"),
                   ("amsgrad", "fixed at construction")):
    with pytest.raises(ValueError, match=rf"param_groups\[0\]\['{key}'\] cannot be deleted.*{why}"):
      del group[key]
  with pytest.raises(KeyError, match="has no key 'momentum'"):
    del group["momentum"]
  with pytest.raises(ValueError, match="cannot be deleted"):
    group.clear()
  assert group.pop("missing", None) is None
  assert group.popitem() == ("initial_lr", 0.1)
  with pytest.raises(KeyError, match="popitem"):
    group.popitem()
  assert _same(_ADAM.state_dict(), _ADAM_GOOD)


# validate_opt_state knows the optimizer state's invariants.


def _with_leaf(state, field, value):
  """``state`` with every leaf under a field named ``field`` replaced by ``value``."""
  def put(path, leaf):
    names = [getattr(k, "name", None) for k in path]
    return jnp.full_like(leaf, value) if field in names else leaf
  return jax.tree_util.tree_map_with_path(put, state)


@pytest.mark.parametrize("make,field", [
    (lambda: optax.adam(0.1), "nu"), (lambda: optax.amsgrad(0.1), "nu_max"),
    (lambda: optax.rmsprop(0.1), "nu"), (lambda: optax.adagrad(0.1), "sum_of_squares"),
    (lambda: optax.adafactor(0.1, min_dim_size_to_factor=1), "v_row"),
    (lambda: optax.adadelta(0.1), "e_x"),
])
def test_validate_opt_state_refuses_negative_second_moments(make, field):
  params = {"w": jnp.ones((2, 2))}
  state = make().init(params)
  assert jaxamp.validate_opt_state(_with_leaf(state, field, 0.0)) is not None
  with pytest.raises(ValueError, match=rf"negative second moments at .*{field}"):
    jaxamp.validate_opt_state(_with_leaf(state, field, -1.0))


def test_a_first_moment_may_be_negative():
  state = optax.adam(0.1).init(W0)
  jaxamp.validate_opt_state(_with_leaf(state, "mu", -1.0))


def test_negative_second_moments_are_refused_on_load():
  _ADAM.load_state_dict(_ADAM_GOOD)
  sd = dict(_ADAM_GOOD, state=_with_leaf(_ADAM_GOOD["state"], "exp_avg_sq", -1.0))
  with pytest.raises(ValueError, match=r"negative second moments at .*exp_avg_sq\['w'\]"):
    _ADAM.load_state_dict(sd)
  assert _same(_ADAM.state_dict(), _ADAM_GOOD)


@pytest.mark.parametrize("key,value", [("one_minus_b1", 2.0), ("one_minus_b1", -0.5),
                                       ("one_minus_b1", 0.0), ("one_minus_b2", 1.5)])
def test_a_loaded_stored_beta_is_checked(key, value):
  _ADAM.load_state_dict(_ADAM_GOOD)
  state = _ADAM_GOOD["state"]
  state = state._replace(hyperparams=dict(state.hyperparams, **{key: jnp.float32(value)}))
  group = {k: v for k, v in _ADAM_GOOD["param_groups"][0].items() if k != "betas"}
  with pytest.raises(ValueError, match=rf"hyperparams\['{key}'\] must be a number in \(0, 1\]"):
    _ADAM.load_state_dict(dict(_ADAM_GOOD, state=state, param_groups=[group]))
  assert _same(_ADAM.state_dict(), _ADAM_GOOD)
  params, _ = _wrapper_iterations(_ADAM)
  assert _loss(params) < _loss(W0)


@pytest.mark.parametrize("key,value", [("b1", 1.5), ("b2", 1.0), ("b1", -0.1),
                                       ("learning_rate", -1.0)])
def test_validate_opt_state_checks_injected_hyperparameters(key, value):
  tx = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
  state = tx.init(W0)
  bad = state._replace(hyperparams=dict(state.hyperparams, **{key: jnp.float32(value)}))
  with pytest.raises(ValueError, match=rf"hyperparams\['{key}'\] must be"):
    jaxamp.validate_opt_state(bad, state)


def test_validate_opt_state_checks_a_stored_beta_field():
  optax_contrib = pytest.importorskip("optax.contrib")
  tx = jaxamp.dynamic_loss_scale(optax_contrib.schedule_free(optax.sgd(0.1), 0.1, b1=0.9))
  state = tx.init(W0)
  bad = state._replace(inner_state=state.inner_state._replace(b1=jnp.float32(1.0)))
  with pytest.raises(ValueError, match=r"inner_state.b1 must be a number in \[0, 1\)"):
    jaxamp.validate_opt_state(bad)


@pytest.mark.parametrize("change,message", [
    (lambda s: s._replace(scale=jnp.full([1], 8.0)), r"state.scale must be a scalar"),
    (lambda s: s._replace(skip_streak=jnp.zeros([1], jnp.int32)), r"skip_streak must be a scalar"),
    (lambda s: s._replace(inner_state=(s.inner_state[0]._replace(count=jnp.float32(2.5)),)
                          + s.inner_state[1:]), r"count must hold whole numbers"),
    (lambda s: s._replace(inner_state=(s.inner_state[0]._replace(count=jnp.zeros([1], jnp.int32)),)
                          + s.inner_state[1:]), r"count must be a scalar"),
])
def test_validate_opt_state_without_a_template_refuses_what_would_broadcast(change, message):
  state = jaxamp.dynamic_loss_scale(optax.adam(0.1)).init(W0)
  with pytest.raises(ValueError, match=message):
    jaxamp.validate_opt_state(change(state))
  whole = state._replace(inner_state=(state.inner_state[0]._replace(count=jnp.float32(2.0)),)
                         + state.inner_state[1:])
  jaxamp.validate_opt_state(whole)  # a float count is whole (the template checks dtypes)


# The restore hook jaxamp registers validates what it restores.


@pytest.mark.parametrize("field,value,message", [
    ("scale", np.float32(np.nan), "state.scale must be finite"),
    ("scale", np.full([1], 8.0, np.float32), "must have shape ()"),
    ("growth_tracker", np.int32(-2), "growth_tracker must be an int >= 0"),
])
def test_flax_restore_into_train_state_is_validated(field, value, message):
  serialization = pytest.importorskip("flax.serialization")
  state = jaxamp.TrainState.create(apply_fn=None, params=W0, tx=_TS_TX)
  saved = serialization.to_state_dict(state)
  saved["opt_state"][field] = value
  with pytest.raises(ValueError, match=re.escape(message)):
    serialization.from_bytes(state, serialization.msgpack_serialize(saved))
  restored = serialization.from_bytes(state, serialization.to_bytes(state))
  assert float(restored.loss_scale) == 8.0


def test_flax_restore_refuses_a_negative_step():
  serialization = pytest.importorskip("flax.serialization")
  state = jaxamp.TrainState.create(apply_fn=None, params=W0, tx=_TS_TX)
  saved = serialization.to_state_dict(state)
  saved["step"] = np.int32(-1)
  with pytest.raises(ValueError, match="step must be an int >= 0"):
    serialization.from_state_dict(state, saved)


# Shapes: per-example gradients reach a transformation that reduces them.


def test_per_example_gradients_reach_the_transformation_inside_the_scaler():
  # A transformation that reduces per-example gradients (as optax.contrib's DP-SGD aggregate does).
  mean = optax.GradientTransformation(
      lambda params: optax.EmptyState(),
      lambda updates, state, params=None: (jax.tree.map(lambda g: jnp.mean(g, 0), updates), state))
  tx = jaxamp.dynamic_loss_scale(optax.chain(mean, optax.sgd(0.1)), init_scale=8.0)
  state = tx.init(W0)
  per_example = {"w": jnp.full((4, 2), -8.0)}  # the scaled gradients of four examples
  updates, state = tx.update(per_example, state, W0)
  assert updates["w"].shape == (2,) and not bool(state.skipped)
  with pytest.raises(ValueError, match=r"the updates leaf \['w'\] has shape \(4, 2\)"):
    _SCALED_SGD.update(per_example, _SCALED_SGD.init(W0), W0)  # not reduced: refused


# Unhelpful errors, now named.


def test_errors_name_the_argument():
  with pytest.raises(TypeError, match="inner must be an optax GradientTransformation.*None"):
    jaxamp.overwrite_with_gradient(None)
  with pytest.raises(TypeError, match="state_dtype must be a floating-point dtype.*got None"):
    jaxamp.low_precision_params(optax.sgd(0.1), state_dtype=None)
  tx = jaxamp.low_precision_params(optax.sgd(1e-3), "kahan")
  state = tx.init({"a": jnp.ones(2, jnp.bfloat16), "b": jnp.ones(3)})
  moved = {"a": jnp.ones(2), "b": jnp.ones(3, jnp.bfloat16)}
  with pytest.raises(ValueError, match=r"bfloat16 parameter \['b'\] has shape \(3,\).*\(2,\)"):
    tx.update(jax.tree.map(jnp.ones_like, moved), state, moved)
