"""Checks of values that reach a state from outside: loaded, restored or set after construction.

A constructor checks its arguments (:mod:`jaxamp._src.validation`); a value
that arrives later (a state dict, a restored checkpoint, a setter,
``GradScaler.update(new_scale)``) must pass the same rules, or a single bad
number turns descent into ascent or stalls a run for good. The rules live
here once, for the functional core and every facade, and each checks the
value **as it will be stored**: converted to the dtype the state holds it in
(``1e39`` is a finite Python float and an infinite float32, ``0.99999999``
a beta below 1 that float32 rounds to 1):

* a loss scale is a positive, finite real within ``[min_scale, max_scale]``;
* a counter is a whole number in ``[0, INT32_MAX]`` (it is stored in an int32);
* a flag is a bool (not a string, not ``None``, not ``0``/``1``);
* a clipping bound is a real number that is not nan and not negative;
* a hyperparameter is finite in its stored dtype and in its range there
  (:data:`RANGES`: learning rates and the others PyTorch bounds below by 0
  are not negative, betas lie in ``[0, 1)``, the facade's ``1 - beta`` in
  ``(0, 1]``);
* a restored optimizer state has the template's tree structure, shapes and
  dtypes, scalar scalars, finite floating leaves, non-negative second
  moments, whole non-negative step counts, hyperparameters in range, and no
  loss scaler in a composition that cannot work (:func:`validate_opt_state`).

Each check names the key or argument, the bad value and what is accepted.
A caller validates everything a call brings before it changes anything, so
that a refused call leaves its object as it was.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple, Optional, Sequence

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
#: Hyperparameters in ``[0, 1)``: PyTorch's Adam betas, and optax's.
UNIT_INTERVAL = frozenset({"betas[0]", "betas[1]", "b1", "b2", "b3"})


class Range(NamedTuple):
  """An interval of real numbers, and how a message says it."""

  low: float
  high: float
  low_open: bool
  high_open: bool
  accepted: str

  def holds(self, values: Any) -> Any:
    """Whether each of ``values`` (a float or a numpy array) lies in the interval."""
    above = values > self.low if self.low_open else values >= self.low
    below = values < self.high if self.high_open else values <= self.high
    return above & below


#: The range of each hyperparameter, by its name in the state (PyTorch's or optax's) or by the
#: name of the form the facade stores it in (``1 - beta``, ``1 - alpha``).
RANGES: dict = {
    **{key: Range(0.0, math.inf, False, True, "a finite number >= 0") for key in NON_NEGATIVE},
    **{key: Range(0.0, 1.0, False, True, "a number in [0, 1)") for key in UNIT_INTERVAL},
    **{key: Range(0.0, 1.0, True, False, "a number in (0, 1] (1 - beta, beta in [0, 1))")
       for key in ("one_minus_b1", "one_minus_b2")},
    "one_minus_alpha": Range(-math.inf, 1.0, True, False, "a finite number <= 1 (1 - alpha, "
                             "alpha >= 0)"),
}


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


def hyperparam(name: str, value: Any, key: Optional[str] = None, dtype: Any = np.float32
               ) -> float:
  """A hyperparameter from outside (``lr``...), checked as it will be stored in ``dtype``.

  ``value`` must be a real number that ``dtype`` holds as a finite number
  (``1e39`` overflows float32), within the range :data:`RANGES` gives
  ``key`` (the name without its position, e.g. ``'lr'`` for
  ``"param_groups[0]['lr']"``; ``name`` when not given) once rounded to
  ``dtype``: PyTorch's constructors refuse negative learning rates,
  epsilons, momenta and weight decays, and so does every later write.

  Returns:
    ``value`` as a Python float (before the rounding to ``dtype``).

  Raises:
    TypeError: not a real number.
    ValueError: nan, inf, a number ``dtype`` cannot hold, or out of range.

  Examples:
    >>> hyperparam("lr", 0.1)
    0.1
    >>> hyperparam("betas[1]", 0.99999999)
    Traceback (most recent call last):
    ...
    ValueError: betas[1] must be a number in [0, 1), got 0.99999999 (1.0 as stored in float32)
  """
  out = validation.check_real(name, validation.one_element(value), arrays=True,
                              kind="hyperparameters")
  if not math.isfinite(out):
    raise ValueError(f"{name} must be a finite number, got {value!r}")
  stored = float(fits(name, out, dtype))
  rule = RANGES.get(name if key is None else key)
  if rule is not None and not rule.holds(stored):
    rounded = "" if stored == out else f" ({stored!r} as stored in {jnp.dtype(dtype)})"
    raise ValueError(f"{name} must be {rule.accepted}, got {value!r}{rounded}")
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
      raise ValueError(f"{name} overflows dtype {dtype}, the dtype it is stored in (largest "
                       f"finite: {float(jnp.finfo(dtype).max):.7g}): got {value!r}")
    return cast
  return raw.astype(dtype)


_UNBOUNDED_FLOATS = ("total_norm",)  # a recorded norm may be inf or nan (a skipped step's)
_INJECT_TYPES = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
#: Fields of optimizer states that hold second moments (running means or sums of squares, never
#: negative): by name, and by (state type, name) where the name alone says nothing.
_SECOND_MOMENTS = frozenset({"nu", "nu_max", "sum_of_squares", "exp_avg_sq", "max_exp_avg_sq",
                             "square_avg", "state_sum", "v_row", "v_col", "e_g", "e_x"})
_SECOND_MOMENTS_OF = {"FactoredState": ("v",), "ScaleByAdanState": ("n",),
                      "ScaleBySimplifiedAdEMAMixState": ("n",)}
_SIGNED_MOMENTS = ("SophiaState",)  # its nu is a running estimate of the Hessian, of either sign
#: State fields that hold a beta (optax.contrib.schedule_free's b1), in any stored form.
_BETA_FIELDS = frozenset({"b1", "b2", "b3", "one_minus_b1", "one_minus_b2"})


def _is_named(node: Any) -> bool:
  return isinstance(node, tuple) and hasattr(node, "_fields")


def _is_second_moment(node: Any, field: str) -> bool:
  kind = type(node).__name__
  return kind not in _SIGNED_MOMENTS and (field in _SECOND_MOMENTS
                                          or field in _SECOND_MOMENTS_OF.get(kind, ()))


def scalar(where: str, value: Any) -> Any:
  """``value`` (concrete) when it is a scalar: a one-element array is refused (it would broadcast).

  Raises:
    ValueError: ``value`` has a shape other than ``()``.
  """
  value = _concrete(value)
  if np.ndim(value) != 0:
    raise ValueError(f"{where} must be a scalar (shape ()), got shape {np.shape(value)}")
  return value


def _check_counts(where: str, value: Any) -> None:
  """A step count (or a tree of them): whole numbers in ``[0, INT32_MAX]``, in any dtype."""
  if isinstance(value, (jax.Array, np.ndarray, np.generic)):
    value = scalar(where, value)
  for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
    array = np.asarray(_concrete(leaf))
    name = where + _path(path).replace("<root>", "")
    if array.ndim == 0 and np.issubdtype(array.dtype, np.integer):
      counter(name, array)
      continue
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.number):
      raise TypeError(f"{name} must hold whole numbers, got {leaf!r}")
    as_float = array.astype(np.float64)
    if not np.all(np.isfinite(as_float) & (as_float == np.round(as_float))
                  & (as_float >= 0) & (as_float <= INT32_MAX)):
      raise ValueError(f"{name} must hold whole numbers in [0, {INT32_MAX}], got {leaf!r}")


def _check_range(where: str, key: str, value: Any) -> None:
  """Every element of a stored hyperparameter within the range :data:`RANGES` gives ``key``."""
  array = np.asarray(_concrete(value))
  if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.number):
    return  # not a number: none of the ranges applies (optax's own checks see it)
  if not np.all(RANGES[key].holds(array.astype(np.float64))):
    raise ValueError(f"{where} must be {RANGES[key].accepted}, got {value!r}")


def _check_loss_scale_state(node: Any, where: str) -> None:
  from jaxamp._src.state import LossScaleState  # noqa: PLC0415 (state imports this module)
  assert isinstance(node, LossScaleState)
  scale(f"{where}.scale", scalar(f"{where}.scale", node.scale))
  for field in ("growth_tracker", "overflow_count", "skipped_steps", "skip_streak"):
    counter(f"{where}.{field}", scalar(f"{where}.{field}", getattr(node, field)))
  for field in ("skipped", "stalled"):
    flag(f"{where}.{field}", scalar(f"{where}.{field}", getattr(node, field)))
  leaves = _concrete(node.nonfinite_leaves)
  if np.ndim(leaves) != 1 or np.asarray(leaves).dtype != np.bool_:
    raise ValueError(f"{where}.nonfinite_leaves must be a bool vector, got {leaves!r}")


def _check_accumulation_state(node: Any, where: str) -> None:
  for field in ("mini_step", "gradient_step", "micro_step", "skipped_windows"):
    counter(f"{where}.{field}", scalar(f"{where}.{field}", getattr(node, field)))
  flag(f"{where}.updated", scalar(f"{where}.updated", node.updated))


def _concrete(x: Any) -> Any:
  if isinstance(x, jax.core.Tracer):
    raise TypeError("validate_opt_state reads the values of the state: call it outside jit, on "
                    "a concrete state")
  return np.asarray(jax.device_get(x)) if isinstance(x, (jax.Array, np.ndarray, np.generic)) else x


@jax.jit
def _bad_leaves(floats: list, moments: list) -> tuple[jax.Array, jax.Array]:
  """Per leaf: whether it holds an inf or a nan; per second moment: whether it is negative."""
  def flags(leaves, bad):
    return jnp.stack([bad(x) for x in leaves]) if leaves else jnp.zeros([0], jnp.bool_)

  return (flags(floats, lambda x: jnp.logical_not(jnp.all(jnp.isfinite(x)))),
          flags(moments, lambda x: jnp.any(x < 0)))


def _walk(tree: Any, prefix: str, floats: list, moment: bool = False) -> None:
  """Checks the jaxamp and optax states inside ``tree``.

  Collects ``(path, leaf, is_second_moment)`` for the floating leaves, whose
  values are checked on the device in one reduction.
  """
  from jaxamp._src.state import AccumulationState, LossScaleState  # noqa: PLC0415

  def is_state(node: Any) -> bool:
    return _is_named(node) and bool(node._fields)

  for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_state)[0]:
    where = prefix + _path(path).replace("<root>", "")
    if isinstance(node, LossScaleState):
      _check_loss_scale_state(node, where)
      _walk(node.inner_state, where + ".inner_state", floats)
    elif isinstance(node, AccumulationState):
      _check_accumulation_state(node, where)
      _walk(node.acc_grads, where + ".acc_grads", floats)
      _walk(node.inner_state, where + ".inner_state", floats)
    elif is_state(node):
      if isinstance(node, _INJECT_TYPES):
        for key, value in node.hyperparams.items():
          if key in RANGES:
            _check_range(f"{where}.hyperparams[{key!r}]", key, value)
      for field in node._fields:
        value = getattr(node, field)
        if field == "count":
          _check_counts(f"{where}.count", value)
        elif field in _UNBOUNDED_FLOATS:
          continue
        else:
          if field in _BETA_FIELDS and np.ndim(_concrete(value)) == 0:
            _check_range(f"{where}.{field}", field, value)
          _walk(value, f"{where}.{field}", floats, moment or _is_second_moment(node, field))
    else:
      _concrete(node)  # refuses a traced state
      if isinstance(node, (int, float)) and not isinstance(node, bool):
        node = np.asarray(node)  # a restored Python number, checked as an array is
      if (isinstance(node, (jax.Array, np.ndarray, np.generic))
          and jnp.issubdtype(jnp.result_type(node), jnp.inexact)):
        floats.append((where, node, moment))


def validate_opt_state(opt_state: optax.OptState, template: Optional[optax.OptState] = None
                       ) -> optax.OptState:
  """Checks an optimizer state that comes from outside (a restored checkpoint, a loaded dict).

  Call it on a state restored with orbax (or any other way) before the first
  step: a bad value there would corrupt the parameters or stall the run
  silently. :func:`jaxamp.upgrade_opt_state` calls it on what it builds, and
  the wrappers' ``load_state_dict`` on what they load, and the restore hook
  of ``jaxamp.TrainState`` (``flax.serialization``) on what it restores.
  It checks, with or without a template:

  * with ``template`` (e.g. ``tx.init(params)``): the same tree structure,
    leaf shapes and dtypes;
  * every :class:`jaxamp.LossScaleState`: a scalar, positive, finite float32
    scale between the smallest normal float32 and the largest finite one;
    scalar counters in ``[0, 2**31 - 1]``; scalar bool flags;
  * every :class:`jaxamp.AccumulationState`: scalar counters in range, a
    scalar bool flag;
  * every ``count`` field (optax's step counts): a scalar holding a whole
    number in ``[0, 2**31 - 1]``, whatever its dtype;
  * the second moments of the optimizers jaxamp knows by their state
    (optax's ``nu``, ``nu_max``, ``sum_of_squares``, Adafactor's factors,
    PyTorch's ``exp_avg_sq``, ``square_avg``, ``state_sum``...): not
    negative;
  * the injected hyperparameters (``optax.inject_hyperparams``) and the
    betas of a state, in the form they are stored in: ``learning_rate``,
    ``momentum``, ``weight_decay``, ``eps``... not negative; ``b1``, ``b2``
    in ``[0, 1)``; the facade's ``one_minus_b1``, ``one_minus_b2`` in
    ``(0, 1]``;
  * every other floating leaf (moments, accumulated gradients, injected
    hyperparameters): finite. The values of the arrays are read in one
    reduction on the device (one host sync). A recorded gradient norm
    (``total_norm``) may be inf or nan;
  * no loss scaler in a composition that cannot work (see
    :func:`jaxamp.get_loss_scale_state`).

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
      if not isinstance(leaf, jax.Array):
        # A host value (a Python number, a numpy array as restored): checked as it will be
        # stored, in the template's dtype (1e39 overflows a float32, 2.5 is no int32).
        fits(f"state{_path(path)}", _concrete(leaf), jnp.result_type(ref))
      if jnp.shape(leaf) != jnp.shape(ref) or jnp.result_type(leaf) != jnp.result_type(ref):
        raise ValueError(f"state{_path(path)} must have shape {jnp.shape(ref)} and dtype "
                         f"{jnp.result_type(ref)}, got shape {jnp.shape(leaf)} and dtype "
                         f"{jnp.result_type(leaf)}")

  from jaxamp._src import state as state_lib  # noqa: PLC0415 (state imports this module)
  state_lib.check_compositions(opt_state)
  floats: list = []
  _walk(opt_state, "state", floats)
  if floats:
    moments = [x for _, x, moment in floats if moment]
    nonfinite, negative = jax.device_get(_bad_leaves([x for _, x, _ in floats], moments))
    if nonfinite.any():
      first = [where for (where, _, _), bad in zip(floats, nonfinite) if bad]
      raise ValueError(f"the optimizer state holds inf or nan at {first}: a state saved after "
                       "its run had diverged, or a corrupted checkpoint")
    if negative.any():
      names = [where for where, _, moment in floats if moment]
      first = [where for where, bad in zip(names, negative) if bad]
      raise ValueError(f"the optimizer state holds negative second moments at {first}: a mean "
                       "of squares is never negative (a corrupted checkpoint, or first and "
                       "second moments swapped in a conversion)")
  return opt_state
