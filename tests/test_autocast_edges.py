"""Edge cases of autocast's dtype rules, against PyTorch's promotion.

Where an operation's operands end up in float16 and bfloat16 (a float16 autocast region
that meets a bfloat16 tensor), PyTorch promotes to float32
(``torch.promote_types(float16, bfloat16) == float32``); so does autocast, also in a
program that asks for strict dtype promotion (the suite's).
"""

import dataclasses
import functools
import re
import sys
import warnings

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from tests._floats import enable_x64

X = np.array([[1.5, 2.0], [0.25, -1.0]], np.float32)
Y = np.array([[3.0, 0.375], [0.125, 7.0]], np.float32)


def test_a_float16_matmul_meeting_a_bfloat16_tensor_gives_float32():
  f = jaxamp.autocast(lambda x, y: x @ x + y, jnp.float16)
  out = jax.jit(f)(jnp.asarray(X, jnp.bfloat16), jnp.asarray(Y, jnp.bfloat16))
  assert out.dtype == jnp.float32
  want = (X.astype(np.float16) @ X.astype(np.float16)).astype(np.float32) + Y
  np.testing.assert_array_equal(out, want)


def test_a_bfloat16_matmul_meeting_a_float16_tensor_gives_float32():
  f = jaxamp.autocast(lambda x, y: y + x @ x, jnp.bfloat16)
  out = f(jnp.asarray(X, jnp.float16), jnp.asarray(Y, jnp.float16))
  assert out.dtype == jnp.float32
  np.testing.assert_array_equal(out, Y + X @ X)


def test_a_python_scalar_does_not_widen_a_half_precision_result():
  f = jaxamp.autocast(lambda x: x @ x * 0.5 + 1.0, jnp.bfloat16)
  out = f(jnp.asarray(X))
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out, np.float32), (X @ X) * 0.5 + 1.0)


def test_float32_rules_widen_half_precision_inputs():
  # exp runs in float32 under torch.autocast: the float16 input is widened first.
  f = jaxamp.autocast(lambda x: jnp.exp(x @ x), jnp.float16)
  out = f(jnp.asarray(X))
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, np.exp(X @ X), rtol=1e-6)


@jax.custom_vjp
def _mul_sin(x, y):
  return x @ y, jnp.sin(x)


def _mul_sin_fwd(x, y):
  return _mul_sin(x, y), (x, y)  # residuals that are the inputs themselves


def _mul_sin_bwd(res, cts):
  x, y = res
  ct_mul, ct_sin = cts
  return ct_mul @ y.T + ct_sin * jnp.cos(x), x.T @ ct_mul


_mul_sin.defvjp(_mul_sin_fwd, _mul_sin_bwd)


def test_gradients_through_a_custom_vjp_match_the_float32_ones():
  # Only the first output reaches the loss: the rule gets a zero cotangent for the second.
  loss = lambda x, y: jnp.sum(_mul_sin(x, y)[0])
  x, y = jnp.asarray(X), jnp.asarray(Y)
  want = jax.grad(loss, argnums=(0, 1))(x, y)
  got = jax.jit(jax.grad(jaxamp.autocast(loss, jnp.bfloat16), argnums=(0, 1)))(x, y)
  for g, w in zip(got, want):
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2)
  both = lambda x, y: jnp.sum(_mul_sin(x, y)[0]) + jnp.sum(_mul_sin(x, y)[1])
  got = jax.grad(jaxamp.autocast(both, jnp.float16))(x, y)
  np.testing.assert_allclose(got, jax.grad(both)(x, y), rtol=2e-3, atol=2e-3)



@jax.custom_vjp
def _scaled_pair(x, y):
  return x @ y, x * 2.0


def _scaled_pair_fwd(x, y):
  return _scaled_pair(x.value, y.value), (x.value, y.value)


def _scaled_pair_bwd(res, cts):
  x, y = res
  ct_mul, ct_double = cts
  # With symbolic_zeros the rule sees which outputs got no cotangent.
  assert isinstance(ct_double, jax.custom_derivatives.SymbolicZero)
  return ct_mul @ y.T, x.T @ ct_mul


_scaled_pair.defvjp(_scaled_pair_fwd, _scaled_pair_bwd, symbolic_zeros=True)


def test_a_custom_vjp_with_symbolic_zeros_still_sees_them_under_autocast():
  loss = lambda x, y: jnp.sum(_scaled_pair(x, y)[0])
  x, y = jnp.asarray(X), jnp.asarray(Y)
  got = jax.grad(jaxamp.autocast(loss, jnp.bfloat16), argnums=(0, 1))(x, y)
  want = jax.grad(loss, argnums=(0, 1))(x, y)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2)



def test_a_matmul_inside_shard_map_is_cast_like_one_outside():
  mesh = jax.make_mesh((1,), ("d",))
  spec = jax.sharding.PartitionSpec()

  def f(x, y):
    return jax.shard_map(lambda a, b: a @ b, mesh=mesh, in_specs=(spec, spec), out_specs=spec)(x, y)

  out = jax.jit(jaxamp.autocast(f, jnp.float16))(jnp.asarray(X), jnp.asarray(Y))
  assert out.dtype == jnp.float16
  np.testing.assert_array_equal(out, X.astype(np.float16) @ Y.astype(np.float16))


def _batch_norm():
  from flax import nnx
  return nnx.BatchNorm(2, momentum=0.5, rngs=nnx.Rngs(0))


XB = jnp.array([[1.0, 2.0], [3.0, 6.0]])


def test_an_nnx_module_under_autocast_updates_its_statistics_as_without_it():
  reference = _batch_norm()
  reference(XB)
  model = _batch_norm()
  jaxamp.autocast(model, jnp.bfloat16)(XB)
  np.testing.assert_array_equal(model.mean[...], reference.mean[...])


def test_a_partial_bound_to_an_nnx_module_updates_its_statistics_as_without_it():
  import functools
  reference = _batch_norm()
  reference(XB)
  model = _batch_norm()
  jaxamp.autocast(functools.partial(lambda m, x: m(x), model), jnp.bfloat16)(XB)
  np.testing.assert_array_equal(model.mean[...], reference.mean[...])


def _loss_a(p, x):
  return jnp.sum(p * x)


