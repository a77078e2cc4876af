"""Tests of jaxamp.autocast: per-operation dtypes, gradients, composition, caching and errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jaxamp
from tests._floats import enable_x64
from jaxamp._src import compat
from tests._problems import classification

F16, BF16, F32, F64 = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32),
                       jnp.dtype(jnp.float64))


def all_eqns(jaxpr):
  """Every equation of a (closed) jaxpr, sub-jaxprs included."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in compat.jaxprs_in_params(eqn.params):
      yield from all_eqns(sub)


def in_dtypes(fn, *args, prim):
  """The input dtypes of each ``prim`` equation in the jaxpr of ``fn(*args)``."""
  jaxpr = jax.make_jaxpr(fn)(*args)
  return [tuple(v.aval.dtype for v in e.invars) for e in all_eqns(jaxpr)
          if e.primitive.name == prim]


def out_dtypes(fn, *args, prim):
  jaxpr = jax.make_jaxpr(fn)(*args)
  return [tuple(v.aval.dtype for v in e.outvars) for e in all_eqns(jaxpr)
          if e.primitive.name == prim]


X = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)
W = jnp.linspace(-0.5, 0.5, 20, dtype=jnp.float32).reshape(4, 5)


# ----------------------------------------------------------------------------- the lists


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_matmul_and_conv_run_in_the_low_dtype(dtype):
  f = jaxamp.autocast(lambda x, w: x @ w, dtype)
  assert in_dtypes(f, X, W, prim="dot_general") == [(dtype, dtype)]
  assert f(X, W).dtype == dtype
  np.testing.assert_allclose(f(X, W).astype(F32), X @ W, rtol=2e-2, atol=2e-2)

  def conv(x, k):
    return lax.conv_general_dilated(x, k, (1, 1), "SAME")

  x, k = jnp.ones((1, 2, 5, 5)), jnp.ones((3, 2, 3, 3)) * 0.1
  g = jaxamp.autocast(conv, dtype)
  assert in_dtypes(g, x, k, prim="conv_general_dilated") == [(dtype, dtype)]
  np.testing.assert_allclose(g(x, k).astype(F32), conv(x, k), rtol=1e-2)


@pytest.mark.parametrize("prim, fn", [
    ("exp", jnp.exp), ("log", lambda h: jnp.log(jnp.abs(h) + 1)), ("log1p", lambda h: jnp.log1p(h * h)),
    ("expm1", jnp.expm1), ("integer_pow", lambda h: h**3), ("square", jnp.square),
    ("rsqrt", lambda h: lax.rsqrt(h * h + 1)), ("sqrt", lambda h: jnp.sqrt(h * h)),
    ("reduce_sum", jnp.sum), ("cumsum", lambda h: jnp.cumsum(h, axis=1)),
    ("logistic", jax.nn.sigmoid), ("erf_inv", lambda h: lax.erf_inv(jnp.tanh(h) * 0.5)),
    ("pow", lambda h: jnp.power(jnp.abs(h) + 1, h)),
])
def test_precision_sensitive_ops_run_in_float32(prim, fn):
  f = jaxamp.autocast(lambda x, w: fn(x @ w))
  dtypes = in_dtypes(f, X, W, prim=prim)
  assert dtypes and all(d == F32 for ds in dtypes for d in ds), dtypes
  np.testing.assert_allclose(f(X, W), fn(X @ W), rtol=1e-2, atol=1e-2)


def test_promote_casts_mixed_inputs_to_the_widest_and_scalars_do_not_widen():
  def f(x, w, b):
    h = x @ w                     # low
    return h + b[None], h * 2.0, jnp.tanh(h), jnp.maximum(h, 0)

  outs = jaxamp.autocast(f)(X, W, jnp.ones(5))
  assert [o.dtype for o in outs] == [F32, F16, F16, F16]
  assert in_dtypes(jaxamp.autocast(f), X, W, jnp.ones(5), prim="add") == [(F32, F32)]


