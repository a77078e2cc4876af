"""fp8 autocast: ``jaxamp.autocast(fn, jnp.float8_e4m3fn)``.

The quantization against ``ml_dtypes``' rounding, the products and their
gradients against a float64 reference on the quantized values, the form of
the lowered program (every chosen product on ``convert(float8) * scalar``
operands, the excluded ones without), the rule and its options, skipped
steps, and the composition with the rest of jaxamp and with JAX's
transformations. Whole models of each family train in
``tests/conformance/test_fp8_autocast.py``.
"""

from __future__ import annotations

import functools

import equinox as eqx
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.linen import fp8_ops
from jax import lax

import jaxamp
from jaxamp._src import fp8_autocast
from tests import _hlo, _optax
from tests.conformance._harness import equations

E4M3, E5M2, BF16, F32 = (jnp.dtype(d) for d in (jnp.float8_e4m3fn, jnp.float8_e5m2,
                                                  jnp.bfloat16, jnp.float32))
SMALL = jaxamp.Fp8Rule(min_dim=16)  # every product of the small programs here
KEYS = jax.random.split(jax.random.key(0), 8)


def _normal(key, shape, scale=1.0):
  return scale * jax.random.normal(key, shape, jnp.float32)


def _products(fn, *args):
  """The dots and convolutions of ``jit(fn)``'s lowered HLO, with their operands' float8 formats."""
  return [p[2:] for p in _hlo.fp8_products(jax.jit(fn).lower(*args).as_text(dialect="hlo"))]


# ----------------------------------------------------------------------------- quantization


@hypothesis.settings(derandomize=True, deadline=None, max_examples=200)
@hypothesis.given(amax=st.floats(min_value=0.0, max_value=float(np.finfo(np.float32).max),
                                 allow_subnormal=True, allow_infinity=False, width=32),
                  fmt=st.sampled_from([E4M3, E5M2]))
def test_the_scale_is_the_largest_power_of_two_that_keeps_the_amax_in_range(amax, fmt):
  scale, inverse = (float(v) for v in fp8_autocast.scales(jnp.float32(amax), fmt))
  fmax = float(jnp.finfo(fmt).max)
  assert np.log2(scale) == np.round(np.log2(scale)) and scale * inverse == 1.0
  assert amax * scale <= fmax
  assert 2 * amax * scale > fmax or scale == 2.0**126  # the largest, but for tiny amaxes


@pytest.mark.parametrize("amax", [np.inf, np.nan])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_a_non_finite_amax_gives_nan_scales(amax, fmt):
  assert all(np.isnan(v) for v in fp8_autocast.scales(jnp.float32(amax), fmt))


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_quantize_rounds_as_ml_dtypes_and_dequantizes_exactly(fmt, dtype):
  x = _normal(KEYS[0], (64, 32), 37.0).astype(dtype)
  q, inverse = jax.jit(fp8_autocast.quantize, static_argnums=1)(x, fmt)
  scale = 1.0 / float(inverse)
  want = (np.asarray(x, np.float64) * scale).astype(np.float32).astype(getattr(ml_dtypes, fmt.name))
  assert q.dtype == fmt and np.asarray(q).tobytes() == want.tobytes()
  back = fp8_autocast.dequantize(q, inverse, BF16)
  np.testing.assert_array_equal(np.asarray(back, np.float64), want.astype(np.float64) / scale)


def test_an_all_zero_operand_quantizes_to_zeros():
  q, inverse = fp8_autocast.quantize(jnp.zeros((4, 4)), E4M3)
  assert np.all(np.asarray(q, np.float32) == 0) and np.isfinite(float(inverse))


# ----------------------------------------------------------------------------- products


def _qdq(x, fmt):
  """``x`` rounded to ``fmt`` with its current power-of-two scale, in float64 (the reference)."""
  x = np.asarray(x, np.float64)
  scale = 2.0**np.floor(np.log2(float(jnp.finfo(fmt).max) / np.max(np.abs(x))))
  return (x * scale).astype(np.float32).astype(getattr(ml_dtypes, fmt.name)).astype(
      np.float64) / scale


def _bf16(x):
  return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


@functools.partial(jax.jit, static_argnums=0)
def _value_and_vjp(fn, x, w, ct):
  out, vjp = jax.vjp(fn, x, w)
  return (out, *vjp(ct))


