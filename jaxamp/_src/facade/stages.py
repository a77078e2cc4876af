"""Where each optimizer stands in a ``GradScaler`` iteration, and the misuse errors both libraries raise.

Per optimizer, keyed by identity as PyTorch keys it, a scaler moves through
READY -> UNSCALED (``unscale_``) -> STEPPED (``step``); ``update()`` resets
every optimizer to READY. PyTorch and Paddle refuse the same misuses with the
same ``RuntimeError`` messages.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Optional

import jax


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
  """The stage of every optimizer since the last ``update()``, keyed by identity."""

  def __init__(self) -> None:
    self._records: dict[int, OptimizerRecord] = {}

  def record(self, optimizer: Any) -> OptimizerRecord:
    """The record of ``optimizer`` (READY when first seen)."""
    return self._records.setdefault(id(optimizer), OptimizerRecord(optimizer=optimizer))

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
    self._records = {}