def _loss_b(p, x):
  return jnp.sum(p * x) + 1.0


def test_mixed_precision_wrappers_are_the_same_static_argument_only_for_the_same_two():
  traces = []

  @functools.partial(jax.jit, static_argnums=0)
  def run(fn, p, x):
    traces.append(fn)
    return fn(p, x)

  p, x = jnp.ones(2), jnp.ones(2)
  assert float(run(jaxamp.mixed_precision(_loss_a, "c=f16"), p, x)) == 2.0
  assert float(run(jaxamp.mixed_precision(_loss_a, "c=f16"), p, x)) == 2.0
  assert len(traces) == 1  # built anew, the same wrapper: no retrace
  assert float(run(jaxamp.mixed_precision(_loss_b, "c=f16"), p, x)) == 3.0  # another function
  assert run(jaxamp.mixed_precision(_loss_a, "c=bf16"), p, x).dtype == jnp.float32
  assert len(traces) == 3  # another policy
  wrapped = jaxamp.mixed_precision(_loss_a, "c=f16")
  assert wrapped == jaxamp.mixed_precision(_loss_a, "c=f16")
  assert hash(wrapped) == hash(jaxamp.mixed_precision(_loss_a, "c=f16"))
  assert wrapped != jaxamp.mixed_precision(_loss_b, "c=f16")
  assert wrapped != jaxamp.mixed_precision(_loss_a, "c=bf16")
  assert wrapped != _loss_a and wrapped != "c=f16"
  # Distinct wrappers hash apart, so a cache keyed by them does not degrade to a list.
  fns = [_loss_a, _loss_b, jnp.sum, jnp.mean]
  assert len({hash(jaxamp.mixed_precision(fn, "c=f16")) for fn in fns}) > 1


# ---- autocast as a method decorator


class _Scaled:
  """A plain Python layer: its scale is a static attribute read by the method."""

  def __init__(self, scale):
    self.scale = scale

  @jaxamp.autocast
  def apply(self, x, w):
    return (x @ w) * self.scale


def test_autocast_decorates_a_method_and_binds_the_instance():
  x, w = jnp.asarray(X), jnp.asarray(Y)
  layer = _Scaled(0.5)
  want = jaxamp.autocast(lambda x, w: (x @ w) * 0.5)(x, w)
  for out in (layer.apply(x, w),  # bound: the instance is the first argument
              _Scaled.apply(layer, x, w)):  # through the class: passed by hand, as for a function
    assert out.dtype == jnp.float16
    np.testing.assert_array_equal(out, want)
  np.testing.assert_array_equal(_Scaled(2.0).apply(x, w), want * 4)


def test_an_autocast_method_of_an_equinox_module_gives_float32_gradients():
  import equinox as eqx

  class Dense(eqx.Module):
    w: jax.Array

    @jaxamp.autocast
    def __call__(self, x):
      return jnp.tanh(x @ self.w)

  def loss(model, x):
    return jnp.sum(model(x).astype(jnp.float32))

  model, x = Dense(jnp.asarray(Y)), jnp.asarray(X)
  assert model(x).dtype == jnp.float16
  grads = jax.grad(loss)(model, x)
  want = jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w)))(model.w, x)
  assert grads.w.dtype == jnp.float32
  np.testing.assert_allclose(grads.w, want, rtol=1e-2, atol=1e-2)


# ---- a step that differentiates a rematerialized scan (a closed_call in its program)


def _rnn_loss(w, xs):
  def cell(h, x):
    h = jnp.tanh(h @ w + x)
    return h, h

  _, hs = jax.lax.scan(cell, jnp.zeros(xs.shape[1:]), xs)
  return jnp.mean(hs ** 2)


def test_autocast_of_a_step_that_differentiates_a_checkpointed_scan():
  # jax.grad of a jax.checkpoint around a scan splits the scan: its forward part is a
  # closed_call, which autocast enters like the rest of the program.
  step = lambda w, xs: jax.value_and_grad(jax.checkpoint(_rnn_loss))(w, xs)
  rng = np.random.RandomState(0)
  w = jnp.asarray(rng.randn(4, 4) / 2, jnp.float32)
  xs = jnp.asarray(rng.randn(5, 2, 4), jnp.float32)
  loss, grad = jaxamp.autocast(step)(w, xs)
  want_loss, want_grad = jax.jit(step)(w, xs)
  assert loss.dtype == grad.dtype == jnp.float32
  # The forward pass is the autocast loss's: its matmuls run in float16.
  np.testing.assert_allclose(loss, jaxamp.autocast(_rnn_loss)(w, xs), rtol=1e-6)
  assert abs(float(loss) - float(want_loss)) > 1e-6
  np.testing.assert_allclose(grad, want_grad, rtol=2e-2, atol=2e-3)


# ---- custom_jvp rules that declare an output's tangent zero


@jax.custom_jvp
def _softsign_and_rounded(h):
  return h / (1 + jnp.abs(h)), jnp.round(h)


def _softsign_and_rounded_jvp(primals, tangents):
  (h,), (th,) = primals, tangents
  # Rounding is a step function: the rule says its tangent is zero, symbolically.
  out = _softsign_and_rounded(h)
  zero = jax.custom_derivatives.zero_from_primal(out[1], symbolic_zeros=True)
  return out, (th / (1 + jnp.abs(h)) ** 2, zero)


_softsign_and_rounded.defjvp(_softsign_and_rounded_jvp, symbolic_zeros=True)


def test_a_custom_jvp_output_with_a_symbolic_zero_tangent_keeps_its_half_precision_dtype():
  f = lambda x, w: _softsign_and_rounded(x @ w)
  x, w = jnp.asarray(X), jnp.asarray(Y)
  (soft, rounded), (t_soft, t_rounded) = jax.jvp(jaxamp.autocast(f), (x, w), (x, w))
  (_, want_rounded), (want_t, _) = jax.jit(lambda *a: jax.jvp(f, a, a))(x, w)
  # The function's outputs are float16 (it runs on a float16 product); so are their tangents.
  assert soft.dtype == rounded.dtype == t_soft.dtype == t_rounded.dtype == jnp.float16
  np.testing.assert_array_equal(rounded, want_rounded)
  np.testing.assert_array_equal(t_rounded, np.zeros_like(X))
  np.testing.assert_allclose(t_soft, want_t, rtol=1e-2, atol=1e-3)
  loss = lambda x, w: jnp.sum(f(x, w)[0] * f(x, w)[1])
  got = jax.grad(jaxamp.autocast(loss))(x, w)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, jax.jit(jax.grad(loss))(x, w), rtol=1e-2, atol=1e-3)