def test_a_matmul_and_its_gradients_are_the_products_of_the_quantized_values():
  x, w = _normal(KEYS[0], (32, 64)), _normal(KEYS[1], (64, 48), 0.1)
  ct = _normal(KEYS[2], (32, 48), 1e-3).astype(BF16)
  out, gx, gw = _value_and_vjp(jaxamp.autocast(jnp.matmul, jnp.float8_e4m3fn, fp8=SMALL), x, w, ct)
  assert out.dtype == BF16 and gx.dtype == gw.dtype == F32
  qx, qw, qg = _qdq(x, E4M3), _qdq(w, E4M3), _qdq(ct, E5M2)
  # Exact products of 4-bit significands, accumulated in float32 and rounded to bfloat16.
  np.testing.assert_allclose(np.asarray(out, np.float64), _bf16(qx @ qw), rtol=2**-8)
  np.testing.assert_allclose(np.asarray(gx, np.float64), _bf16(qg @ qw.T), rtol=2**-8)
  np.testing.assert_allclose(np.asarray(gw, np.float64), _bf16(qx.T @ qg), rtol=2**-8)


def test_a_convolution_and_its_gradients_are_those_of_the_quantized_values():
  x, k = _normal(KEYS[0], (4, 8, 8, 16)), _normal(KEYS[1], (3, 3, 16, 16), 0.2)

  def conv(x, k):
    return lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))

  ct = _normal(KEYS[2], (4, 8, 8, 16)).astype(BF16)
  out, gx, gk = _value_and_vjp(jaxamp.autocast(conv, jnp.float8_e4m3fn, fp8=SMALL), x, k, ct)
  qx, qk = (jnp.asarray(_qdq(a, E4M3), F32) for a in (x, k))
  want, want_gx, want_gk = _value_and_vjp(conv, qx, qk, jnp.asarray(_qdq(ct, E5M2), F32))
  for got, ref in ((out, want), (gx, want_gx), (gk, want_gk)):
    np.testing.assert_allclose(np.asarray(got, np.float64), _bf16(ref), rtol=2**-7,
                               atol=2**-7 * float(jnp.max(jnp.abs(ref))))


# ----------------------------------------------------------------------------- the lowered program


def _mlp_params(sizes=(32, 64, 64, 16)):
  return [{"w": _normal(k, (a, b), a**-0.5), "b": jnp.zeros((b,))}
          for k, a, b in zip(KEYS, sizes[:-1], sizes[1:])]


def _mlp_loss(params, x):
  for i, p in enumerate(params):
    with jax.named_scope(f"layer_{i}"):
      x = x @ p["w"] + p["b"][None, :]
      x = jax.nn.gelu(x) if i < len(params) - 1 else x
  return jnp.mean(jnp.square(x.astype(F32)))


X = _normal(KEYS[7], (32, 32))


def test_every_chosen_product_and_its_gradients_run_on_dequantized_float8():
  f = jaxamp.autocast(_mlp_loss, jnp.float8_e4m3fn, fp8=SMALL)
  products = _products(jax.grad(f), _mlp_params(), X)
  # Three layers: three forward dots, and for each the two backward ones (the first layer's
  # input gradient is not needed: five).
  assert len(products) == 8, products
  forward = [p for p in products if p[1] == ("f8e4m3fn", "f8e4m3fn")]
  backward = [p for p in products if sorted(p[1]) == ["f8e4m3fn", "f8e5m2"]]
  assert len(forward) == 3 and len(backward) == 5, products


def test_excluded_and_small_products_stay_in_bfloat16_and_show_no_float8():
  rule = jaxamp.Fp8Rule(min_dim=16, exclude=("layer_0",))
  f = jaxamp.autocast(_mlp_loss, jnp.float8_e4m3fn, fp8=rule)
  params = _mlp_params((32, 64, 64, 8))  # the last layer's n = 8 is below min_dim
  products = _products(jax.grad(f), params, X)
  assert sum(p[1] == ("f8e4m3fn", "f8e4m3fn") for p in products) == 1  # layer_1 alone
  assert sum(p[1] == (None, None) for p in products) == 8 - 3
  # The same program in bfloat16 autocast has no float8 at all.
  plain = _products(jax.grad(jaxamp.autocast(_mlp_loss, jnp.bfloat16)), params, X)
  assert plain and all(p[1] == (None, None) for p in plain)


