"""bfloat16 parameters without a master copy against float32-master mixed precision.

Two measurements of the roundings alone (deterministic: ``tests/test_low_precision.py``
asserts them, ``tests/test_doc_figures.py`` compares them with the docs):

- ``--what drift``: a bfloat16 weight of 1.0 plus ``1e-4``, 2000 times, for
  each rounding (target 1.2);
- ``--what convergence``: linear regression (256 x 64, noise 0.4) trained by
  SGD from ``w* + 8`` for 2000 steps, float32 against bfloat16 with each
  rounding: the final mean squared error.

Three on the transformer LM of ``bench_train_step.py``:

- ``--what lm``: trains it for ``--steps`` steps four ways, on a synthetic
  corpus with structure to learn (tokens of a fixed random bigram chain):
  float32 master parameters with a bfloat16 forward and backward
  (``master``), and bfloat16 parameters with
  ``jaxamp.low_precision_params(adamw, rounding)`` for each rounding.
  Prints the loss every 25 steps and the final losses (mean of the last 20
  steps) as ratios to the master's; ``--plot PATH`` saves the curves.
- ``--what memory``: bytes per parameter of params, optimizer state and
  gradients of each configuration, with float32 and bfloat16 moments (plus
  the bfloat16 compute copy that the master configuration makes each step).
- ``--what time``: the whole jitted, donated train step of each
  configuration as a ratio to ``master``, in the update-bound regime (a
  batch of 1 x 16 tokens) and the compute-bound one (8 x 128); medians of
  interleaved rounds (the machine may be shared: only the ratios mean
  anything).

Run: ``python benchmarks/bench_low_precision.py --what lm --plot docs/img/low_precision_lm.png``
(``--json PATH`` also writes the results).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jaxamp  # noqa: E402
from benchmarks.bench_train_step import half_loss, lm_loss, make_lm  # noqa: E402
from benchmarks.common import device_summary, interleaved_medians, print_ratios  # noqa: E402
from benchmarks.record import add_json_args, write_json  # noqa: E402

ROUNDINGS = ("stochastic", "kahan", "nearest")
CONFIGS = ("master",) + ROUNDINGS


def _apply_updates(params, updates):
  # float32 updates on bfloat16 parameters: optax adds them under JAX's default promotion.
  with jax.numpy_dtype_promotion("standard"):
    return optax.apply_updates(params, updates)


def drift(rounding: str, steps: int = 2000, size: int = 4096):
  """``size`` bfloat16 weights of 1.0 after ``steps`` SGD updates of exactly float32(1e-4).

  Returns ``(params, state)`` of :func:`jaxamp.low_precision_params`.
  """
  tx = jaxamp.low_precision_params(optax.sgd(1e-4), rounding)
  params = {"w": jnp.ones(size, jnp.bfloat16)}
  grads = {"w": jnp.full(size, -1.0, jnp.bfloat16)}

  @jax.jit
  def run(params, state):
    def body(_, carry):
      p, s = carry
      updates, s = tx.update(grads, s, p)
      return _apply_updates(p, updates), s
    return jax.lax.fori_loop(0, steps, body, (params, state))

  return run(params, tx.init(params))


def drift_figures() -> dict:
  """The drift table: each rounding's result, Kahan's weight plus its compensation."""
  out = {}
  for rounding in ROUNDINGS:
    params, state = drift(rounding)
    weight = np.asarray(params["w"], np.float32)
    out[rounding] = {"mean": float(weight.mean()), "min": float(weight.min()),
                     "max": float(weight.max())}
    if rounding == "kahan":
      total = weight + np.asarray(jaxamp.decode_compensation(state.compensation[0], params["w"]))
      out[rounding].update(sum_min=float(total.min()), sum_max=float(total.max()))
  return out


def regression(dtype, rounding, steps: int = 2000, noise: float = 0.4, lr: float = 3e-3) -> float:
  """The mean squared error of a linear regression trained by SGD from ``w* + 8``.

  ``dtype`` is the weights' dtype; ``rounding`` (``None`` for plain optax) that
  of :func:`jaxamp.low_precision_params`.
  """
  rng = np.random.default_rng(0)
  x = rng.standard_normal((256, 64)).astype(np.float32)
  w_star = rng.standard_normal(64).astype(np.float32)
  y = (x @ w_star + noise * rng.standard_normal(256)).astype(np.float32)

  def loss(w):
    return jnp.mean((x @ w.astype(jnp.float32) - y) ** 2)

  tx = optax.sgd(lr) if rounding is None else jaxamp.low_precision_params(optax.sgd(lr), rounding)

  @jax.jit
  def run(w, state):
    def body(carry, _):
      w, s = carry
      updates, s = tx.update(jax.grad(loss)(w), s, w)
      return (_apply_updates(w, updates), s), None
    (w, _), _ = jax.lax.scan(body, (w, state), None, length=steps)
    return loss(w)

  w = jnp.asarray(w_star + 8.0, dtype)
  return float(run(w, tx.init(w)))


def convergence_figures() -> dict:
  """The final mean squared error of the float32 run and of bfloat16 with each rounding."""
  out = {"float32": regression(jnp.float32, None)}
  out.update({rounding: regression(jnp.bfloat16, rounding) for rounding in ROUNDINGS})
  return out


def bigram_corpus(vocab: int, batches: int, batch: int, length: int, seed: int = 0):
  """``batches`` int32 token arrays ``[batch, length]`` from a fixed sparse random bigram chain."""
  rng = np.random.default_rng(seed)
  nexts = rng.integers(0, vocab, (vocab, 4))  # each token has 4 likely successors
  out = np.empty((batches, batch, length), np.int32)
  out[:, :, 0] = rng.integers(0, vocab, (batches, batch))
  for t in range(1, length):
    pick = rng.integers(0, 4, (batches, batch))
    out[:, :, t] = nexts[out[:, :, t - 1], pick]
  return jnp.asarray(out)


def configuration(name: str, params32, lr: float = 3e-3, state_dtype=jnp.float32):
  """``(params, tx, loss)`` of a configuration: the master's float32 params or bfloat16 ones."""
  adamw = optax.adamw(lr, weight_decay=0.01)
  if name == "master":
    return params32, adamw, half_loss(jnp.bfloat16)
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params32)
  return params, jaxamp.low_precision_params(adamw, name, state_dtype=state_dtype), lm_loss