@jax.custom_jvp
def _clip_and_count(x, limit):
  clipped = jnp.clip(x, -limit, limit)
  return clipped, jnp.sum(jnp.abs(x) > limit, axis=-1, dtype=jnp.int32)


def _clip_and_count_jvp(primals, tangents):
  (x, limit), (tx, _) = primals, tangents
  clipped, count = _clip_and_count(x, limit)
  t_clipped = jnp.where(jnp.abs(x) > limit, jnp.zeros_like(tx), tx)
  return (clipped, count), (t_clipped, jax.custom_derivatives.zero_from_primal(
      count, symbolic_zeros=True))


_clip_and_count.defjvp(_clip_and_count_jvp, symbolic_zeros=True)


def test_a_custom_jvp_integer_output_gets_a_float0_tangent_under_autocast():
  def f(x, w):
    return _clip_and_count(x @ w, 2.0)

  x, w = jnp.asarray(X), jnp.asarray(Y)
  (clipped, count), (t_clipped, t_count) = jax.jvp(jaxamp.autocast(f), (x, w), (x, w))
  (_, want_count), (want_t, _) = jax.jit(lambda *a: jax.jvp(f, a, a))(x, w)
  assert count.dtype == jnp.int32 and t_clipped.dtype == clipped.dtype
  np.testing.assert_array_equal(count, want_count)
  assert t_count.dtype == jax.dtypes.float0 and t_count.shape == count.shape
  np.testing.assert_allclose(t_clipped, want_t, rtol=2e-3)
  loss = lambda x, w: jnp.sum(f(x, w)[0])
  np.testing.assert_allclose(jax.grad(jaxamp.autocast(loss))(x, w),
                             jax.jit(jax.grad(loss))(x, w), rtol=1e-2)


# ---- custom_vjp patterns


@jax.custom_vjp
def _sin_times(x, h):
  return jnp.sin(x) * h


def _sin_times_fwd(x, h):
  # Two residuals computed here, and one that is an input (h).
  return _sin_times(x, h), (jnp.cos(x), jnp.sin(x), h)


def _sin_times_bwd(res, g):
  cos_x, sin_x, h = res
  return cos_x * g * h, sin_x * g


_sin_times.defvjp(_sin_times_fwd, _sin_times_bwd)


def test_a_custom_vjp_with_computed_residuals_gives_the_autocast_value_and_float32_gradients():
  # h is a float16 product under autocast: the backward rule still gets it at float32,
  # the dtype it was traced with, like its other residuals and the cotangent.
  loss = lambda x, w: jnp.sum(_sin_times(x, x @ w))
  x, w = jnp.asarray(X), jnp.asarray(Y)
  value, grads = jax.value_and_grad(jaxamp.autocast(loss), argnums=(0, 1))(x, w)
  np.testing.assert_array_equal(value, jaxamp.autocast(loss)(x, w))
  want = jax.grad(loss, argnums=(0, 1))(x, w)
  for g, r in zip(grads, want):
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, r, rtol=1e-2, atol=1e-2)


@jax.custom_vjp
def _tanh(h):
  return jnp.tanh(h)


def _tanh_fwd(h):
  # The same function by another formula (its float32 sigmoid kept for the backward rule).
  s = jax.nn.sigmoid(2 * h)
  return 2 * s - 1, s


def _tanh_bwd(s, g):
  return (g * 4 * s * (1 - s),)


_tanh.defvjp(_tanh_fwd, _tanh_bwd)


def test_a_custom_vjp_forward_rule_returns_the_dtype_the_function_returns():
  f = lambda x, w: _tanh(x @ w)
  x, w = jnp.asarray(X) / 4, jnp.asarray(Y) / 4
  out, vjp = jax.vjp(jaxamp.autocast(f), x, w)
  assert out.dtype == jaxamp.autocast(f)(x, w).dtype == jnp.float16
  np.testing.assert_allclose(out, np.tanh((X / 4) @ (Y / 4)), rtol=2e-3, atol=2e-3)
  grads = vjp(jnp.ones_like(out))
  want = jax.vjp(f, x, w)[1](jnp.ones((2, 2)))
  for g, r in zip(grads, want):
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, r, rtol=1e-2, atol=1e-3)


@jax.custom_vjp
def _matmul_and_double(x, y):
  return x @ y, x * 2.0


def _matmul_and_double_fwd(x, y):
  return _matmul_and_double(x.value, y.value), (x.value, y.value)


def _matmul_and_double_bwd(res, cts):
  x, y = res
  ct_mul, ct_double = cts
  # A rule written for symbolic zeros that makes arrays of them where it needs arrays.
  if isinstance(ct_double, jax.custom_derivatives.SymbolicZero):
    ct_double = jnp.zeros(ct_double.shape, ct_double.dtype)
  return ct_mul @ y.T + 2.0 * ct_double, x.T @ ct_mul


_matmul_and_double.defvjp(_matmul_and_double_fwd, _matmul_and_double_bwd, symbolic_zeros=True)


def test_a_symbolic_zero_cotangent_has_the_shape_and_dtype_of_its_output():
  loss = lambda x, y: jnp.sum(_matmul_and_double(x, y)[0])
  x, y = jnp.asarray(X), jnp.asarray(Y)
  got = jax.grad(jaxamp.autocast(loss, jnp.bfloat16), argnums=(0, 1))(x, y)
  want = jax.grad(loss, argnums=(0, 1))(x, y)
  for g, w in zip(got, want):
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2)


@jax.custom_vjp
def _tempered(x, temperature):
  return x / temperature


def _tempered_fwd(x, temperature):
  return _tempered(x, temperature), temperature


def _tempered_bwd(temperature, g):
  return g / temperature, None  # the temperature is a float input the rule does not differentiate


_tempered.defvjp(_tempered_fwd, _tempered_bwd)