def test_float64_ints_bools_and_keys_are_untouched():
  def f(x, i, b, key, z):
    noise = jax.random.normal(key, x.shape, jnp.float32)
    return x @ x.T + noise[:, :3] * 0, i * 2, ~b, jax.random.split(key), z @ z

  with enable_x64(True):
    z = jnp.ones((2, 2), F64)
    key = jax.random.key(0)
    out = jaxamp.autocast(f)(X, jnp.arange(3), jnp.array([True]), key, z)
    assert out[1].dtype == jnp.int64 and out[2].dtype == jnp.bool_
    assert jax.dtypes.issubdtype(out[3].dtype, jax.dtypes.prng_key)
    assert out[4].dtype == F64
    assert in_dtypes(jaxamp.autocast(f), X, jnp.arange(3), jnp.array([True]), key, z,
                     prim="dot_general") == [(F16, F16), (F64, F64)]


def test_overrides_replace_a_primitive_rule():
  f = jaxamp.autocast(lambda x, w: jnp.tanh(x @ w), overrides={"dot_general": "float32"})
  assert in_dtypes(f, X, W, prim="dot_general") == [(F32, F32)]
  g = jaxamp.autocast(lambda x, w: jnp.exp(x @ w), overrides={lax.exp_p: "promote"})
  assert in_dtypes(g, X, W, prim="exp") == [(F16,)]
  h = jaxamp.autocast(lambda x, w: jnp.tanh(x @ w), overrides={"tanh": "float32"})
  assert out_dtypes(h, X, W, prim="tanh") == [(F32,)]
  off = jaxamp.autocast(lambda x, w: jnp.tanh(x @ w), overrides={"tanh": "off"})
  assert in_dtypes(off, X, W, prim="tanh") == [(F32,)]


def test_unknown_primitives_run_at_their_traced_dtypes():
  # A primitive with a body autocast does not enter (lax.reduce with a custom
  # computation) runs as traced, and autocast says so once, naming it.
  def f(x, w):
    h = x @ w
    return lax.reduce(h, 0.0, lambda a, b: a + b * 1.0, (1,)) + lax.reduce(
        h, 1.0, lambda a, b: a * b * 1.0, (1,))

  with pytest.warns(jaxamp.AutocastWarning, match="cannot interpret 'reduce'") as record:
    dtypes = in_dtypes(jaxamp.autocast(f), X, W, prim="reduce")
  assert len(record) == 1
  assert dtypes == [(F32, F32), (F32, F32)]
  # The trace is cached: the second call says nothing more.
  np.testing.assert_allclose(jaxamp.autocast(f)(X, W), f(X, W), rtol=1e-2, atol=1e-2)


# ----------------------------------------------------------------------------- gradients


def _mlp(params, x, labels):
  h = jax.nn.relu(x @ params["w1"] + params["b1"][None])
  logits = h @ params["w2"]
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


@pytest.mark.parametrize("dtype, tol", [(F16, 1e-2), (BF16, 5e-2)])
def test_gradients_are_float32_and_close_to_float32(dtype, tol):
  params, x, labels = classification()
  f = jaxamp.autocast(_mlp, dtype)
  loss, grads = jax.jit(jax.value_and_grad(f))(params, x, labels)
  assert loss.dtype == F32
  assert all(g.dtype == F32 for g in jax.tree.leaves(grads))
  ref_loss, ref_grads = jax.value_and_grad(_mlp)(params, x, labels)
  np.testing.assert_allclose(loss, ref_loss, rtol=tol)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, r, rtol=tol, atol=tol * float(jnp.max(jnp.abs(r))))
  # The backward products run in the low dtype too: 2 forward, 3 backward.
  dots = in_dtypes(jax.value_and_grad(f), params, x, labels, prim="dot_general")
  assert len(dots) == 5 and all(d == (dtype, dtype) for d in dots)
  # The log-softmax's exp, log and sums run in float32, forward and backward.
  assert all(d == (F32,) for d in in_dtypes(jax.grad(f), params, x, labels, prim="exp"))


