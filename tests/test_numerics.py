"""The numerical building blocks: finite checks, unscaling, float64-like rounding, selection."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import jaxamp
from jaxamp._src import numerics

F32_TINY = float(np.finfo(np.float32).tiny)
F32_MAX = float(np.finfo(np.float32).max)


def bits(x):
  return np.asarray(x).view(np.uint32 if np.asarray(x).dtype == np.float32 else np.uint16)


def torch_unscale(g, scale):
  """PyTorch's unscale: g * float32(1 / float64(scale)), denormals kept (numpy keeps them)."""
  inv = np.float32(1.0 / np.float64(np.float32(scale)))
  return (np.asarray(g, np.float32) * inv).astype(np.float32)


# ------------------------------------------------------------------------------------- all_finite


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_all_finite_detects_every_kind_of_non_finite(bad):
  tree = {"a": jnp.ones(5), "b": jnp.array([1.0, 2.0, bad, 3.0])}
  assert bool(jaxamp.all_finite(tree)) is False
  assert bool(jax.jit(jaxamp.all_finite)(tree)) is False
  assert bool(jaxamp.all_finite({"a": jnp.ones(5)})) is True


def test_all_finite_ignores_integers_and_accepts_an_empty_tree():
  ints = {"i": jnp.array([2**31 - 1, -5], jnp.int32), "b": jnp.array([True, False])}
  assert bool(jaxamp.all_finite(ints)) is True
  assert bool(jaxamp.all_finite({})) is True
  assert bool(jaxamp.all_finite(())) is True
  mixed = {"i": jnp.arange(3), "f": jnp.array([jnp.nan])}
  assert bool(jaxamp.all_finite(mixed)) is False
  out = jax.jit(jaxamp.all_finite)({})
  assert out.dtype == jnp.bool_ and out.shape == ()


def test_all_finite_low_precision_complex_and_huge_finite_values():
  assert bool(jaxamp.all_finite(jnp.array([1.0, jnp.inf], jnp.bfloat16))) is False
  assert bool(jaxamp.all_finite(jnp.array([1.0, jnp.nan], jnp.float16))) is False
  assert bool(jaxamp.all_finite(jnp.array([1 + 1j, complex(0, np.inf)], jnp.complex64))) is False
  # Values whose sum or squares overflow are still finite.
  huge = jnp.full(1000, F32_MAX, jnp.float32)
  assert bool(jax.jit(jaxamp.all_finite)(huge)) is True


# ---------------------------------------------------------------------------- unscale / the check

SCALES = [1.0, 2.0**16, 1000.0, 1.5 * 2**20, 0.3, 2.0**-10, F32_TINY, 2.0**125, 2.0**126, 2.0**127,
          3.0 * 2**126]


@pytest.mark.parametrize("scale", SCALES)
def test_unscale_matches_pytorch_bit_for_bit(scale):
  rng = np.random.default_rng(0)
  g = rng.uniform(-1.0, 1.0, 64)
  g = (g * scale if scale > 1 else g).astype(np.float32)
  got = np.asarray(jax.jit(numerics.unscale)(jnp.asarray(g), jnp.float32(scale)))
  want = torch_unscale(g, scale)
  if scale >= 2.0**126 and math.frexp(scale)[0] != 0.5:
    # PyTorch's reciprocal is a denormal with fewer significant bits; ours has all 24.
    np.testing.assert_allclose(got, g / np.float32(scale), rtol=2e-7)
  else:
    np.testing.assert_array_equal(bits(got), bits(want))


def test_unscale_at_2_127_is_exact_not_flushed_to_zero():
  g = jnp.array([2.0**127, -(2.0**126), 3.0 * 2**120, 0.0], jnp.float32)
  got = jax.jit(numerics.unscale)(g, jnp.float32(2.0**127))
  np.testing.assert_array_equal(np.asarray(got), [1.0, -0.5, 3.0 * 2**-7, 0.0])


def test_unscale_keeps_dtypes_and_ignores_integers():
  tree = {"f": jnp.ones(3, jnp.bfloat16), "i": jnp.arange(3), "c": jnp.ones(2, jnp.complex64)}
  out = numerics.unscale(tree, jnp.float32(4.0))
  assert jax.tree.map(lambda x: x.dtype, out) == jax.tree.map(lambda x: x.dtype, tree)
  np.testing.assert_array_equal(out["i"], tree["i"])
  np.testing.assert_array_equal(out["f"].astype(jnp.float32), 0.25)
  np.testing.assert_array_equal(out["c"], 0.25 + 0j)


_check = jax.jit(numerics.unscaled_all_finite)


