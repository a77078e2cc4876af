"""A ``GradScaler``'s device state: updated once per iteration, loaded from checked values.

The state is a :class:`jaxamp.LossScaleState` (so the state queries of
``jaxamp`` read it) with no per-leaf flags and no inner state. Both facades
advance it with one jitted call per iteration from the ``found_inf`` flags of
the optimizers they stepped, by the core's rule (``loss_scale.advance``: the
scale, its counters, the skip counters and the stall flag), as
:func:`jaxamp.dynamic_loss_scale` advances its own.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from jaxamp._src import loss_scale
from jaxamp._src import outside
from jaxamp._src import validation
from jaxamp._src.state import LossScaleState

Update = Callable[[LossScaleState, Sequence[jax.Array]], tuple[LossScaleState, jax.Array]]


def check_factors(**values: Any) -> list[float]:
  """The rule's factors as floats; refuses those that are not finite real numbers."""
  return [validation.check_real(name, value, finite=True, arrays=True,
                                kind="loss-scaling hyperparameters")
          for name, value in values.items()]


def checked_state_dict(state_dict: Any, keys: Sequence[str], empty_message: str) -> Mapping:
  """``state_dict`` when it is a mapping with exactly ``keys``; ``RuntimeError`` when empty."""
  outside.mapping("state_dict", state_dict)
  if len(state_dict) == 0:  # saved by a disabled scaler
    raise RuntimeError(empty_message)
  outside.keys("state_dict", state_dict, keys)
  return state_dict


@functools.lru_cache(maxsize=64)
def update_fn(rule: loss_scale.ScaleRule, stall_after: int) -> Update:
  """The jitted scale update for one (static, hashable) rule, built once per rule.

  The returned function maps ``(state, found_infs)`` (a tuple of boolean
  scalars, one per optimizer checked this iteration) to ``(new_state,
  found_inf)``, where ``found_inf`` is their OR.
  """

  @jax.jit
  def update(state: LossScaleState, found_infs: Sequence[jax.Array]
             ) -> tuple[LossScaleState, jax.Array]:
    found = jnp.stack([jnp.asarray(f, jnp.bool_) for f in found_infs]).any()
    return loss_scale.advance(rule, state, found, stall_after), found

  return update