class LinenMlp(nn.Module):
  """An unmodified Linen model: autocast sees its modules' names in the name stack."""

  @nn.compact
  def __call__(self, x):
    x = nn.gelu(nn.Dense(64)(x))
    x = nn.gelu(nn.Dense(64)(x))
    return nn.Dense(16, name="head")(x)


def test_linen_modules_are_excluded_by_name_in_the_lowered_program():
  model = LinenMlp()
  variables = model.init(KEYS[0], X)
  rule = jaxamp.Fp8Rule(min_dim=16, exclude=("Dense_0", "LinenMlp/head"))
  f = jaxamp.autocast(lambda v, x: jnp.mean(model.apply(v, x).astype(F32)), jnp.float8_e4m3fn,
                      fp8=rule)
  formats = [tuple(sorted(map(str, p[1]))) for p in _products(jax.grad(f), variables, X)]
  # Dense_1 in float8 (its three products), Dense_0 (one: no input gradient) and head (three)
  # in bfloat16.
  assert sorted(formats) == sorted([("f8e4m3fn", "f8e4m3fn")] + [("f8e4m3fn", "f8e5m2")] * 2
                                   + [("None", "None")] * 4), formats


def _stack_loss(ws, x):
  """A scan over layers, each a remat block: the products sit in the loop's body."""

  @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
  def block(h, w):
    return jnp.tanh(h @ w)

  h, _ = lax.scan(lambda h, w: (block(h, w), None), x, ws)
  return jnp.mean(jnp.square(h.astype(F32)))


def test_products_inside_scan_and_remat_run_on_float8():
  ws = _normal(KEYS[1], (3, 32, 32), 32**-0.5)
  f = jaxamp.autocast(_stack_loss, jnp.float8_e4m3fn, fp8=SMALL)
  products = _products(jax.grad(f, argnums=(0, 1)), ws, X)
  assert len(products) >= 3 and all(None not in p[1] for p in products), products
  grads = jax.jit(jax.grad(f))(ws, X)
  want = jax.grad(jaxamp.autocast(_stack_loss, jnp.bfloat16))(ws, X)
  assert _rel_err(grads, want) < 0.15


def test_scopes_reach_into_the_bodies_jax_traces_with_name_stacks_of_their_own():
  # JAX traces a scan's and a jit's body with a fresh name stack: the rule sees the outer names.
  ws = _normal(KEYS[1], (2, 32, 32), 32**-0.5)

  def loss(ws, x):
    with jax.named_scope("encoder"):
      h, _ = lax.scan(lambda h, w: (jax.jit(lambda h, w: jnp.tanh(h @ w))(h, w), None), x, ws)
    with jax.named_scope("decoder"):
      h = jnp.tanh(h @ ws[0])
    return jnp.mean(jnp.square(h.astype(F32)))

  seen = []
  rule = jaxamp.Fp8Rule(min_dim=16, exclude=(lambda site: seen.append(site.scope) or False,
                                             "encoder"))
  products = _products(jax.grad(jaxamp.autocast(loss, jnp.float8_e4m3fn, fp8=rule)), ws, X)
  assert seen == ["autocast_loss/encoder", "autocast_loss/decoder"]
  # The decoder's product and its two gradients in float8; the encoder's in bfloat16.
  assert sum(None not in p[1] for p in products) == 3, products
  assert sum(p[1] == (None, None) for p in products) == 3, products


def test_the_forward_convolution_runs_on_dequantized_float8():
  x, k = _normal(KEYS[0], (4, 8, 8, 16)), _normal(KEYS[1], (3, 3, 16, 16), 0.2)
  f = jaxamp.autocast(
      lambda x, k: jnp.sum(lax.conv_general_dilated(
          x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")).astype(F32)),
      jnp.float8_e4m3fn, fp8=SMALL)
  products = _products(jax.grad(f, argnums=(0, 1)), x, k)
  assert [p for p in products if p[0] == "convolution"]
  assert all(p[1] != (None, None) for p in products), products


def _rel_err(a, b):
  a, b = (np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in jax.tree.leaves(t)])
          for t in (a, b))
  return np.linalg.norm(a - b) / np.linalg.norm(b)


