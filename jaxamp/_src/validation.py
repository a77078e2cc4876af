"""Checks of hyperparameters, raised at construction with the argument, the value and what is accepted."""

from __future__ import annotations

import numbers
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

INT32_MAX = int(np.iinfo(np.int32).max)
_F32_MAX = float(np.finfo(np.float32).max)


def concrete_scalar(value: Any) -> Any:
  """Unwraps a concrete 0-d numpy/JAX array; refuses traced values."""
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
        f"got the traced value {value!r}; loss-scaling hyperparameters select code at "
        "construction and must be Python numbers (with optax.inject_hyperparams, list them "
        "in static_args)")
  if isinstance(value, (np.ndarray, np.generic, jax.Array)) and np.ndim(value) == 0:
    return np.asarray(value).item()
  return value


def check_real(name: str, value: Any) -> float:
  """A real number (not a bool), as a float; concrete 0-d arrays are accepted."""
  try:
    value = concrete_scalar(value)
  except TypeError as err:
    raise TypeError(f"{name} must be a real number: {err}") from None
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{name} must be a real number, got {value!r} of type {type(value).__name__}")
  return float(value)


def check_finite(name: str, value: Any) -> float:
  """A finite real number, as a float."""
  value = check_real(name, value)
  if not np.isfinite(value):
    raise ValueError(f"{name} must be finite, got {value!r}")
  return value


def check_int(name: str, value: Any) -> int:
  """An int in ``[1, INT32_MAX]`` (it is counted by an int32 in the state)."""
  try:
    value = concrete_scalar(value)
  except TypeError as err:
    raise TypeError(f"{name} must be an int: {err}") from None
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
  if value < 1:
    raise ValueError(f"{name} must be an int >= 1, got {value!r}")
  if value > INT32_MAX:
    raise ValueError(f"{name} must be an int <= {INT32_MAX} (it is counted in an int32), "
                     f"got {value!r}")
  return int(value)


def check_bool(name: str, value: Any) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool, got {value!r}")
  return bool(value)


def check_scale(name: str, value: Any, low: float = 0.0, high: float = _F32_MAX) -> float:
  """A positive, finite loss scale within ``[low, high]``."""
  value = check_finite(name, value)
  if value <= 0.0:
    raise ValueError(f"{name} must be a positive, finite number, got {value!r}")
  if not low <= value <= high:
    raise ValueError(f"{name} must lie in [min_scale, max_scale] = [{low!r}, {high!r}], "
                     f"got {value!r}")
  return value


def check_float_dtype(name: str, dtype: Any, *, allow_none: bool = False) -> Optional[jnp.dtype]:
  """A floating-point dtype (or ``None`` where allowed), as a ``jnp.dtype``."""
  accepted = "None or a floating-point dtype" if allow_none else "a floating-point dtype"
  if dtype is None and allow_none:
    return None
  try:
    out = jnp.dtype(dtype)
  except TypeError:
    raise TypeError(f"{name} must be {accepted}, got {dtype!r}") from None
  if not jnp.issubdtype(out, jnp.floating):
    raise ValueError(f"{name} must be {accepted} (float32 is usual), got {out}")
  return out


def is_transformation(value: Any) -> bool:
  """Whether ``value`` has an ``init`` and an ``update`` (an optax GradientTransformation)."""
  return callable(getattr(value, "init", None)) and callable(getattr(value, "update", None))


def check_transformation(name: str, value: Any) -> optax.GradientTransformationExtraArgs:
  """An optax transformation, with extra-args support."""
  if not is_transformation(value):
    raise TypeError(
        f"{name} must be an optax GradientTransformation (with init and update), got {value!r}")
  return optax.with_extra_args_support(value)