def test_forward_mode_and_vmap():
  params, x, labels = classification()
  f = jaxamp.autocast(_mlp)
  tangent = jax.tree.map(jnp.ones_like, params)
  _, jvp = jax.jvp(lambda p: f(p, x, labels), (params,), (tangent,))
  _, ref = jax.jvp(lambda p: _mlp(p, x, labels), (params,), (tangent,))
  np.testing.assert_allclose(jvp, ref, rtol=2e-2)
  per_example = jax.vmap(f, in_axes=(None, 0, 0))(params, x[:, None], labels[:, None])
  ref = jax.vmap(_mlp, in_axes=(None, 0, 0))(params, x[:, None], labels[:, None])
  assert per_example.shape == (32,)
  np.testing.assert_allclose(per_example, ref, rtol=2e-2, atol=1e-3)


# ----------------------------------------------------------------------------- composition


def test_scan_cond_while_checkpoint_and_nested_jit():
  def f(x, w, with_while=True):
    def layer(h, _):
      return jnp.tanh(h @ w), jnp.sum(h)

    h, sums = lax.scan(layer, x, None, length=3)
    h = lax.cond(jnp.sum(h) > 0, lambda a: a @ w, lambda a: -a, h)
    h = lax.fori_loop(0, 2, lambda i, a: jax.nn.softmax(a @ w), h)
    if with_while:  # not reverse-differentiable
      h = lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] @ w), (0, h))[1]
    h = jax.checkpoint(lambda a: jnp.exp(a @ w))(h)
    h = jax.jit(lambda a: a @ w)(h)
    return jnp.sum(h) + jnp.sum(sums)

  x, w = jnp.ones((2, 4)) * 0.1, jnp.eye(4) * 0.5
  g = jaxamp.autocast(f)
  dots = in_dtypes(g, x, w, prim="dot_general")
  assert len(dots) == 6 and all(d == (F16, F16) for d in dots)
  np.testing.assert_allclose(g(x, w), f(x, w), rtol=1e-2)
  grads = jax.jit(jax.grad(lambda w: g(x, w, with_while=False)))(w)
  ref = jax.grad(lambda w: f(x, w, with_while=False))(w)
  np.testing.assert_allclose(grads, ref, rtol=2e-2, atol=2e-2)
  # Loop carries and cond outputs keep their traced dtypes.
  for prim in ("scan", "while", "cond"):
    floats = [d for ds in out_dtypes(g, x, w, prim=prim) for d in ds
              if jnp.issubdtype(d, jnp.floating)]
    assert floats and all(d == F32 for d in floats), prim


def test_custom_jvp_rules_are_kept():
  # relu's rule gives 0 at 0; differentiating max(x, 0) directly would give 0.5.
  f = jaxamp.autocast(lambda x: jnp.sum(jax.nn.relu(x)))
  assert float(jax.grad(f)(jnp.zeros(()))) == 0.0

  @jax.custom_jvp
  def clipped_exp(x):
    return jnp.exp(x)

  clipped_exp.defjvp(lambda p, t: (clipped_exp(p[0]), t[0] * 7.0))
  g = jaxamp.autocast(lambda x, w: jnp.sum(clipped_exp(x @ w)))
  grad = jax.grad(g)(X, W)
  ref = jax.grad(lambda x, w: jnp.sum(clipped_exp(x @ w)))(X, W)
  np.testing.assert_allclose(grad, ref, rtol=1e-2, atol=1e-2)