# ----------------------------------------------------------------------------- the rule


def _site(m=1024, n=1024, k=1024, scope="model/block_0/mlp"):
  return jaxamp.Fp8Site("dot_general", scope, (m, k), (k, n), m, n, k)


def test_the_default_rule_takes_large_aligned_products():
  rule = jaxamp.Fp8Rule()
  assert rule.chooses(_site())
  assert not rule.chooses(_site(m=512))  # small
  assert not rule.chooses(_site(k=1032))  # not a multiple of 16
  assert jaxamp.Fp8Rule(min_dim=1, multiple=1).chooses(_site(3, 5, 7))


def test_exclusions_match_runs_of_scope_names_with_wildcards_and_callables():
  rule = jaxamp.Fp8Rule(exclude=("head", "block_*/attn", lambda site: site.n == 4096))
  assert not rule.chooses(_site(scope="model/head"))
  assert rule.chooses(_site(scope="model/header"))  # whole names only
  assert not rule.chooses(_site(scope="model/block_3/attn/qkv"))
  assert rule.chooses(_site(scope="model/block_3/mlp/attn_like"))
  assert not rule.chooses(_site(n=4096))
  assert jaxamp.Fp8Rule(exclude="head").exclude == ("head",)  # one pattern


@pytest.mark.parametrize("kwargs, error, match", [
    ({"min_dim": 0}, ValueError, "min_dim must be >= 1, got 0"),
    ({"min_dim": 16.0}, TypeError, "min_dim must be an int, got 16.0"),
    ({"multiple": True}, TypeError, "multiple must be an int, got True"),
    ({"exclude": ("a//b",)}, ValueError, "got 'a//b'"),
    ({"exclude": ("",)}, ValueError, "none empty"),
    ({"exclude": (3,)}, TypeError, "scope patterns \\(strings\\) or callables.*got 3"),
    ({"exclude": 3}, TypeError, "must be a sequence.*got 3"),
])
def test_bad_rules_are_refused(kwargs, error, match):
  with pytest.raises(error, match=match):
    jaxamp.Fp8Rule(**kwargs)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, "float8_e4m3fn", "fp8", " FP8 "])
def test_fp8_autocast_is_asked_for_by_dtype_or_name(dtype):
  f = jaxamp.autocast(jnp.matmul, dtype, fp8=SMALL)
  assert f == jaxamp.autocast(jnp.matmul, jnp.float8_e4m3fn, fp8=jaxamp.Fp8Rule(min_dim=16))
  assert "float8_e4m3fn" in repr(f) and "min_dim=16" in repr(f)
  assert any(e.outvars[0].aval.dtype == E4M3 for e, _ in equations(jax.make_jaxpr(f)(X, X).jaxpr))


@pytest.mark.parametrize("dtype, fp8, error, match", [
    (jnp.float8_e5m2, None, ValueError, "dtype must be float16 or bfloat16, got float8_e5m2.*"
     "float8_e4m3fn \\(its gradients are float8_e5m2\\)"),
    (jnp.bfloat16, SMALL, ValueError, "fp8 applies to fp8 autocast.*not to dtype"),
    (jnp.float8_e4m3fn, "small", TypeError, "fp8 must be a jaxamp.Fp8Rule, got 'small'"),
])
def test_bad_fp8_options_are_refused(dtype, fp8, error, match):
  with pytest.raises(error, match=match):
    jaxamp.autocast(jnp.matmul, dtype, fp8=fp8)


def test_with_no_product_chosen_it_is_bfloat16_autocast():
  params = _mlp_params()
  none = jaxamp.autocast(_mlp_loss, jnp.float8_e4m3fn)  # the default rule: all too small
  bf16 = jaxamp.autocast(_mlp_loss, jnp.bfloat16)
  assert str(jax.make_jaxpr(jax.grad(none))(params, X)) == str(
      jax.make_jaxpr(jax.grad(bf16))(params, X))


