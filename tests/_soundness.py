"""The soundness battery's producers and checks (tests/test_soundness.py, tests/multidevice).

A *producer* is a loss whose gradients are computed inside the compiled step, with a particular last
operation: a multiply that overflows, gains and biases, a matmul, a convolution, half-precision
compute, remat, a scan over layers, a custom VJP, a genuine nan. The data (hypothesis chooses it)
puts huge, tiny, inf and nan values at chosen places, so that the overflow lands at different ops.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import settings, strategies as st
from jax import lax

N = 4  # features
B = 3  # batch rows

settings.register_profile("soundness", max_examples=12, deadline=None, derandomize=True,
                          database=None)
settings.register_profile("soundness-long", max_examples=200, deadline=None, database=None)
PROFILE = "soundness-long" if os.environ.get("JAXAMP_SOUNDNESS") == "long" else "soundness"

# Scales near the float32 maximum, not powers of two, below 1, and ordinary ones.
SCALES = [2.0**127, 2.0**126, 3e38, 1000.0, 3.0, 0.5, 2.0**16, 1.0]
# Values the data takes: ordinary, a few times larger (times a scale near the float32 maximum
# their products overflow, while a sum with the other elements may not), huge, denormal, inf, nan.
VALUES = [1.0, -1.7, 0.3, 3.37, -2.5, 4.0, 1e20, -3e38, 3e38, 1e-40, np.inf, -np.inf, np.nan]


def params0():
  rng = np.random.default_rng(0)
  return {"g": jnp.asarray(rng.uniform(0.5, 1.5, N), jnp.float32),
          "b": jnp.asarray(rng.uniform(-0.5, 0.5, N), jnp.float32),
          "w": jnp.asarray(rng.uniform(-0.5, 0.5, (N, N)), jnp.float32),
          "k": jnp.asarray(rng.uniform(-0.5, 0.5, (2, 1, 1)), jnp.float32)}


def _overflowing_row():
  """One element of ``row * 2^127`` overflows, while the row's sum times 2^127 does not."""
  x = np.ones((B, N), np.float32)
  x[0] = [1.779, -3.37, 1.209, 1.717]
  return jnp.asarray(x)


# Always tried, whatever hypothesis draws: the overflow that a fused sum hides.
HIDDEN_OVERFLOW = (_overflowing_row(), 2.0**127)


@st.composite
def data(draw):
  """``x``: a (B, N) batch with a few special values at chosen places, and a scale."""
  x = np.asarray(draw(st.lists(st.sampled_from([1.0, -1.7, 0.3, 0.9, 1.5, -1.2]), min_size=B * N,
                               max_size=B * N)), np.float32).reshape(B, N)
  for _ in range(draw(st.integers(0, 2))):
    i, j = draw(st.integers(0, B - 1)), draw(st.integers(0, N - 1))
    x[i, j] = draw(st.sampled_from(VALUES))
  return jnp.asarray(x), draw(st.sampled_from(SCALES))


@jax.custom_vjp
def _twice(x):
  return 2.0 * x


def _twice_fwd(x):
  return 2.0 * x, None


def _twice_bwd(_, ct):
  return (ct * 2.0,)  # the backward pass multiplies


_twice.defvjp(_twice_fwd, _twice_bwd)


def _conv(x, k):
  out = lax.conv_general_dilated(x[:, None, :], k, window_strides=(1,), padding="SAME",
                                 dimension_numbers=("NCH", "OIH", "NCH"))
  return out[:, 0, :]


def _layer(p, x):
  return jnp.tanh(x * p["g"][None, :] + p["b"][None, :])


PRODUCERS = {
    # The gradient of sum(g * x0) is x0 * scale: a multiply that overflows.
    "multiply": lambda p, x: jnp.sum(p["g"] * x[0]),
    "multiply_twice": lambda p, x: jnp.sum(p["g"] * x[0]) + jnp.sum(p["b"] * x[1]),
    "gain_bias": lambda p, x: jnp.sum(x * p["g"][None, :] + p["b"][None, :]),
    "matmul": lambda p, x: jnp.sum((x @ p["w"]) * x),
    "conv": lambda p, x: jnp.sum(_conv(x, p["k"]) * x),
    "float16": lambda p, x: jnp.sum(
        (x.astype(jnp.float16) @ p["w"].astype(jnp.float16)).astype(jnp.float32) * x),
    "bfloat16": lambda p, x: jnp.sum(
        (x.astype(jnp.bfloat16) * p["g"].astype(jnp.bfloat16)[None, :]).astype(jnp.float32)),
    "checkpoint": lambda p, x: jnp.sum(jax.checkpoint(_layer)(p, x) * x),
    "scan": lambda p, x: jnp.sum(lax.scan(lambda h, _: (_layer(p, h) * x, None), x, None,
                                          length=2)[0]),
    "custom_vjp": lambda p, x: jnp.sum(_twice(p["g"][None, :] * x)),
    # 0 * inf inside the model: a genuine nan where x holds an inf.
    "nan": lambda p, x: jnp.sum(p["g"] * (x[0] * 0.0)) + jnp.sum(p["b"] * x[1]),
}


def bits(tree):
  """The raw bits of every leaf (so that -0.0 and nan payloads compare too)."""
  return [np.asarray(x).view(np.uint8).tobytes() for x in jax.tree.leaves(tree)]


def unscaled_finite(grads, scale) -> bool:
  """The eager rule on gradients: all of ``grads / scale`` finite, in float32 as PyTorch unscales."""
  with np.errstate(over="ignore", invalid="ignore"):
    return all(np.all(np.isfinite((np.asarray(g, np.float64) / np.float64(np.float32(scale)))
                                  .astype(np.float32)))
               for g in jax.tree.leaves(grads)
               if np.issubdtype(np.asarray(g).dtype, np.floating))


def check_step(before, after, grads, skipped, compiled_scale, eager, scale):
  """The four assertions of every step.

  ``before``/``after``: ``(params, inner optimizer state)`` around the compiled step; ``grads``:
  the scaled gradients the compiled step computed (what its update read); ``eager``:
  ``(skipped, scale, grads)`` of the same step run without ``jit``.
  """
  finite = unscaled_finite(grads, scale)
  assert skipped == (not finite), f"compiled skip {skipped}, its own gradients finite {finite}"
  eager_skipped, eager_scale, eager_grads = eager
  if skipped:
    assert bits(after) == bits(before), "a skipped step changed the params or the state"
  for leaf in jax.tree.leaves(after[0]):
    assert np.all(np.isfinite(np.asarray(leaf))), "a compiled step wrote a non-finite parameter"
  # Where the two programs computed gradients of different finiteness (an intermediate that one
  # rounds to inf and the other fuses away), each decided on its own gradients, checked above.
  if unscaled_finite(eager_grads, scale) == finite:
    assert skipped == eager_skipped, "compiled and eager steps decide differently"
    assert np.float32(compiled_scale) == np.float32(eager_scale), "compiled and eager scales differ"
