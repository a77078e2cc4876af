"""Command line of ``python -m jaxamp.demo``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Optional, Sequence, TextIO

from rich import console as rich_console
from rich import progress as rich_progress

from jaxamp.demo import plot as plot_lib
from jaxamp.demo import train as train_lib

_DEFAULTS = train_lib.DemoConfig()


def progress_bar(stream: TextIO) -> rich_progress.Progress:
  """A ``rich`` progress bar on ``stream``: ``train  40% |####    | 40/100 0:00:02 0:00:03 ...``.

  On a terminal it is redrawn in place; elsewhere (a log file, a captured
  stream) its final state is written once, on one line.
  """
  console = rich_console.Console(file=stream, width=None if stream.isatty() else 160)
  return rich_progress.Progress(
      rich_progress.TextColumn("{task.description}"),
      rich_progress.TextColumn("{task.percentage:>3.0f}% |"),
      rich_progress.BarColumn(bar_width=24),
      rich_progress.TextColumn("| {task.completed}/{task.total}"),
      rich_progress.TimeElapsedColumn(),
      rich_progress.TimeRemainingColumn(),
      rich_progress.TextColumn("{task.fields[status]}"),
      console=console)


def build_parser() -> argparse.ArgumentParser:
  """The argument parser of the demo."""
  parser = argparse.ArgumentParser(
      prog="python -m jaxamp.demo",
      description=(
          "Trains a small Flax MLP on a synthetic spirals dataset in float16 compute with "
          "float32 master parameters, jaxamp's dynamic loss scaling, gradient accumulation and "
          "gradient clipping; shows a progress bar, prints a summary and writes a plot and the "
          "metrics to an output folder. Runs on whatever device JAX sees (CPU, GPU, TPU)."),
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  add = parser.add_argument
  add("--steps", type=int, default=_DEFAULTS.steps, help="optimizer steps")
  add("--accumulate", "-k", type=int, default=_DEFAULTS.accumulate, metavar="K",
      help="micro-batches accumulated per optimizer step (1 disables accumulation)")
  add("--batch-size", type=int, default=_DEFAULTS.batch_size, help="examples per micro-batch")
  add("--dtype", choices=sorted(train_lib.DTYPES), default=_DEFAULTS.dtype,
      help="compute dtype (the optimizer state stays float32)")
  add("--params", choices=sorted(train_lib.PARAM_DTYPES), default=_DEFAULTS.params,
      help="parameter dtype: float32 (a master copy) or bfloat16 (no master copy)")
  add("--rounding", choices=train_lib.ROUNDINGS, default=_DEFAULTS.rounding,
      help="how bfloat16 parameters are updated (with --params bfloat16)")
  add("--no-loss-scale", dest="loss_scale", action="store_false",
      help="train without loss scaling")
  add("--init-scale", type=float, default=_DEFAULTS.init_scale,
      help="initial loss scale (high on purpose: the first steps overflow and calibrate it)")
  add("--growth-interval", type=int, default=_DEFAULTS.growth_interval,
      help="good steps before the loss scale doubles")
  add("--lr", dest="learning_rate", type=float, default=_DEFAULTS.learning_rate,
      help="peak learning rate of AdamW (warm-up, then cosine decay)")
  add("--clip", type=float, default=_DEFAULTS.clip,
      help="maximum global gradient norm, applied after unscaling (0 disables)")
  add("--width", type=int, default=_DEFAULTS.width, help="width of the hidden layers")
  add("--depth", type=int, default=_DEFAULTS.depth, help="number of hidden layers")
  add("--classes", dest="num_classes", type=int, default=_DEFAULTS.num_classes,
      help="number of spiral arms (classes)")
  add("--train-size", type=int, default=_DEFAULTS.train_size, help="training examples")
  add("--eval-size", type=int, default=_DEFAULTS.eval_size, help="held-out examples")
  add("--seed", type=int, default=_DEFAULTS.seed, help="seed of data, initialization and batches")
  add("--out", default="demo_output", help="output folder for metrics.json and training.png")
  add("--no-plot", dest="plot", action="store_false", help="do not write the PNG")
  add("--quiet", action="store_true", help="no progress bar")
  return parser


def config_from_args(args: argparse.Namespace) -> train_lib.DemoConfig:
  """The :class:`~jaxamp.demo.train.DemoConfig` the parsed arguments describe."""
  names = {f.name for f in dataclasses.fields(train_lib.DemoConfig)}
  return train_lib.DemoConfig(**{k: v for k, v in vars(args).items() if k in names})


def format_summary(metrics: dict, files: Sequence[str]) -> str:
  """The summary printed at the end of a run."""
  config, summary, model = metrics["config"], metrics["summary"], metrics["model"]
  device = metrics["device"]
  k = config["accumulate"]
  layers = "-".join(str(n) for n in model["layers"])
  scaling = (f"dynamic, {plot_lib.power_of_two(summary['initial_scale'])} -> "
             f"{plot_lib.power_of_two(summary['final_scale'])}, {summary['scale_changes']} changes "
             f"({summary['scale_increases']} up, {summary['scale_decreases']} down)"
             if config["loss_scale"] else "off")
  lines = [
      f"jaxamp demo: {config['num_classes']}-class spirals, MLP {layers} "
      f"({model['parameters']:,} parameters)",
      f"  device          {device['platform']} ("
      f"{'' if device['kind'] == device['platform'] else device['kind'] + ', '}"
      f"{device['count']} device{'s' if device['count'] > 1 else ''})",
      f"  precision       {config['dtype']} compute, " + (
          "float32 parameters and optimizer state" if config.get("params", "float32") == "float32"
          else f"bfloat16 parameters ({config['rounding']} rounding, no master copy; "
          f"round-to-nearest would lose {summary['stale_fraction']:.1%} of the last update), "
          "float32 optimizer state"),
      f"  optimizer steps {summary['optimizer_steps']} of {k} micro-batch"
      f"{'es' if k > 1 else ''} x {config['batch_size']} ({summary['micro_steps']} micro-steps), "
      f"{summary['applied_steps']} applied",
      f"  loss            {summary['initial_loss']:.4f} -> {summary['final_loss']:.4f} (train); "
      f"held-out {summary['eval_loss']:.4f}, accuracy {summary['initial_eval_accuracy']:.1%} -> "
      f"{summary['eval_accuracy']:.1%}",
      f"  skipped steps   {summary['skipped_steps']}" + (
          f"; the last (step {summary['last_skipped_step']}) had inf/nan gradients in "
          f"{', '.join(summary['last_skipped_leaves'])}" if summary["last_skipped_leaves"] else "")
      + (f"; stalled for {summary['stalled_steps']} steps" if summary["stalled_steps"] else ""),
      f"  loss scale      {scaling}",
      f"  speed           {summary['steps_per_second']:.1f} optimizer steps/s "
      f"({summary['micro_steps_per_second']:.1f} micro-steps/s); "
      f"{summary['train_seconds']:.1f} s training, {summary['compile_seconds']:.1f} s compiling",
  ]
  if files:
    lines.append(f"  wrote           {', '.join(files)}")
  return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None, *, stdout: Optional[TextIO] = None,
         stderr: Optional[TextIO] = None) -> int:
  """Runs the demo with the given command-line arguments; returns the exit status."""
  stdout = sys.stdout if stdout is None else stdout
  stderr = sys.stderr if stderr is None else stderr
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    config = config_from_args(args)
  except ValueError as error:
    parser.error(str(error))

  bars = []
  report = None
  if not args.quiet:

    def report(done, latest):
      if latest is None:  # training starts: start the clock now, compilation is over
        bar = progress_bar(stderr)
        bar.start()
        bars.append((bar, bar.add_task("train", total=config.steps, status="")))
        return
      bar, task = bars[0]
      status = f"loss {latest['loss']:.4f}"
      if config.loss_scale:
        status += f" | scale {plot_lib.power_of_two(latest['scale'])} | skipped {latest['skipped']}"
        if latest["last_skip"]:
          status += f" (last in {latest['last_skip'][0]})"
      bar.update(task, completed=done, status=status)

  print(f"Training for {config.steps} steps in {config.dtype} on "
        f"{train_lib.default_platform()} (compiling first)...", file=stderr, flush=True)
  result = train_lib.run(config, report=report)
  for bar, _ in bars:
    bar.stop()

  os.makedirs(args.out, exist_ok=True)
  files = []
  metrics_path = os.path.join(args.out, "metrics.json")
  with open(metrics_path, "w", encoding="utf-8") as f:
    json.dump(result.metrics, f, indent=1)
  files.append(metrics_path)
  if args.plot:
    plot_path = os.path.join(args.out, "training.png")
    lim, n = 2.4, 160
    grid = result.predict_grid(lim, n)
    points = (result.eval_data.x[:1500], result.eval_data.y[:1500])
    plot_lib.plot_training(result.metrics, plot_path, grid=(lim, grid), points=points)
    files.append(plot_path)
  print(format_summary(result.metrics, files), file=stdout, flush=True)
  return 0
