"""Shared pieces of the soundness battery (tests/test_soundness.py, tests/multidevice/...).

The promise under test: a step whose *unscaled* gradients hold an inf or a nan is never applied
(params and optimizer state bit-identical, the scale backs off), also when the gradients are
computed inside the same compiled program as the update, where XLA may fuse the ops that produce
them into the finite check.

Every path runs a step in two modes, compiled (the step as a user jits it, or the facade's own
jitted programs) and eager (the same step under ``jax.disable_jit()``), and returns an
:class:`Outcome` holding the (scaled) gradients that mode actually computed. :func:`check` then
asserts, from the public state only:

1. ``skipped`` equals the eager rule evaluated in numpy on those gradients
   (``not all(isfinite(unscale(grads)))``, unscaled as PyTorch unscales), and equals the eager
   mode's decision wherever the two modes' gradients agree in finiteness;
2. a skipped step leaves params and the inner optimizer state bit-identical (raw bits);
3. no compiled step writes a non-finite parameter;
4. the compiled and eager scales are equal (where the gradients agree in finiteness).

Hypothesis profiles: ``soundness`` (the default: few derandomized examples, deterministic) and
``soundness-long`` (``HYPOTHESIS_PROFILE=soundness-long``: many random examples).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck
from hypothesis import settings
from hypothesis import strategies as st
from jax import lax

import jaxamp

# -------------------------------------------------------------------------------------------------
# Hypothesis profiles (applied per test with ``@SETTINGS``; the global profile is left alone).

_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
           HealthCheck.differing_executors]
settings.register_profile("soundness", max_examples=5, derandomize=True, deadline=None,
                          database=None, print_blob=True, suppress_health_check=_HEALTH)
settings.register_profile("soundness-long", max_examples=150, deadline=None, database=None,
                          print_blob=True, suppress_health_check=_HEALTH)
LONG = os.environ.get("HYPOTHESIS_PROFILE") == "soundness-long"
SETTINGS = settings.get_profile("soundness-long" if LONG else "soundness")

N = 8  # every producer reads one float32 vector of N values per micro-step

F32_MAX = float(np.finfo(np.float32).max)

# -------------------------------------------------------------------------------------------------
# Strategies: where the inf/nan/huge values sit, their magnitudes, and the scale.

SPECIAL = [np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-40, -1e-40, 3e38, -3e38, 1e20, -2e19,
           3.0e35, 65504.0, 7e4]
SCALES = [2.0**127, 2.0**126, 3e38, F32_MAX, 2.0**16, 1000.0, 3.0, 1.0, 0.5, 2.0**-10, 1e-3]

_ordinary = st.floats(-4.0, 4.0, width=32)
_element = st.one_of(_ordinary, _ordinary, st.sampled_from(SPECIAL),
                     st.floats(width=32, allow_nan=False, allow_infinity=False))
scales = st.one_of(st.sampled_from(SCALES),
                   st.floats(2.0**-20, F32_MAX, width=32))


@st.composite
def cases(draw, rows: int = 1):
  """``(x, scale)``: ``rows`` vectors of N float32 values and a loss scale.

  Each value is free (ordinary, special, or any float32), or, in a row of the cancelling kind, of
  alternating sign and about float32-max / scale in magnitude: its scaled gradient overflows
  while a sum fused with the producer's multiply does not. Optionally a 0 at i and a huge value
  at i + N/2, so that a producer multiplying the halves meets 0 x inf.
  """
  scale = draw(scales)
  bound = F32_MAX / float(np.float32(scale))
  x = np.empty((rows, N), np.float32)
  for r in range(rows):
    cancel = draw(st.booleans())
    running = 0.0  # the running sum of x * scale / F32_MAX, kept within (-0.9, 0.9)
    for i in range(N):
      if cancel and draw(st.integers(0, 4)):
        u = draw(st.floats(0.2, 0.9))
        step = -np.sign(running or 1.0) * (abs(running) + u)  # overflows where |step| > 1
        v = np.float32(min(step * bound, F32_MAX) if step > 0 else max(step * bound, -F32_MAX))
        running = float(v) / bound + running
      else:
        v = draw(_element)
      x[r, i] = v
  pair = draw(st.one_of(st.none(), st.tuples(st.integers(0, rows - 1),
                                             st.integers(0, N // 2 - 1))))
  if pair is not None:
    r, i = pair
    x[r, i] = 0.0
    x[r, i + N // 2] = draw(st.sampled_from([np.inf, 3e38, 1e3]))
  return x, scale


# The repro's data, padded with zeros (which keep the running sum in range): its scaled gradient
# holds -inf at 2^127, but an FMA-fused sum of it is finite.
REPRO_ROW = np.array([1.779, -3.37, 1.209, 1.717, 0.0, 0.0, 0.0, 0.0], np.float32)


def repro_case(rows: int) -> tuple:
  x = np.zeros((rows, N), np.float32)
  x[0] = REPRO_ROW
  return x, 2.0**127


# -------------------------------------------------------------------------------------------------
# Producers: the last ops that make the gradient, inside the differentiated loss.


@dataclasses.dataclass(frozen=True)
class Producer:
  name: str
  params: Callable[[], dict]
  loss: Callable[[dict, jax.Array], jax.Array]


def _vec(*values):
  return np.asarray(values, np.float32)


def _mul(p, x):
  return jnp.sum(p["w"] * x)


def _gain_bias(p, x):
  h = x[:4] * p["g"] + p["b"]
  return jnp.sum(h * x[4:])


_T22 = _vec(1.0, -2.0, 0.5, 3.0).reshape(2, 2)


def _matmul(p, x):
  return jnp.sum((x.reshape(2, 4) @ p["w"]) * _T22)


_T6 = _vec(1.0, -1.5, 2.0, 0.25, -3.0, 1.0).reshape(1, 1, 6)


def _conv(p, x):
  out = lax.conv_general_dilated(x.reshape(1, 1, N), p["k"], window_strides=(1,), padding="VALID")
  return jnp.sum(out * _T6)


def _half(dtype):
  def loss(p, x):
    h = p["w"].astype(dtype) * x.astype(dtype) + p["b"].astype(dtype)
    return jnp.sum(h.astype(jnp.float32))
  return loss


def _remat(p, x):
  f = jax.checkpoint(lambda q, x: jnp.tanh(q["w1"] * x) * q["w2"])
  return jnp.sum(f(p, x) * x)


def _scan(p, x):
  def layer(h, w):
    return h * w + 0.5 * h, None
  h, _ = lax.scan(layer, x, p["ws"])
  return jnp.sum(h)


@jax.custom_vjp
def _twice_product(w, x):
  return w * x


def _twice_fwd(w, x):
  return w * x, (w, x)


def _twice_bwd(res, ct):
  w, x = res
  return ct * x * jnp.float32(2.0), ct * w  # the backward multiplies (and doubles)


_twice_product.defvjp(_twice_fwd, _twice_bwd)


def _custom(p, x):
  return jnp.sum(_twice_product(p["w"], x))


def _nan(p, x):
  # exp overflows to inf where x[4:] is large; times a 0 of x[:4] it is a nan inside the model.
  return jnp.sum(p["w"] * (x[:4] * jnp.exp(x[4:])))


def _p(**shapes_values):
  return lambda: {k: np.asarray(v, np.float32) for k, v in shapes_values.items()}


PRODUCERS = {p.name: p for p in [
    Producer("mul", _p(w=np.linspace(-0.5, 0.5, N)), _mul),
    Producer("gain_bias", _p(g=_vec(1.0, 0.5, -1.0, 2.0), b=_vec(0.1, 0.0, -0.2, 0.3)),
             _gain_bias),
    Producer("matmul", _p(w=np.linspace(-1.0, 1.0, 8).reshape(4, 2)), _matmul),
    Producer("conv", _p(k=_vec(0.5, -1.0, 0.25).reshape(1, 1, 3)), _conv),
    Producer("float16", _p(w=np.linspace(-0.5, 0.5, N), b=np.full(N, 0.125)),
             _half(jnp.float16)),
    Producer("bfloat16", _p(w=np.linspace(-0.5, 0.5, N), b=np.full(N, 0.125)),
             _half(jnp.bfloat16)),
    Producer("checkpoint", _p(w1=np.linspace(-1.0, 1.0, N), w2=np.linspace(0.5, 1.5, N)),
             _remat),
    Producer("scan", _p(ws=np.linspace(0.5, 1.5, 3 * N).reshape(3, N)), _scan),
    Producer("custom_vjp", _p(w=np.linspace(-0.5, 0.5, N)), _custom),
    Producer("nan", _p(w=_vec(0.1, -0.2, 0.3, -0.4)), _nan),
]}


# -------------------------------------------------------------------------------------------------
# The eager rule, in numpy.


def to_host(tree: Any) -> Any:
  return jax.tree.map(lambda a: np.array(a, copy=True), tree)


def unscale_np(g: np.ndarray, scale: np.float32) -> np.ndarray:
  """``g * float32(1 / scale)`` in float32 as PyTorch computes it; for scales >= 2^126 (whose
  reciprocal is subnormal) the product by the two normal factors 2^-64 and 2^64 / scale."""
  g = np.asarray(g).astype(np.float32)
  scale = np.float32(scale)
  with np.errstate(all="ignore"):
    if scale >= np.float32(2.0**126):
      return (g * np.float32(2.0**-64)) * (np.float32(2.0**64) / scale)
    return g * (np.float32(1.0) / scale)


def window_grads(grads: list, window: int) -> Any:
  """What the scaler sees: one step's gradients, or the mean of a window of micro-steps."""
  if window == 1:
    (g,) = grads
    return g
  assert len(grads) == window, (len(grads), window)
  with np.errstate(all="ignore"):
    total = jax.tree.map(lambda g: np.zeros_like(np.asarray(g, np.float32)), grads[0])
    for g in grads:
      total = jax.tree.map(lambda t, x: t + np.asarray(x, np.float32), total, g)
    return jax.tree.map(lambda t: t / np.float32(window), total)