def test_a_custom_vjp_rule_may_return_none_for_a_float_input():
  loss = lambda x, w, t: jnp.sum(jax.nn.log_softmax(_tempered(x @ w, t)))
  x, w, t = jnp.asarray(X), jnp.asarray(Y), jnp.float32(2.0)
  got = jax.grad(jaxamp.autocast(loss), argnums=(1, 2))(x, w, t)
  want = jax.jit(jax.grad(loss, argnums=(1, 2)))(x, w, t)
  assert got[0].dtype == got[1].dtype == jnp.float32
  np.testing.assert_allclose(got[0], want[0], rtol=1e-2, atol=1e-2)
  assert float(got[1]) == float(want[1]) == 0.0


class _Named:
  """Something with a name that is not a primitive's (a primitive's is a non-empty str)."""

  def __init__(self, name):
    self.name = name


def test_an_override_key_with_an_empty_or_non_string_name_is_refused():
  f = lambda x: x @ x
  for key in (_Named(""), _Named(b"dot_general")):
    with pytest.raises(TypeError, match="overrides keys must be primitive names"):
      jaxamp.autocast(f, overrides={key: "off"})
  assert jaxamp.autocast(f, overrides={jax.lax.dot_general_p: "off"})(X).dtype == jnp.float32


def _ring_sum(s, axis, n):
  """The sum of ``s`` over the ``n`` shards of ``axis``, passed round a ring by ppermute."""
  total = s
  for shift in range(1, n):
    total = total + jax.lax.ppermute(s, axis, [(i, (i + shift) % n) for i in range(n)])
  return total


def test_a_shard_map_without_varying_checks_keeps_them_off_under_autocast():
  # A sum by ppermute is the same on every shard, but only the program knows it: the
  # shard_map turns off the check that its output does not vary, and autocast keeps it off.
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  spec = jax.sharding.PartitionSpec

  def f(x, w):
    body = lambda x, w: _ring_sum(jnp.sum(x @ w, axis=0), "d", n)
    return jax.shard_map(body, mesh=mesh, in_specs=(spec("d"), spec()), out_specs=spec(),
                         check_vma=False)(x, w)

  x, w = jnp.tile(jnp.asarray(X), (n, 1)), jnp.asarray(Y)
  out = jax.jit(jaxamp.autocast(f))(x, w)
  assert out.dtype == jnp.float32  # a float16 product, summed in float32
  want = n * np.sum((X.astype(np.float16) @ Y.astype(np.float16)).astype(np.float32), axis=0)
  np.testing.assert_allclose(out, want, rtol=1e-6)


def test_a_shard_map_over_some_axes_leaves_the_others_to_the_compiler_under_autocast():
  # Manual over 'data' only: the body may constrain the sharding of 'model', an axis
  # that stays automatic inside it (and cannot be constrained where it is manual).
  n = jax.device_count()
  shape = (n // 2, 2) if n > 1 else (1, 1)
  mesh = jax.make_mesh(shape, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  spec = jax.sharding.PartitionSpec

  def body(x, w):
    return jax.lax.with_sharding_constraint(x @ w, spec(None, "model"))

  def f(x, w):
    return jax.shard_map(body, mesh=mesh, in_specs=(spec("data"), spec()),
                         out_specs=spec("data"), axis_names={"data"})(x, w)

  x, w = jnp.tile(jnp.asarray(X), (shape[0], 1)), jnp.asarray(Y)
  with jax.set_mesh(mesh):
    out = jax.jit(jaxamp.autocast(f))(x, w)
  assert out.dtype == jnp.float16
  np.testing.assert_array_equal(out, np.tile(X.astype(np.float16) @ Y.astype(np.float16),
                                             (shape[0], 1)))


def test_a_data_parallel_mean_in_shard_map_differentiates_under_autocast():
  # The shard_map checks which values vary across shards (the default); pmean makes the
  # local losses one, and its gradient goes back to each shard.
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  spec = jax.sharding.PartitionSpec

  def local_loss(w, x):
    return jax.lax.pmean(jnp.mean(jnp.tanh(x @ w) ** 2), "data")

  loss = jax.shard_map(local_loss, mesh=mesh, in_specs=(spec(), spec("data")), out_specs=spec())
  w, x = jnp.asarray(Y) / 4, jnp.tile(jnp.asarray(X), (n, 1))
  value, grad = jax.value_and_grad(jaxamp.autocast(loss))(w, x)
  want_value, want_grad = jax.jit(jax.value_and_grad(loss))(w, x)
  assert value.dtype == grad.dtype == jnp.float32
  np.testing.assert_allclose(value, want_value, rtol=1e-2)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-2, atol=1e-3)


@jax.custom_vjp
def _clamp_and_count(x):
  return jnp.clip(x, -1.0, 1.0), jnp.sum(jnp.abs(x) > 1.0, dtype=jnp.int32)


def _clamp_and_count_fwd(x):
  return _clamp_and_count(x), x


def _clamp_and_count_bwd(x, cts):
  g, _ = cts  # the count's cotangent: float0, like every integer output's
  return (jnp.where(jnp.abs(x) > 1.0, jnp.zeros_like(g), g),)


_clamp_and_count.defvjp(_clamp_and_count_fwd, _clamp_and_count_bwd)


def test_a_custom_vjp_with_an_integer_output_differentiates_under_autocast():
  def loss(x, w):
    clipped, count = _clamp_and_count(x @ w)
    return jnp.sum(clipped) + count.astype(jnp.float32)

  x, w = jnp.asarray(X), jnp.asarray(Y) / 4
  got = jax.grad(jaxamp.autocast(loss), argnums=(0, 1))(x, w)
  want = jax.grad(loss, argnums=(0, 1))(x, w)
  for g, r in zip(got, want):
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, r, rtol=1e-2, atol=1e-3)


@jax.custom_jvp
def _sin_and_floor(x):
  return jnp.sin(x), jnp.floor(x).astype(jnp.int32)


@_sin_and_floor.defjvp
def _sin_and_floor_jvp(primals, tangents):
  (x,), (tx,) = primals, tangents
  # An integer output's tangent is float0 zeros, as JAX asks of a rule without symbolic zeros.
  return _sin_and_floor(x), (jnp.cos(x) * tx, np.zeros(x.shape, jax.dtypes.float0))