def test_everything_but_the_chosen_products_runs_as_in_bfloat16_autocast():
  def dtypes(fn):
    return [(e.primitive.name, tuple(str(v.aval.dtype) for v in e.invars))
            for e in jax.make_jaxpr(fn)(_mlp_params(), X).jaxpr.eqns
            if e.primitive.name in ("exp", "reduce_sum", "integer_pow", "add", "tanh")]

  assert dtypes(jaxamp.autocast(_mlp_loss, jnp.float8_e4m3fn, fp8=SMALL)) == dtypes(
      jaxamp.autocast(_mlp_loss, jnp.bfloat16))


# ----------------------------------------------------------------------------- skipped steps


def _train_setup(rule=SMALL, tx=None):
  params = _mlp_params()
  tx = jaxamp.dynamic_loss_scale(_optax.adam(1e-2), init_scale=2.0**10) if tx is None else tx
  loss = jaxamp.autocast(_mlp_loss, jnp.float8_e4m3fn, fp8=rule)

  @jax.jit
  def step(params, opt_state, x):
    grads = jax.grad(lambda p: jaxamp.scale_loss(loss(p, x), opt_state))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return params, tx.init(params), step


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def test_a_non_finite_operand_skips_the_step_bit_identically():
  params, opt_state, step = _train_setup()
  params, opt_state = step(params, opt_state, X)
  for bad in (jnp.inf, jnp.nan):
    new_params, new_state = step(params, opt_state, X.at[3, 5].set(bad))
    assert _bits(new_params) == _bits(params)
    assert _bits(jaxamp.get_loss_scale_state(new_state).inner_state) == _bits(
        jaxamp.get_loss_scale_state(opt_state).inner_state)
    assert float(jaxamp.loss_scale(new_state)) == float(jaxamp.loss_scale(opt_state)) / 2
    params, opt_state = new_params, new_state
  assert int(jaxamp.skipped_steps(opt_state)) == 2
  good_params, _ = step(params, opt_state, X)
  assert _bits(good_params) != _bits(params)


@jax.custom_vjp
def _poison(x):
  """Identity whose backward puts an inf into one element of the cotangent (an overflow)."""
  return x


_poison.defvjp(lambda x: (x, None), lambda _, g: (g.at[0, 0].set(jnp.inf),))


def test_a_gradient_that_overflows_into_a_product_makes_all_its_gradients_nan():
  w, x = _normal(KEYS[0], (32, 32)), X
  f = jaxamp.autocast(lambda w, x: jnp.sum(_poison(x @ w).astype(F32)), jnp.float8_e4m3fn,
                      fp8=SMALL)
  gw, gx = jax.jit(jax.grad(f, argnums=(0, 1)))(w, x)
  assert np.all(np.isnan(gw)) and np.all(np.isnan(gx))
  # In bfloat16 autocast only the rows and columns the inf reaches.
  gw16 = jax.grad(jaxamp.autocast(lambda w, x: jnp.sum(_poison(x @ w).astype(F32)),
                                  jnp.bfloat16))(w, x)
  assert not np.all(~np.isfinite(gw16))


def test_a_gradient_overflow_skips_the_step_bit_identically():
  params = _mlp_params()
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))
  opt_state = tx.init(params)
  loss = jaxamp.autocast(lambda p, x: _mlp_loss(p[1:], _poison(x @ p[0]["w"])),
                         jnp.float8_e4m3fn, fp8=SMALL)
  grads = jax.jit(jax.grad(lambda p: jaxamp.scale_loss(loss(p, X), opt_state)))(params)
  updates, new_state = tx.update(grads, opt_state, params)
  assert _bits(optax.apply_updates(params, updates)) == _bits(params)
  assert int(jaxamp.skipped_steps(new_state)) == 1


def test_a_power_of_two_loss_scale_changes_no_bit_of_the_unscaled_gradients():
  # Current scaling quantizes c * g as c times the quantized g for any power of two c, and
  # bfloat16 has float32's range: fp8 autocast needs no loss scale against underflow.
  params = _mlp_params()
  f = jaxamp.autocast(_mlp_loss, jnp.float8_e4m3fn, fp8=SMALL)
  plain = jax.jit(jax.grad(f))(params, X)
  for scale in (2.0**15, 2.0**-20):
    scaled = jax.jit(jax.grad(lambda p, s: f(p, X) * s))(params, jnp.float32(scale))
    assert _bits(jax.tree.map(lambda g: g / scale, scaled)) == _bits(plain)


