"""The static/dynamic split of a loss-function call, as ``jax.jit`` splits its arguments.

``backward(loss_fn, *args, **kwargs)`` passes ``loss_fn``, ``args`` and
``kwargs`` to a jitted function as one pytree: array leaves are traced
(:func:`split_call` returns them as the dynamic part), every other leaf (the
function itself, Python numbers, strings) is static, hashed into a
:class:`CallSpec` that is part of the jit cache key. Repeated calls with
new arrays of the same shapes therefore compile once; a new function
object or a new Python number compiles again, exactly as with
``jax.jit``'s static arguments.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence, Tuple

import jax

from jaxamp._src.facade.mmengine.trees import is_array


class StaticLeaf:
  """A hashable box for a non-array leaf passed to a jitted function as static data."""

  __slots__ = ("value", "_hash")

  def __init__(self, value: Any):
    self.value = value
    try:
      self._hash = hash((type(value), value))
    except TypeError:
      self._hash = id(value)

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other: Any) -> bool:
    if not isinstance(other, StaticLeaf):
      return False
    a, b = self.value, other.value
    if a is b:
      return True
    if type(a) is not type(b) or self._hash != other._hash:
      return False
    try:
      return bool(a == b)
    except Exception:  # noqa: BLE001 (an __eq__ that fails means "not equal")
      return False


@dataclasses.dataclass(frozen=True, eq=False)
class CallSpec:
  """The static part of ``loss_fn(params, *args, **kwargs)``: tree structure and non-array leaves."""

  treedef: Any
  statics: Tuple[Optional[StaticLeaf], ...]
  has_aux: bool

  def __post_init__(self):
    object.__setattr__(self, "_hash", hash((self.treedef, self.statics, self.has_aux)))

  def __hash__(self) -> int:
    return self._hash  # type: ignore[attr-defined]

  def __eq__(self, other: Any) -> bool:
    return (isinstance(other, CallSpec) and self._hash == other._hash  # type: ignore[attr-defined]
            and self.has_aux == other.has_aux and self.treedef == other.treedef
            and self.statics == other.statics)


def split_call(loss_fn: Any, args: tuple, kwargs: dict, has_aux: bool):
  """Flattens ``(loss_fn, args, kwargs)``: array leaves are traced, the rest static."""
  leaves, treedef = jax.tree.flatten((loss_fn, args, kwargs))
  dynamic = []
  statics: List[Optional[StaticLeaf]] = []
  for leaf in leaves:
    if is_array(leaf):
      dynamic.append(leaf)
      statics.append(None)
    else:
      statics.append(StaticLeaf(leaf))
  return tuple(dynamic), CallSpec(treedef, tuple(statics), bool(has_aux))


def merge_call(spec: CallSpec, dynamic: Sequence[Any]):
  """The inverse of :func:`split_call`: ``(loss_fn, args, kwargs)`` from the spec and arrays."""
  it = iter(dynamic)
  leaves = [next(it) if s is None else s.value for s in spec.statics]
  return jax.tree.unflatten(spec.treedef, leaves)
