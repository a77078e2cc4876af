"""Parameter and state pytrees of the wrappers: leaf names, and checks of what users pass in.

A leaf's name is its dotted pytree path (``'backbone.conv.kernel'``; the
``.value`` of Flax variables dropped), which ``param_groups[i]['params']``
lists and ``paramwise_cfg`` matches against. The checks refuse, before
anything is traced, trees that do not match what the wrapper holds, and
say where they differ.
"""

from __future__ import annotations

import numbers
from typing import Any, List, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._src import validation
from jaxamp._src import outside


def _without_value(path: Sequence[Any]) -> tuple:
  """``path`` without the final ``.value`` of a flax Variable."""
  if (len(path) > 1 and isinstance(path[-1], jax.tree_util.GetAttrKey)
      and path[-1].name in ("value", "raw_value")):
    return tuple(path[:-1])
  return tuple(path)


def path_parts(path: Sequence[Any]) -> List[str]:
  """The names along a pytree path, without the ``.value`` of flax Variables."""
  return [jax.tree_util.keystr((k,), simple=True) for k in _without_value(path)]


def param_names(params: Any) -> List[str]:
  """Dotted names of the leaves of ``params`` (``'backbone.conv.kernel'``), in leaf order."""
  return [jax.tree_util.keystr(_without_value(p), simple=True, separator=".") or "<root>"
          for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


is_array = validation.is_array


def where(path: Sequence[Any]) -> str:
  """A pytree path as in messages (``"['w']"``; ``<root>`` for the root)."""
  return jax.tree_util.keystr(tuple(path)) or "<root>"


def short(treedef: Any, limit: int = 300) -> str:
  """``str(treedef)``, cut to ``limit`` characters for messages."""
  text = str(treedef)
  return text if len(text) <= limit else text[:limit] + "..."


def check_params(params: Any) -> Any:
  """``params`` as a pytree of floating-point device arrays (numpy leaves moved to the device).

  Raises:
    ValueError: an empty tree.
    TypeError: leaves that are not arrays, or not floating-point.
  """
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
  if not leaves_with_path:
    raise ValueError("params must be a non-empty pytree of floating-point arrays, got "
                     f"{params!r}")
  out = []
  for path, leaf in leaves_with_path:
    if not is_array(leaf):
      raise TypeError(f"params leaf {where(path)} must be an array, got {type(leaf).__name__} "
                      f"{leaf!r}")
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
      raise TypeError(f"params leaf {where(path)} has dtype {leaf.dtype}; only floating-point "
                      "parameters can be optimized (keep other state outside the wrapper)")
    out.append(leaf if isinstance(leaf, jax.Array) else jnp.asarray(_private_copy(leaf)))
  return jax.tree.unflatten(treedef, out)


def _private_copy(leaf: Any) -> np.ndarray:
  """A numpy copy of a host array: on CPU, JAX may keep a numpy array's buffer as its own
  (jax 0.7.1 does for aligned arrays), and the caller's later writes would then change it."""
  return np.array(leaf, copy=True)


def validated_like_params(value: Any, params: Any, what: str) -> Any:
  """``value`` checked to have the structure, shapes and dtypes of ``params``.

  numpy leaves are put on the device with the sharding of the matching
  parameter.
  """
  ref_def: Any
  treedef: Any
  ref_leaves, ref_def = jax.tree_util.tree_flatten_with_path(params)
  leaves, treedef = jax.tree.flatten(value)
  if treedef != ref_def:
    raise ValueError(f"{what} must have the structure of params: expected "
                     f"{short(ref_def)}, got {short(treedef)}")
  out = []
  for (path, ref), leaf in zip(ref_leaves, leaves):
    if not is_array(leaf):
      raise TypeError(f"{what} leaf {where(path)} must be an array, got "
                      f"{type(leaf).__name__}")
    if tuple(leaf.shape) != tuple(ref.shape) or jnp.dtype(leaf.dtype) != jnp.dtype(ref.dtype):
      raise ValueError(f"{what} leaf {where(path)} must have shape {tuple(ref.shape)} and dtype "
                       f"{ref.dtype} like the parameter, got shape {tuple(leaf.shape)} and dtype "
                       f"{leaf.dtype}")
    out.append(leaf if isinstance(leaf, jax.Array)
               else jax.device_put(_private_copy(leaf), ref.sharding))
  return jax.tree.unflatten(treedef, out)


def validated_like(value: Any, reference: Any, what: str) -> Any:
  """``value`` as a pytree with ``reference``'s structure, shapes and dtypes (on its devices)."""
  ref_def: Any
  treedef: Any
  ref_leaves, ref_def = jax.tree_util.tree_flatten_with_path(reference)
  try:
    leaves, treedef = jax.tree.flatten(value)
  except Exception as e:  # noqa: BLE001 (any flatten failure means "not a pytree")
    raise TypeError(f"{what} is not a pytree: {e}") from None
  if treedef != ref_def:
    raise ValueError(f"{what} does not match this optimizer's state (a state of a different "
                     f"optimizer, or of other parameters): expected {short(ref_def)}, got "
                     f"{short(treedef)}")
  out = []
  for (path, ref), leaf in zip(ref_leaves, leaves):
    if isinstance(leaf, (numbers.Number, np.generic)) and not isinstance(leaf, jax.Array):
      leaf = np.asarray(leaf)
      if jnp.shape(ref) == () and np.can_cast(leaf.dtype, ref.dtype, "same_kind"):
        # A Python number is cast only when the cast keeps it (2**40 is no int32).
        leaf = outside.fits(f"{what} leaf {where(path)}", leaf, ref.dtype)
    if not is_array(leaf):
      raise TypeError(f"{what} leaf {where(path)} must be an array, got {type(leaf).__name__}")
    if tuple(leaf.shape) != tuple(jnp.shape(ref)) or jnp.dtype(leaf.dtype) != jnp.dtype(ref.dtype):
      raise ValueError(f"{what} leaf {where(path)} must have shape {tuple(jnp.shape(ref))} and "
                       f"dtype {jnp.dtype(ref.dtype)}, got shape {tuple(leaf.shape)} and dtype "
                       f"{leaf.dtype}")
    sharding = getattr(ref, "sharding", None)
    if isinstance(leaf, jax.Array) and (sharding is None or leaf.sharding == sharding):
      out.append(leaf)
    else:
      out.append(jax.device_put(leaf if isinstance(leaf, jax.Array) else _private_copy(leaf),
                                sharding))
  return jax.tree.unflatten(ref_def, out)