def test_a_custom_jvp_rule_returning_float0_for_an_integer_output_runs_under_autocast():
  f = lambda x, w: _sin_and_floor(x @ w)
  x, w = jnp.asarray(X), jnp.asarray(Y) / 4
  (_, floor), (t_sin, t_floor) = jax.jvp(jaxamp.autocast(f), (x, w), (x, w))
  (_, want_floor), (want_t, _) = jax.jit(lambda *a: jax.jvp(f, a, a))(x, w)
  np.testing.assert_array_equal(floor, want_floor)
  assert t_floor.dtype == jax.dtypes.float0 and t_floor.shape == floor.shape
  np.testing.assert_allclose(t_sin, want_t, rtol=1e-2, atol=1e-3)
  loss = lambda x, w: jnp.sum(f(x, w)[0])
  np.testing.assert_allclose(jax.grad(jaxamp.autocast(loss))(x, w),
                             jax.jit(jax.grad(loss))(x, w), rtol=1e-2, atol=1e-3)


@jax.custom_jvp
def _complex_square(z):
  return z * z


@_complex_square.defjvp
def _complex_square_jvp(primals, tangents):
  (z,), (tz,) = primals, tangents
  return _complex_square(z), 2 * z * tz


def test_a_custom_jvp_on_complex_values_keeps_their_tangents_under_autocast():
  z = jnp.asarray(X[0] + 1j * Y[0], jnp.complex64)
  got = jax.jvp(jaxamp.autocast(_complex_square), (z,), (z,))
  want = jax.jvp(_complex_square, (z,), (z,))
  for g, r in zip(got, want):
    assert g.dtype == jnp.complex64
    np.testing.assert_allclose(g, r, rtol=1e-6)


class _Normed:
  """A module whose method updates batch statistics (a bound method is the function)."""

  def __init__(self):
    self.norm = _batch_norm()

  def forward(self, x, *, shift=0.0):
    return self.norm(x) + shift


def _normed():
  from flax import nnx
  return type("Normed", (_Normed, nnx.Module), {})()


def test_an_autocast_bound_method_of_an_nnx_module_updates_its_statistics_as_without_it():
  reference = _normed()
  want = reference.forward(XB, shift=1.0)
  model = _normed()
  got = jaxamp.autocast(model.forward, jnp.bfloat16)(XB, shift=1.0)
  np.testing.assert_allclose(got, want, rtol=1e-2)
  np.testing.assert_array_equal(model.norm.mean[...], reference.norm.mean[...])


def test_an_nnx_function_with_keyword_arguments_and_its_trace_cached():
  model, calls = _batch_norm(), []

  def loss(m, x, *, weight):
    calls.append(None)
    return jnp.sum(m(x)) * weight

  f = jaxamp.autocast(loss, jnp.bfloat16)
  reference = _batch_norm()
  for _ in range(2):
    np.testing.assert_allclose(f(model, XB, weight=2.0), loss(reference, XB, weight=2.0),
                               rtol=1e-2, atol=1e-2)
  np.testing.assert_array_equal(model.mean[...], reference.mean[...])
  assert len(calls) == 3  # traced once under autocast (the third is the reference's)


def test_autocast_of_a_builtin_function_with_nnx_imported():
  import operator

  from flax import nnx  # noqa: F401  (autocast looks for NNX objects once it is imported)
  out = jaxamp.autocast(operator.matmul)(jnp.asarray(X), jnp.asarray(Y))
  assert out.dtype == jnp.float16
  np.testing.assert_array_equal(out, X.astype(np.float16) @ Y.astype(np.float16))


def test_autocast_of_a_partial_without_nnx_objects_with_nnx_imported():
  from flax import nnx  # noqa: F401
  f = jaxamp.autocast(functools.partial(jnp.matmul, jnp.asarray(X)), jnp.bfloat16)
  out = f(jnp.asarray(Y))
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(out, (jnp.asarray(X, jnp.bfloat16) @ jnp.asarray(Y, jnp.bfloat16)))


def _linear():
  from flax import nnx
  return nnx.Linear(2, 2, rngs=nnx.Rngs(0))


def test_a_function_closing_over_an_nnx_module_is_refused_with_the_remedy():
  model = _linear()
  with pytest.raises(ValueError, match=r"^autocast\('<lambda>'\) reads the NNX object Linear "
                     r"from outside its arguments: .*Pass it as an argument instead"):
    jaxamp.autocast(lambda x: model(x))(XB)


def test_a_closed_over_nnx_module_is_refused_after_an_unset_closure_variable():
  model = _linear()

  def loss(x, verbose=False):
    if verbose:
      a_report(x)
    return jnp.sum(model(x))

  with pytest.raises(ValueError, match=r"^autocast\('loss'\) reads the NNX object Linear"):
    jaxamp.autocast(loss)(XB)

  def a_report(x):  # bound after the call: an empty closure cell, before model's
    return x


_GLOBAL_MODEL = None


def _reads_the_global_model(x):
  return jnp.sum(_GLOBAL_MODEL(x))


def test_a_function_reading_an_nnx_module_from_its_globals_is_refused():
  global _GLOBAL_MODEL
  _GLOBAL_MODEL = _linear()
  try:
    with pytest.raises(ValueError, match=r"^autocast\('_reads_the_global_model'\) reads the "
                       r"NNX object Linear from outside its arguments"):
      jaxamp.autocast(_reads_the_global_model)(XB)
  finally:
    _GLOBAL_MODEL = None


def _returns_the_module(m, x, scale=1.0):
  return m, x * scale


def test_a_function_returning_an_nnx_module_is_refused_naming_it():
  with pytest.raises(ValueError, match=r"^_returns_the_module returns an NNX object; under "
                     r"jaxamp.autocast a function may update"):
    jaxamp.autocast(_returns_the_module)(_linear(), XB)
  with pytest.raises(ValueError, match=r"^partial returns an NNX object"):
    jaxamp.autocast(functools.partial(_returns_the_module, scale=2.0))(_linear(), XB)
  with pytest.raises(ValueError, match=r"^<lambda> returns an NNX object"):
    jaxamp.autocast(lambda x, m: [(x, {"m": m})])(XB, _linear())