def rule_skips(grads: list, window: int, scale: float) -> bool:
  """The eager rule: whether any unscaled gradient the scaler sees is inf or nan."""
  seen = window_grads(grads, window)
  return not all(np.all(np.isfinite(unscale_np(g, scale))) for g in jax.tree.leaves(seen))


def bits(tree: Any) -> list:
  out = []
  for leaf in jax.tree.leaves(tree):
    a = np.asarray(leaf)
    if a.dtype.kind in "fc" or a.dtype.name == "bfloat16":
      a = a.view(f"u{a.dtype.itemsize}")
    out.append(a)
  return out


def same_bits(a: Any, b: Any) -> bool:
  x, y = bits(a), bits(b)
  return len(x) == len(y) and all(u.shape == v.shape and np.array_equal(u, v)
                                  for u, v in zip(x, y))


def assert_bit_identical(before: Any, after: Any, what: str) -> None:
  b, a = bits(before), bits(after)
  assert len(a) == len(b), what
  for i, (x, y) in enumerate(zip(b, a)):
    assert x.shape == y.shape and np.array_equal(x, y), (
        f"{what}: leaf {i} changed on a skipped step: {x!r} -> {y!r}")


# -------------------------------------------------------------------------------------------------
# Outcomes and the checks.


@dataclasses.dataclass
class Outcome:
  params0: Any
  state0: Any  # the inner optimizer state, which a skipped step must not touch
  params1: Any
  state1: Any
  skipped: bool
  scale1: np.float32
  grads: list  # the scaled gradients of each micro-step, as computed in this mode
  window: int = 1
  consistent: tuple = ()  # (bool, message) pairs: path-specific agreements (step counters)


