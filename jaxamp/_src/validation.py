"""Checks of Python arguments: real numbers, counts, flags, optax transformations.

Factories check their hyperparameters when they are called, before anything
is traced, and say what was expected and what came
(``"growth_factor must be a real number, got '2' of type str"``). The checks
live here once, for the functional core and for the facades alike. Each
returns the value as the Python type it stands for (``float``, ``int``,
``bool``), so callers close over plain numbers, never over arrays.
"""

from __future__ import annotations

import numbers
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

INT32_MAX = int(np.iinfo(np.int32).max)


def concrete_scalar(value: Any, kind: str = "hyperparameters") -> Any:
  """Unwraps a concrete 0-d numpy or JAX array into a Python scalar; refuses traced values.

  Args:
    value: anything; only 0-d arrays are unwrapped.
    kind: what the values are, for the message about traced values.

  Raises:
    TypeError: for a traced value (a hyperparameter that selects code must
      be known at construction).

  Examples:
    >>> concrete_scalar(np.float32(0.5)), concrete_scalar(2)
    (0.5, 2)
  """
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
        f"got the traced value {value!r}; {kind} select code at construction and must be "
        "Python numbers (with optax.inject_hyperparams, list them in static_args)")
  if isinstance(value, (np.ndarray, np.generic, jax.Array)) and np.ndim(value) == 0:
    return np.asarray(value).item()
  return value


def one_element(value: Any) -> Any:
  """A one-element numpy or JAX array as a Python scalar; anything else unchanged (host value).

  Examples:
    >>> one_element(np.array([4.0])), one_element("x")
    (4.0, 'x')
  """
  if isinstance(value, (jax.Array, np.ndarray, np.generic)) and np.size(value) == 1:
    return np.asarray(value).reshape(()).item()
  return value


def check_real(name: str, value: Any, *, finite: bool = False, arrays: bool = False,
               kind: str = "hyperparameters") -> float:
  """``value`` as a Python float, refusing ``bool`` and non-real values.

  Args:
    name: the argument's name, for the message.
    value: a real number (``int``, ``float``, numpy floating scalar).
    finite: also refuse inf and nan (``ValueError``).
    arrays: also accept a concrete 0-d array (unwrapped with
      :func:`concrete_scalar`; a traced value is refused).
    kind: what the values are, for the message about traced values.

  Raises:
    TypeError: ``"<name> must be a real number, got <value> of type <type>"``.
    ValueError: ``"<name> must be finite, got <value>"`` with ``finite=True``.

  Examples:
    >>> check_real("lr", 1), check_real("lr", np.float32(0.5))
    (1.0, 0.5)
  """
  if arrays:
    try:
      value = concrete_scalar(value, kind)
    except TypeError as err:
      raise TypeError(f"{name} must be a real number: {err}") from None
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
    raise TypeError(f"{name} must be a real number, got {value!r} of type {type(value).__name__}")
  out = float(value)
  if finite and not np.isfinite(out):
    raise ValueError(f"{name} must be finite, got {value!r}")
  return out


def check_int(name: str, value: Any, *, minimum: Optional[int] = None,
              maximum: Optional[int] = None) -> int:
  """``value`` as a Python int within ``[minimum, maximum]``, refusing ``bool`` and floats.

  Raises:
    TypeError: ``"<name> must be an int, got <value> of type <type>"``.
    ValueError: ``"<name> must be an int >= <minimum>, got <value>"``, or
      ``"<name> must be an int <= <maximum>, got <value>"``.

  Examples:
    >>> check_int("every_k", np.int32(4), minimum=1)
    4
  """
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
  out = int(value)
  if minimum is not None and out < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
  if maximum is not None and out > maximum:
    raise ValueError(f"{name} must be an int <= {maximum}, got {value!r}")
  return out


def check_bool(name: str, value: Any) -> bool:
  """``value`` as a Python bool; ``bool`` and ``numpy.bool_`` only (not ``0``/``1``).

  Raises:
    TypeError: ``"<name> must be a bool, got <value>"``.

  Examples:
    >>> check_bool("nesterov", np.bool_(True))
    True
  """
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool, got {value!r}")
  return bool(value)


def is_gradient_transformation(value: Any) -> bool:
  """Whether ``value`` has callable ``init`` and ``update``, as an optax transformation has.

  Examples:
    >>> is_gradient_transformation(optax.sgd(0.1)), is_gradient_transformation(optax.sgd)
    (True, False)
  """
  return callable(getattr(value, "init", None)) and callable(getattr(value, "update", None))


