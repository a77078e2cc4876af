"""The demo's synthetic dataset: interleaved spirals, generated on the fly (no downloads)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Dataset(NamedTuple):
  """Points and labels, as NumPy arrays.

  Attributes:
    x: float32 array of shape ``(n, 2)``, the points.
    y: int32 array of shape ``(n,)``, the class of each point.
  """

  x: np.ndarray
  y: np.ndarray


def make_spirals(n: int, *, num_classes: int = 5, turns: float = 1.25, noise: float = 0.025,
                 seed: int = 0) -> Dataset:
  """Samples ``n`` points from ``num_classes`` interleaved spiral arms.

  Arm ``c`` is the curve ``r(t) = t``, ``angle(t) = 2*pi*(c / num_classes +
  turns * t)`` for ``t`` in ``[0, 1]``; points are drawn uniformly over the
  area the arms sweep (``t = sqrt(u)``), jittered by Gaussian ``noise`` and
  scaled by 2, so they lie roughly in ``[-2, 2]^2``. Classes are balanced in
  expectation. A small network needs a few hundred Adam steps to separate
  the arms, which makes the task a visible test of an optimizer.

  Args:
    n: number of points.
    num_classes: number of arms (and classes), >= 2.
    turns: how many times each arm winds around the centre.
    noise: standard deviation of the jitter, relative to the unit radius.
    seed: seed of the NumPy generator; the same seed gives the same data on
      every platform.

  Returns:
    A :class:`Dataset`.

  Examples:
    >>> data = make_spirals(6, num_classes=3, seed=0)
    >>> data.x.shape, data.x.dtype, data.y.dtype
    ((6, 2), dtype('float32'), dtype('int32'))
    >>> bool(abs(data.x).max() < 2.5)
    True
  """
  if n < 1:
    raise ValueError(f"n must be >= 1, got {n!r}")
  if num_classes < 2:
    raise ValueError(f"num_classes must be >= 2, got {num_classes!r}")
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, num_classes, size=n)
  t = np.sqrt(rng.uniform(size=n))
  angle = 2.0 * np.pi * (labels / num_classes + turns * t)
  points = np.stack([t * np.cos(angle), t * np.sin(angle)], axis=-1)
  points += noise * rng.standard_normal(points.shape)
  return Dataset(x=(2.0 * points).astype(np.float32), y=labels.astype(np.int32))