def make_step(tx, loss):
  def step(params, state, tokens):
    value, grads = jax.value_and_grad(loss)(params, tokens)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value
  return step


def train_curves(steps: int, d: int = 128, layers: int = 2, vocab: int = 256, batch: int = 8,
                 length: int = 33, lr: float = 5e-4, configs=CONFIGS) -> dict:
  """The per-step training losses of each configuration in ``configs`` (numpy arrays)."""
  params32 = make_lm(vocab=vocab, d=d, layers=layers)
  corpus = bigram_corpus(vocab, steps, batch, length)
  curves = {}
  for name in configs:
    params, tx, loss = configuration(name, params32, lr)
    step = make_step(tx, loss)

    @jax.jit
    def run(params, state, corpus, step=step):
      def body(carry, tokens):
        p, s, value = step(*carry, tokens)
        return (p, s), value
      _, values = jax.lax.scan(body, (params, state), corpus)
      return values

    curves[name] = np.asarray(run(params, tx.init(params), corpus))
  return curves


def final_losses(curves: dict, last: int = 20) -> dict:
  return {name: float(np.mean(v[-last:])) for name, v in curves.items()}


def plot_curves(curves: dict, path: str) -> None:
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  figure = Figure(figsize=(6.4, 3.6), dpi=110, layout="constrained")
  FigureCanvasAgg(figure)
  axis = figure.add_subplot()
  labels = {"master": "float32 master, bfloat16 compute", "stochastic": "bfloat16, stochastic",
            "kahan": "bfloat16, Kahan", "nearest": "bfloat16, nearest"}
  for name, values in curves.items():
    smooth = np.convolve(values, np.ones(10) / 10, mode="valid")
    axis.plot(np.arange(len(smooth)) + 10, smooth, label=labels[name], lw=1.2)
  axis.set_xlabel("step")
  axis.set_ylabel("training loss (10-step mean)")
  axis.legend()
  figure.savefig(path)