@contextlib.contextmanager
def mode(eager: bool):
  if eager:
    with jax.disable_jit():
      yield
  else:
    yield


def check(compiled: Outcome, eager: Outcome, scale: float, label: str = "") -> None:
  scale = np.float32(scale)
  want = rule_skips(compiled.grads, compiled.window, scale)
  want_eager = rule_skips(eager.grads, eager.window, scale)
  ctx = (f"{label}, scale={float(scale)!r}, compiled scaled grads="
         f"{window_grads(compiled.grads, compiled.window)!r}")
  # (1) the compiled decision is the eager rule on the compiled gradients ...
  assert compiled.skipped == want, (
      f"compiled step {'skipped' if compiled.skipped else 'applied'} but the unscaled gradients "
      f"it computed are {'not ' if want else ''}all finite; {ctx}; params after="
      f"{compiled.params1!r}")
  assert eager.skipped == want_eager, (
      f"eager step {'skipped' if eager.skipped else 'applied'} against the rule; {ctx}")
  # ... and the eager step's decision wherever the two computed gradients agree in finiteness.
  if want == want_eager:
    assert compiled.skipped == eager.skipped, f"compiled and eager disagree; {ctx}"
    # (4) the same scale.
    assert np.float32(compiled.scale1).view(np.uint32) == np.float32(eager.scale1).view(
        np.uint32), f"scale compiled {compiled.scale1!r} != eager {eager.scale1!r}; {ctx}"
  for outcome, name in ((compiled, "compiled"), (eager, "eager")):
    # (2) a skipped step changes nothing.
    if outcome.skipped:
      assert_bit_identical(outcome.params0, outcome.params1, f"{name} params; {ctx}")
      assert_bit_identical(outcome.state0, outcome.state1, f"{name} optimizer state; {ctx}")
    for ok, message in outcome.consistent:
      assert ok, f"{name}: {message}; {ctx}"
  # (3) no compiled step writes a non-finite parameter.
  for leaf in jax.tree.leaves(compiled.params1):
    assert np.all(np.isfinite(np.asarray(leaf, np.float32))), (
        f"compiled step wrote a non-finite parameter: {compiled.params1!r}; {ctx}")


def loss_scale_state(opt_state: Any) -> Any:
  return jaxamp.get_loss_scale_state(opt_state)


def counts(opt_state: Any) -> list:
  """Every leaf named ``count`` (adam's step count) in an optax state, as ints."""
  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
    if path and getattr(path[-1], "name", None) == "count":
      out.append(int(np.asarray(leaf)))
  return out


def run_both(runner: Callable[[np.ndarray, float, bool], Outcome], x: np.ndarray, scale: float,
             label: str = "") -> None:
  check(runner(x, scale, False), runner(x, scale, True), scale, label)

