"""Unscaling and the finite check."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import jaxamp
from jaxamp._src import finite
from tests._floats import F32_MAX, F32_TINY, bits, enable_x64, torch_unscale


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
  got = np.asarray(jax.jit(finite.unscale)(jnp.asarray(g), jnp.float32(scale)))
  want = torch_unscale(g, scale)
  if scale >= 2.0**126 and math.frexp(scale)[0] != 0.5:
    # PyTorch's reciprocal is a denormal with fewer significant bits; ours has all 24.
    np.testing.assert_allclose(got, g / np.float32(scale), rtol=2e-7)
  else:
    np.testing.assert_array_equal(bits(got), bits(want))


def test_unscale_at_2_127_is_exact_not_flushed_to_zero():
  g = jnp.array([2.0**127, -(2.0**126), 3.0 * 2**120, 0.0], jnp.float32)
  got = jax.jit(finite.unscale)(g, jnp.float32(2.0**127))
  np.testing.assert_array_equal(np.asarray(got), [1.0, -0.5, 3.0 * 2**-7, 0.0])


def test_unscale_keeps_dtypes_and_ignores_integers():
  tree = {"f": jnp.ones(3, jnp.bfloat16), "i": jnp.arange(3), "c": jnp.ones(2, jnp.complex64)}
  out = finite.unscale(tree, jnp.float32(4.0))
  assert jax.tree.map(lambda x: x.dtype, out) == jax.tree.map(lambda x: x.dtype, tree)
  np.testing.assert_array_equal(out["i"], tree["i"])
  np.testing.assert_array_equal(out["f"].astype(jnp.float32), 0.25)
  np.testing.assert_array_equal(out["c"], 0.25 + 0j)


_check = jax.jit(finite.unscaled_all_finite)


@settings(derandomize=True, deadline=None, max_examples=60)
@given(scale=st.sampled_from(SCALES + [0.5, 1e-30, 1e-38]),
       values=st.lists(st.sampled_from([0.0, 1.0, -3.5, 1e30, -3e38, F32_MAX, 1e-40, np.inf, -np.inf,
                                        np.nan]), min_size=1, max_size=6))
def test_unscaled_all_finite_is_all_finite_of_the_unscaled_gradients(scale, values):
  grads = {"a": jnp.asarray(values, jnp.float32), "b": jnp.ones(3), "i": jnp.arange(2)}
  unscaled = finite.unscale(grads, jnp.float32(scale))
  want = all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(unscaled))
  assert bool(_check(grads, jnp.float32(scale))) is want
  assert bool(jax.jit(jaxamp.all_finite)(unscaled)) is want


@pytest.mark.parametrize("scale", [1.0, 2.0**16])
def test_a_sum_that_overflows_is_not_an_overflow(scale):
  # Finite values whose sum is inf are finite.
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


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_nonfinite_mask_reads_the_bits_of_each_dtype(dtype):
  info = jnp.finfo(dtype)
  values = np.array([0.0, -0.0, 1.0, -2.5, float(info.max), -float(info.max), float(info.tiny),
                     float(info.tiny) / 4, np.inf, -np.inf, np.nan], np.float32)
  x = jnp.asarray(values).astype(dtype)
  got = jax.jit(finite.nonfinite_mask)(x)
  np.testing.assert_array_equal(got, ~np.isfinite(np.asarray(x, np.float32)))


def test_nonfinite_mask_of_complex_checks_both_parts():
  x = jnp.array([1 + 1j, complex(np.inf, 0), complex(0, np.nan)], jnp.complex64)
  np.testing.assert_array_equal(finite.nonfinite_mask(x), [False, True, True])


@pytest.mark.parametrize("dtype", [jnp.float8_e5m2, jnp.float8_e4m3fn])
def test_float8_leaves_are_checked_and_kept_as_stored(dtype):
  # float8 is not an IEEE format with a bit rule here (e4m3fn has no inf): its check reads
  # isinf/isnan, and as_stored passes every value through unchanged.
  special = [np.nan] + ([np.inf, -np.inf] if jnp.finfo(dtype).bits == 8 and dtype == jnp.float8_e5m2
                        else [])
  finite_values = jnp.array([0.0, -1.5, float(jnp.finfo(dtype).max)], jnp.float32).astype(dtype)
  assert bool(jax.jit(jaxamp.all_finite)({"w": finite_values})) is True
  for value in special:
    leaf = jnp.array([1.0, value], jnp.float32).astype(dtype)
    assert bool(jax.jit(jaxamp.all_finite)({"w": finite_values, "g": leaf})) is False
    np.testing.assert_array_equal(finite.nonfinite_mask(leaf), [False, True])
    inf, nan = finite.inf_nan_masks(leaf)
    np.testing.assert_array_equal(nan, [False, np.isnan(value)])
    np.testing.assert_array_equal(inf, [False, np.isinf(value)])
  values = jnp.array([0.0, -1.5, 448.0 if dtype == jnp.float8_e4m3fn else 57344.0, np.nan],
                     jnp.float32).astype(dtype)
  got = jax.jit(finite.as_stored)(values)
  assert got.dtype == dtype
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(values, np.float32))


# The gradient of sum(p * x) * s is x * s: with s = 2^127 one element overflows
# to -inf, while a sum that XLA fuses with that multiply (an FMA) stays finite.
_X = jnp.array([1.779, -3.37, 1.209, 1.717], jnp.float32)
_S = jnp.float32(2.0**127)


def _grad_in_jit(p, x, s):
  return jax.grad(lambda p: jnp.sum(p * x) * s)(p)


def test_the_checks_hold_when_the_gradient_is_computed_in_the_same_program():
  @jax.jit
  def checks(p, x, s):
    g = _grad_in_jit(p, x, s)
    return (finite.all_finite(g), finite.unscaled_all_finite(g, s),
            finite.unscaled_all_finite(g, jnp.float32(0.5)))

  assert not any(bool(c) for c in checks(jnp.ones(4), _X, _S))


def test_as_stored_rounds_what_an_accumulator_adds():
  @jax.jit
  def accumulate(acc, p, x, s):
    g = _grad_in_jit(p, x, s)
    return acc + finite.as_stored(g), acc + g

  stored, unrounded = accumulate(jnp.full(4, 3e38, jnp.float32), jnp.ones(4), _X, _S)
  assert np.asarray(stored)[1] == -np.inf
  del unrounded  # what XLA makes of the plain sum depends on whether it contracts it
  np.testing.assert_array_equal(finite.as_stored(jnp.array([1.0, -np.inf, np.nan, -0.0])),
                                [1.0, -np.inf, np.nan, -0.0])


def test_the_check_is_exact_for_sums_that_would_overflow_and_flags_each_leaf():
  # Below scale 1: 4096 elements that unscale to the largest float32 are finite (a check that
  # summed them would overflow); one element that unscales past it is not, and only its leaf is
  # flagged, among leaves of two dtypes.
  half_max = np.float32(F32_MAX / 2)

  @jax.jit
  def check(p, x):
    g = jax.grad(lambda p: sum(jnp.sum(p[k] * x[k]).astype(jnp.float32) for k in p))(p)
    c = finite.unscaled_check(g, jnp.float32(0.5))
    return c.finite, c.nonfinite_leaves

  p = {"a": jnp.ones(4096), "b": jnp.ones(3, jnp.bfloat16), "c": jnp.ones(3)}
  x = {"a": jnp.full(4096, half_max), "b": jnp.array([1.0, 2.0, 3.0], jnp.bfloat16),
       "c": jnp.array([1.0, np.nextafter(half_max, np.float32(np.inf)), 2.0], jnp.float32)}
  ok, flags = check(p, x)
  assert not bool(ok)
  np.testing.assert_array_equal(flags, [False, False, True])
  x["b"] = jnp.array([1.0, 3e38, 3.0], jnp.bfloat16)  # 6e38 is inf in bfloat16
  x["c"] = jnp.ones(3)
  ok, flags = check(p, x)
  assert not bool(ok)
  np.testing.assert_array_equal(flags, [False, True, False])
  x["b"] = jnp.ones(3, jnp.bfloat16)
  ok, flags = check(p, x)
  assert bool(ok)
  np.testing.assert_array_equal(flags, [False, False, False])


@pytest.mark.parametrize("scale", [2.0, 2.0**127])
def test_a_complex_leaf_is_unscaled_part_by_part_as_real_leaves_are(scale):
  # Bit for bit, the signs of zeros included (a complex product would mix the parts).
  g = jnp.asarray(np.array([complex(-0.0, -1.0), complex(-0.0, 3.0), complex(5.0, -0.0),
                            complex(F32_MAX, -F32_TINY)], np.complex64))
  unscale = jax.jit(finite.unscale)
  got = np.asarray(unscale({"g": g}, jnp.float32(scale))["g"])
  parts = unscale({"re": jnp.real(g), "im": jnp.imag(g)}, jnp.float32(scale))
  np.testing.assert_array_equal(bits(got.real), bits(parts["re"]))
  np.testing.assert_array_equal(bits(got.imag), bits(parts["im"]))


def test_bfloat16_gradients_are_unscaled_in_float32_then_rounded_once():
  # As PyTorch's unscale: the product of a half-precision gradient with float32(1 / scale) is
  # formed in float32; in bfloat16 the reciprocal itself would be rounded first.
  g = jnp.asarray(np.linspace(-3.0, 3.0, 13), jnp.bfloat16)
  for scale in (3.0, 1000.0, 2.0**20 / 3):
    got = jax.jit(finite.unscale)({"g": g}, jnp.float32(scale))["g"]
    assert got.dtype == jnp.bfloat16
    want = (np.asarray(g, np.float32) * np.float32(1 / np.float32(scale))).astype(jnp.bfloat16)
    np.testing.assert_array_equal(bits(got), bits(want))


def test_under_x64_float64_gradients_are_unscaled_in_float64():
  with enable_x64():
    g = jnp.asarray([1.0 + 2.0**-40, -3.0, 1e300], jnp.float64)
    got = jax.jit(finite.unscale)({"g": g}, jnp.float32(3.0))["g"]
    assert got.dtype == jnp.float64
    np.testing.assert_array_equal(got, np.asarray(g) * np.float64(np.float32(1) / np.float32(3)))


_MIXED = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16, "c64": jnp.complex64,
          "f8": jnp.float8_e4m3fn, "int": jnp.int32}


@pytest.mark.parametrize("bad", [None, *(k for k in _MIXED if k != "int")])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_check_flags_exactly_the_leaves_that_hold_an_inf_or_a_nan(bad, value):
  # One flag per floating leaf, in tree order, whatever the dtype of the other leaves.
  tree = {k: jnp.ones(5, d) for k, d in _MIXED.items()}
  if bad is not None:
    tree[bad] = tree[bad].at[3].set(value)
  got = jax.jit(finite.check)(tree)
  floating = [k for k in sorted(_MIXED) if k != "int"]
  np.testing.assert_array_equal(got.nonfinite_leaves, [k == bad for k in floating])
  assert bool(got.finite) == (bad is None)


def test_a_complex_leaf_whose_magnitude_overflows_is_still_finite():
  # |z| of finite parts near the float32 maximum is inf; the check reads each part.
  big = float(np.finfo(np.float32).max) * 0.9
  tree = {"z": jnp.full(3, big + 1j * big, jnp.complex64), "w": jnp.ones(2)}
  got = jax.jit(finite.check)(tree)
  assert bool(got.finite)
  np.testing.assert_array_equal(got.nonfinite_leaves, [False, False])


def test_with_x64_the_check_of_a_mixed_tree_flags_each_leaf():
  with enable_x64(True):
    tree = {"a": jnp.ones(3, jnp.float64), "b": jnp.array([1.0, jnp.inf], jnp.bfloat16),
            "c": jnp.ones(2, jnp.float32)}
    got = jax.jit(finite.check)(tree)
    np.testing.assert_array_equal(got.nonfinite_leaves, [False, True, False])
    assert not bool(got.finite)


# ------------------------------------------------------------------ the check through the step

# Leaves of every size class the check may reduce differently: small leaves of one shape, large
# leaves of one shape, a large leaf of its own shape, half precision, complex.
_SHAPES = {"small_a": ((3, 5), jnp.float32), "small_b": ((3, 5), jnp.float32),
           "big_a": ((65536,), jnp.float32), "big_b": ((65536,), jnp.float32),
           "mid": ((4099,), jnp.float32),
           "half": ((7,), jnp.bfloat16), "half_big": ((4096,), jnp.bfloat16),
           "z": ((4,), jnp.complex64)}


def test_the_step_skips_on_every_unscaled_overflow_and_applies_the_rest_without_recompiling():
  # Through the loss scaler's step, over every path of the check: a value that overflows only
  # once unscaled (scale below 1), an inf or a nan in any leaf and at either end of it, skips;
  # finite values as large as float32 allows are applied. One compilation for every scale.
  tx = jaxamp.static_loss_scale(optax.sgd(1.0), 1.0)
  params = {k: jnp.zeros(s, d) for k, (s, d) in _SHAPES.items() if d != jnp.complex64}
  step = jax.jit(tx.update)

  def grads(key=None, index=0, value=0.0):
    tree = {k: np.ones(s, np.float32) for k, (s, _) in _SHAPES.items() if k in params}
    if key is not None:
      tree[key].reshape(-1)[index] = value
    return {k: jnp.asarray(v).astype(params[k].dtype) for k, v in tree.items()}

  cases = [(0.5, grads("big_b", -1, 1e38), True), (0.5, grads("big_b", -1, 2e38), False),
           (0.5, grads("half_big", 0, 2e38), False), (0.5, grads("small_b", -1, 2e38), False),
           (2.0**16, grads("mid", -1, F32_MAX), True)]
  cases += [(scale, grads(key, index, value), False) for scale in (0.5, 2.0**16)
            for key in params for index in (0, -1) for value in (math.inf, -math.inf, math.nan)]
  for scale, g, applied in cases:
    state = jaxamp.set_loss_scale(tx.init(params), scale)
    updates, state = step(g, state, params)
    assert int(state.skipped_steps) == (0 if applied else 1), (scale, g)
    for u, x in zip(jax.tree.leaves(updates), jax.tree.leaves(g)):
      want = -(x.astype(jnp.float32) / scale).astype(x.dtype) if applied else jnp.zeros_like(x)
      np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(want, np.float32))
  assert step._cache_size() == 1