@settings(derandomize=True, deadline=None, max_examples=60)
@given(scale=st.sampled_from(SCALES + [0.5, 1e-30, 1e-38]),
       values=st.lists(st.sampled_from([0.0, 1.0, -3.5, 1e30, -3e38, F32_MAX, 1e-40, np.inf, -np.inf,
                                        np.nan]), min_size=1, max_size=6))
def test_unscaled_all_finite_is_all_finite_of_the_unscaled_gradients(scale, values):
  grads = {"a": jnp.asarray(values, jnp.float32), "b": jnp.ones(3), "i": jnp.arange(2)}
  unscaled = numerics.unscale(grads, jnp.float32(scale))
  want = all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(unscaled))
  assert bool(_check(grads, jnp.float32(scale))) is want
  assert bool(jax.jit(jaxamp.all_finite)(unscaled)) is want


@pytest.mark.parametrize("scale", [1.0, 2.0**16])
def test_a_sum_that_overflows_is_not_an_overflow(scale):
  # The quick check sums each leaf; finite values whose sum is inf are finite.
  grads = {"w": jnp.array([F32_MAX, F32_MAX, -1.0], jnp.float32), "b": jnp.ones(2)}
  assert bool(jax.jit(jaxamp.all_finite)(grads)) is True
  assert bool(_check(grads, jnp.float32(scale))) is True
  grads["b"] = jnp.array([1.0, np.nan])
  assert bool(jax.jit(jaxamp.all_finite)(grads)) is False
  assert bool(_check(grads, jnp.float32(scale))) is False


def test_unscaled_all_finite_catches_an_overflow_of_finite_gradients_below_scale_1():
  grads = {"w": jnp.array([1e37, 1.0], jnp.float32)}
  assert bool(_check(grads, jnp.float32(1.0))) is True
  assert bool(_check(grads, jnp.float32(0.01))) is False  # 1e39 is inf in float32


# ------------------------------------------------------------------------------ mul_like_float64


def float64_then_float32(x, factor):
  with np.errstate(over="ignore"):
    return np.float32(np.float64(np.float32(x)) * factor)


def ulps(a, b):
  a, b = np.float32(a), np.float32(b)
  return abs(int(np.asarray(a).view(np.int32)) - int(np.asarray(b).view(np.int32)))


_mul = jax.jit(numerics.mul_like_float64, static_argnums=1)


@pytest.mark.parametrize("factor", [2.0, 0.5, 4.0, 0.25, 1.5, 0.3, 1.1, 0.9, 3.0, 0.7, 1.0001])
def test_mul_like_float64_reference_values(factor):
  xs = np.array([1.0, 1000.0, 1500.0, 450.0, 65536.0, 3.0e38, 2.0**-100, 12345.678, 0.1, 7.0],
                np.float32)
  got = np.asarray(_mul(jnp.asarray(xs), factor))
  for x, y in zip(xs, got):
    want = float64_then_float32(x, factor)
    if math.frexp(factor)[0] == 0.5:
      assert bits(y) == bits(want)
    else:
      assert ulps(y, want) <= 1, (x, factor, y, want)
  # The PyTorch example from the reference: 1500 * 0.3 is 450.0, not 450.00003.
  assert float(_mul(jnp.float32(1500.0), 0.3)) == 450.0


@settings(derandomize=True, deadline=None, max_examples=40)
@given(x=st.floats(min_value=float(np.float32(1e-30)), max_value=float(np.float32(1e30)), width=32),
       factor=st.sampled_from([1.5, 0.3, 1.1, 0.9, 1.25, 0.7, 3.0, 1.0001, 0.99]))
def test_mul_like_float64_is_within_one_ulp_of_float64(x, factor):
  got = float(_mul(jnp.float32(x), factor))
  assert ulps(got, float64_then_float32(x, factor)) <= 1


def test_mul_like_float64_is_exact_for_common_factors():
  """Bit-exact on 4096 random inputs for these factors; only rare near-ties (1.1) differ."""
  rng = np.random.default_rng(1)
  xs = (2.0 ** rng.integers(-30, 30, 4096) * rng.uniform(1, 2, 4096)).astype(np.float32)
  for factor in (1.5, 0.3, 0.7, 0.9, 0.1, 1.7, 1.0001):
    got = np.asarray(_mul(jnp.asarray(xs), factor))
    want = (xs.astype(np.float64) * factor).astype(np.float32)
    np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"factor {factor}")
  got = np.asarray(_mul(jnp.asarray(xs), 1.1))
  want = (xs.astype(np.float64) * 1.1).astype(np.float32)
  assert np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32)).max() <= 1


# ------------------------------------------------------------------ counters and tree selection


def test_safe_increment_saturates():
  top = jnp.array(np.iinfo(np.int32).max, jnp.int32)
  assert int(numerics.safe_increment(top)) == np.iinfo(np.int32).max
  assert int(numerics.safe_increment(jnp.array(5, jnp.int32))) == 6
  assert numerics.safe_increment(jnp.array(5, jnp.int32)).dtype == jnp.int32