def _nested_jits(jaxpr, found):
  """(name, keep_unused, inline, in_shardings, out_shardings) of the jit calls in a jaxpr."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("jit", "pjit"):
      p = eqn.params
      found.append((p["name"], p["keep_unused"], p["inline"], p["in_shardings"],
                    p["out_shardings"]))
      _nested_jits(p["jaxpr"].jaxpr, found)
  return found


def test_inner_jits_keep_their_shardings_and_options_under_autocast():
  from jax.sharding import NamedSharding, PartitionSpec

  rows = NamedSharding(jax.make_mesh((1,), ("rows",)), PartitionSpec("rows"))

  def gram(x, unused):
    return x @ x

  def f(x, y):
    kept = jax.jit(gram, in_shardings=(rows, None), out_shardings=rows, keep_unused=True)
    doubled = jax.jit(lambda a: a * 2.0, out_shardings=rows, inline=True)(x)
    return kept(x, y) + jax.jit(jnp.tanh)(doubled)

  x = jnp.asarray(X)
  want = _nested_jits(jax.make_jaxpr(f)(x, x).jaxpr, [])
  got = _nested_jits(jax.make_jaxpr(jaxamp.autocast(f))(x, x).jaxpr, [])
  assert got == want
  out = jax.jit(jaxamp.autocast(f))(x, x)
  np.testing.assert_allclose(out, f(x, x), rtol=1e-2)
  np.testing.assert_allclose(jaxamp.autocast(f)(x, x), out)  # eager: through the cached jit
  assert out.sharding.is_equivalent_to(jax.jit(f)(x, x).sharding, 2)


def test_autocast_binds_into_the_callers_trace_under_its_name():
  # Under a trace the cast equations join the caller's trace (a nested jit would make grad
  # trace them again to differentiate, partially evaluate and transpose them), named as a jit
  # would name them.
  def loss(w, x):
    return jnp.sum(jnp.tanh(x @ w))

  w, x = jnp.asarray(X), jnp.asarray(XB)
  cast = jaxamp.autocast(loss)
  jaxpr = jax.make_jaxpr(jax.grad(cast))(w, x).jaxpr
  assert not any(e.primitive.name in ("jit", "pjit") for e in jaxpr.eqns)
  assert "autocast_loss" in jax.jit(jax.grad(cast)).lower(w, x).as_text(debug_info=True)
  assert cast(w, x).dtype == jnp.float32
  np.testing.assert_allclose(jax.grad(cast)(w, x), jax.grad(loss)(w, x), rtol=2e-2, atol=1e-3)


def test_a_python_bool_predicate_selects_under_autocast():
  f = lambda x: jax.lax.select_n(True, x, x @ x)
  out = jaxamp.autocast(f)(jnp.asarray(X))
  assert out.dtype == jnp.float32  # float32 x meets the float16 product: the widest
  np.testing.assert_array_equal(out, (X.astype(np.float16) @ X.astype(np.float16)).astype(np.float32))


def test_a_weakly_typed_value_computed_in_the_function_does_not_widen_a_half_result():
  # jnp.sqrt(n * 4.0) is weakly typed, as a Python scalar is: lax.div keeps x @ x's float16.
  def f(x, n):
    return jax.lax.div(x @ x, jnp.sqrt(n * 4.0))

  for n in (1.0, 1):
    out = jax.jit(jaxamp.autocast(f), static_argnums=1)(jnp.asarray(X), n)
    assert out.dtype == jnp.float16
    np.testing.assert_array_equal(out, X.astype(np.float16) @ X.astype(np.float16) / 2)


def _structured(jaxpr, found):
  """The options of the checkpoint, scan and shard_map calls in a jaxpr, through jit calls."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("remat2", "checkpoint", "scan", "shard_map"):
      found.append((eqn.primitive.name,
                    {k: v for k, v in eqn.params.items() if "jaxpr" not in k}))
    if eqn.primitive.name in ("jit", "pjit"):
      _structured(eqn.params["jaxpr"].jaxpr, found)
  return found


def test_checkpoint_scan_and_shard_map_keep_their_options_under_autocast():
  from jax.sharding import PartitionSpec

  # Auto axes: over make_mesh's default Explicit ones, jax 0.12's shard_map refuses in_specs
  # that do not match the input's sharding.
  mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

  def f(x):
    y = jax.checkpoint(lambda a: jnp.sin(a @ a), prevent_cse=False,
                       policy=jax.checkpoint_policies.dots_saveable)(x)
    c, _ = jax.lax.scan(lambda c, _: (c @ c, None), y, length=4, unroll=2)
    return jax.shard_map(lambda a: a @ a, mesh=mesh, in_specs=PartitionSpec("data"),
                         out_specs=PartitionSpec("data"), axis_names={"data"},
                         check_vma=False)(c)

  x = jnp.asarray(X) / 4
  want = _structured(jax.make_jaxpr(f)(x).jaxpr, [])
  assert [name for name, _ in want] == ["remat2", "scan", "shard_map"]
  assert _structured(jax.make_jaxpr(jaxamp.autocast(f))(x).jaxpr, []) == want
  np.testing.assert_allclose(jaxamp.autocast(f, jnp.bfloat16)(x), jax.jit(f)(x), rtol=5e-2,
                             atol=1e-3)


@pytest.mark.parametrize("int_dtype", [jnp.int8, jnp.int16])
def test_a_matmul_with_integer_weights_casts_only_its_floating_input(int_dtype):
  # Quantized weights: integers are never cast, and the product returns the low dtype.
  w = np.array([[1, -2], [3, 4]], int_dtype)
  f = lambda x, w: jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())),
                                       preferred_element_type=jnp.float32)
  out = jaxamp.autocast(f)(jnp.asarray(X), jnp.asarray(w))
  assert out.dtype == jnp.float16
  np.testing.assert_array_equal(out, (X.astype(np.float16) @ w.astype(np.float16)))


def _dots(jaxpr, found):
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      found.append((eqn.params["preferred_element_type"], [v.aval.dtype for v in eqn.invars]))
    if eqn.primitive.name in ("jit", "pjit"):
      _dots(eqn.params["jaxpr"].jaxpr, found)
  return found


