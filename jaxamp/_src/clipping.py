"""Gradient clipping as optax transformations, with PyTorch's exact arithmetic.

:func:`clip_grad_norm` is ``torch.nn.utils.clip_grad_norm_`` and
:func:`clip_grad_value` is ``torch.nn.utils.clip_grad_value_``, written as
pure optax transformations. The norm before clipping is kept in the state
(:class:`ClipGradNormState`), so it can be logged after the step without a
host sync, the way mmengine logs ``train/grad_norm``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp._src import outside
from jaxamp._src import validation
from jaxamp._src.state import ClipGradNormState

# PyTorch adds this to the total norm before dividing max_norm by it.
_EPS = 1e-6


def norm_order(norm_type: Any) -> float:
  """``norm_type`` as a float order: a real number, or ``'inf'``/``'-inf'`` (PyTorch's spelling).

  Raises:
    TypeError: neither a real number nor a string.
    ValueError: nan, or another string.
  """
  if isinstance(norm_type, str):
    if norm_type.strip().lower() in ("inf", "+inf", "infinity"):
      return math.inf
    if norm_type.strip().lower() in ("-inf", "-infinity"):
      return -math.inf
    raise ValueError(f"norm_type must be a number or 'inf', got {norm_type!r}")
  norm_type = validation.check_real("norm_type", norm_type)
  if math.isnan(norm_type):
    raise ValueError(f"norm_type must not be nan, got {norm_type!r}")
  return norm_type


def total_grad_norm(grads: Any, norm_type: float | str = 2.0) -> jax.Array:
  """The total ``norm_type``-norm of all floating leaves, as PyTorch measures it.

  Each leaf's norm is taken first and the norm of those norms is returned
  (``torch.nn.utils.get_total_norm``), in float32. ``norm_type`` may be any
  float, ``inf`` (the largest absolute value) or ``-inf``. A tree without
  floating leaves has norm 0.

  Examples:
    >>> import jax.numpy as jnp, jaxamp
    >>> jaxamp.total_grad_norm({'a': jnp.array([3.0]), 'b': jnp.array([4.0])})
    Array(5., dtype=float32)
    >>> jaxamp.total_grad_norm({'a': jnp.array([3.0]), 'b': jnp.array([-4.0])}, 'inf')
    Array(4., dtype=float32)
  """
  order: Any = norm_order(norm_type)  # jax annotates ord as int | str; it takes floats too
  norms = [jnp.linalg.vector_norm(jnp.ravel(g).astype(jnp.float32), ord=order)
           for g in jax.tree.leaves(grads) if validation.is_inexact(g) and jnp.size(g) > 0]
  if not norms:
    return jnp.zeros([], jnp.float32)
  if len(norms) == 1:
    return norms[0]
  return jnp.linalg.vector_norm(jnp.stack(norms), ord=order)


def clip_grad_norm(max_norm: float, norm_type: float | str = 2.0) -> optax.GradientTransformation:
  """Scales the gradients so that their total norm is at most ``max_norm``.

  The arithmetic of ``torch.nn.utils.clip_grad_norm_``::

    total_norm = norm of the per-leaf norms (any order, inf included)
    clip_coef = min(max_norm / (total_norm + 1e-6), 1.0)
    grads = grads * clip_coef

  The coefficient is always applied (it is 1.0 when no clipping is needed),
  and the minimum propagates nan as PyTorch's clamp does: non-finite
  gradients give a non-finite coefficient, exactly as in PyTorch. The total
  norm before clipping is recorded in :class:`ClipGradNormState`.

  PyTorch's ``error_if_nonfinite=True`` needs to know on the host whether the
  norm is finite, which a jitted transformation cannot raise about; call
  :func:`check_total_norm` on the recorded norm after the step (the
  mmengine-style wrappers do this, at the cost of one host sync per step).

  Args:
    max_norm: the largest total norm allowed: a number >= 0 (``inf`` clips
      nothing). nan and negative bounds are refused (PyTorch accepts them:
      nan writes nan into the parameters, a negative bound flips the
      gradient's sign).
    norm_type: the order of the norm: a float, or ``'inf'``.

  Returns:
    An ``optax.GradientTransformation`` with state :class:`ClipGradNormState`.

  Raises:
    TypeError: a ``max_norm`` that is not a real number.
    ValueError: a nan or negative ``max_norm``, a nan ``norm_type``.

  Examples:
    >>> import jax.numpy as jnp, jaxamp
    >>> tx = jaxamp.clip_grad_norm(1.0)
    >>> grads = {'w': jnp.array([3.0, 4.0])}
    >>> clipped, state = tx.update(grads, tx.init(grads))
    >>> clipped['w'], state.total_norm
    (Array([0.5999999 , 0.79999983], dtype=float32), Array(5., dtype=float32))
  """
  max_norm_ = outside.max_norm("max_norm", max_norm)
  order = norm_order(norm_type)

  def init_fn(params):
    del params
    return ClipGradNormState(total_norm=jnp.zeros([], jnp.float32))

  def update_fn(updates, state, params=None):
    del state, params
    clipped, norm = clip_by_total_norm(updates, jnp.float32(max_norm_), order)
    return clipped, ClipGradNormState(total_norm=norm)

  return optax.GradientTransformation(init_fn, update_fn)


def clip_by_total_norm(grads: Any, max_norm: jax.Array, order: float) -> tuple[Any, jax.Array]:
  """PyTorch's clipping of ``grads`` to total norm ``max_norm`` (a float32 scalar, may be traced).

  Returns the clipped gradients and the total norm before clipping.
  """
  norm = total_grad_norm(grads, order)
  coef = jnp.minimum(max_norm / (norm + jnp.float32(_EPS)), jnp.float32(1.0))
  return jax.tree.map(
      lambda g: (g.astype(jnp.float32) * coef).astype(g.dtype) if validation.is_inexact(g) else g,
      grads), norm


def clip_grad_value(clip_value: float) -> optax.GradientTransformation:
  """Clamps every gradient element to ``[-clip_value, clip_value]``.

  ``torch.nn.utils.clip_grad_value_``: nan stays nan, infinities are clamped.
  Stateless (``optax.EmptyState``); PyTorch reports no norm for it either.
  ``clip_value`` must be a number >= 0 (``inf`` clips nothing); nan and
  negative values are refused (``ValueError``), where PyTorch clamps every
  element to the bound of the wrong sign, or to nan.

  Examples:
    >>> import jax.numpy as jnp, jaxamp
    >>> tx = jaxamp.clip_grad_value(0.5)
    >>> grads = {'w': jnp.array([-2.0, 0.25, jnp.inf])}
    >>> tx.update(grads, tx.init(grads))[0]['w']
    Array([-0.5 ,  0.25,  0.5 ], dtype=float32)
  """
  return optax.clip(outside.clip_value("clip_value", clip_value))


def check_total_norm(total_norm: Any, norm_type: float | str = 2.0) -> None:
  """Raises PyTorch's ``RuntimeError`` when ``total_norm`` is not finite.

  This is ``error_if_nonfinite=True`` of ``clip_grad_norm_``. It reads the
  norm on the host, so it synchronizes with the device.

  Raises:
    RuntimeError: with PyTorch's message, when the norm is nan or infinite.
  """
  if not np.isfinite(np.asarray(total_norm)):
    order = norm_order(norm_type)
    raise RuntimeError(
        f"The total norm of order {order} for gradients from `parameters` is non-finite, so "
        "it cannot be clipped. To disable this error and scale the gradients by the "
        "non-finite norm anyway, set `error_if_nonfinite=False`")
