"""A small terminal progress bar (no dependencies)."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


def format_seconds(seconds: float) -> str:
  """``75.0`` -> ``'01:15'``; hours when needed (``'1:02:03'``).

  Examples:
    >>> format_seconds(75.4), format_seconds(3723)
    ('01:15', '1:02:03')
  """
  seconds = int(round(max(seconds, 0.0)))
  hours, rest = divmod(seconds, 3600)
  minutes, seconds = divmod(rest, 60)
  if hours:
    return f"{hours}:{minutes:02d}:{seconds:02d}"
  return f"{minutes:02d}:{seconds:02d}"


class ProgressBar:
  """A one-line progress bar with a free-form status, redrawn in place.

  On a terminal the line is redrawn at most every ``min_interval`` seconds;
  elsewhere (a log file, a captured stream) a plain line is written at every
  tenth of the way, so logs stay short.

  Examples:
    >>> import io
    >>> stream = io.StringIO()
    >>> bar = ProgressBar(4, stream=stream, width=8, desc="train", clock=lambda: 0.0)
    >>> bar.update(2, "loss 0.5")
    >>> bar.close()
    >>> print(stream.getvalue().splitlines()[0])
    train  50% |####----| 2/4 [00:00<00:00] loss 0.5
  """

  def __init__(self, total: int, *, stream: Optional[TextIO] = None, width: int = 24,
               desc: str = "", min_interval: float = 0.1, unit: str = "step",
               clock=time.perf_counter):
    if total < 1:
      raise ValueError(f"total must be >= 1, got {total!r}")
    self.total = int(total)
    self.stream = sys.stderr if stream is None else stream
    self.width = width
    self.desc = desc
    self.unit = unit
    self.min_interval = min_interval
    self._clock = clock
    self._start = clock()
    self._last_draw = -float("inf")
    self._last_tenth = -1
    self._count = 0
    self._status = ""
    self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
    encoding = (getattr(self.stream, "encoding", None) or "").lower()
    self._fill, self._empty = ("\u2588", "\u2591") if self._tty and "utf" in encoding else ("#", "-")

  def update(self, count: int, status: str = "") -> None:
    """Sets the number of completed units and the status text; redraws if due."""
    self._count = min(int(count), self.total)
    self._status = status
    now = self._clock()
    if self._tty:
      if now - self._last_draw >= self.min_interval or self._count == self.total:
        self._draw(now, end="\r")
    else:
      tenth = self._count * 10 // self.total
      if tenth > self._last_tenth:
        self._last_tenth = tenth
        self._draw(now, end="\n")

  def close(self) -> None:
    """Draws the final state and ends the line."""
    now = self._clock()
    if self._tty:
      self._draw(now, end="\n")
    elif self._count * 10 // self.total > self._last_tenth:
      self._draw(now, end="\n")
    self.stream.flush()

  def line(self, now: Optional[float] = None) -> str:
    """The text of the bar as it would be drawn now."""
    now = self._clock() if now is None else now
    elapsed = now - self._start
    frac = self._count / self.total
    filled = int(round(frac * self.width))
    bar = self._fill * filled + self._empty * (self.width - filled)
    rate = self._count / elapsed if elapsed > 0 else 0.0
    eta = (self.total - self._count) / rate if rate > 0 else 0.0
    speed = f", {rate:.1f} {self.unit}/s" if rate > 0 else ""
    head = f"{self.desc} " if self.desc else ""
    text = (f"{head}{frac:4.0%} |{bar}| {self._count}/{self.total} "
            f"[{format_seconds(elapsed)}<{format_seconds(eta)}{speed}]")
    return f"{text} {self._status}" if self._status else text

  def _draw(self, now: float, end: str) -> None:
    self._last_draw = now
    text = self.line(now)
    if self._tty:
      text = "\r" + text + "\x1b[K"  # clear the rest of a longer previous line
    self.stream.write(text + end if end == "\n" else text)
    self.stream.flush()