def test_select_tree_keeps_old_dtypes_and_never_leaks_nan():
  old = {"a": jnp.zeros(2, jnp.bfloat16), "n": jnp.array(3, jnp.int32)}
  new = {"a": jnp.array([jnp.nan, 1.0], jnp.float32), "n": jnp.array(4, jnp.int32)}
  out = numerics.select_tree(jnp.array(False), new, old)
  assert out["a"].dtype == jnp.bfloat16 and int(out["n"]) == 3
  np.testing.assert_array_equal(out["a"].astype(jnp.float32), [0.0, 0.0])


# -------------------------------------------------------------------------------- select_update


@pytest.fixture(scope="module")
def adam_setup():
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))
  params = {"w": jnp.array([1.0, -0.0, -2.0]), "b": jnp.zeros(2)}
  with jax.numpy_dtype_promotion("standard"):
    state = tx.init(params)
    grads = {"w": jnp.array([0.5, -1.0, 2.0]), "b": jnp.ones(2)}
    # One step so that the state is not all zeros.
    _, state = tx.update(grads, state, params)
  return tx, params, state, grads


def _naive(pred, tx, grads, state, params):
  updates, new_state = tx.update(grads, state, params)
  updates = jax.tree.map(lambda u: jnp.where(pred, u, -0.0 * jnp.ones_like(u)), updates)
  return updates, numerics.select_tree(pred, new_state, state)


@pytest.mark.parametrize("pred", [True, False])
@pytest.mark.parametrize("fallback", [False, True])
def test_select_update_equals_the_naive_selection(adam_setup, monkeypatch, pred, fallback):
  tx, params, state, grads = adam_setup
  if fallback:  # the plain path, taken when the tracing cannot be used

    def broken(*args, **kwargs):
      raise RuntimeError("unusable jaxpr")

    monkeypatch.setattr(numerics, "_eval_selecting", broken)

  @jax.jit
  def both(pred):
    with jax.numpy_dtype_promotion("standard"):
      got = numerics.select_update(pred, lambda: tx.update(grads, state, params), state)
      return got, _naive(pred, tx, grads, state, params)

  got, want = both(jnp.array(pred))
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == w.dtype
    if pred:
      # XLA fuses the two programs differently, so the last bit may differ.
      np.testing.assert_allclose(g, w, rtol=1e-6)
    else:
      np.testing.assert_array_equal(np.atleast_1d(g).view(np.uint8),
                                    np.atleast_1d(w).view(np.uint8))
  if not pred:
    for g, s in zip(jax.tree.leaves(got[1]), jax.tree.leaves(state)):
      np.testing.assert_array_equal(g, s)
    new_params = optax.apply_updates(params, got[0])
    np.testing.assert_array_equal(bits(new_params["w"]), bits(params["w"]))  # -0.0 stays -0.0


def _witnesses_seen(inner, grads, params, scale=None):
  """The witnesses that ``select_update`` hands to ``pred`` for ``inner`` (with ``scale``:
  watching the gradients unscaled by it)."""
  seen = []

  def decide(witnesses):
    seen.append([w is not None for w in witnesses])
    return jnp.array(True)

  @jax.jit
  def run(grads):
    with jax.numpy_dtype_promotion("standard"):
      state = inner.init(params)
      unscaled, unscaled_from = grads, None
      if scale is not None:
        unscaled = numerics.unscale(grads, scale)
        unscaled_from = (numerics.float_leaves(grads), jnp.float32(scale))
      return numerics.select_update(decide, lambda: inner.update(unscaled, state, params), state,
                                    watch=numerics.float_leaves(unscaled),
                                    unscaled_from=unscaled_from)

  run(grads)
  return seen[0]


def test_select_update_hands_a_global_norm_clip_reduction_to_pred():
  params = {"w": jnp.ones((3, 2)), "b": jnp.ones(2), "s": jnp.ones(())}
  grads = jax.tree.map(jnp.ones_like, params)
  clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))
  assert _witnesses_seen(clipped, grads, params) == [True, True, True]
  assert _witnesses_seen(clipped, grads, params, scale=8.0) == [True, True, True]
  # Adam reduces nothing: the scalar leaf is its own witness, the others have none.
  assert _witnesses_seen(optax.adam(0.1), grads, params) == [False, True, False]  # b, s, w
  # A max does not carry a nan through (max(nan, x) may be x): no witness.
  by_max = optax.stateless(lambda u, p: jax.tree.map(lambda x: x / jnp.max(jnp.abs(x)), u))
  maxed = optax.chain(by_max, optax.sgd(0.1))
  assert _witnesses_seen(maxed, grads, params) == [False, True, False]