def check_gradient_transformation(value: Any, name: str = "inner"
                                  ) -> optax.GradientTransformationExtraArgs:
  """``value`` with extra-args support, when it is an optax transformation.

  Raises:
    TypeError: ``"<name> must be an optax GradientTransformation (with init
      and update), got <value>"``.
  """
  if not is_gradient_transformation(value):
    raise TypeError(
        f"{name} must be an optax GradientTransformation (with init and update), got {value!r}")
  return optax.with_extra_args_support(value)


def check_finite(name: str, value: Any) -> float:
  """A finite loss-scaling hyperparameter (concrete 0-d arrays accepted), as a float."""
  return check_real(name, value, finite=True, arrays=True, kind="loss-scaling hyperparameters")


def check_count(name: str, value: Any) -> int:
  """An int in ``[1, INT32_MAX]``, counted by an int32 in a state (concrete 0-d arrays accepted).

  Examples:
    >>> check_count("every_k", np.int32(4))
    4
  """
  try:
    value = concrete_scalar(value, "loss-scaling hyperparameters")
  except TypeError as err:
    raise TypeError(f"{name} must be an int: {err}") from None
  return check_int(name, value, minimum=1, maximum=INT32_MAX)


def check_scale(name: str, value: Any, low: float = 0.0,
                high: float = float(np.finfo(np.float32).max)) -> float:
  """A positive, finite loss scale within ``[low, high]``, as a float."""
  value = check_finite(name, value)
  if value <= 0.0:
    raise ValueError(f"{name} must be a positive, finite number, got {value!r}")
  if not low <= value <= high:
    raise ValueError(f"{name} must lie in [min_scale, max_scale] = [{low!r}, {high!r}], "
                     f"got {value!r}")
  return value


def check_float_dtype(name: str, dtype: Any, *, allow_none: bool = False) -> Optional[jnp.dtype]:
  """A floating-point dtype (or ``None`` where allowed), as a ``jnp.dtype``.

  Raises:
    TypeError: neither a dtype nor a dtype name (nor ``None`` where allowed).
    ValueError: a dtype that is not floating-point (complex included).
  """
  accepted = "None or a floating-point dtype" if allow_none else "a floating-point dtype"
  if dtype is None:
    if allow_none:
      return None
    # jnp.dtype(None) is float64: say what came.
    raise TypeError(f"{name} must be {accepted} (a dtype or a dtype name), got None")
  try:
    out = jnp.dtype(dtype)
  except TypeError:
    raise TypeError(f"{name} must be {accepted} (a dtype or a dtype name), got {dtype!r}"
                    ) from None
  if not jnp.issubdtype(out, jnp.floating):
    raise ValueError(f"{name} must be {accepted}, got {out}")
  return out


def is_inexact(x: Any) -> bool:
  """Whether ``x`` (an array, a Python or numpy scalar, or a dtype) is floating-point or complex."""
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def is_array(x: Any) -> bool:
  """Whether ``x`` is a JAX or numpy array (or numpy scalar)."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def check_shapes_like(what: str, tree: Any, like_what: str, like: Any, *,
                      leading: bool = False) -> None:
  """Refuses ``tree`` unless it has ``like``'s tree structure and, leaf by leaf, its shapes.

  Where two trees are combined leaf by leaf (gradients and parameters, new
  and old statistics), a leaf of another shape would broadcast silently: a
  gradient of shape ``(1,)`` would step every element of its parameter. A
  trace-time check (shapes are static).

  Args:
    what: what ``tree`` is, for the message (``"the gradients"``).
    tree: the tree to check.
    like_what: what ``like`` is (``"the parameters"``).
    like: the reference tree.
    leading: also accept leaves with extra leading axes (per-example
      gradients, which transformations such as
      ``optax.contrib.differentially_private_aggregate`` take).

  Raises:
    ValueError: another tree structure, or a leaf of another shape (named by
      its path).

  Examples:
    >>> check_shapes_like("the gradients", {'w': np.ones(1)}, "the parameters", {'w': np.ones(2)})
    Traceback (most recent call last):
    ...
    ValueError: the gradients leaf ['w'] has shape (1,), the parameters (2,): ...
  """
  treedef: Any = jax.tree.structure(tree)
  like_def: Any = jax.tree.structure(like)
  if treedef != like_def:
    raise ValueError(f"{what} must have the tree structure of {like_what}: got {treedef}, "
                     f"expected {like_def}")
  for (path, leaf), ref in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(like)):
    shape, ref_shape = tuple(jnp.shape(leaf)), tuple(jnp.shape(ref))
    extra = len(shape) - len(ref_shape)
    if shape != ref_shape and not (leading and extra > 0 and shape[extra:] == ref_shape):
      raise ValueError(f"{what} leaf {jax.tree_util.keystr(path) or '<root>'} has shape {shape}, "
                       f"{like_what} {ref_shape}: a leaf of another shape would be broadcast "
                       "silently")
