"""The demo's training run: a Flax MLP on spirals, float16 compute, loss scaling, accumulation."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

import jaxamp
from jaxamp.demo import data as data_lib

DTYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32}
PARAM_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
ROUNDINGS = ("stochastic", "kahan", "nearest")


@dataclasses.dataclass(frozen=True)
class DemoConfig:
  """Settings of a demo run (the command-line options of ``python -m jaxamp.demo``).

  Attributes:
    steps: optimizer steps; each one accumulates ``accumulate`` micro-batches.
    accumulate: micro-batches per optimizer step (``jaxamp.accumulate_gradients``).
    batch_size: examples per micro-batch.
    dtype: compute dtype of the model: ``'float16'``, ``'bfloat16'`` or ``'float32'``
      (the optimizer state and the loss stay float32).
    params: dtype of the parameters: ``'float32'`` (a master copy) or
      ``'bfloat16'`` (no master copy: ``jaxamp.low_precision_params``).
    rounding: how bfloat16 parameters are updated: ``'stochastic'``,
      ``'kahan'`` or ``'nearest'`` (ignored with float32 parameters).
    loss_scale: whether to use ``jaxamp.dynamic_loss_scale``.
    init_scale: its initial scale; deliberately high, so that the first steps
      overflow and the scale calibrates itself, as in real runs.
    growth_interval: good steps before the scale doubles (2000 in PyTorch;
      shorter here so that a short run shows the dynamics).
    learning_rate: peak AdamW learning rate (linear warm-up, cosine decay).
    clip: maximum global gradient norm, applied after unscaling; 0 disables.
    weight_decay: AdamW weight decay.
    width: width of the hidden layers.
    depth: number of hidden layers.
    num_classes: number of spiral arms.
    train_size: size of the training set.
    eval_size: size of the held-out set.
    evals: how many times the held-out set is evaluated during the run.
    seed: seed of the data, the initialization and the batch order.
  """

  steps: int = 1000
  accumulate: int = 4
  batch_size: int = 64
  dtype: str = "float16"
  params: str = "float32"
  rounding: str = "stochastic"
  loss_scale: bool = True
  init_scale: float = 2.0**24
  growth_interval: int = 100
  learning_rate: float = 3e-3
  clip: float = 1.0
  weight_decay: float = 1e-4
  width: int = 256
  depth: int = 3
  num_classes: int = 5
  train_size: int = 20000
  eval_size: int = 4000
  evals: int = 20
  seed: int = 0

  def __post_init__(self):
    for name in ("steps", "accumulate", "batch_size", "growth_interval", "width", "depth",
                 "train_size", "eval_size", "evals"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if self.dtype not in DTYPES:
      raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
    if self.params not in PARAM_DTYPES:
      raise ValueError(f"params must be one of {sorted(PARAM_DTYPES)}, got {self.params!r}")
    if self.rounding not in ROUNDINGS:
      raise ValueError(f"rounding must be one of {list(ROUNDINGS)}, got {self.rounding!r}")
    if self.num_classes < 2:
      raise ValueError(f"num_classes must be >= 2, got {self.num_classes!r}")
    if not (self.init_scale > 0 and math.isfinite(self.init_scale)):
      raise ValueError(f"init_scale must be positive and finite, got {self.init_scale!r}")
    if not self.learning_rate > 0:
      raise ValueError(f"learning_rate must be > 0, got {self.learning_rate!r}")
    if not self.clip >= 0:
      raise ValueError(f"clip must be >= 0 (0 disables clipping), got {self.clip!r}")


class MLP(nn.Module):
  """A GELU MLP that computes in ``dtype`` and keeps ``param_dtype`` parameters."""

  width: int
  depth: int
  num_classes: int
  dtype: Any = jnp.float16
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.astype(self.dtype)
    for _ in range(self.depth):
      x = nn.gelu(nn.Dense(self.width, dtype=self.dtype, param_dtype=self.param_dtype)(x))
    return nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype)(x)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean cross-entropy, computed in float32 whatever the dtype of the logits."""
  logits = logits.astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_optimizer(config: DemoConfig) -> optax.GradientTransformation:
  """``accumulate_gradients(dynamic_loss_scale(chain(clip, adamw)), k)``, as configured.

  With bfloat16 parameters the chain is wrapped in ``jaxamp.low_precision_params``.
  """
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.learning_rate,
      warmup_steps=max(1, config.steps // 20), decay_steps=config.steps,
      end_value=config.learning_rate * 0.05)
  parts = [optax.clip_by_global_norm(config.clip)] if config.clip > 0 else []
  tx = optax.chain(*parts, optax.adamw(schedule, weight_decay=config.weight_decay))
  if config.params == "bfloat16":
    tx = jaxamp.low_precision_params(tx, config.rounding, seed=config.seed)
  if config.loss_scale:
    tx = jaxamp.dynamic_loss_scale(tx, init_scale=config.init_scale,
                                   growth_interval=config.growth_interval)
  if config.accumulate > 1:
    tx = jaxamp.accumulate_gradients(tx, config.accumulate)
  return tx


