"""A float16 model whose gradients underflow without loss scaling, and its figure.

The model is a deep chain of small ``tanh`` layers (small activations, gain
0.85 per layer) with a zero-initialized linear head, fitted by mean squared
error to small targets (``|y| < 1e-4``) over 8192 output elements. The
gradient of the loss with respect to each output element is then about
``2 * 1e-4 / 8192 ~ 2e-8``: below float16's smallest subnormal (``2^-24 ~
6e-8``), it rounds to zero, and so does every gradient computed from it. In
float16 without loss scaling the parameters never move and the loss stays
flat; with :func:`jaxamp.dynamic_loss_scale` the scaled gradients land in
float16's range and training follows the float32 run.

``python -m jaxamp.demo.underflow [--out docs/img/underflow.png]`` draws
the figure shown in the documentation.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

import jaxamp

MODES = ("float32", "float16", "float16+scaling")
F16_SMALLEST_SUBNORMAL = 2.0**-24
F16_SMALLEST_NORMAL = 2.0**-14


@dataclasses.dataclass(frozen=True)
class UnderflowConfig:
  """The showcase's settings (defaults: the documented figure and the test).

  Attributes:
    depth: number of ``tanh`` layers in the chain.
    width: their width.
    inputs: input features.
    outputs: output features (with ``batch``, the elements the loss averages).
    batch: examples in the (fixed) batch.
    target_scale: bound of the targets' magnitude.
    gain: initialization gain of each layer (< 1: activations shrink).
    learning_rate: Adam's learning rate.
    init_scale: the initial loss scale.
    growth_interval: good steps before the scale doubles.
    steps: training steps.
    seed: seed of the data and the initialization.
  """

  depth: int = 8
  width: int = 32
  inputs: int = 16
  outputs: int = 64
  batch: int = 128
  target_scale: float = 1e-4
  gain: float = 0.85
  learning_rate: float = 3e-5
  init_scale: float = 2.0**16
  growth_interval: int = 10
  steps: int = 40
  seed: int = 0


class Chain(nn.Module):
  """``depth`` small ``tanh`` layers and a zero-initialized linear head."""

  depth: int
  width: int
  outputs: int
  gain: float
  dtype: Any = jnp.float16

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    init = nn.initializers.variance_scaling(self.gain**2, "fan_in", "normal")
    x = x.astype(self.dtype)
    for _ in range(self.depth):
      x = jnp.tanh(nn.Dense(self.width, dtype=self.dtype, param_dtype=jnp.float32,
                            kernel_init=init)(x))
    return nn.Dense(self.outputs, dtype=self.dtype, param_dtype=jnp.float32,
                    kernel_init=nn.initializers.zeros)(x)


@functools.partial(jax.jit, static_argnames=("config",))
def make_problem(config: UnderflowConfig) -> tuple[jax.Array, jax.Array, Any]:
  """The batch ``(x, y)`` and the float32 initial parameters."""
  kx, kt, kp = jax.random.split(jax.random.key(config.seed), 3)
  x = jax.random.normal(kx, (config.batch, config.inputs), jnp.float32)
  teacher = jax.random.normal(kt, (config.inputs, config.outputs), jnp.float32)
  y = config.target_scale * jnp.tanh(x @ teacher / math.sqrt(config.inputs))
  model = Chain(config.depth, config.width, config.outputs, config.gain, jnp.float32)
  params = model.init(kp, x)["params"]
  return x, y, params


def _mse(pred: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


def _zero_fraction(grads: Any) -> jax.Array:
  leaves = jax.tree.leaves(grads)
  zeros = sum((jnp.sum(g == 0).astype(jnp.float32) for g in leaves), jnp.zeros([], jnp.float32))
  return zeros / float(sum(g.size for g in leaves))


@functools.partial(jax.jit, static_argnames=("config", "mode"))
def train(config: UnderflowConfig, mode: str) -> dict[str, jax.Array]:
  """Trains the chain for ``config.steps`` Adam steps (one ``lax.scan``).

  Args:
    config: the settings.
    mode: ``'float32'`` (the reference), ``'float16'`` (float16 compute,
      float32 parameters, no loss scaling) or ``'float16+scaling'`` (the same
      with :func:`jaxamp.dynamic_loss_scale`).

  Returns:
    Per step: ``loss`` (before the step), ``scale`` (the loss scale used;
    1 without scaling) and ``zero_fraction`` (the fraction of gradient
    entries that are exactly zero); and ``params``, the final parameters.
  """
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  x, y, params = make_problem(config)
  dtype = jnp.float32 if mode == "float32" else jnp.float16
  model = Chain(config.depth, config.width, config.outputs, config.gain, dtype)
  tx = optax.adam(config.learning_rate)
  if mode == "float16+scaling":
    tx = jaxamp.dynamic_loss_scale(tx, init_scale=config.init_scale,
                                   growth_interval=config.growth_interval)
  state = jaxamp.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  def step(state, _):
    def loss_fn(params):
      loss = _mse(state.apply_fn({"params": params}, x), y)
      return state.scale_loss(loss), loss

    grads, loss = jax.grad(loss_fn, has_aux=True)(state.params)
    out = {"loss": loss, "scale": state.loss_scale, "zero_fraction": _zero_fraction(grads)}
    return state.apply_gradients(grads=grads), out

  # optax.adam's bias correction mixes a float and an int32 counter.
  with jax.numpy_dtype_promotion("standard"):
    state, history = jax.lax.scan(step, state, length=config.steps)
  history["params"] = state.params
  return history


@functools.partial(jax.jit, static_argnames=("config",))
def gradient_magnitudes(config: UnderflowConfig, params: Any) -> jax.Array:
  """Quantiles (5%, 50%, 95%) of the float32 ``|dL/dW|`` of each layer's kernel.

  Returns:
    A float32 array of shape ``(depth + 1, 3)``, input layer first.
  """
  x, y, _ = make_problem(config)
  model = Chain(config.depth, config.width, config.outputs, config.gain, jnp.float32)
  grads = jax.grad(lambda p: _mse(jnp.asarray(model.apply({"params": p}, x)), y))(params)
  names = [f"Dense_{i}" for i in range(config.depth + 1)]
  return jnp.stack([jnp.quantile(jnp.abs(grads[n]["kernel"]), jnp.array([0.05, 0.5, 0.95]))
                    for n in names])


def run_all(config: UnderflowConfig) -> dict[str, dict[str, np.ndarray]]:
  """The three runs of :func:`train`, as NumPy arrays."""
  return {mode: jax.device_get(train(config, mode)) for mode in MODES}


def plot(config: UnderflowConfig, runs: dict[str, Any], path: str) -> None:
  """Draws loss curves, the loss scale and the gradient magnitudes per layer."""
  from jaxamp.demo import plot as plot_lib

  figure = plot_lib.new_figure(13.0, 4.4)
  ax_loss, ax_scale, ax_grad = figure.subplots(1, 3, gridspec_kw={"width_ratios": [1.3, 1, 1]})
  steps = np.arange(config.steps)
  styles = {
      "float32": dict(color="#555555", linestyle="--", linewidth=1.5, label="float32"),
      "float16": dict(color="#d62728", linewidth=2.0, label="float16, no loss scaling"),
      "float16+scaling": dict(color="#1f77b4", linewidth=2.0,
                              label="float16, jaxamp.dynamic_loss_scale"),
  }
  first = float(runs["float32"]["loss"][0])
  for mode in ("float16", "float16+scaling", "float32"):
    ax_loss.plot(steps, np.asarray(runs[mode]["loss"]) / first, **styles[mode])
  ax_loss.set_xlabel("Adam step")
  ax_loss.set_ylabel("loss / initial loss")
  ax_loss.set_ylim(0, max(1.1, float(np.max(runs["float32"]["loss"])) / first * 1.05))
  ax_loss.grid(alpha=0.3)
  ax_loss.legend(fontsize=8, loc="lower left")
  zeros = float(np.mean(runs["float16"]["zero_fraction"]))
  ax_loss.set_title(f"float16 without scaling: {zeros:.0%} of gradients are 0", fontsize=10)

  ax_scale.step(steps, runs["float16+scaling"]["scale"], where="post", color="#1f77b4",
                linewidth=2.0)
  plot_lib.log2_axis(ax_scale)
  ax_scale.set_xlabel("Adam step")
  ax_scale.set_ylabel("loss scale")
  ax_scale.grid(alpha=0.3)
  ax_scale.set_title(f"dynamic scale: doubles every {config.growth_interval} good steps "
                     "(no overflow here)",
                     fontsize=10)

  magnitudes = np.asarray(gradient_magnitudes(config, runs["float32"]["params"]))
  layers = np.arange(1, config.depth + 2)
  scale = config.init_scale
  for values, color, label in ((magnitudes, "#d62728", "float32 |dL/dW| (median, 5-95%)"),
                               (magnitudes * scale, "#1f77b4",
                                f"the same x {plot_lib.power_of_two(scale)} (initial scale)")):
    ax_grad.errorbar(layers, values[:, 1],
                     yerr=[values[:, 1] - values[:, 0], values[:, 2] - values[:, 1]],
                     fmt="o", color=color, capsize=2, markersize=4, label=label)
  ax_grad.axhspan(1e-30, F16_SMALLEST_SUBNORMAL / 2, color="#d62728", alpha=0.12)
  ax_grad.axhline(F16_SMALLEST_SUBNORMAL, color="#d62728", linewidth=1, linestyle=":")
  ax_grad.axhline(F16_SMALLEST_NORMAL, color="#999999", linewidth=1, linestyle=":")
  ax_grad.set_xlim(0.4, config.depth + 1.6)
  ax_grad.text(0.5, F16_SMALLEST_SUBNORMAL / 2.5, "rounds to 0 in float16", color="#d62728",
               fontsize=8, va="top")
  ax_grad.text(0.5, F16_SMALLEST_NORMAL * 1.4, "float16 smallest normal", color="#777777",
               fontsize=8)
  ax_grad.set_yscale("log")
  ax_grad.set_ylim(min(1e-11, magnitudes[:, 0].min() / 3),
                   max(1e-1, float(np.max(magnitudes[:, 2])) * scale * 30))
  ax_grad.set_xticks(layers)
  ax_grad.set_xlabel("layer (input -> output)")
  ax_grad.set_ylabel("|weight gradient|")
  ax_grad.grid(alpha=0.3, axis="y")
  ax_grad.legend(fontsize=8, loc="upper left")
  ax_grad.set_title("why: the gradients lie below float16's range", fontsize=10)
  figure.savefig(path)


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs the three trainings and writes the figure."""
  parser = argparse.ArgumentParser(prog="python -m jaxamp.demo.underflow",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="docs/img/underflow.png", help="where to write the PNG")
  parser.add_argument("--steps", type=int, default=150, help="Adam steps per run")
  args = parser.parse_args(argv)
  config = UnderflowConfig(steps=args.steps)
  runs = run_all(config)
  plot(config, runs, args.out)
  first = float(runs["float32"]["loss"][0])
  for mode in MODES:
    loss = runs[mode]["loss"]
    print(f"{mode:>16}: loss {first:.3e} -> {float(loss[-1]):.3e} "
          f"({float(loss[-1]) / first:.1%} of the initial loss), "
          f"{float(np.mean(runs[mode]['zero_fraction'])):.0%} zero gradients on average")
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
