"""fp8 autocast against bfloat16 autocast and float32: numerics (any backend) and speed (a GPU).

``jaxamp.autocast(loss, jnp.float8_e4m3fn)`` runs the products its rule
chooses on float8 operands (e4m3 forward, e5m2 gradients, per-tensor current
scaling) and everything else as ``autocast(loss, jnp.bfloat16)``.

- ``--what numerics`` (the default; XLA emulates float8 on a CPU, so this
  runs anywhere):

  - the transformer LM of ``bench_train_step.py`` (``--layers`` blocks of
    width ``--width``), trained ``--steps`` steps with
    ``dynamic_loss_scale(adamw)`` on a bigram corpus (structure to learn), in
    float32, bfloat16 autocast and fp8 autocast (every product of at least
    256 in float8: the blocks' and the head's, not the attention's), and fp8
    keeping in bfloat16 the head, the first and last blocks, or all three
    (as TransformerEngine's users keep the first and last layers): the final
    losses (mean of the last 20 steps) and their ratios to bfloat16's; the
    relative error of each parameter's gradient against bfloat16's (and
    bfloat16's against float32's) at the first step; and whether a loss
    scale of 2**15 changes the unscaled gradients (it does not, to the bit:
    current scaling is invariant to a power of two, and bfloat16 has
    float32's range, so no loss scale is needed against underflow);
  - one conformance model of each family (``tests/conformance``: an Equinox
    MLP, a pure-JAX transformer, Linen's lm1b-style LM, an NNX CNN), every
    product in float8, trained ``--model-steps`` steps with adam on its
    batch: final-loss ratios and per-parameter gradient errors.

- ``--what speed``: a pre-norm transformer block of width ``--d`` (attention
  and a 4x MLP, float32 parameters), forward and backward (``value_and_grad``
  of a mean-square loss), bfloat16 autocast against fp8 autocast with the
  default rule, medians of interleaved rounds; and how many products of the
  program run in float8: on a GPU the cuBLASLt float8 GEMMs of the compiled
  program (``__cublas$lt$matmul$f8``), anywhere the dots of the lowered one
  on dequantized float8 operands. On a CPU the time means nothing (float8 is
  emulated): run it there at a small size only to see that it works.

``--json PATH`` writes ``{"runs": [{"provenance": ..., "results": ...}]}``:
the results with the command, commit, date, machine and versions.

Run: ``python benchmarks/bench_fp8_autocast.py --json fp8_numerics.json``, and on an H200
``python benchmarks/bench_fp8_autocast.py --what speed --d 4096 --json fp8_speed.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jaxamp  # noqa: E402
from benchmarks.bench_low_precision import bigram_corpus  # noqa: E402
from benchmarks.bench_train_step import lm_loss, make_lm  # noqa: E402
from benchmarks.common import device_summary, interleaved_medians, print_ratios  # noqa: E402
from benchmarks.record import add_json_args, write_json  # noqa: E402
from tests._hlo import fp8_products  # noqa: E402

FP8, BF16, F32 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
LM_MIN_DIM = 256  # the LM's blocks and head at width 256, not its attention (head size 64)
#: The fp8 cuBLASLt GEMM custom call of XLA's GPU compiler.
F8_GEMM = "__cublas$lt$matmul$f8"


# ----------------------------------------------------------------------------- helpers


def _flat(tree) -> np.ndarray:
  return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def _rel(a, b) -> float:
  a, b = _flat(a), _flat(b)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def leaf_errors(grads, reference) -> Dict[str, dict]:
  """Each leaf's relative L2 error against ``reference``, and its share of the gradient's norm.

  ``{path: {"error": |g - r| / |r|, "norm_share": |r| / |all of reference|}}``:
  a leaf whose gradient is zero in exact arithmetic (a bias before a norm, a
  key bias before a softmax) has a large relative error of no consequence.
  """
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(reference)]
  total = max(float(np.linalg.norm(_flat(reference))), 1e-30)
  return {path: {"error": _rel(g, r), "norm_share": float(np.linalg.norm(_flat(r))) / total}
          for path, g, r in zip(paths, jax.tree.leaves(grads), jax.tree.leaves(reference))}


def worst_leaf(errors: Dict[str, dict], min_share: float = 0.01) -> tuple:
  """The leaf with the largest error among those holding at least ``min_share`` of the norm."""
  return max(((p, e["error"]) for p, e in errors.items() if e["norm_share"] >= min_share),
             key=lambda kv: kv[1])


def loss_scale_invariance(loss: Callable, params, batch, scale: float = 2.0**15) -> dict:
  """Whether ``grad(loss * scale) / scale`` equals ``grad(loss)``, bit for bit (one program)."""
  grad = jax.jit(jax.grad(lambda p, s: loss(p, batch) * s))
  plain = grad(params, jnp.float32(1.0))
  scaled = jax.tree.map(lambda g: g / scale, grad(params, jnp.float32(scale)))
  same = all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
             for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(scaled)))
  return {"scale": scale, "identical": same, "max_relative_difference": _rel(scaled, plain)}


def train(loss: Callable, params, batches, tx, loss_scale: bool):
  """Trains on each batch of ``batches`` (stacked) in one jitted scan; the losses and skips."""
  if loss_scale:
    tx = jaxamp.dynamic_loss_scale(tx)

  def step(carry, batch):
    p, s = carry
    if loss_scale:
      def scaled(p):
        value = loss(p, batch)
        return jaxamp.scale_loss(value, s), value

      grads, value = jax.grad(scaled, has_aux=True)(p)
    else:
      value, grads = jax.value_and_grad(loss)(p, batch)
    updates, s = tx.update(grads, s, p)
    return (optax.apply_updates(p, updates), s), value

  @jax.jit
  def run(params, state, batches):
    (_, state), values = jax.lax.scan(step, (params, state), batches)
    return values, state

  values, state = run(params, tx.init(params), batches)
  skipped = int(jaxamp.skipped_steps(state)) if loss_scale else 0
  return np.asarray(values, np.float64), skipped


def _autocast(fn, dtype, rule=None):
  if dtype is None:
    return fn
  return jaxamp.autocast(fn, dtype, fp8=rule) if dtype == FP8 else jaxamp.autocast(fn, dtype)


# ----------------------------------------------------------------------------- numerics


def lm_variants(layers: int, min_dim: int = LM_MIN_DIM) -> Dict[str, tuple]:
  """``{name: (dtype or None, Fp8Rule or None)}`` of the LM's runs."""
  first, last = "block_0", f"block_{layers - 1}"

  def rule(*exclude):
    return jaxamp.Fp8Rule(min_dim=min_dim, exclude=exclude)

  return {"float32": (None, None), "bfloat16": (BF16, None), "fp8": (FP8, rule()),
          "fp8_keep_head": (FP8, rule("head")),
          "fp8_keep_first_last": (FP8, rule(first, last)),
          "fp8_keep_first_last_head": (FP8, rule(first, last, "head"))}