@pytest.mark.parametrize("value", [1e30, np.nan, np.inf])
def test_a_clipped_step_with_witnesses_decides_as_the_exact_check(value):
  """Squares that overflow are not an overflow; nan and inf are."""
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
  tx = jaxamp.dynamic_loss_scale(inner, init_scale=1.0)
  params = {"w": jnp.array([1.0, 2.0]), "b": jnp.array([0.5])}
  grads = {"w": jnp.array([value, 1.0]), "b": jnp.array([1.0])}
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  finite = bool(np.isfinite(value))
  assert bool(state.skipped) is (not finite)
  if finite:  # the norm is inf: the clipped step is what the inner alone gives
    want, _ = inner.update(grads, inner.init(params), params)
    for u, w in zip(jax.tree.leaves(updates), jax.tree.leaves(want)):
      np.testing.assert_array_equal(bits(u), bits(w))


def _degrees(fn, leaf):
  """The degrees of homogeneity of the witnesses ``select_update`` finds in ``fn(leaf)``."""
  found = []

  def trace(leaf):
    closed = jax.make_jaxpr(lambda: fn(leaf))()
    found.extend(w and w.degree for w in numerics._witnesses(closed, [leaf], 10**6))
    return leaf

  jax.jit(trace)(leaf)
  return found


def test_witness_degrees_follow_the_homogeneity_of_the_reduction():
  x = jnp.ones((4, 3))
  assert _degrees(lambda u: jnp.sqrt(jnp.sum(u * u)), x) == [2]  # the sum, not its root
  assert _degrees(optax.tree.norm, x) == [2]  # through optax's "+ 0 ** 2" for the imaginary part
  assert _degrees(lambda u: jnp.sum(jnp.abs(u)) * 3.0, x) == [1]
  assert _degrees(lambda u: jnp.sum(u ** 3 / 2.0), x) == [3]
  # Not homogeneous: the witness is still found, but it is computed as written.
  assert _degrees(lambda u: jnp.sum(u * u + 1.0), x) == [None]
  assert _degrees(lambda u: jnp.sum(jnp.sqrt(u)), x) == [None]


@pytest.mark.parametrize("scale,grad", [
    (2.0**10, 3.0),  # from the raw gradients
    (1000.0, 3.0),  # not a power of two: as written
    (0.25, 3.0),  # below 1: as written
    (2.0**127, 3.0 * 2.0**120),  # no normal reciprocal: as written
    (2.0**10, 1e20),  # the raw squares overflow, the unscaled ones do not
    (2.0**10, 1e-17),  # the unscaled squares are subnormal, the raw ones are not
    (2.0**10, np.inf),
])
def test_a_clipped_step_is_the_clipped_step_of_the_unscaled_gradients(scale, grad):
  inner = optax.chain(optax.clip_by_global_norm(1e-30), optax.sgd(1.0))
  tx = jaxamp.dynamic_loss_scale(inner, init_scale=scale, max_scale=2.0**127)
  params = {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4)}
  grads = {"w": jnp.full((3, 4), grad, jnp.float32), "b": jnp.arange(4.0) * grad}
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  unscaled = numerics.unscale(grads, scale)
  want, _ = jax.jit(inner.update)(unscaled, inner.init(params), params)
  assert bool(state.skipped) is (not np.isfinite(grad))
  if np.isfinite(grad):
    for u, w in zip(jax.tree.leaves(updates), jax.tree.leaves(want)):
      np.testing.assert_allclose(u, w, rtol=1e-6)


def test_select_update_reruns_a_broken_update_to_raise_its_own_error():
  def broken():
    raise KeyError("from the inner update")

  with pytest.raises(KeyError, match="from the inner update"):
    numerics.select_update(jnp.array(True), broken, ())


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="reads XLA:CPU's compiled HLO")
def test_select_update_fuses_the_selection_into_the_inner_update():
  """No copy of a donated optimizer-state buffer, as the naive selection causes."""
  tx = optax.adam(1e-3)
  params = {f"p{i}": jnp.ones(4096) for i in range(3)}
  with jax.numpy_dtype_promotion("standard"):
    state = tx.init(params)

  def step(params, state, grads, pred, fused):
    with jax.numpy_dtype_promotion("standard"):
      if fused:
        updates, state = numerics.select_update(pred, lambda: tx.update(grads, state, params), state)
      else:
        updates, state = _naive(pred, tx, grads, state, params)
    return optax.apply_updates(params, updates), state

  def copies(fused):
    lowered = jax.jit(step, donate_argnums=(0, 1), static_argnums=4).lower(
        params, state, params, jnp.array(True), fused)
    text = lowered.compile().as_text()
    entry = text[text.index("\nENTRY"):]
    return sum(" copy(" in line and "f32[4096]" in line for line in entry.splitlines())

  assert copies(True) == 0
