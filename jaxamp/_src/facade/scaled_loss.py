"""Loss functions multiplied by a loss scale or divided by an accumulation factor.

JAX has no ``loss.backward()``: the facades take a loss *function* and
differentiate it. ``scaler.scale(loss_fn)`` and ``wrapper.scale_loss(loss_fn)``
return such a function with its loss multiplied or divided. Both are pytrees
whose child is the factor (a float32 device scalar) and whose static part is
the wrapped function; a wrapped ``ScaledLoss`` or ``DividedLoss`` (one inside
the other, in either order) is a second child, so its factor is traced too.
Passing them to a jitted step therefore brings the current factors in as
traced arguments: the step compiles once while the scale changes. Losses in
float16/bfloat16 are promoted to float32 first (65536 is not a finite float16).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import jax

from jaxamp._src import state as state_lib


def divide(loss: Any, factor: jax.Array) -> jax.Array:
  """``loss / factor``, computed in float32 at least."""
  loss = state_lib.loss_in_float32_at_least(loss)
  return loss / factor.astype(loss.dtype)


class ScalesInUse:
  """The scales of the :class:`ScaledLoss` calls under way, innermost last.

  A scaler keeps one: inside a scaled loss (traced while a backward pass is
  compiled), asking the scaler for its scale must give that call's scale,
  not the stored one, which the compiled code would freeze.
  """

  def __init__(self) -> None:
    self._stack: list[jax.Array] = []

  def current(self) -> Optional[jax.Array]:
    """The innermost call's scale, or ``None`` outside every call."""
    return self._stack[-1] if self._stack else None

  def current_or(self, stored: Callable[[], jax.Array]) -> jax.Array:
    """The innermost call's scale, or ``stored()`` (the scaler's) outside every call."""
    return self._stack[-1] if self._stack else stored()

  @contextlib.contextmanager
  def using(self, scale: jax.Array) -> Iterator[None]:
    """Inside, :meth:`current` is ``scale``."""
    self._stack.append(scale)
    try:
      yield
    finally:
      self._stack.pop()


class ScaledLoss:
  """A loss function whose output is multiplied by a scaler's current scale.

  Returned by ``scaler.scale(loss_fn)``: a pytree (see the module notes)
  whose child is the scale, read from the scaler when it is flattened (or
  called outside a trace), and whose static part is ``(fn, scaler,
  has_aux)``. With ``has_aux=True`` only the loss of ``(loss, aux)`` is scaled.

  The scaler (a ``GradScaler``) has a ``_scale_array()`` method returning its
  current scale as a float32 device scalar, and a ``using_scale`` context
  manager: the call runs inside ``using_scale(scale)``, so that code in
  ``fn`` that asks the scaler for its scale gets the one ``fn`` is scaled by
  (traced, inside a jitted backward pass).
  """

  __slots__ = ("fn", "scaler", "has_aux", "_scale")

  def __init__(self, fn: Callable[..., Any], scaler: Any, has_aux: bool = False,
               scale: Optional[jax.Array] = None):
    self.fn = fn
    self.scaler = scaler
    self.has_aux = has_aux
    self._scale = scale

  @property
  def scale(self) -> jax.Array:
    """The scale this function multiplies by (the scaler's, unless unflattened)."""
    if self._scale is None:
      return self.scaler._scale_array()  # noqa: SLF001
    return self._scale

  def unscaled(self, *args: Any, **kwargs: Any) -> Any:
    """``fn``'s own output (the loss before scaling), computed as :meth:`__call__` computes it."""
    # Inside, the scaler's scale() and get_scale() use this (traced) scale.
    with self.scaler.using_scale(self.scale):
      return self.fn(*args, **kwargs)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    scale = self.scale
    out = self.unscaled(*args, **kwargs)
    if self.has_aux:
      loss, aux = out
      return state_lib.multiply_by_scale(loss, scale), aux
    return state_lib.multiply_by_scale(out, scale)

  def __eq__(self, other: Any) -> bool:
    return (type(other) is ScaledLoss and self.fn == other.fn and self.scaler is other.scaler
            and self.has_aux == other.has_aux)

  def __hash__(self) -> int:
    return hash((self.fn, id(self.scaler), self.has_aux))

  def __repr__(self) -> str:
    return f"ScaledLoss({self.fn!r}, has_aux={self.has_aux})"


def _flatten_scaled(f: ScaledLoss) -> tuple:
  if isinstance(f.fn, (ScaledLoss, DividedLoss)):
    # A wrapped wrapper is a child: its own factor is traced too, not frozen as static data.
    return (f.scale, f.fn), (None, f.scaler, f.has_aux)
  return (f.scale,), (f.fn, f.scaler, f.has_aux)


def _unflatten_scaled(aux: tuple, children: tuple) -> ScaledLoss:
  fn, scaler, has_aux = aux
  return ScaledLoss(children[1] if len(children) == 2 else fn, scaler, has_aux, children[0])


class DividedLoss:
  """``loss_fn`` with its loss divided by a factor; a pytree whose child is the factor.

  Returned by ``OptimWrapper.scale_loss(loss_fn)``. A function returning a
  pair ``(loss, aux)`` has only its loss divided.
  """

  __slots__ = ("fn", "factor")

  def __init__(self, fn: Callable[..., Any], factor: jax.Array):
    self.fn = fn
    self.factor = factor

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    out = self.fn(*args, **kwargs)
    if isinstance(out, tuple) and len(out) == 2:
      loss, aux = out
      return divide(loss, self.factor), aux
    return divide(out, self.factor)

  def __eq__(self, other: Any) -> bool:
    return type(other) is DividedLoss and self.fn == other.fn

  def __hash__(self) -> int:
    return hash((DividedLoss, self.fn))


def _flatten_divided(f: DividedLoss) -> tuple:
  if isinstance(f.fn, (ScaledLoss, DividedLoss)):
    return (f.factor, f.fn), None
  return (f.factor,), f.fn


def _unflatten_divided(fn: Any, children: tuple) -> DividedLoss:
  return DividedLoss(children[1] if len(children) == 2 else fn, children[0])


jax.tree_util.register_pytree_node(ScaledLoss, _flatten_scaled, _unflatten_scaled)
jax.tree_util.register_pytree_node(DividedLoss, _flatten_divided, _unflatten_divided)