def test_custom_vjp_forward_is_autocast_and_backward_runs_as_written():
  seen = []

  @jax.custom_vjp
  def scale_grad(x):
    return x * 1.0

  def fwd(x):
    return x * 1.0, jnp.ones_like(x)

  def bwd(res, g):
    seen.append((res.dtype, g.dtype))
    return (g * 3.0 * res,)

  scale_grad.defvjp(fwd, bwd)
  f = jaxamp.autocast(lambda x, w: jnp.sum(scale_grad(x @ w).astype(jnp.float32)))
  grad_w = jax.grad(f, argnums=1)(X, W)
  ref = jax.grad(lambda x, w: jnp.sum(scale_grad(x @ w)), argnums=1)(X, W)
  np.testing.assert_allclose(grad_w, ref, rtol=1e-2)
  assert grad_w.dtype == F32
  assert seen[-1] == (F32, F32)  # the backward rule sees the dtypes it was written for
  assert in_dtypes(f, X, W, prim="dot_general") == [(F16, F16)]


def test_one_trace_and_one_compile_per_loop(count_traces):
  params, x, labels = classification()
  counted, counter = count_traces(_mlp)
  loss_fn = jaxamp.autocast(counted)
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.5), init_scale=2.0**10)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, x):
    scaled = lambda p: jaxamp.scale_loss(loss_fn(p, x, labels), opt_state)
    grads = jax.grad(scaled)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  opt_state = tx.init(params)
  first = _mlp(params, x, labels)
  for _ in range(8):
    params, opt_state = step(params, opt_state, x)
  assert counter["n"] == 1 and step._cache_size() == 1
  assert all(p.dtype == F32 for p in jax.tree.leaves(params))
  assert _mlp(params, x, labels) < 0.8 * first
  # Eager calls reuse the trace; a new wrapper of the same function compares equal.
  jaxamp.autocast(counted)(params, x, labels)
  jaxamp.autocast(counted)(params, x, labels)
  assert counter["n"] == 1
  assert jaxamp.autocast(counted) == loss_fn and hash(jaxamp.autocast(counted)) == hash(loss_fn)
  assert jaxamp.autocast(counted, "bf16") != loss_fn


def test_loss_scaling_overflow_is_seen_through_autocast():
  params, x, labels = classification()
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**40)
  opt_state = tx.init(params)
  f = jaxamp.autocast(_mlp)
  grads = jax.grad(lambda p: jaxamp.scale_loss(f(p, x, labels), opt_state))(params)
  _, new_state = tx.update(grads, opt_state, params)
  assert float(jaxamp.loss_scale(new_state)) < 2.0**40  # the f16 backward overflowed


def test_whole_cast_overflows_where_autocast_does_not():
  """Layer norm and log-sum-exp of large activations: float16 everywhere fails, autocast not."""

  def model(p, x):
    h = x @ p["w1"]
    mu = jnp.mean(h, -1, keepdims=True)
    var = jnp.mean(jnp.square(h - mu), -1, keepdims=True)
    h = (h - mu) * lax.rsqrt(var + 1e-5) * p["g"][None]
    logits = h @ p["w2"] * 8.0
    return jnp.mean(jax.nn.logsumexp(logits, -1)), jnp.mean(var)

  k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
  p = {"w1": jax.random.normal(k1, (16, 32)), "g": jnp.ones(32),
       "w2": jax.random.normal(k2, (32, 8))}
  x = jax.random.normal(k3, (8, 16)) * 200.0
  ref_lse, ref_var = model(p, x)
  whole = jaxamp.mixed_precision(model, "params=float32,compute=float16,output=float32")
  lse_h, var_h = whole(p, x)
  lse_a, var_a = jaxamp.autocast(model)(p, x)
  assert float(ref_var) > 65504  # the variance does not fit in float16
  assert not np.isfinite(float(var_h)) or abs(float(lse_h) / float(ref_lse) - 1) > 0.02
  np.testing.assert_allclose(var_a, ref_var, rtol=5e-3)
  np.testing.assert_allclose(lse_a, ref_lse, rtol=5e-3)


# ----------------------------------------------------------------------------- Flax