def lm_numerics(steps: int, width: int, layers: int, vocab: int, batch: int, length: int,
                lr: float, last: int = 20, min_dim: int = LM_MIN_DIM) -> dict:
  """The LM's runs: final losses, ratios to bfloat16, gradient errors, loss-scale invariance."""
  params = make_lm(vocab=vocab, d=width, layers=layers)
  corpus = bigram_corpus(vocab, steps, batch, length + 1)
  out: Dict[str, Any] = {"config": {"steps": steps, "width": width, "layers": layers,
                                    "vocab": vocab, "batch": batch, "length": length, "lr": lr,
                                    "fp8_min_dim": min_dim, "optimizer": "adamw",
                                    "final_loss": f"mean of the last {last} steps"},
                         "runs": {}}
  grads = {}
  for name, (dtype, rule) in lm_variants(layers, min_dim).items():
    loss = _autocast(lm_loss, dtype, rule)
    curve, skipped = train(loss, params, corpus, optax.adamw(lr, weight_decay=0.01),
                           loss_scale=dtype is not None)
    grads[name] = jax.jit(jax.grad(loss))(params, corpus[0])
    print(f"  LM {name}: final loss {np.mean(curve[-last:]):.4f}", flush=True)
    out["runs"][name] = {"final_loss": float(np.mean(curve[-last:])), "skipped_steps": skipped,
                         "curve": curve[::max(1, steps // 100)].tolist()}
    if name in ("bfloat16", "fp8"):
      out.setdefault("loss_scale_invariance", {})[name] = loss_scale_invariance(
          loss, params, corpus[0])
  base = out["runs"]["bfloat16"]["final_loss"]
  for run in out["runs"].values():
    run["ratio_to_bfloat16"] = run["final_loss"] / base
  out["grad_error_vs_bfloat16"] = {name: leaf_errors(g, grads["bfloat16"])
                                   for name, g in grads.items() if name.startswith("fp8")}
  out["grad_error_bfloat16_vs_float32"] = leaf_errors(grads["bfloat16"], grads["float32"])
  return out


def conformance_cases() -> Dict[str, Callable]:
  """One conformance model of each family (imported from the test suite)."""
  from tests.conformance import test_equinox, test_flax_linen, test_flax_nnx, test_pure_jax
  return {"equinox_mlp": test_equinox.CASES["mlp_filter_custom_vjp"],
          "pure_jax_transformer": test_pure_jax.CASES["attention_embeddings_dropout_stats"],
          "linen_transformer_lm": test_flax_linen.CASES["transformer_lm"],
          "nnx_cnn": test_flax_nnx.CASES["cnn_batchnorm_dropout"]}


def model_numerics(steps: int, lr: float, last: int = 5) -> dict:
  """Each conformance model trained in float32, bfloat16 and fp8 (every product in float8)."""
  every = jaxamp.Fp8Rule(min_dim=1, multiple=1)
  out = {}
  for name, make in conformance_cases().items():
    case = make()
    batches = jax.tree.map(lambda x: jnp.stack([x] * steps), case.batch)
    runs, grads = {}, {}
    for variant, dtype in (("float32", None), ("bfloat16", BF16), ("fp8", FP8)):
      loss = _autocast(case.loss, dtype, every)
      curve, skipped = train(loss, case.params, batches, optax.adam(lr),
                             loss_scale=dtype is not None)
      runs[variant] = {"final_loss": float(np.mean(curve[-last:])), "first_loss": float(curve[0]),
                       "skipped_steps": skipped}
      grads[variant] = jax.jit(jax.grad(loss))(case.params, case.batch)
    for run in runs.values():
      run["ratio_to_bfloat16"] = run["final_loss"] / runs["bfloat16"]["final_loss"]
    errors = leaf_errors(grads["fp8"], grads["bfloat16"])
    out[name] = {"runs": runs, "grad_error_vs_bfloat16": errors,
                 "grad_error_vs_bfloat16_all": _rel(grads["fp8"], grads["bfloat16"]),
                 "grad_error_bfloat16_vs_float32_all": _rel(grads["bfloat16"], grads["float32"]),
                 "config": {"steps": steps, "lr": lr, "optimizer": "adam",
                            "final_loss": f"mean of the last {last} steps"}}
  return out


def print_numerics(lm: Optional[dict], models: Optional[dict]) -> None:
  if lm is not None:
    c = lm["config"]
    print(f"\nLM: {c['layers']} blocks of width {c['width']}, vocab {c['vocab']}, batch "
          f"{c['batch']} x {c['length']}, {c['steps']} steps; final loss = {c['final_loss']}")
    for name, run in lm["runs"].items():
      print(f"  {name:<26} {run['final_loss']:.4f}  {run['ratio_to_bfloat16']:.4f}x bfloat16"
            f"  (skipped {run['skipped_steps']})")
    for name, inv in lm["loss_scale_invariance"].items():
      print(f"  {name}: unscaled gradients with a loss scale of {inv['scale']:g} bit-identical to "
            f"those without: {inv['identical']} (relative difference "
            f"{inv['max_relative_difference']:.3g})")
    print("\n  gradient error against bfloat16 at the first step (relative L2), per parameter:")
    names = list(lm["grad_error_vs_bfloat16"])
    print(f"  {'parameter':<24}" + "".join(f"{n:>26}" for n in names)
          + f"{'bfloat16 vs float32':>22}")
    for path, base in lm["grad_error_bfloat16_vs_float32"].items():
      print(f"  {path:<24}" + "".join(f"{lm['grad_error_vs_bfloat16'][n][path]['error']:26.4f}"
                                      for n in names) + f"{base['error']:22.4f}")
  if models is not None:
    print("\nConformance models, every product in float8 (final loss ratio to bfloat16; "
          "gradient error against bfloat16, all parameters and the worst one)")
    for name, m in models.items():
      worst = worst_leaf(m["grad_error_vs_bfloat16"])
      print(f"  {name:<22} fp8 {m['runs']['fp8']['ratio_to_bfloat16']:.4f}x, float32 "
            f"{m['runs']['float32']['ratio_to_bfloat16']:.4f}x; grad error "
            f"{m['grad_error_vs_bfloat16_all']:.4f} (worst of the leaves holding 1% of the norm: "
            f"{worst[0]} {worst[1]:.4f}; bfloat16 "
            f"vs float32 {m['grad_error_bfloat16_vs_float32_all']:.4f})")


# ----------------------------------------------------------------------------- speed


def _layer_norm(h, scale):
  h32 = h.astype(F32)
  mu = jnp.mean(h32, -1, keepdims=True)
  var = jnp.mean(jnp.square(h32 - mu), -1, keepdims=True)
  return ((h32 - mu) * jax.lax.rsqrt(var + 1e-5)).astype(h.dtype) * scale


def block_loss(params, x, heads: int):
  """A pre-norm transformer block (causal attention, 4x GELU MLP); the mean square output."""
  b, t, d = x.shape
  q, k, v = jnp.split(_layer_norm(x, params["ln1"]) @ params["qkv"], 3, axis=-1)
  split = lambda a: a.reshape(b, t, heads, d // heads)  # noqa: E731
  att = jax.nn.dot_product_attention(split(q), split(k), split(v), is_causal=True)
  h = x + att.reshape(b, t, d) @ params["out"]
  h = h + jax.nn.gelu(_layer_norm(h, params["ln2"]) @ params["up"]) @ params["down"]
  return jnp.mean(jnp.square(h.astype(F32)))


def block_problem(d: int, batch: int, seq: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  w = lambda a, b: jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), F32)  # noqa: E731
  params = {"ln1": jnp.ones((d,), F32), "ln2": jnp.ones((d,), F32), "qkv": w(d, 3 * d),
            "out": w(d, d), "up": w(d, 4 * d), "down": w(4 * d, d)}
  return params, jnp.asarray(rng.standard_normal((batch, seq, d)), F32)


def speed(d: int, batch: int, seq: int, heads: int, rounds: int, inner: int,
          min_dim: Optional[int] = None) -> dict:
  """Interleaved medians of the block's forward and backward in bfloat16 and fp8 autocast."""
  params, x = block_problem(d, batch, seq)
  rule = jaxamp.Fp8Rule() if min_dim is None else jaxamp.Fp8Rule(min_dim=min_dim)
  loss = lambda p, x: block_loss(p, x, heads)  # noqa: E731
  steps, counts = {}, {}
  for name, dtype in (("bfloat16", BF16), ("fp8", FP8)):
    fn = jax.jit(jax.value_and_grad(_autocast(loss, dtype, rule), argnums=(0, 1)))
    lowered = fn.lower(params, x)
    compiled = lowered.compile()
    products = fp8_products(lowered.as_text(dialect="hlo"))
    counts[name] = {"dots": sum(p[2] == "dot" for p in products),
                    "dots_on_float8": sum(None not in p[3] for p in products),
                    "cublaslt_f8_gemms": compiled.as_text().count(F8_GEMM)}
    steps[name] = lambda fn=compiled: jax.block_until_ready(fn(params, x))
  medians = interleaved_medians(steps, rounds=rounds, inner=inner)
  flops = 2 * batch * seq * 12 * d * d * 3  # the four projections, forward and backward
  return {"config": {"d": d, "batch": batch, "seq": seq, "heads": heads, "rounds": rounds,
                     "inner": inner, "rule": repr(rule), "params": "float32",
                     "what": "value_and_grad of the block, params and input"},
          "median_s": medians, "fp8_speedup": medians["bfloat16"] / medians["fp8"],
          "projection_tflops_per_s": {n: flops / t / 1e12 for n, t in medians.items()},
          "products": counts}


def print_speed(result: dict) -> None:
  c = result["config"]
  print(f"\ntransformer block d={c['d']}, batch {c['batch']} x {c['seq']}, {c['heads']} heads; "
        f"{c['what']}")
  print_ratios(result["median_s"], "bfloat16", "fp8 autocast against bfloat16 autocast")
  print(f"  fp8 speed-up: {result['fp8_speedup']:.3f}x; projections at "
        + ", ".join(f"{n} {v:.1f}" for n, v in result["projection_tflops_per_s"].items())
        + " TFLOP/s")
  for name, n in result["products"].items():
    print(f"  {name}: {n['dots_on_float8']} of {n['dots']} dots on dequantized float8 in the "
          f"lowered program; {n['cublaslt_f8_gemms']} cuBLASLt float8 GEMMs compiled")


# ----------------------------------------------------------------------------- main


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--what", choices=("numerics", "lm", "models", "speed"),
                      default="numerics", help="numerics: the LM and the models")
  parser.add_argument("--steps", type=int, default=300, help="LM training steps")
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--vocab", type=int, default=512)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--length", type=int, default=64)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--lm-min-dim", type=int, default=LM_MIN_DIM,
                      help="the LM's Fp8Rule min_dim (products at least this large in float8)")
  parser.add_argument("--model-steps", type=int, default=40)
  parser.add_argument("--model-lr", type=float, default=3e-3)
  parser.add_argument("--d", type=int, default=4096, help="speed: the block's width")
  parser.add_argument("--heads", type=int, default=None, help="speed: default d // 128")
  parser.add_argument("--seq", type=int, default=2048, help="speed: sequence length")
  parser.add_argument("--speed-batch", type=int, default=4)
  parser.add_argument("--min-dim", type=int, default=None,
                      help="speed: the rule's min_dim (default Fp8Rule's)")
  parser.add_argument("--rounds", type=int, default=10)
  parser.add_argument("--inner", type=int, default=3)
  add_json_args(parser)
  args = parser.parse_args(argv)
  print(device_summary())
  result: Dict[str, Any] = {}
  if args.what in ("numerics", "lm"):
    result["lm"] = lm_numerics(args.steps, args.width, args.layers, args.vocab, args.batch,
                               args.length, args.lr, min_dim=args.lm_min_dim)
  if args.what in ("numerics", "models"):
    result["models"] = model_numerics(args.model_steps, args.model_lr)
  if args.what != "speed":
    print_numerics(result.get("lm"), result.get("models"))
  else:
    result["speed"] = speed(args.d, args.speed_batch, args.seq, args.heads or max(1, args.d // 128),
                            args.rounds, args.inner, args.min_dim)
    print_speed(result["speed"])
  write_json(args.json, result, args.append,
             argv=None if argv is None else ["benchmarks/bench_fp8_autocast.py", *argv])
  return result


if __name__ == "__main__":
  main()