def bytes_per_param(name: str, state_dtype, d: int = 256, layers: int = 2) -> dict:
  """Bytes per parameter of params, optimizer state and gradients (the trees a step holds)."""
  params32 = make_lm(d=d, layers=layers)
  params, tx, _ = configuration(name, params32, state_dtype=state_dtype)
  count = sum(p.size for p in jax.tree.leaves(params32))
  size = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
  state = jax.eval_shape(tx.init, params)
  grads = jax.eval_shape(lambda p: p, params)  # gradients have the params' dtypes
  out = {"params": size(params) / count, "optimizer state": size(state) / count,
         "gradients": size(grads) / count}
  out["compute copy"] = 2.0 if name == "master" else 0.0  # the bfloat16 cast of the master
  out["total"] = sum(out.values())
  return out


def memory_figures() -> dict:
  """:func:`bytes_per_param` of every configuration, by the moments' dtype."""
  return {jnp.dtype(state_dtype).name: {name: bytes_per_param(name, state_dtype)
                                        for name in CONFIGS}
          for state_dtype in (jnp.float32, jnp.bfloat16)}


def print_memory(figures: dict) -> None:
  base = figures["float32"]["master"]["total"]
  for state_dtype, configs in figures.items():
    print(f"\nbytes per parameter, AdamW, moments of bfloat16 leaves in {state_dtype}"
          " (the master's are float32)")
    for name, b in configs.items():
      parts = ", ".join(f"{k} {v:.2f}" for k, v in b.items() if k != "total")
      less = 100 * (1 - b["total"] / base)
      print(f"  {name:<10} {b['total']:5.2f}  ({parts})  {less:5.1f}% less")


def time_steps(regime: str, rounds: int) -> dict:
  batch, length = {"update": (1, 16), "compute": (8, 128)}[regime]
  params32 = make_lm()
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 1024, (batch, length + 1)), jnp.int32)
  runs = {}
  for name in CONFIGS:
    params, tx, loss = configuration(name, params32)
    step = jax.jit(make_step(tx, loss), donate_argnums=(0, 1))
    box = {"p": jax.tree.map(jnp.copy, params), "s": tx.init(params)}

    def run(step=step, box=box):
      box["p"], box["s"], value = step(box["p"], box["s"], tokens)
      value.block_until_ready()
    runs[name] = run
  return interleaved_medians(runs, rounds=rounds)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--what", nargs="+", default=["all"],
                      choices=("drift", "convergence", "lm", "memory", "time", "all"))
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--lr", type=float, default=5e-4, help="the LM's learning rate")
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--plot", default=None, help="save the LM's loss curves (PNG) here")
  add_json_args(parser)
  args = parser.parse_args(argv)
  what = {"drift", "convergence", "lm", "memory", "time"} if "all" in args.what else set(args.what)
  print(device_summary())
  results: dict = {}
  if "drift" in what:
    results["drift"] = drift_figures()
    print("\ndrift: 1.0 + 1e-4, 2000 times (target 1.2)")
    for rounding, figures in results["drift"].items():
      print(f"  {rounding:<10} " + ", ".join(f"{k} {v:.7g}" for k, v in figures.items()))
  if "convergence" in what:
    results["convergence"] = convergence_figures()
    print("\nlinear regression, final mean squared error")
    for name, value in results["convergence"].items():
      print(f"  {name:<10} {value:.4f}  {value / results['convergence']['float32']:.3f}x float32")
  if "lm" in what:
    curves = train_curves(args.steps, lr=args.lr)
    for step in range(0, args.steps, 25):
      print(f"  step {step:4d}  " + "  ".join(f"{n} {curves[n][step]:.3f}" for n in CONFIGS))
    final = final_losses(curves)
    print(f"\nfinal loss (mean of the last 20 of {args.steps} steps)")
    for name, value in final.items():
      print(f"  {name:<10} {value:.4f}  {value / final['master']:.4f}x master")
    results["lm"] = {"steps": args.steps, "lr": args.lr, "final": final}
    if args.plot:
      plot_curves(curves, args.plot)
      print(f"saved {args.plot}")
  if "memory" in what:
    results["memory"] = memory_figures()
    print_memory(results["memory"])
  if "time" in what:
    results["time"] = {regime: print_ratios(time_steps(regime, args.rounds), "master",
                                            f"whole train step, {regime}-bound regime")
                       for regime in ("update", "compute")}
  write_json(args.json, results, args.append)


if __name__ == "__main__":
  main()