def test_a_matmul_under_autocast_is_the_one_jnp_emits_for_float16_operands():
  f = lambda x, y: x @ y
  x = jnp.asarray(X)
  want = _dots(jax.make_jaxpr(f)(x.astype(jnp.float16), x.astype(jnp.float16)).jaxpr, [])
  assert _dots(jax.make_jaxpr(jaxamp.autocast(f))(x, x).jaxpr, []) == want


# ---- integer and complex operands beside floating ones


def _rows_times_two(symbolic_zeros):
  """A custom_jvp gather whose rule records the tangent it is given for the indices."""
  seen = set()

  @jax.custom_jvp
  def rows(table, idx):
    return table[idx] * 2

  def rows_jvp(primals, tangents):
    (table, idx), (t_table, t_idx) = primals, tangents
    seen.add((isinstance(t_idx, jax.custom_derivatives.SymbolicZero), jnp.dtype(t_idx.dtype)))
    return rows(table, idx), t_table[idx] * 2

  rows.defjvp(rows_jvp, symbolic_zeros=symbolic_zeros)
  return rows, seen


@pytest.mark.parametrize("symbolic_zeros", [False, True])
def test_a_custom_jvp_rule_gets_an_integer_inputs_tangent_as_it_would_without_autocast(
    symbolic_zeros):
  # JAX gives a rule float0 zeros for an integer input, or a symbolic zero if it asked for them.
  rows, seen = _rows_times_two(symbolic_zeros)
  idx = jnp.array([1, 0, 1])
  f = lambda x, w: rows(x @ w, idx)
  x, w = jnp.asarray(X), jnp.asarray(Y)
  _, want_t = jax.jvp(f, (x, w), (x, w))
  want = set(seen)
  seen.clear()
  _, t = jax.jvp(jaxamp.autocast(f), (x, w), (x, w))
  assert want == {(symbolic_zeros, jnp.dtype(jax.dtypes.float0))}
  assert seen == want
  assert t.dtype == jnp.float16
  np.testing.assert_allclose(t, want_t, rtol=1e-2, atol=1e-2)


def test_a_matmul_of_a_complex_operand_with_a_real_one_stays_complex():
  # lax.dot_general takes mixed operands; autocast halves the real one and keeps the complex.
  z = jnp.asarray(np.array([[1 + 2j, 3j], [0.5, -1j]], np.complex64))
  matmul = lambda z, w: lax.dot_general(z, w, (((1,), (0,)), ((), ())),
                                        preferred_element_type=jnp.complex64)
  got = jaxamp.autocast(matmul)(z, jnp.asarray(Y))
  assert got.dtype == jnp.complex64
  np.testing.assert_array_equal(got, matmul(z, jnp.asarray(Y, jnp.float16)))


# ---- constructs autocast leaves at their traced dtypes


def test_a_control_flow_primitive_turned_off_runs_at_its_traced_dtypes_without_a_warning():
  def f(x, w):
    def body(h, _):
      return jnp.tanh(h @ w), None
    return lax.scan(body, x, None, length=3)[0]

  x, w = jnp.asarray(X), jnp.asarray(Y) / 8
  want = jax.jit(f)(x, w)
  # Autocast runs the body's products in float16 (the carry keeps its float32 type).
  assert not np.array_equal(jaxamp.autocast(f)(x, w), want)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # an 'off' override says it is meant: no warning
    off = jaxamp.autocast(f, overrides={"scan": "off"})(x, w)
  assert off.dtype == jnp.float32
  np.testing.assert_array_equal(off, want)


def test_a_custom_jvp_closing_over_a_traced_value_warns_and_runs_at_its_traced_dtypes():
  def f(x, w):
    @jax.custom_jvp
    def project(a):
      return a @ w  # w is a traced value of the enclosing function

    project.defjvp(lambda primals, tangents: (project(*primals), tangents[0] @ w))
    return project(x)

  x, w = jnp.asarray(X), jnp.asarray(Y)
  with pytest.warns(jaxamp.AutocastWarning,
                    match=r"cannot interpret 'custom_jvp_call' \(a custom_jvp function that "
                          r"closes over traced values"):
    got = jaxamp.autocast(f)(x, w)
  assert got.dtype == jnp.float32
  np.testing.assert_array_equal(got, jax.jit(f)(x, w))


def test_a_primitive_with_a_body_autocast_does_not_know_warns_and_runs_at_its_traced_dtypes():
  def f(x, w):  # lax.reduce with a computation that is no monoid: the 'reduce' primitive
    return lax.reduce(x @ w, 0.0, lambda a, b: a + jnp.abs(b), (1,))

  x, w = jnp.asarray(X), jnp.asarray(Y)
  with pytest.warns(jaxamp.AutocastWarning,
                    match=r"cannot interpret 'reduce' \(autocast does not enter its body\)"):
    got = jaxamp.autocast(f)(x, w)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, jax.jit(f)(x, w), rtol=1e-2)  # x @ w ran in float16


def test_integer_operations_keep_their_integer_dtype():
  a = jnp.asarray([[3001, 2], [5, 4097]], jnp.int32)  # not representable in float16
  got = jaxamp.autocast(lambda a, b: a @ b)(a, a)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(got, np.asarray(a) @ np.asarray(a))


def test_float32_ops_of_a_bfloat16_model_run_in_float32():
  # As torch's autocast: exp and log of 16-bit values (softmax, losses) are computed in float32.
  x = jnp.asarray(X @ Y, jnp.bfloat16)
  exp, log = jaxamp.autocast(lambda x: (jnp.exp(x), jnp.log(jnp.abs(x))), jnp.bfloat16)(x)
  assert exp.dtype == log.dtype == jnp.float32
  np.testing.assert_array_equal(exp, jnp.exp(x.astype(jnp.float32)))
  np.testing.assert_array_equal(log, jnp.log(jnp.abs(x).astype(jnp.float32)))


# ---- the float32 rule widens only 16-bit (and narrower) floating inputs



