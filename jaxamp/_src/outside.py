"""Checks of values that reach a state from outside: loaded, restored or set after construction.

A constructor checks its arguments (:mod:`jaxamp._src.validation`); a value
that arrives later (a state dict, a restored checkpoint, a setter,
``GradScaler.update(new_scale)``) must pass the same rules, or a single bad
number turns descent into ascent or stalls a run for good. The rules live
here once, for the functional core and every facade:

* a loss scale is a positive, finite real within ``[min_scale, max_scale]``;
* a counter is a whole number in ``[0, INT32_MAX]`` (it is stored in an int32);
* a flag is a bool (not a string, not ``None``, not ``0``/``1``);
* a clipping bound is a real number that is not nan and not negative;
* a learning rate (and the other hyperparameters PyTorch bounds below by 0)
  is finite and not negative;
* a restored optimizer state has the template's tree structure, shapes and
  dtypes, finite floating leaves and non-negative step counts
  (:func:`validate_opt_state`).

Each check names the key or argument, the bad value and what is accepted.
A caller validates everything a call brings before it changes anything, so
that a refused call leaves its object as it was.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp._src import validation

INT32_MAX = validation.INT32_MAX
#: Smallest normal float32: the smallest scale a state may hold (``DEFAULT_MIN_SCALE``).
MIN_SCALE = float(np.finfo(np.float32).tiny)
#: Largest finite float32: the largest scale a state may hold (``DEFAULT_MAX_SCALE``).
MAX_SCALE = float(np.finfo(np.float32).max)

#: Hyperparameters that PyTorch's constructors bound below by 0 (optax's names too).
NON_NEGATIVE = frozenset({"lr", "learning_rate", "eps", "weight_decay", "momentum", "dampening",
                          "lr_decay", "initial_accumulator_value", "lr_mult", "decay_mult",
                          "alpha"})
#: Hyperparameters in ``[0, 1)`` (PyTorch's Adam betas).
UNIT_INTERVAL = frozenset({"betas[0]", "betas[1]"})


def _host_scalar(name: str, value: Any, accepted: str) -> Any:
  """``value`` as a Python scalar: 0-d and one-element numpy/JAX arrays (and lists) unwrapped."""
  if isinstance(value, jax.core.Tracer):
    raise TypeError(f"{name} must be {accepted}, got a traced value; pass a concrete value")
  if isinstance(value, (list, tuple)):
    if len(value) != 1:
      raise ValueError(f"{name} must be {accepted}, got a sequence of {len(value)} elements: "
                       f"{value!r}")
    value = value[0]
  if isinstance(value, (jax.Array, np.ndarray, np.generic)):
    if np.size(value) != 1:
      raise ValueError(f"{name} must be {accepted}, got an array of shape {np.shape(value)}")
    value = np.asarray(value).reshape(()).item()
  return value


def scale(name: str, value: Any, low: float = MIN_SCALE, high: float = MAX_SCALE) -> float:
  """A loss scale from outside, as a float: positive, finite, within ``[low, high]``.

  Python and numpy reals, 0-d or one-element arrays and one-element lists are
  accepted (Paddle saves its scale as a one-element array).

  Raises:
    TypeError: not a real number (a string, ``None``, a bool...).
    ValueError: several elements, nan, inf, 0, negative, or outside ``[low, high]``.

  Examples:
    >>> scale("scale", np.array([1024.0], np.float32))
    1024.0
  """
  value = _host_scalar(name, value, "a positive, finite number")
  return validation.check_scale(name, value, low, high)


def counter(name: str, value: Any, minimum: int = 0, maximum: int = INT32_MAX) -> int:
  """A counter from outside, as an int: a whole number in ``[minimum, maximum]``.

  Python and numpy integers and one-element integer arrays are accepted; a
  float (even ``3.0``), a bool or a string is not.

  Raises:
    TypeError: not an integer.
    ValueError: outside ``[minimum, maximum]`` (an int32 holds it).

  Examples:
    >>> counter("_growth_tracker", np.int32(5))
    5
  """
  value = _host_scalar(name, value, f"an int in [{minimum}, {maximum}]")
  return validation.check_int(name, value, minimum=minimum, maximum=maximum)


def flag(name: str, value: Any) -> bool:
  """A flag from outside, as a bool: ``bool``, ``numpy.bool_`` or a one-element bool array.

  Raises:
    TypeError: anything else (``"False"``, ``None``, ``0``, ``1``...).

  Examples:
    >>> flag("use_dynamic_loss_scaling", np.array([True]))
    True
  """
  if isinstance(value, (jax.Array, np.ndarray)) and np.size(value) == 1 and (
      np.asarray(value).dtype == np.bool_):
    value = np.asarray(value).reshape(()).item()
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool (True or False), got {value!r} of type "
                    f"{type(value).__name__}")
  return bool(value)


def mapping(name: str, value: Any) -> Mapping:
  """``value`` when it is a dict (a ``Mapping``), else a ``TypeError`` naming ``name``."""
  if not isinstance(value, Mapping):
    raise TypeError(f"{name} must be a dict (a state dict saved by state_dict()), got "
                    f"{value!r} of type {type(value).__name__}")
  return value


def keys(name: str, value: Mapping, required: Sequence[str],
         optional: Sequence[str] = ()) -> None:
  """Refuses a dict without every ``required`` key, or with keys outside ``required + optional``.

  Raises:
    KeyError: a missing key (the original loaders' type).
    ValueError: an unexpected key (a state dict of another class).
  """
  missing = [k for k in required if k not in value]
  if missing:
    raise KeyError(f"{name} lacks the keys {missing} (it needs {list(required)}); is it a state "
                   "dict of another class?")
  extra = sorted(str(k) for k in value if k not in required and k not in optional)
  if extra:
    raise ValueError(f"{name} has unexpected keys {extra} (accepted: "
                     f"{list(required) + list(optional)}); is it a state dict of another class?")


def max_norm(name: str, value: Any) -> float:
  """A clipping norm bound: a real number, not nan, not negative (``inf``: no clipping).

  Raises:
    TypeError: not a real number.
    ValueError: nan or negative (a negative bound flips the gradient's sign).

  Examples:
    >>> max_norm("max_norm", 1)
    1.0
  """
  out = validation.check_real(name, value, arrays=True, kind="clipping bounds")
  if math.isnan(out) or out < 0.0:
    raise ValueError(f"{name} must be a number >= 0 (inf for no clipping), got {value!r}")
  return out


def clip_value(name: str, value: Any) -> float:
  """A clipping value bound: a real number, not nan, not negative (``inf``: no clipping)."""
  return max_norm(name, value)


def hyperparam(name: str, value: Any, key: Optional[str] = None) -> float:
  """A hyperparameter set or loaded after construction (``lr``...): a finite real number.

  ``key`` (the name without its position, e.g. ``'lr'`` for
  ``"param_groups[0]['lr']"``) selects the range: PyTorch's constructors
  refuse negative learning rates, epsilons, momenta and weight decays, and
  so does every later write.

  Raises:
    TypeError: not a real number.
    ValueError: nan, inf, or negative where the constructor refuses it.
  """
  out = validation.check_real(name, validation.one_element(value), arrays=True,
                              kind="hyperparameters")
  if not math.isfinite(out):
    raise ValueError(f"{name} must be a finite number, got {value!r}")
  key = name if key is None else key
  if key in NON_NEGATIVE and out < 0.0:
    raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
  if key in UNIT_INTERVAL and not 0.0 <= out < 1.0:
    raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
  return out


# -------------------------------------------------------------------------------------------------
# Optimizer states.
# -------------------------------------------------------------------------------------------------


def _path(path: Any) -> str:
  return jax.tree_util.keystr(tuple(path)) or "<root>"


def fits(name: str, value: Any, dtype: Any) -> np.ndarray:
  """``value`` as a numpy array of ``dtype``, refusing a value the cast would change.

  A fraction for an integer dtype, a number outside the integer dtype's range,
  a non-bool for a bool dtype, and a finite number that overflows a floating
  dtype are refused; nan and inf are left to the finiteness checks.

  Raises:
    TypeError: a value of another kind (a string, ``None``).
    ValueError: a value the cast would change.
  """
  dtype = jnp.dtype(dtype)
  try:
    raw = np.asarray(value)
  except Exception as err:  # noqa: BLE001 (anything numpy cannot read is not a state leaf)
    raise TypeError(f"{name} must be an array or a number, got {type(value).__name__}: "
                    f"{err}") from None
  if raw.dtype == object or raw.dtype.kind in "USV":
    raise TypeError(f"{name} must be an array or a number of dtype {dtype}, got {value!r}")
  if dtype == np.bool_:
    if raw.dtype != np.bool_:
      raise TypeError(f"{name} must be a bool, got {value!r} of dtype {raw.dtype}")
    return raw
  if np.issubdtype(dtype, np.integer):
    if raw.dtype == np.bool_ or not (np.issubdtype(raw.dtype, np.integer)
                                     or np.issubdtype(raw.dtype, np.floating)):
      raise TypeError(f"{name} must be an integer of dtype {dtype}, got {value!r}")
    info = np.iinfo(dtype)
    as_float = raw.astype(np.float64)
    if not np.all(np.isfinite(as_float)) or np.any(as_float != np.round(as_float)):
      raise ValueError(f"{name} must hold whole numbers (dtype {dtype}), got {value!r}")
    if np.any(as_float < info.min) or np.any(as_float > info.max):
      raise ValueError(f"{name} must lie in [{info.min}, {info.max}] (dtype {dtype}), "
                       f"got {value!r}")
    return raw.astype(dtype)
  if np.issubdtype(dtype, np.floating):
    if raw.dtype == np.bool_ or not (np.issubdtype(raw.dtype, np.number)):
      raise TypeError(f"{name} must be a real number or array of dtype {dtype}, got {value!r}")
    with np.errstate(over="ignore", invalid="ignore"):
      cast = raw.astype(dtype)
    finite_in = np.isfinite(raw.astype(np.float64))
    if np.any(finite_in & ~np.isfinite(cast.astype(np.float64))):
      raise ValueError(f"{name} overflows dtype {dtype}: got {value!r}")
    return cast
  return raw.astype(dtype)


_UNBOUNDED_FLOATS = ("total_norm",)  # a recorded norm may be inf or nan (a skipped step's)
_INJECT_TYPES = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def _is_named(node: Any) -> bool:
  return isinstance(node, tuple) and hasattr(node, "_fields")


def _check_loss_scale_state(node: Any, where: str) -> None:
  from jaxamp._src.state import LossScaleState  # noqa: PLC0415 (state imports this module)
  assert isinstance(node, LossScaleState)
  scale(f"{where}.scale", _concrete(node.scale))
  for field in ("growth_tracker", "overflow_count", "skipped_steps", "skip_streak"):
    counter(f"{where}.{field}", _concrete(getattr(node, field)))
  for field in ("skipped", "stalled"):
    flag(f"{where}.{field}", _concrete(getattr(node, field)))
  leaves = _concrete(node.nonfinite_leaves)
  if np.ndim(leaves) != 1 or np.asarray(leaves).dtype != np.bool_:
    raise ValueError(f"{where}.nonfinite_leaves must be a bool vector, got {leaves!r}")


def _check_accumulation_state(node: Any, where: str) -> None:
  for field in ("mini_step", "gradient_step", "micro_step", "skipped_windows"):
    counter(f"{where}.{field}", _concrete(getattr(node, field)))
  flag(f"{where}.updated", _concrete(node.updated))


def _concrete(x: Any) -> Any:
  if isinstance(x, jax.core.Tracer):
    raise TypeError("validate_opt_state reads the values of the state: call it outside jit, on "
                    "a concrete state")
  return np.asarray(jax.device_get(x)) if isinstance(x, (jax.Array, np.ndarray, np.generic)) else x


@jax.jit
def _nonfinite_flags(leaves: list) -> jax.Array:
  if not leaves:
    return jnp.zeros([0], jnp.bool_)
  return jnp.stack([jnp.logical_not(jnp.all(jnp.isfinite(x))) for x in leaves])


def _walk(tree: Any, prefix: str, floats: list, names: list) -> None:
  """Checks the jaxamp and optax states inside ``tree``; collects the floating leaves to check."""
  from jaxamp._src.state import AccumulationState, LossScaleState  # noqa: PLC0415

  def is_checked(node: Any) -> bool:
    return isinstance(node, (LossScaleState, AccumulationState)) or (
        _is_named(node) and "count" in node._fields)

  for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_checked)[0]:
    where = prefix + _path(path).replace("<root>", "")
    if isinstance(node, LossScaleState):
      _check_loss_scale_state(node, where)
      _walk(node.inner_state, where + ".inner_state", floats, names)
    elif isinstance(node, AccumulationState):
      _check_accumulation_state(node, where)
      _walk(node.acc_grads, where + ".acc_grads", floats, names)
      _walk(node.inner_state, where + ".inner_state", floats, names)
    elif is_checked(node):
      if isinstance(node, _INJECT_TYPES):
        for key, value in node.hyperparams.items():
          if np.size(_concrete(value)) == 1 and key in NON_NEGATIVE:
            hyperparam(f"{where}.hyperparams[{key!r}]", _concrete(value), key=key)
      count = _concrete(node.count)
      if np.size(count) == 1 and np.issubdtype(np.asarray(count).dtype, np.integer):
        counter(f"{where}.count", count)
      for field in node._fields:
        if field != "count":
          _walk(getattr(node, field), f"{where}.{field}", floats, names)
    else:
      _concrete(node)  # refuses a traced state
      last = path[-1] if path else None
      field = getattr(last, "name", getattr(last, "key", None))
      if (isinstance(node, (jax.Array, np.ndarray, np.generic))
          and jnp.issubdtype(jnp.result_type(node), jnp.inexact)
          and field not in _UNBOUNDED_FLOATS):
        floats.append(node)
        names.append(where)


def validate_opt_state(opt_state: optax.OptState, template: Optional[optax.OptState] = None
                       ) -> optax.OptState:
  """Checks an optimizer state that comes from outside (a restored checkpoint, a loaded dict).

  Call it on a state restored with orbax (or any other way) before the first
  step: a bad value there would corrupt the parameters or stall the run
  silently. :func:`jaxamp.upgrade_opt_state` calls it on what it builds, and
  the wrappers' ``load_state_dict`` on what they load. It checks:

  * with ``template`` (e.g. ``tx.init(params)``): the same tree structure,
    leaf shapes and dtypes;
  * every :class:`jaxamp.LossScaleState`: a positive, finite float32 scale
    between the smallest normal float32 and the largest finite one;
    counters in ``[0, 2**31 - 1]``; bool flags;
  * every :class:`jaxamp.AccumulationState`: counters in range, a bool flag;
  * every ``count`` field (optax's step counts): in ``[0, 2**31 - 1]``;
  * the injected hyperparameters (``optax.inject_hyperparams``) that
    PyTorch bounds below (``learning_rate``, ``momentum``, ``weight_decay``,
    ``eps``...): not negative;
  * every other floating leaf (moments, accumulated gradients, injected
    hyperparameters): finite, read in one reduction on the device (one host
    sync). A recorded gradient norm (``total_norm``) may be inf or nan.

  Args:
    opt_state: the state to check (concrete arrays, not traced).
    template: optionally, a state of the right structure.

  Returns:
    ``opt_state`` unchanged.

  Raises:
    ValueError: another structure, shape or dtype than ``template``, or a
      value out of range; the message names the field by its path.
    TypeError: a leaf of the wrong kind.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> tx = jaxamp.dynamic_loss_scale(optax.adam(1e-3))
    >>> state = tx.init({'w': jnp.zeros(2)})
    >>> jaxamp.validate_opt_state(state._replace(scale=jnp.float32(-4.0)))
    Traceback (most recent call last):
    ...
    ValueError: state.scale must be a positive, finite number, got -4.0
  """
  if template is not None:
    treedef: Any
    ref_def: Any
    leaves, treedef = jax.tree_util.tree_flatten_with_path(opt_state)
    ref_leaves, ref_def = jax.tree_util.tree_flatten_with_path(template)
    if treedef != ref_def:
      raise ValueError("the optimizer state does not have the template's structure (a state of "
                       f"another optimizer, or of other parameters): expected {ref_def}, got "
                       f"{treedef}")
    for (path, leaf), (_, ref) in zip(leaves, ref_leaves):
      if jnp.shape(leaf) != jnp.shape(ref) or jnp.result_type(leaf) != jnp.result_type(ref):
        raise ValueError(f"state{_path(path)} must have shape {jnp.shape(ref)} and dtype "
                         f"{jnp.result_type(ref)}, got shape {jnp.shape(leaf)} and dtype "
                         f"{jnp.result_type(leaf)}")

  floats: list = []
  names: list = []
  _walk(opt_state, "state", floats, names)
  if floats:
    bad = np.asarray(_nonfinite_flags(floats))
    if bad.any():
      first = [n for n, b in zip(names, bad) if b]
      raise ValueError(f"the optimizer state holds inf or nan at {first}: a state saved after "
                       "its run had diverged, or a corrupted checkpoint")
  return opt_state
