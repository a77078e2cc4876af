"""Figures of the demo, drawn with matplotlib's Agg canvas (no display, no pyplot state)."""

from __future__ import annotations

import math
from typing import Any, Sequence, Union

import numpy as np


def power_of_two(value: float) -> str:
  """``65536.0`` -> ``'2^16'``; other values as ``'%g'``.

  Examples:
    >>> power_of_two(65536.0), power_of_two(0.25), power_of_two(3.0)
    ('2^16', '2^-2', '3')
  """
  if value > 0 and math.isfinite(value):
    exponent = math.log2(value)
    if exponent.is_integer():
      return f"2^{int(exponent)}"
  return f"{value:g}"


def new_figure(width: float, height: float) -> Any:
  """A matplotlib ``Figure`` attached to an Agg canvas; imports matplotlib lazily."""
  try:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
  except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("The demo's plots need matplotlib: pip install 'jaxamp[demo]'") from error
  figure = Figure(figsize=(width, height), dpi=110, layout="constrained")
  FigureCanvasAgg(figure)
  return figure


def log2_axis(axis: Any) -> None:
  """Base-2 logarithmic y axis labelled ``2^k``."""
  from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

  axis.set_yscale("log", base=2)
  axis.yaxis.set_major_locator(LogLocator(base=2.0, numticks=8))
  axis.yaxis.set_minor_locator(NullLocator())
  axis.yaxis.set_major_formatter(FuncFormatter(
      lambda v, _: f"$2^{{{int(round(math.log2(v)))}}}$" if v > 0 else ""))


def moving_average(values: Union[Sequence[float], np.ndarray], window: int) -> np.ndarray:
  """Trailing mean over ``window`` values (shorter at the start), ignoring non-finite values.

  Examples:
    >>> moving_average([1.0, 3.0, float('nan'), 5.0], 2).tolist()
    [1.0, 2.0, 3.0, 5.0]
  """
  array = np.asarray(values, np.float64)
  finite = np.isfinite(array)
  sums = np.cumsum(np.where(finite, array, 0.0))
  counts = np.cumsum(finite)
  shifted_sums = np.concatenate([np.zeros(window), sums[:-window]])[:len(array)]
  shifted_counts = np.concatenate([np.zeros(window), counts[:-window]])[:len(array)]
  with np.errstate(invalid="ignore", divide="ignore"):
    return (sums - shifted_sums) / (counts - shifted_counts)


def plot_training(metrics: dict[str, Any], path: str, *, grid: Any = None,
                  points: Any = None) -> None:
  """Writes the demo's figure: loss, loss scale and (optionally) decision regions.

  Args:
    metrics: the metrics of :func:`jaxamp.demo.train.run`.
    path: where to write the PNG.
    grid: optional ``(lim, classes)``: the class predicted on a square grid
      over ``[-lim, lim]^2``, drawn as the model's decision regions.
    points: optional ``(x, y)`` held-out points drawn over the regions.
  """
  config, summary, history = metrics["config"], metrics["summary"], metrics["history"]
  steps = np.asarray(history["step"])
  loss = np.asarray(history["loss"], np.float64)
  scale = np.asarray(history["scale"], np.float64)
  skipped = np.asarray(history["skipped"], bool)

  with_regions = grid is not None
  figure = new_figure(13.0 if with_regions else 8.5, 6.2)
  spec = figure.add_gridspec(2, 2 if with_regions else 1,
                             width_ratios=[1.55, 1] if with_regions else None)
  ax_loss = figure.add_subplot(spec[0, 0])
  ax_scale = figure.add_subplot(spec[1, 0], sharex=ax_loss)

  # Loss.
  ax_loss.plot(steps, loss, color="#9fb7d9", linewidth=0.8, label="train loss (per step)")
  ax_loss.plot(steps, moving_average(loss, max(1, len(steps) // 50)), color="#1f4e99",
               linewidth=1.8, label="train loss (moving average)")
  evals = metrics.get("eval", {})
  if evals.get("step"):
    ax_loss.plot(evals["step"], evals["loss"], "o", color="#e08a00", markersize=4,
                 label="held-out loss")
  if skipped.any():
    for s in steps[skipped]:
      ax_loss.axvline(s, color="#d62728", alpha=0.25, linewidth=0.8)
    ax_loss.plot([], [], color="#d62728", alpha=0.5, label="skipped step (overflow)")
  stalled = np.asarray(history.get("stalled", [False] * len(steps)), bool)
  if stalled.any():
    first = steps[stalled][0]
    for ax in (ax_loss, ax_scale):
      ax.axvspan(first, steps[-1], color="#7f7f7f", alpha=0.2,
                 label="stalled: every step skipped" if ax is ax_loss else None)
  positive = loss[np.isfinite(loss) & (loss > 0)]
  if positive.size and positive.max() / positive.min() > 20:
    ax_loss.set_yscale("log")
  ax_loss.set_ylabel("cross-entropy")
  ax_loss.grid(alpha=0.3)
  ax_loss.legend(loc="upper right", fontsize=8)
  scaling = "dynamic loss scaling" if config["loss_scale"] else "no loss scaling"
  clip = f"global-norm clip {config['clip']:g}" if config["clip"] > 0 else "no clipping"
  ax_loss.set_title(f"{config['dtype']} compute, float32 params: {scaling}, "
                    f"{config['accumulate']}-step accumulation, {clip}", fontsize=10)
  ax_loss.tick_params(labelbottom=False)

  # Loss scale.
  ax_scale.step(steps, scale, where="post", color="#2ca02c", linewidth=1.6,
                label="loss scale used")
  if skipped.any():
    ax_scale.plot(steps[skipped], scale[skipped], "v", color="#d62728", markersize=5,
                  label=f"skipped: {int(skipped.sum())} (scale halved)")
  if np.all(scale > 0):
    log2_axis(ax_scale)
    low, high = np.log2(scale.min()), np.log2(scale.max())
    ax_scale.set_ylim(2.0**(math.floor(low) - 1), 2.0**(math.ceil(high) + 1))
  ax_scale.set_xlabel(f"optimizer step ({config['accumulate']} micro-batches of "
                      f"{config['batch_size']} each)")
  ax_scale.set_ylabel("loss scale")
  ax_scale.grid(alpha=0.3)
  ax_scale.legend(loc="upper right", fontsize=8)
  ax_scale.set_title(
      f"{summary['scale_changes']} scale changes ({summary['scale_increases']} up, "
      f"{summary['scale_decreases']} down); growth every {config['growth_interval']} good steps",
      fontsize=10)

  if with_regions:
    lim, classes = grid
    ax = figure.add_subplot(spec[:, 1])
    from matplotlib.colors import ListedColormap
    palette = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3",
               "#8c8c8c", "#ccb974", "#64b5cd"]
    num_classes = int(config["num_classes"])
    colors = [palette[i % len(palette)] for i in range(num_classes)]
    ax.imshow(classes, origin="lower", extent=(-lim, lim, -lim, lim), interpolation="nearest",
              cmap=ListedColormap(colors), vmin=-0.5, vmax=num_classes - 0.5, alpha=0.35)
    if points is not None:
      x, y = points
      ax.scatter(x[:, 0], x[:, 1], c=[colors[int(c)] for c in y], s=4, linewidths=0)
    ax.set_xlim(-lim, lim)
    ax.set_ylim(-lim, lim)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(f"decision regions; held-out accuracy {summary['eval_accuracy']:.1%}",
                 fontsize=10)
  figure.savefig(path)
