"""A ``GradScaler``'s device state: built from checked values, updated once per iteration, loaded.

The state is a :class:`jaxamp.LossScaleState` (so the state queries of
``jaxamp`` read it) with no per-leaf flags and no inner state. Both facades
advance it with one jitted call per iteration from the ``found_inf`` flags of
the optimizers they stepped, following the rule's ``adjust`` and
:func:`jaxamp.dynamic_loss_scale`'s skip counters and stall flag.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import optax

from jaxamp._src import loss_scale
from jaxamp._src import outside
from jaxamp._src import validation
from jaxamp._src.state import LossScaleState

Update = Callable[[LossScaleState, Sequence[jax.Array]], tuple[LossScaleState, jax.Array]]


def make_state(scale: Any, growth_tracker: Any = 0, overflow_count: Any = 0) -> LossScaleState:
  """Builds a scaler's state with explicit dtypes (no step skipped yet)."""
  zero, false = jnp.zeros([], jnp.int32), jnp.zeros([], jnp.bool_)
  return LossScaleState(jnp.asarray(scale, jnp.float32), jnp.asarray(growth_tracker, jnp.int32),
                        jnp.asarray(overflow_count, jnp.int32), false, zero, zero, false,
                        jnp.zeros([0], jnp.bool_), ())


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
