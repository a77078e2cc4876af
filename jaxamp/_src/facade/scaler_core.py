"""What PyTorch's and Paddle's ``GradScaler`` facades share: state, stages, holders, jitted steps.

Both scalers hold a small pytree of device arrays (:class:`ScalerState`) and
drive it with jitted functions of the functional core
(``ScaleRule.adjust``, ``finite.unscale``, ``finite.all_finite``). Per
optimizer, keyed by identity, they move through the stages READY ->
UNSCALED (``unscale_``) -> STEPPED (``step``), reset by ``update()``
(:class:`StageBook`, with the misuse errors both libraries raise with the
same messages). Each facade keeps its own constructor, getters, state-dict
format and exception messages where the libraries differ.

**The optimizer holder protocol** (:class:`OptimizerHolder`). A scaler
steps ``jaxamp.OptimWrapper`` or any object with

* ``params``, ``opt_state``: the parameters and optax state (read only here);
* ``grads``: the accumulated gradients, readable and settable (``None`` or a
  pytree shaped like ``params``);
* ``backward(loss_fn, *args, has_aux=False, **kwargs)``: adds the gradients
  of ``loss_fn(params, *args, **kwargs)`` into ``grads``. ``loss_fn`` is
  passed to ``jit`` as a pytree, so a pytree callable such as the one
  ``GradScaler.scale`` returns does not retrace when only its array leaves
  (the scale) change;
* ``apply_gradients(grads=None, *, skip=None)``: one jitted call that clips (per
  the holder's configuration), runs the optax update and applies it. When
  ``skip`` (a device boolean scalar) is true, ``params`` and ``opt_state`` stay
  bit-identical, without a host sync;
* optionally ``apply_scaled_gradients(scale)``: unscale, check and apply in one
  jitted call, returning ``found_inf``; ``step`` uses it when ``unscale_`` was
  not called (see :func:`fused_step`).

PyTorch's ``scaler.scale(loss).backward()`` is spelled
``opt.backward(scaler.scale(loss_fn), batch)``.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

import jax
import jax.numpy as jnp
import optax

from jaxamp._src import finite
from jaxamp._src import fp8
from jaxamp._src import loss_scale
from jaxamp._src import state as state_lib
from jaxamp._src import validation
from jaxamp._src.facade import stall


class OptimizerHolder(Protocol):
  """What a scaler needs of the optimizer it steps (see the module notes)."""

  params: Any
  opt_state: Any
  grads: Optional[Any]

  def backward(self, loss_fn: Callable[..., Any], *args: Any, has_aux: bool = False,
               **kwargs: Any) -> Any:
    """Adds the gradients of ``loss_fn(params, *args, **kwargs)`` into ``grads``."""

  def apply_gradients(self, grads: Optional[Any] = None, *, skip: Optional[Any] = None) -> None:
    """Clips, runs the optax update and applies it; nothing changes where ``skip`` is true."""


# The scalers' device state: a LossScaleState (the same fields as dynamic_loss_scale's, so the state
# queries of jaxamp.state read it) with no per-leaf flags and no inner state.
ScalerState = state_lib.LossScaleState


def make_state(scale: Any, growth_tracker: Any = 0, overflow_count: Any = 0) -> ScalerState:
  """Builds a scaler's state with explicit dtypes (no step skipped yet)."""
  zero = jnp.zeros([], jnp.int32)
  return ScalerState(jnp.asarray(scale, jnp.float32), jnp.asarray(growth_tracker, jnp.int32),
                     jnp.asarray(overflow_count, jnp.int32), jnp.zeros([], jnp.bool_), zero, zero,
                     jnp.zeros([], jnp.bool_), jnp.zeros([0], jnp.bool_), ())


def metrics(state: ScalerState) -> dict:
  """The ``jaxamp.step_metrics`` of a scaler facade's state (device scalars)."""
  return {"loss_scale": state.scale, "skipped": state.skipped,
          "skipped_steps": state.skipped_steps, "skip_streak": state.skip_streak,
          "stalled": state.stalled}


# -------------------------------------------------------------------------------------------------
# Stages per optimizer.
# -------------------------------------------------------------------------------------------------


class OptState(enum.Enum):
  """Per-optimizer stage within one iteration (PyTorch's names)."""

  READY = 0
  UNSCALED = 1
  STEPPED = 2


@dataclasses.dataclass
class OptimizerRecord:
  """What the scaler knows about one optimizer since the last ``update()``."""

  stage: OptState = OptState.READY
  found_inf: Optional[jax.Array] = None
  optimizer: Any = None


