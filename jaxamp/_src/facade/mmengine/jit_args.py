"""The static/dynamic split of a loss-function call, as ``jax.jit`` splits its arguments.

``backward(loss_fn, *args, **kwargs)`` passes ``loss_fn``, ``args`` and
``kwargs`` to a jitted function as one pytree: array leaves are traced
(:func:`split_call` returns them as the dynamic part), every other leaf (the
function itself, Python numbers, strings) is static, hashed into a
:class:`CallSpec` that is part of the jit cache key. Repeated calls with
new arrays of the same shapes therefore compile once; a new function
object or a new Python number compiles again, exactly as with
``jax.jit``'s static arguments; :class:`RetraceWatch` warns when that
happens every call because the function is written anew each time.
"""

from __future__ import annotations

import dataclasses
import types
import warnings
from typing import Any, List, Optional, Sequence, Set, Tuple

import jax

from jaxamp._src.facade.mmengine.trees import is_array
from jaxamp._src.facade.scaled_loss import DividedLoss, ScaledLoss


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


@dataclasses.dataclass(frozen=True)
class CallSpec:
  """The static part of ``loss_fn(params, *args, **kwargs)``: tree structure and non-array leaves."""

  treedef: Any
  statics: Tuple[Optional[StaticLeaf], ...]
  has_aux: bool


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


def _captured(fn: types.FunctionType) -> Tuple[Any, ...]:
  """What ``fn`` closes over and its defaults: arrays by type (they are baked into the trace as
  constants, so a new batch each iteration recompiles too), other objects by identity."""
  cells = []
  for cell in fn.__closure__ or ():
    try:
      cells.append(cell.cell_contents)
    except ValueError:  # an empty cell
      cells.append(None)
  values = (*cells, *(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values())
  return tuple(jax.typeof(v) if is_array(v) else id(v) for v in values)


class RetraceWatch:
  """Warns, once per loss code, when a holder traces a loss call it has traced before.

  A jitted backward pass retraces for a new function object even when its code,
  the argument types and the static values are those of a call it has
  compiled: the sign of a loss function (a ``lambda``, a closure) written inside
  the training loop, which then compiles at every iteration. The function's
  code, what it closes over (see :func:`_captured`) and its defaults make the
  key. Only a plain Python function is watched, bare or inside ``scaler.scale``/``scale_loss``
  (whose scaler counts by identity); other callables compare by their own
  equality, as jaxamp's ``mixed_precision`` and ``autocast`` wrappers do.
  """

  def __init__(self):
    self._seen: Set[Any] = set()
    self._warned: Set[Any] = set()

  def traced(self, name: Any, spec: CallSpec, dynamic: Sequence[Any], params: Any) -> None:
    """Call from the traced body of a jitted step (``name``: its kind) for ``merge_call(spec, dynamic)``."""
    leaves = (*dynamic, *jax.tree.leaves(params))
    if not any(isinstance(x, jax.core.Tracer) for x in leaves):
      return  # run eagerly (jax.disable_jit), not traced
    fn, scalers = merge_call(spec, dynamic)[0], []
    while isinstance(fn, (ScaledLoss, DividedLoss)):
      scalers.append(id(getattr(fn, "scaler", None)))
      fn = fn.fn
    if not isinstance(fn, types.FunctionType):
      return
    code = fn.__code__
    key = (name, code, tuple(scalers), _captured(fn), spec.has_aux,
           tuple(s for s in spec.statics if s is not None and not callable(s.value)),
           tuple(jax.typeof(x) for x in leaves))
    if key in self._seen and code not in self._warned:
      self._warned.add(code)
      warnings.warn(
          f"backward() compiled {code.co_name!r} again for the same argument types: the loss "
          "function is a new object at every call (a lambda or closure written inside the "
          "training loop?), so every iteration compiles. Define it once, outside the loop, and "
          "pass what changes (the batch) as arguments.", RuntimeWarning, stacklevel=2)
    self._seen.add(key)