def test_float32_rules_leave_float64_values_at_full_precision_under_x64():
  # A float64 log-sum-exp (exp, reduce_sum, log: all float32 ops) keeps its float64 precision.
  with enable_x64():
    x = jnp.asarray([0.0, 1e-9, 2e-9], jnp.float64)  # float32 would lose the small terms
    lse = lambda x: jnp.log(jnp.sum(jnp.exp(x)))
    got = jaxamp.autocast(lse)(x)
    assert got.dtype == jnp.float64
    assert float(got) != float(np.log(3.0))
    np.testing.assert_array_equal(got, lse(x))


def test_a_power_with_small_integer_exponents_differentiates_as_without_autocast():
  # Polynomial features x**[0, 1, 2] with int8 degrees: the exponents stay integers, so the
  # derivative of x**0 at x = 0 is 0 (a float exponent would give 0 * 0**-1 = nan).
  def poly(x, degrees):
    return jnp.sum(lax.pow(x[:, None], degrees[None, :]))

  x, degrees = jnp.asarray([0.0, 1.0, 2.0]), jnp.arange(3, dtype=jnp.int8)
  with jax.numpy_dtype_promotion("standard"):  # lax.pow's own derivative mixes the two dtypes
    want = jax.grad(poly)(x, degrees)
    got = jax.grad(jaxamp.autocast(poly))(x, degrees)
  assert np.isfinite(want).all()
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(jaxamp.autocast(poly)(x, degrees), poly(x, degrees))


# ---- calling an autocast function: options, static arguments, the trace cache


def test_a_disabled_autocast_passes_keyword_arguments_through():
  def loss(w, x, *, scale=1.0):
    return jnp.sum(x @ w) * scale

  w, x = jnp.asarray(Y), jnp.asarray(X)
  np.testing.assert_array_equal(jaxamp.autocast(loss, enabled=False)(w, x, scale=2.0),
                                loss(w, x, scale=2.0))


def test_autocast_runs_in_a_program_that_never_imports_flax_nnx(monkeypatch):
  monkeypatch.delitem(sys.modules, "flax.nnx", raising=False)
  got = jaxamp.autocast(lambda x, w: x @ w)(jnp.asarray(X), jnp.asarray(Y))
  assert got.dtype == jnp.float16
  np.testing.assert_array_equal(got, X.astype(np.float16) @ Y.astype(np.float16))


def test_a_static_argument_selects_its_trace_by_its_type_and_value():
  # 1, True and 1.0 are equal in Python (and hash alike) but make arrays of different dtypes.
  def filled(x, value):
    return jnp.full(x.shape, value)

  f, x = jaxamp.autocast(filled), jnp.asarray(X)
  for value in (1, True, 1.0, 2, False):
    got, want = f(x, value), filled(x, value)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@dataclasses.dataclass
class _DropoutConfig:
  """A mutable (so unhashable) configuration object, passed as a static argument."""
  rate: float


def test_a_function_of_an_unhashable_static_argument_is_traced_at_each_call():
  def scale(x, cfg):
    return x * (1.0 - cfg.rate)

  f, x = jaxamp.autocast(scale), jnp.asarray(X)
  for rate in (0.5, 0.25, 0.5):
    np.testing.assert_array_equal(f(x, _DropoutConfig(rate)), scale(x, _DropoutConfig(rate)))
  # Another function with such an argument gets its own trace too.
  shift = jaxamp.autocast(lambda x, cfg: x + cfg.rate)
  np.testing.assert_array_equal(shift(x, _DropoutConfig(0.5)), X + 0.5)


def test_repeated_calls_reuse_the_trace_and_the_cache_keeps_the_256_most_recent():
  traces = []

  @jaxamp.autocast
  def shift(x, k):
    traces.append(k)  # runs once per trace
    return x + k

  def run(*ks):  # inside eval_shape autocast traces but nothing is compiled
    jax.eval_shape(lambda x: [shift(x, k) for k in ks], jnp.asarray(X))

  run(*range(256))
  run(0, 1, 255)  # all kept: no new trace (and 0 is now the most recently used)
  assert traces == list(range(256))
  run(256)  # one too many: the least recently used (2) is dropped
  run(256, 0, 1, 3)
  assert traces == list(range(257))
  run(2)  # dropped: traced again
  assert traces == list(range(257)) + [2]


class _Head:
  """A plain Python layer whose weights are set on it inside the step that applies it."""

  def __init__(self):
    self.w = None

  @jaxamp.autocast
  def apply(self, x):
    return x @ self.w


def test_a_method_reading_traced_weights_from_its_object_is_traced_again_in_each_step():
  head = _Head()

  def loss(w, x):
    head.w = w  # a traced value: the trace of apply closes over it
    return jnp.sum(head.apply(x).astype(jnp.float32))

  def loss_f16(w, x):
    return jnp.sum((x.astype(jnp.float16) @ w.astype(jnp.float16)).astype(jnp.float32))

  w, x = jnp.asarray(Y), jnp.asarray(X)
  np.testing.assert_array_equal(jax.jit(loss)(w, x), loss_f16(w, x))
  # jax.grad traces loss again, with another traced w: apply must not reuse the jit's trace.
  np.testing.assert_array_equal(jax.grad(loss)(w, x), jax.grad(loss_f16)(w, x))
  np.testing.assert_array_equal(jax.jit(loss)(2 * w, x), loss_f16(2 * w, x))


def test_the_compiled_program_names_an_autocast_module_after_its_class():
  # An Equinox module (a callable object without __name__): its operations are named
  # autocast_Linear in the program (XLA's op_name metadata, which profilers show).
  import equinox as eqx
  linear = eqx.nn.Linear(2, 2, key=jax.random.key(0))
  f = jaxamp.autocast(linear)
  compiled = jax.jit(lambda x: f(x)).lower(jnp.ones(2)).compile().as_text()
  assert re.search(r'op_name="jit\(<lambda>\)/autocast_Linear/[^"]*dot_general"', compiled)


def test_a_function_updating_an_nnx_module_kept_in_a_dict_is_refused_with_the_remedy():
  # The module is not in the closure itself (a dict is) but the trace still catches it.
  state = {"model": _batch_norm()}

  def forward(x):
    return state["model"](x)

  with pytest.raises(ValueError, match="forward changes an NNX object that is not among its "
                                       "arguments: .* Pass it as an argument instead"):
    jaxamp.autocast(forward, jnp.bfloat16)(XB)
