"""Reporting a run stuck on skipped steps from the stateful facades, without a host sync per step.

The device state counts the consecutive skipped iterations and sets a ``stalled``
flag (``LossScaleState.stalled``). A facade reads that
flag every ``check_every`` iterations, once the device has computed it, so the
read never waits. When the flag is set
it warns (the default), raises, or stays silent, naming the gradient leaves that
held inf or nan. So a stall is reported at most ``check_every - 1`` iterations
after ``stall_after`` consecutive skips.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import jax

from jaxamp._src import finite
from jaxamp._src import validation
from jaxamp._src.loss_scale import StallWarning

ON_STALL = ("warn", "raise", "ignore")
__all__ = ["ON_STALL", "StallMonitor", "StallWarning", "StalledError"]


class StalledError(RuntimeError):
  """Raised instead of :class:`StallWarning` by a facade built with ``on_stall='raise'``."""


class StallMonitor:
  """Looks at a device ``stalled`` flag every ``check_every`` calls and reports once per stall.

  The flag of every ``check_every``-th call is kept and read at the first
  later call where it is already computed (``jax.Array.is_ready``), so the
  read never waits for the device.
  """

  def __init__(self, on_stall: str = "warn", check_every: int = 10):
    if on_stall not in ON_STALL:
      raise ValueError(f"on_stall must be one of {ON_STALL}, got {on_stall!r}")
    self.on_stall = on_stall
    self.check_every = validation.check_count("stall_check_every", check_every)
    self._calls = 0
    self._kept: Optional[tuple[jax.Array, jax.Array]] = None
    self._reported = False

  def after_step(self, stalled: jax.Array, skip_streak: jax.Array,
                 bad_leaves: Callable[[], list]) -> None:
    """Call once per iteration with the device flag and streak; ``bad_leaves`` names the leaves."""
    if self.on_stall == "ignore":
      return
    self._calls += 1
    if self._calls % self.check_every == 0 and self._kept is None:
      self._kept = (stalled, skip_streak)
    if self._kept is None or not self._kept[0].is_ready():  # type: ignore[attr-defined]
      return
    (flag, streak), self._kept = self._kept, None
    if not bool(flag):
      self._reported = False
      return
    if self._reported:
      return
    self._reported = True
    self._report(int(streak), bad_leaves())

  def _report(self, streak: int, leaves: list) -> None:
    named = ", ".join(leaves[:8]) + (f" and {len(leaves) - 8} more" if len(leaves) > 8 else "")
    message = (
        f"{streak} consecutive steps were skipped because the gradients held inf or nan"
        f"{f' (in {named})' if leaves else ''}, and lowering the loss scale has not helped: the "
        "model or the data produce non-finite values at every scale. Look for the operation "
        "that overflows (jaxamp.skip_report names the leaves), or for bad inputs.")
    if self.on_stall == "raise":
      raise StalledError(message)
    warnings.warn(message, StallWarning, stacklevel=4)


def nonfinite_grad_leaves(optimizers: list) -> list:
  """The paths of the gradient leaves holding inf or nan in each optimizer's ``grads`` (a host sync).

  With several optimizers each path is prefixed by the optimizer's position.
  """
  names: list[str] = []
  for i, optimizer in enumerate(optimizers):
    prefix = f"optimizer {i}: " if len(optimizers) > 1 else ""
    for path, leaf in jax.tree_util.tree_leaves_with_path(getattr(optimizer, "grads", None)):
      if validation.is_inexact(leaf) and bool(jax.device_get(finite.nonfinite_mask(leaf).any())):
        names.append(prefix + jax.tree_util.keystr(path))
  return names
