"""mmengine's accumulation counting, on the host: which call steps and what the loss is divided by.

mmengine counts ``update_params`` calls in ``_inner_count``; a window of
``accumulative_counts`` calls closes when the count is a multiple of it or
reaches ``max_counts`` (set by ``initialize_count_status``), and every loss
of the last, shorter window is divided by its length. The counters are
Python ints, public through the wrappers (``inner_count``,
``should_update()``, ``should_sync()``), so that deciding whether to step
never waits for the device. (``jaxamp.accumulate_gradients`` counts the
same windows on the device instead, inside an optax state.)

::

  initialize_count_status(init_counts, max_counts):
      inner_count = init_counts; remainder = max_counts % acc
  loss_factor():   # before backward increments inner_count
      1 if acc == 1 else acc if max_counts == -1 else
      acc if inner_count < max_counts - remainder else remainder
  should_update(): inner_count % acc == 0 or inner_count == max_counts
  should_sync():   (inner_count + 1) % acc == 0 or inner_count + 1 == max_counts
"""

from __future__ import annotations

import numbers
import warnings
from typing import Any

from jaxamp._src.facade.errors import AssertionRuntimeError
from jaxamp._src.facade.errors import AssertionTypeError
from jaxamp._src.facade.errors import AssertionValueError


class AccumulationCounter:
  """The counters of one wrapper: ``accumulative_counts``, ``inner_count``, ``max_counts``.

  Raises:
    AssertionError: (also a ``TypeError``/``ValueError``) for an
      ``accumulative_counts`` that is not an int >= 1 (mmengine asserts).
  """

  def __init__(self, accumulative_counts: Any):
    if (isinstance(accumulative_counts, bool)
        or not isinstance(accumulative_counts, numbers.Integral)):
      raise AssertionTypeError(
          f"accumulative_counts must be an int >= 1, got {accumulative_counts!r}")
    if accumulative_counts <= 0:
      raise AssertionValueError("_accumulative_counts at least greater than or equal to 1")
    self.accumulative_counts = int(accumulative_counts)
    self.inner_count = 0
    self.max_counts = -1
    self.remainder_counts = -1

  def initialize(self, init_counts: int, max_counts: int, has_batch_norm: bool) -> None:
    """mmengine's ``initialize_count_status``, with its warnings (``stacklevel`` for the wrapper)."""
    for name, value in (("init_counts", init_counts), ("max_counts", max_counts)):
      if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    self.inner_count = int(init_counts)
    self.max_counts = int(max_counts)
    if self.inner_count % self.accumulative_counts != 0:
      warnings.warn(
          "Resumed iteration number is not divisible by `_accumulative_counts` in "
          "`GradientCumulativeOptimizerHook`, which means the gradient of some iterations is "
          "lost and the result may be influenced slightly.", UserWarning, stacklevel=3)
    if self.accumulative_counts > 1 and has_batch_norm:
      warnings.warn("Gradient accumulative may slightly decrease performance because the model "
                    "has BatchNorm layers.", UserWarning, stacklevel=3)
    self.remainder_counts = self.max_counts % self.accumulative_counts

  def should_update(self) -> bool:
    """Whether the current call (after ``backward``) closes a window."""
    return (self.inner_count % self.accumulative_counts == 0
            or self.inner_count == self.max_counts)

  def should_sync(self) -> bool:
    """Whether the next ``backward`` closes a window."""
    return ((self.inner_count + 1) % self.accumulative_counts == 0
            or (self.inner_count + 1) == self.max_counts)

  def loss_factor(self) -> int:
    """What the loss of the current call is divided by.

    Raises:
      AssertionError: (also a ``RuntimeError``) past ``max_counts``, where
        mmengine's factor is 0.
    """
    acc = self.accumulative_counts
    if acc == 1:
      return 1
    if self.max_counts == -1:
      return acc
    if self.inner_count >= self.max_counts:
      raise AssertionRuntimeError(
          f"Called past max_counts: inner_count is {self.inner_count} but "
          f"initialize_count_status set max_counts={self.max_counts}, so no accumulation "
          "window is left to divide the loss by. Stop the loop at max_counts, or call "
          "initialize_count_status again with the right counts.")
    if self.inner_count < self.max_counts - self.remainder_counts:
      return acc
    return self.remainder_counts