def test_flax_linen_apply_and_nnx_split_merge():
  nn = pytest.importorskip("flax.linen")
  nnx = pytest.importorskip("flax.nnx")

  class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(3)(nn.LayerNorm()(nn.relu(nn.Dense(8)(x))))

  model = Mlp()
  x = jnp.ones((2, 4))
  variables = model.init(jax.random.key(0), x)
  out = jaxamp.autocast(model.apply)(variables, x)
  assert out.dtype == F32  # the float32 bias promotes the float16 product
  assert in_dtypes(jaxamp.autocast(model.apply), variables, x, prim="dot_general") == [
      (F16, F16), (F16, F16)]
  np.testing.assert_allclose(out.astype(F32), model.apply(variables, x), rtol=2e-2, atol=2e-2)
  grads = jax.grad(lambda v: jnp.sum(jaxamp.autocast(model.apply)(v, x).astype(F32)))(variables)
  assert all(g.dtype == F32 for g in jax.tree.leaves(grads))

  linear = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(linear)

  def forward(state, x):
    return nnx.merge(graphdef, state)(x)

  out = jaxamp.autocast(forward)(state, x)
  assert in_dtypes(jaxamp.autocast(forward), state, x, prim="dot_general") == [(F16, F16)]
  grads = jax.grad(lambda s: jnp.sum(jaxamp.autocast(forward)(s, x).astype(F32)))(state)
  assert all(g.dtype == F32 for g in jax.tree.leaves(grads))


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("dtype, error, match", [
    ("float32", ValueError, "dtype must be float16 or bfloat16, got float32; for full precision"),
    (jnp.int8, ValueError, "dtype must be a floating-point dtype, got int8"),
    ("quarter", ValueError, "dtype must be one of"),
    (object(), TypeError, "dtype must be a floating-point dtype \\(a dtype or a dtype name\\)"),
])
def test_bad_dtypes_are_refused_at_construction(dtype, error, match):
  with pytest.raises(error, match=match):
    jaxamp.autocast(jnp.sin, dtype)


def test_bad_options_are_refused_at_construction():
  with pytest.raises(ValueError, match=r"overrides\['exp'\] must be one of .*'low'.*got 'f16'"):
    jaxamp.autocast(jnp.sin, overrides={"exp": "f16"})
  with pytest.raises(ValueError, match=r"overrides\['scan'\] must be 'off'"):
    jaxamp.autocast(jnp.sin, overrides={"scan": "low"})
  with pytest.raises(TypeError, match="overrides keys must be primitive names"):
    jaxamp.autocast(jnp.sin, overrides={3: "low"})
  with pytest.raises(TypeError, match="enabled must be a bool"):
    jaxamp.autocast(jnp.sin, enabled="yes")
  with pytest.raises(TypeError, match="fn must be callable"):
    jaxamp.autocast(3)


def test_disabled_calls_the_function_unchanged():
  f = jaxamp.autocast(lambda x, w: x @ w, enabled=False)
  assert f(X, W).dtype == F32
  assert f.__name__ == "<lambda>"


def test_static_arguments_and_pytrees_of_outputs():
  def f(x, w, *, train, name="a"):
    h = x @ w
    return {"h": h if train else -h, "name_len": len(name), "n": jnp.sum(h)}

  g = jaxamp.autocast(f)
  out = g(X, W, train=True, name="abc")
  assert out["h"].dtype == F16 and out["n"].dtype == F32 and int(out["name_len"]) == 3
  assert float(jnp.sum(g(X, W, train=False)["h"] + out["h"])) == 0.0


def test_half_products_accumulate_in_float32_on_this_backend():
  """A sum of 8192 ones is exact: a float16 accumulator would stop at 2048."""
  x = jnp.ones((1, 8192), jnp.float32)
  out = jaxamp.autocast(lambda a, b: a @ b, jnp.float16)(x, x.T)
  assert out.dtype == jnp.float16 and float(out[0, 0]) == 8192.0
