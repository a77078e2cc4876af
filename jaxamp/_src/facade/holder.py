"""The optimizer holders the ``GradScaler``s step, and the unscaling of a holder's gradients.

A scaler steps ``jaxamp.OptimWrapper`` or any object with

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
  not called (see :func:`fused_step`);
* optionally ``donate``: ``True`` when the holder owns its buffers and donates
  them; its gradients are then unscaled in place.

PyTorch's ``scaler.scale(loss).backward()`` is spelled
``opt.backward(scaler.scale(loss_fn), batch)``.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxamp._src import fp8


# ``(grads / scale, found_inf)``, ``found_inf`` checked on the unscaled gradients (Flax's fp8
# values are not unscaled, and are inf only when the step overflowed).
_unscale_and_check = jax.jit(fp8.unscale_and_check)
_unscale_and_check_donated = jax.jit(fp8.unscale_and_check, donate_argnums=(0,))


def holds_grads(optimizer: Any) -> bool:
  """Whether ``optimizer`` holds gradients (not ``None``, not an empty tree)."""
  grads = optimizer.grads
  return grads is not None and bool(jax.tree.leaves(grads))


def _checked_grads(optimizer: Any, allow_float16: bool) -> Optional[Any]:
  """``optimizer.grads`` (``None`` when it holds none), refused when float16 and not allowed."""
  if not holds_grads(optimizer):
    return None
  grads = optimizer.grads
  # ``g.dtype``: ``jnp.result_type(g)`` would cost tens of microseconds a leaf on every step.
  if not allow_float16 and any(getattr(g, "dtype", None) == jnp.float16
                               for g in jax.tree.leaves(grads)):
    raise ValueError("Attempting to unscale FP16 gradients.")
  return grads


def unscale_grads(optimizer: Any, scale: jax.Array, *, allow_float16: bool
                  ) -> Optional[jax.Array]:
  """Replaces ``optimizer.grads`` by ``grads / scale``; returns ``found_inf`` (no host sync).

  One jitted call. ``found_inf`` is checked on the unscaled gradients: an inf
  or nan stays one, and a finite value that the division overflows (possible
  only with a scale below 1) is caught too, where PyTorch would step on it.
  A holder that donates its buffers has its gradients unscaled in place.
  Returns ``None`` when the holder has no gradients (nothing is changed).

  Raises:
    ValueError: ``"Attempting to unscale FP16 gradients."`` for float16
      gradients unless ``allow_float16``.
  """
  grads = _checked_grads(optimizer, allow_float16)
  if grads is None:
    return None
  donate = getattr(optimizer, "donate", False) is True
  step = _unscale_and_check_donated if donate else _unscale_and_check
  optimizer.grads, found_inf = step(grads, scale)
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
  if apply_scaled is None or _checked_grads(optimizer, allow_float16) is None:
    return None
  return apply_scaled(scale)