# ----------------------------------------------------------------------------- composition


def test_the_train_step_traces_once_and_descends(count_traces):
  params = _mlp_params()
  tx = jaxamp.dynamic_loss_scale(_optax.adam(1e-2), init_scale=2.0**10)

  def step(params, opt_state, x):
    # autocast is called anew in every trace: equal options give an equal (cached) function.
    value, grads = jax.value_and_grad(
        lambda p: jaxamp.scale_loss(jaxamp.autocast(_mlp_loss, jnp.float8_e4m3fn,
                                                    fp8=jaxamp.Fp8Rule(min_dim=16))(p, x),
                                    opt_state))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value / jaxamp.loss_scale(opt_state)

  opt_state = tx.init(params)
  traced, counter = count_traces(step)
  step = jax.jit(traced)
  losses = []
  for _ in range(8):
    params, opt_state, value = step(params, opt_state, X)
    losses.append(float(value))
  assert counter["n"] == 1 and losses[-1] < 0.7 * losses[0], losses


def test_accumulated_micro_steps_apply_the_mean_of_their_fp8_gradients():
  params = _mlp_params()
  loss = jaxamp.autocast(_mlp_loss, jnp.float8_e4m3fn, fp8=SMALL)
  micro = [X[:16], X[16:]]
  tx = jaxamp.accumulate_gradients(jaxamp.dynamic_loss_scale(optax.sgd(0.1)), 2)
  opt_state = tx.init(params)

  @jax.jit
  def step(opt_state, x):
    grads = jax.grad(lambda p: jaxamp.scale_loss(loss(p, x), opt_state))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  for x in micro:
    params_after, opt_state = step(opt_state, x)
  grad = jax.jit(jax.grad(loss))
  mean = jax.tree.map(lambda a, b: (a + b) / 2, *(grad(params, x) for x in micro))
  want = jax.tree.map(lambda p, g: p - 0.1 * g, params, mean)
  for got, ref in zip(jax.tree.leaves(params_after), jax.tree.leaves(want)):
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_microbatching_averages_the_fp8_values_and_gradients_of_its_microbatches():
  params = _mlp_params()
  loss = jaxamp.autocast(_mlp_loss, jnp.float8_e4m3fn, fp8=SMALL)
  value, grads = jax.jit(jaxamp.microbatch_value_and_grad(loss, 2))(params, X)
  # The strided micro-batches; jitted both, as XLA computes bfloat16 elementwise ops with more
  # precision than op-by-op dispatch rounds them to.
  parts = [jax.jit(jax.value_and_grad(loss))(params, x) for x in (X[0::2], X[1::2])]
  np.testing.assert_allclose(value, (parts[0][0] + parts[1][0]) / 2, rtol=1e-6)
  for got, a, b in zip(*(jax.tree.leaves(t) for t in (grads, parts[0][1], parts[1][1]))):
    np.testing.assert_allclose(got, (a + b) / 2, rtol=1e-5, atol=1e-7)


def test_bfloat16_parameters_without_a_master_train_under_fp8_autocast():
  params = jax.tree.map(lambda p: p.astype(BF16), _mlp_params())
  tx = jaxamp.low_precision_params(optax.sgd(0.5))
  opt_state = tx.init(params)
  loss = jaxamp.autocast(_mlp_loss, jnp.float8_e4m3fn, fp8=SMALL)

  @jax.jit
  def step(params, opt_state):
    value, grads = jax.value_and_grad(loss)(params, X.astype(BF16))
    updates, opt_state = tx.update(grads, opt_state, params)
    with jax.numpy_dtype_promotion("standard"):  # float32 updates onto bfloat16 params
      return optax.apply_updates(params, updates), opt_state, value, grads

  first = None
  for _ in range(8):
    params, opt_state, value, grads = step(params, opt_state)
    first = float(value) if first is None else first
  assert all(g.dtype == BF16 for g in jax.tree.leaves(grads))
  assert all(p.dtype == BF16 for p in jax.tree.leaves(params))
  assert float(value) < 0.7 * first