class StageBook:
  """The stage of every optimizer since the last ``update()``, keyed by identity.

  The misuse checks raise the ``RuntimeError`` messages PyTorch and Paddle
  share.
  """

  def __init__(self) -> None:
    self._records: collections.defaultdict[int, OptimizerRecord] = (
        collections.defaultdict(OptimizerRecord))

  def record(self, optimizer: Any) -> OptimizerRecord:
    """The record of ``optimizer`` (READY when first seen)."""
    record = self._records[id(optimizer)]
    record.optimizer = optimizer
    return record

  def check_unscale(self, optimizer: Any) -> OptimizerRecord:
    """The record of ``optimizer``; raises if it was already unscaled or stepped."""
    record = self.record(optimizer)
    if record.stage is OptState.UNSCALED:
      raise RuntimeError(
          "unscale_() has already been called on this optimizer since the last update().")
    if record.stage is OptState.STEPPED:
      raise RuntimeError("unscale_() is being called after step().")
    return record

  def check_step(self, optimizer: Any) -> OptimizerRecord:
    """The record of ``optimizer``; raises if it was already stepped."""
    record = self.record(optimizer)
    if record.stage is OptState.STEPPED:
      raise RuntimeError("step() has already been called since the last update().")
    return record

  def found_infs(self) -> tuple:
    """The ``found_inf`` flags recorded since the last reset, in order of first use."""
    return tuple(r.found_inf for r in self._records.values() if r.found_inf is not None)

  def optimizers(self) -> list:
    """The optimizers seen since the last reset, in order of first use."""
    return [r.optimizer for r in self._records.values()]

  def reset(self) -> None:
    """Every optimizer back to READY, with no flag (what ``update()`` does)."""
    self._records = collections.defaultdict(OptimizerRecord)


# -------------------------------------------------------------------------------------------------
# Jitted building blocks.
# -------------------------------------------------------------------------------------------------


def _unscale_and_check_impl(grads: Any, scale: jax.Array) -> tuple[Any, jax.Array]:
  grads, values = fp8.split(grads)  # Flax's fp8 values: not unscaled; inf only when overflowed
  unscaled = finite.unscale(grads, scale)
  found_inf = jnp.logical_not(finite.all_finite(unscaled))
  if values is not None:
    found_inf = jnp.logical_or(found_inf, jnp.logical_not(finite.all_finite(values)))
  return fp8.merge(unscaled, values), found_inf


_unscale_and_check = jax.jit(_unscale_and_check_impl)
_unscale_and_check_donated = jax.jit(_unscale_and_check_impl, donate_argnums=(0,))


def unscale_and_check(grads: Any, scale: jax.Array, *,
                      donate: bool = False) -> tuple[Any, jax.Array]:
  """Returns ``(grads / scale, found_inf)`` from one jitted call (no host sync).

  ``found_inf`` is checked on the unscaled gradients: an inf or nan stays
  one, and a finite value that the division overflows (possible only with a
  scale below 1) is caught too, where PyTorch would step on it. With
  ``donate=True`` the buffers of ``grads`` are donated (unscaled in place;
  ``grads`` is deleted).
  """
  if donate:
    return _unscale_and_check_donated(grads, scale)
  return _unscale_and_check(grads, scale)


def holder_donates(optimizer: Any) -> bool:
  """Whether ``optimizer`` owns its buffers and donates them (``donate=True``).

  Its gradients are then unscaled in place: the scaled ones, which only the
  holder references, are donated to the unscaled result.
  """
  return getattr(optimizer, "donate", False) is True


def holder_grads_empty(optimizer: Any) -> bool:
  """Whether ``optimizer`` holds no gradients (``None`` or an empty tree)."""
  grads = optimizer.grads
  return grads is None or not jax.tree.leaves(grads)


def has_float16_leaf(tree: Any) -> bool:
  """Whether any leaf of ``tree`` is float16."""
  return any(jnp.result_type(leaf) == jnp.float16 for leaf in jax.tree.leaves(tree))


def unscale_grads(optimizer: Any, scale: jax.Array, *, allow_float16: bool
                  ) -> Optional[jax.Array]:
  """Replaces ``optimizer.grads`` by ``grads / scale``; returns ``found_inf`` (no host sync).

  Returns ``None`` when the holder has no gradients (nothing is changed).

  Raises:
    ValueError: ``"Attempting to unscale FP16 gradients."`` for float16
      gradients unless ``allow_float16``.
  """
  grads = optimizer.grads
  if grads is None or not jax.tree.leaves(grads):
    return None
  if not allow_float16 and has_float16_leaf(grads):
    raise ValueError("Attempting to unscale FP16 gradients.")
  unscaled, found_inf = unscale_and_check(grads, scale, donate=holder_donates(optimizer))
  optimizer.grads = unscaled
  return found_inf


