"""Names of the functional API kept for one release under their old spelling.

Each one warns with a ``DeprecationWarning`` naming its replacement and then
does what it did before. They go in the release after the next.
"""

from __future__ import annotations

import warnings

import jax
import optax

from jaxamp._src import state as state_lib


def _warn(old: str, new: str) -> None:
  warnings.warn(f"jaxamp.{old} is deprecated and goes in the next release: use {new}.",
                DeprecationWarning, stacklevel=3)


def get_loss_scale(opt_state: optax.OptState) -> jax.Array:
  """Deprecated: :func:`jaxamp.loss_scale`, under its old name."""
  _warn("get_loss_scale", "jaxamp.loss_scale (the same function)")
  return state_lib.loss_scale(opt_state)


def has_updated(opt_state: optax.OptState) -> jax.Array:
  """Deprecated: whether the last update closed an accumulation window.

  Use :func:`jaxamp.update_applied` (``before``, ``after``) to know whether a
  step changed the parameters (a skipped step did not), or
  ``jaxamp.get_accumulation_state(opt_state).updated`` for the window flag
  this returns.
  """
  _warn("has_updated", "jaxamp.update_applied(before, after) to know whether the parameters "
        "changed, or jaxamp.get_accumulation_state(opt_state).updated for whether the "
        "accumulation window closed")
  return state_lib.get_accumulation_state(opt_state).updated