def default_platform() -> str:
  """The platform JAX computes on by default (``'cpu'``, ``'gpu'``, ``'tpu'``)."""
  return jax.devices()[0].platform


def _describe_device() -> dict[str, Any]:
  devices = jax.devices()
  return {"platform": devices[0].platform, "kind": devices[0].device_kind, "count": len(devices)}


@dataclasses.dataclass
class DemoResult:
  """What a demo run produces.

  Attributes:
    metrics: the JSON-ready metrics (see :func:`run`).
    state: the final :class:`jaxamp.TrainState`.
    model: the Flax module.
    eval_data: the held-out :class:`~jaxamp.demo.data.Dataset`.
  """

  metrics: dict[str, Any]
  state: jaxamp.TrainState
  model: nn.Module
  eval_data: data_lib.Dataset

  def predict(self, x: np.ndarray) -> np.ndarray:
    """The classes the trained model predicts for the points ``x``."""
    logits = jax.jit(self.model.apply)({"params": self.state.params}, jnp.asarray(x))
    return np.asarray(jnp.argmax(logits, axis=-1))

  def predict_grid(self, lim: float, n: int) -> np.ndarray:
    """The classes predicted on an ``n`` x ``n`` grid over ``[-lim, lim]^2`` (rows: y)."""
    axis = np.linspace(-lim, lim, n, dtype=np.float32)
    grid = np.stack(np.meshgrid(axis, axis), axis=-1).reshape(-1, 2)
    return self.predict(grid).reshape(n, n)