def fused_step(optimizer: Any, scale: jax.Array, *, allow_float16: bool) -> Optional[jax.Array]:
  """Unscales, checks and applies ``optimizer.grads`` in one call, where the holder can.

  A holder with ``apply_scaled_gradients(scale)`` (``jaxamp.OptimWrapper``)
  does it in one jitted call.

  Returns:
    ``found_inf``, or ``None`` when the caller must unscale and apply in two
    calls (no such method, or no gradients).

  Raises:
    ValueError: ``"Attempting to unscale FP16 gradients."`` for float16
      gradients unless ``allow_float16``.
  """
  apply_scaled = getattr(optimizer, "apply_scaled_gradients", None)
  if apply_scaled is None:
    return None
  grads = optimizer.grads
  if grads is None or not jax.tree.leaves(grads):
    return None
  if not allow_float16 and has_float16_leaf(grads):
    raise ValueError("Attempting to unscale FP16 gradients.")
  return apply_scaled(scale)


def update_fn(rule: loss_scale.ScaleRule, stall_after: int = loss_scale.DEFAULT_STALL_AFTER
              ) -> Callable[[ScalerState, Sequence[jax.Array]], tuple[ScalerState, jax.Array]]:
  """The jitted scale update for one (static, hashable) rule, built once per rule."""
  return _update_fn(rule, stall_after)


@functools.lru_cache(maxsize=64)
def _update_fn(rule: loss_scale.ScaleRule, stall_after: int
               ) -> Callable[[ScalerState, Sequence[jax.Array]], tuple[ScalerState, jax.Array]]:
  """See :func:`update_fn`.

  The returned function maps ``(state, found_infs)`` (a tuple of boolean
  scalars, one per optimizer checked this iteration) to ``(new_state,
  found_inf)``, where ``found_inf`` is their OR. The skip counters and the
  stall flag follow :func:`jaxamp.dynamic_loss_scale`'s.
  """

  @jax.jit
  def update(state: ScalerState, found_infs: Sequence[jax.Array]) -> tuple[ScalerState, jax.Array]:
    found = jnp.stack([jnp.asarray(f, jnp.bool_) for f in found_infs]).any()
    scale, tracker, overflow = rule.adjust(state.scale, state.growth_tracker,
                                           state.overflow_count, found)
    streak = jnp.where(found, optax.safe_increment(state.skip_streak), 0).astype(jnp.int32)
    at_floor = rule.dynamic and state.scale <= jnp.float32(rule.min_scale)
    return state._replace(
        scale=scale, growth_tracker=tracker, overflow_count=overflow, skipped=found,
        skipped_steps=jnp.where(found, optax.safe_increment(state.skipped_steps),
                                state.skipped_steps),
        skip_streak=streak, stalled=found & ((streak >= stall_after) | at_floor)), found

  return update


# -------------------------------------------------------------------------------------------------
# Host values: arguments, setters and state dicts.
# -------------------------------------------------------------------------------------------------

_KIND = "loss-scaling hyperparameters"


is_array = validation.is_array


def as_float(name: str, value: Any) -> float:
  """A finite Python float from a real number or a one-element array (host value)."""
  return validation.check_real(name, validation.one_element(value), finite=True, arrays=True,
                               kind=_KIND)


def as_count(name: str, value: Any) -> int:
  """A non-negative Python int from an int or a one-element integer array."""
  return validation.check_int(name, validation.one_element(value), minimum=0)


def check_factor_types(**values: Any) -> list[float]:
  """The factors as floats; refuses those that are not finite real numbers (``TypeError``/``ValueError``)."""
  return [validation.check_real(name, value, finite=True, arrays=True, kind=_KIND)
          for name, value in values.items()]


def require_nonempty(state_dict: Mapping[str, Any], message: str) -> None:
  """Raises ``RuntimeError(message)`` for an empty state dict (one saved by a disabled scaler)."""
  if len(state_dict) == 0:
    raise RuntimeError(message)


def nonfinite_grad_leaves(optimizers: Sequence[Any]) -> list:
  """The gradient leaves holding inf or nan in each optimizer's ``grads`` (a host sync).

  With several optimizers each path is prefixed by the optimizer's position.
  """
  names: list[str] = []
  for i, optimizer in enumerate(optimizers):
    grads = getattr(optimizer, "grads", None)
    if grads is None:
      continue
    prefix = f"optimizer {i}: " if len(optimizers) > 1 else ""
    names.extend(prefix + name for name in stall.leaf_names_with_nonfinite(grads))
  return names