def test_fp8_autocast_inside_and_around_shard_map():
  mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  spec = jax.sharding.PartitionSpec
  params = _mlp_params()

  def local(p, x):
    return lax.pmean(_mlp_loss(p, x), "data")

  sharded = jax.shard_map(local, mesh=mesh, in_specs=(spec(), spec("data")), out_specs=spec())
  want = jax.jit(jax.grad(jaxamp.autocast(_mlp_loss, jnp.float8_e4m3fn, fp8=SMALL)))(params, X)
  for fn in (jaxamp.autocast(sharded, jnp.float8_e4m3fn, fp8=SMALL),
             jax.shard_map(jaxamp.autocast(local, jnp.float8_e4m3fn, fp8=SMALL), mesh=mesh,
                           in_specs=(spec(), spec("data")), out_specs=spec())):
    grads = jax.jit(jax.grad(fn))(params, X)
    assert _bits(grads) == _bits(want)
    assert all(None not in p[1] for p in _products(jax.grad(fn), params, X))


def test_a_custom_jvp_function_keeps_its_products_in_bfloat16_and_differentiates():
  @jax.custom_jvp
  def bilinear(x, w):
    return x @ w

  @bilinear.defjvp
  def _(primals, tangents):
    (x, w), (tx, tw) = primals, tangents
    return x @ w, tx @ w + x @ tw

  f = jaxamp.autocast(lambda w, x: jnp.sum(bilinear(x, w).astype(F32)), jnp.float8_e4m3fn,
                      fp8=SMALL)
  w = _normal(KEYS[0], (32, 32))
  grads = jax.jit(jax.grad(f))(w, X)
  np.testing.assert_allclose(grads, jax.grad(lambda w: jnp.sum(X @ w))(w), rtol=2e-2, atol=0.1)
  assert all(p[1] == (None, None) for p in _products(jax.grad(f), w, X))


def test_forward_mode_through_a_float8_product_is_refused_as_for_any_custom_vjp():
  f = jaxamp.autocast(jnp.matmul, jnp.float8_e4m3fn, fp8=SMALL)
  with pytest.raises(TypeError, match="custom_vjp"):
    jax.jvp(f, (X, X), (X, X))


class Fp8Layers(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.gelu(nn.Dense(32, dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp)(x))
    return nn.Dense(16)(x)


def test_flax_fp8_layers_are_left_as_they_are():
  model = Fp8Layers()
  variables = model.init(KEYS[0], X)

  def loss(v, x):
    return jnp.mean(jnp.square(model.apply(v, x).astype(F32)))

  def quantizations(fn):
    return sum(e.primitive.name == "convert_element_type" and e.params["new_dtype"] == E4M3
               for e, _ in equations(jax.make_jaxpr(fn)(variables, X).jaxpr))

  fp8_fn = jaxamp.autocast(loss, jnp.float8_e4m3fn, fp8=SMALL)
  # Flax's layer quantizes its two operands itself; fp8 autocast adds the plain Dense's two.
  assert quantizations(fp8_fn) == quantizations(jaxamp.autocast(loss, jnp.bfloat16)) + 2
  tx = jaxamp.dynamic_loss_scale(_optax.adam(1e-2))
  state = jaxamp.TrainState.create(apply_fn=model.apply, params=variables, tx=tx)

  @jax.jit
  def step(state):
    value, grads = state.value_and_grad(fp8_fn)(state.params, X)
    return state.apply_gradients(grads=grads), value

  values = []
  for _ in range(6):
    state, value = step(state)
    values.append(float(value))
  assert values[-1] < values[0] and int(state.step) == 6
  history = state.params["_overwrite_with_gradient"]["Dense_0"]["Fp8DirectDotGeneralOp_0"]
  assert float(jnp.max(history["input_amax_history"])) > 0


def test_an_equinox_mlp_traces_its_vmapped_layers_as_batched_products():
  model = eqx.nn.MLP(32, 16, 64, 2, key=KEYS[0])
  params, static = eqx.partition(model, eqx.is_array)

  def loss(params, x):
    return jnp.mean(jnp.square(jax.vmap(eqx.combine(params, static))(x).astype(F32)))

  f = jaxamp.autocast(loss, jnp.float8_e4m3fn, fp8=SMALL)
  products = _products(jax.grad(f), params, X)
  assert sum(p[1] == ("f8e4m3fn", "f8e4m3fn") for p in products) == 3, products