def run(config: DemoConfig, *, report: Optional[Callable[[int, Optional[dict[str, float]]], None]] = None,
        report_interval: float = 0.1) -> DemoResult:
  """Trains the demo model and returns its metrics (what ``metrics.json`` holds).

  One jitted call per micro-batch, with the train state donated; the host
  reads the metrics back only every ``report_interval`` seconds (and calls
  ``report(optimizer_steps_done, latest)`` then), so the device is never
  waited on step by step.

  Args:
    config: the settings.
    report: called with the number of optimizer steps done and the latest
      values (``loss``, ``scale``, ``skipped``), for a progress bar; first
      with ``(0, None)`` when compilation is over and training starts.
    report_interval: seconds between two reads of the metrics.

  Returns:
    A :class:`DemoResult`, whose ``metrics`` dict has ``config``, ``device``,
    ``versions``, ``model``, ``summary``, ``history`` (per optimizer step:
    ``loss``, the ``scale`` the step's losses were multiplied by, whether it
    was ``skipped``) and ``eval`` (per evaluation) entries; every value is a
    plain Python number, string, bool or list, ready for ``json.dump``.
  """
  dtype = DTYPES[config.dtype]
  k = config.accumulate
  train = data_lib.make_spirals(config.train_size, num_classes=config.num_classes,
                                seed=config.seed)
  held_out = data_lib.make_spirals(config.eval_size, num_classes=config.num_classes,
                                   seed=config.seed + 1)
  train_x, train_y = jnp.asarray(train.x), jnp.asarray(train.y)
  eval_x, eval_y = jnp.asarray(held_out.x), jnp.asarray(held_out.y)

  model = MLP(config.width, config.depth, config.num_classes, dtype,
              PARAM_DTYPES[config.params])
  key = jax.random.key(config.seed)
  init_key, batch_key = jax.random.split(key)
  params = jax.jit(model.init)(init_key, train_x[:1])["params"]
  state = jaxamp.TrainState.create(apply_fn=model.apply, params=params,
                                   tx=make_optimizer(config))
  num_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
  leaf_paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
  num_leaves = len(leaf_paths)

  def train_step(state, micro_step, x_all, y_all):
    index = jax.random.randint(jax.random.fold_in(batch_key, micro_step), (config.batch_size,),
                               0, x_all.shape[0])
    x, y = x_all[index], y_all[index]

    def loss_fn(params):
      loss = cross_entropy(state.apply_fn({"params": params}, x), y)
      return state.scale_loss(loss), loss

    grads, loss = jax.grad(loss_fn, has_aux=True)(state.params)
    used_scale = state.loss_scale
    state = state.apply_gradients(grads=grads)
    if config.loss_scale:
      health = jaxamp.get_loss_scale_state(state.opt_state)
      stalled, bad = health.stalled, health.nonfinite_leaves
    else:
      stalled, bad = jnp.zeros([], bool), jnp.zeros([num_leaves], bool)
    return state, (loss, used_scale, state.skipped_steps, stalled, bad)

  def evaluate(params, x, y):
    logits = model.apply({"params": params}, x).astype(jnp.float32)
    return cross_entropy(logits, y), jnp.mean(jnp.argmax(logits, axis=-1) == y)

  compile_start = time.perf_counter()
  micro_index = jnp.zeros([], jnp.int32)
  step_fn = jax.jit(train_step, donate_argnums=0).lower(
      state, micro_index, train_x, train_y).compile()
  eval_fn = jax.jit(evaluate).lower(params, eval_x, eval_y).compile()
  compile_seconds = time.perf_counter() - compile_start

  eval_every = max(1, config.steps // config.evals)
  eval_steps = set(range(eval_every, config.steps + 1, eval_every)) | {config.steps}
  pending_evals = [(0, eval_fn(state.params, eval_x, eval_y))]

  pending: list[Any] = []   # device metrics of micro-steps not yet read back
  micro: list[tuple[float, float, int, bool]] = []
  evals: list[tuple[int, float, float]] = []
  last_skip: dict[str, Any] = {}  # the micro-step and leaves of the last skipped step

  def drain():
    values = jax.device_get(pending)
    for loss, s, n, stalled, bad in values:
      if micro and int(n) > micro[-1][2] or not micro and int(n) > 0:
        last_skip.update(micro_step=len(micro) + 1,
                         leaves=[p for p, c in zip(leaf_paths, bad) if c])
      micro.append((float(loss), float(s), int(n), bool(stalled)))
    pending.clear()
    for step, (loss, acc) in jax.device_get(pending_evals):
      evals.append((step, float(loss), float(acc)))
    pending_evals.clear()

  if report is not None:
    report(0, None)
  start = time.perf_counter()
  last_report = start
  for step in range(1, config.steps + 1):
    for j in range(k):
      state, metrics = step_fn(state, jnp.asarray((step - 1) * k + j, jnp.int32),
                               train_x, train_y)
      pending.append(metrics)
    if step in eval_steps:
      pending_evals.append((step, eval_fn(state.params, eval_x, eval_y)))
    now = time.perf_counter()
    if step == config.steps or (report is not None and now - last_report >= report_interval):
      drain()
      last_report = now
      if report is not None:
        done = len(micro) // k
        window = micro[(done - 1) * k:done * k]
        report(done, {"loss": float(np.mean([m[0] for m in window])), "scale": window[-1][1],
                      "skipped": window[-1][2], "last_skip": last_skip.get("leaves", [])})
  jax.block_until_ready(state)
  drain()
  seconds = time.perf_counter() - start

  losses = np.asarray([m[0] for m in micro], np.float64).reshape(config.steps, k)
  scales = np.asarray([m[1] for m in micro], np.float64).reshape(config.steps, k)[:, 0]
  skipped_total = np.asarray([m[2] for m in micro], np.int64).reshape(config.steps, k)[:, -1]
  skipped = np.diff(np.concatenate([[0], skipped_total])) > 0
  stalled = np.asarray([m[3] for m in micro], bool).reshape(config.steps, k)[:, -1]
  window_loss = losses.mean(axis=1)
  final_scale = float(state.loss_scale)
  scale_path = np.concatenate([scales, [final_scale]])
  ups = int(np.sum(scale_path[1:] > scale_path[:-1]))
  downs = int(np.sum(scale_path[1:] < scale_path[:-1]))
  tail = max(1, config.steps // 20)
  eval_loss, eval_acc = evals[-1][1], evals[-1][2]

  summary = {
      "initial_loss": float(window_loss[0]),
      "final_loss": float(window_loss[-tail:].mean()),
      "initial_eval_loss": evals[0][1],
      "initial_eval_accuracy": evals[0][2],
      "eval_loss": eval_loss,
      "eval_accuracy": eval_acc,
      "optimizer_steps": config.steps,
      "applied_steps": int(state.step),
      "micro_steps": config.steps * k,
      "skipped_steps": int(skipped.sum()),
      "last_skipped_step": (None if not last_skip
                            else (last_skip["micro_step"] - 1) // k + 1),
      "last_skipped_leaves": last_skip.get("leaves", []),
      "stalled_steps": int(stalled.sum()),
      "stale_fraction": (float(jaxamp.step_metrics(state.opt_state)["stale_fraction"])
                         if config.params == "bfloat16" else None),
      "initial_scale": float(scales[0]),
      "final_scale": final_scale,
      "scale_changes": ups + downs,
      "scale_increases": ups,
      "scale_decreases": downs,
      "train_seconds": seconds,
      "compile_seconds": compile_seconds,
      "steps_per_second": config.steps / seconds,
      "micro_steps_per_second": config.steps * k / seconds,
      "examples_per_second": config.steps * k * config.batch_size / seconds,
  }
  metrics = {
      "config": dataclasses.asdict(config),
      "device": _describe_device(),
      "versions": {"jax": jax.__version__, "jaxamp": jaxamp.__version__},
      "model": {"kind": "MLP", "layers": [2] + [config.width] * config.depth +
                [config.num_classes], "parameters": num_params,
                "compute_dtype": config.dtype, "param_dtype": config.params},
      "summary": summary,
      "history": {
          "step": list(range(1, config.steps + 1)),
          "loss": window_loss.tolist(),
          "scale": scales.tolist(),
          "skipped": skipped.tolist(),
          "stalled": stalled.tolist(),
      },
      "eval": {"step": [e[0] for e in evals], "loss": [e[1] for e in evals],
               "accuracy": [e[2] for e in evals]},
  }
  return DemoResult(metrics=metrics, state=state, model=model, eval_data=held_out)
