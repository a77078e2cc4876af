"""What autocast keeps of the program: requested dtypes, loop termination, opt-out regions.

- A product whose ``preferred_element_type`` the program set to a dtype other
  than its operands' returns that dtype (every pair of operand and requested
  dtype, for ``dot_general`` and ``conv_general_dilated``).
- A ``while_loop`` whose predicate reads a floating value runs at its traced
  dtypes, so it stops when, and with what, float32 stops; loops with a
  counted trip count are entered.
- Every name in the op lists is a primitive of the installed JAX; the scatter
  family and the segment reductions run under the promote rule, silently.
- ``jaxamp.autocast_disabled`` (or a nested ``autocast(fn, enabled=False)``)
  runs its operations at their traced dtypes, the program's casts deciding.
- Linear solves (``custom_linear_solve``) stay at their traced dtypes, silently.
"""

import gc
import importlib

import jax
import jax.numpy as jnp
import jax.scipy as jsp
import numpy as np
import pytest
from jax import lax

import jaxamp
from jaxamp._src import autocast_ops
from jaxamp._src import jaxpr_interp
from tests.test_autocast import all_eqns

F16, BF16, F32 = jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
LOW = pytest.mark.parametrize("low", [F16, BF16], ids=["f16", "bf16"])


def eqns_of(fn, *args, prim):
  """The equations of primitive ``prim`` (every one for ``None``) in the jaxpr of ``fn``."""
  return [e for e in all_eqns(jax.make_jaxpr(fn)(*args)) if prim in (None, e.primitive.name)]


def in_dtypes(eqn):
  return tuple(v.aval.dtype for v in eqn.invars)


# ----------------------------------------------------------------------------- requested dtypes


def _dot(requested):
  return lambda a, b: lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                                      preferred_element_type=requested)


def _conv(requested):
  return lambda a, b: lax.conv_general_dilated(a, b, (1, 1), "VALID",
                                               preferred_element_type=requested)


PRODUCTS = {
    "dot_general": (_dot, (np.linspace(-2, 2, 12).reshape(3, 4),
                           np.linspace(1, -1, 20).reshape(4, 5))),
    "conv_general_dilated": (_conv, (np.linspace(-2, 2, 32).reshape(1, 2, 4, 4),
                                     np.linspace(1, -1, 24).reshape(3, 2, 2, 2))),
}
DTYPES = [F16, BF16, F32]


# Every pair of operand and requested dtype that JAX accepts: a convolution refuses a result
# narrower than its operands.
CASES = [(op, operands, requested) for op in sorted(PRODUCTS) for operands in DTYPES
         for requested in DTYPES
         if op == "dot_general" or requested.itemsize >= operands.itemsize]


@LOW
@pytest.mark.parametrize("op, operands, requested", CASES,
                         ids=[f"{o}-{a.name}-{r.name}" for o, a, r in CASES])
def test_a_requested_result_dtype_is_kept_and_the_operands_follow_autocast(
    op, operands, requested, low):
  make, args = PRODUCTS[op]
  a, b = (jnp.asarray(x, operands) for x in args)
  product = make(requested)
  # The program asked for `requested` unless that is its operands' dtype, which is what
  # jnp writes for every product (no request): then the product returns the autocast dtype.
  want = low if requested == operands else requested
  got = jaxamp.autocast(product, low)(a, b)
  assert got.dtype == want
  (eqn,) = eqns_of(jaxamp.autocast(product, low), a, b, prim=op)
  assert in_dtypes(eqn) == (low, low)
  assert eqn.params["preferred_element_type"] == want
  # The value is the product of the operands rounded to the autocast dtype, returned in `want`.
  np.testing.assert_array_equal(got, jax.jit(make(want))(a.astype(low), b.astype(low)))


def test_a_requested_float32_result_of_half_operands_does_not_overflow():
  a = jnp.full((1, 16), 80.0, jnp.float16)
  b = jnp.full((16, 1), 80.0, jnp.float16)
  wide = _dot(jnp.float32)  # 16 * 80 * 80 = 102400, above float16's 65504
  np.testing.assert_array_equal(jaxamp.autocast(wide)(a, b), [[102400.0]])
  # A product of no request returns the autocast dtype, as jnp.matmul's does.
  assert bool(jnp.isinf(jaxamp.autocast(lambda x, y: x @ y)(a, b))[0, 0])


def test_a_requested_float32_product_differentiates_to_float32_gradients():
  a = jnp.asarray(PRODUCTS["dot_general"][1][0], jnp.float32)
  b = jnp.asarray(PRODUCTS["dot_general"][1][1], jnp.float32)

  def loss(a, b):  # half operands, float32 result: the mixed-precision pattern written by hand
    return jnp.sum(_dot(jnp.float32)(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)) ** 2)

  got = jax.grad(jaxamp.autocast(loss), argnums=(0, 1))(a, b)
  want = jax.grad(loss, argnums=(0, 1))(a, b)
  for g, w in zip(got, want):
    assert g.dtype == F32
    np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------- loops


def fixed_point(f, a, x_guess):
  """JAX's documentation's fixed point (custom_vjp's implicit differentiation example).

  Iterates until the change is under 1e-6; the count is returned, and capped so that a loop
  that would never stop ends the test instead.
  """
  def cond_fun(carry):
    x_prev, x, n = carry
    return (jnp.max(jnp.abs(x_prev - x)) > 1e-6) & (n < 1000)

  def body_fun(carry):
    _, x, n = carry
    return x, f(a, x), n + 1

  _, x_star, n = lax.while_loop(cond_fun, body_fun, (x_guess, f(a, x_guess), 1))
  return x_star, n


def _layer(params, x):  # a deep-equilibrium layer: x = tanh(W x + b)
  w, b = params
  return jnp.tanh(w @ x + b)


K1, K2 = jax.random.split(jax.random.key(2))
DEQ = (jax.random.normal(K1, (16, 16)) / 8, jax.random.normal(K2, (16,)))


@LOW
def test_a_fixed_point_loop_stops_with_its_float32_result(low):
  solve = lambda params: fixed_point(_layer, params, jnp.zeros(16))
  want, n = jax.jit(solve)(DEQ)
  assert int(n) < 50
  got, m = jaxamp.autocast(solve, low)(DEQ)
  assert int(m) == int(n)  # in half precision this iterate never settles: 1000 iterations
  np.testing.assert_array_equal(got, want)
  (loop,) = eqns_of(jaxamp.autocast(solve, low), DEQ, prim="while")
  assert [in_dtypes(e) for e in all_eqns(loop.params["body_jaxpr"])
          if e.primitive.name == "dot_general"] == [(F32, F32)]


@LOW
def test_a_loop_whose_predicate_reads_only_a_counter_is_entered(low):
  def f(w, x, n):  # fori_loop with a traced trip count: a while loop on an integer counter
    return lax.fori_loop(0, n, lambda i, h: jnp.tanh(h @ w), x)

  w, x = DEQ[0], jnp.ones((2, 16))
  (loop,) = eqns_of(jaxamp.autocast(f, low), w, x, 3, prim="while")
  assert [in_dtypes(e) for e in all_eqns(loop.params["body_jaxpr"])
          if e.primitive.name == "dot_general"] == [(low, low)]
  np.testing.assert_allclose(jaxamp.autocast(f, low)(w, x, 3), f(w, x, 3), rtol=5e-2, atol=5e-2)


@LOW
def test_a_flag_computed_from_a_floating_value_keeps_the_loop_at_its_traced_dtypes(low):
  def f(w, x):  # the predicate reads a boolean carry that the body computes from x
    def body(c):
      h, _, n = c
      new = jnp.tanh(h @ w)
      return new, jnp.max(jnp.abs(new - h)) < 1e-6, n + 1
    return lax.while_loop(lambda c: ~c[1] & (c[2] < 1000), body, (x, False, 0))

  w, x = DEQ[0], jnp.ones((2, 16))
  (loop,) = eqns_of(jaxamp.autocast(f, low), w, x, prim="while")
  assert [in_dtypes(e) for e in all_eqns(loop.params["body_jaxpr"])
          if e.primitive.name == "dot_general"] == [(F32, F32)]
  np.testing.assert_array_equal(jaxamp.autocast(f, low)(w, x)[0], jax.jit(f)(w, x)[0])


def test_a_loop_body_wrapped_in_autocast_opts_in():
  def solve(params):
    def body_fun(carry):  # the body's own autocast region: its product is float16
      _, x, n = carry
      return x, _layer(params, x), n + 1

    init = (jnp.zeros(16), _layer(params, jnp.zeros(16)), 1)
    cond = lambda c: (jnp.max(jnp.abs(c[0] - c[1])) > 1e-3) & (c[2] < 1000)
    return lax.while_loop(cond, jaxamp.autocast(body_fun), init)

  (loop,) = eqns_of(jaxamp.autocast(solve), DEQ, prim="while")
  dots = [in_dtypes(e) for e in all_eqns(loop.params["body_jaxpr"])
          if e.primitive.name == "dot_general"]
  assert dots == [(F16, F16)]
  x, _, n = jaxamp.autocast(solve)(DEQ)
  assert int(n) < 1000
  np.testing.assert_allclose(x, fixed_point(_layer, DEQ, jnp.zeros(16))[0], atol=1e-2)


# ----------------------------------------------------------------------------- op names


def _installed_primitives():
  """The names of every primitive the installed JAX defines (after importing its modules)."""
  for module in ("jax.numpy", "jax.lax", "jax.nn", "jax.scipy.linalg", "jax.scipy.special",
                 "jax.ops", "jax.random", "jax.experimental.shard_map"):
    try:
      importlib.import_module(module)
    except ImportError:  # a module a release does not have
      continue
  return {o.name for o in gc.get_objects() if isinstance(o, jax.extend.core.Primitive)}


def test_every_op_list_name_is_a_primitive_of_the_installed_jax():
  names = {
      "LOW_PRECISION": autocast_ops.LOW_PRECISION, "FLOAT32": autocast_ops.FLOAT32,
      "PROMOTE": autocast_ops.PROMOTE, "TRACED": autocast_ops.TRACED,
      "FAMILIES": set(jaxpr_interp.FAMILY_OF),
  }
  installed = _installed_primitives()
  missing = {group: sorted(set(listed) - installed) for group, listed in names.items()}
  assert not any(missing.values()), missing
  lists = [autocast_ops.LOW_PRECISION, autocast_ops.FLOAT32, autocast_ops.PROMOTE]
  assert sum(len(x) for x in lists) == len(set().union(*lists)), "a name in two lists"


@LOW
def test_scatters_and_segment_reductions_run_under_the_promote_rule_without_a_warning(low):
  index = jnp.array([0, 1, 1, 2])
  segments = jnp.array([0, 2, 2, 1])

  def f(w, u):
    h = u @ w  # in the autocast dtype
    half = u[:3] @ w  # a buffer in the autocast dtype too
    full = jnp.zeros((3, 3))  # a float32 buffer
    return (full.at[index].add(h), full.at[index].min(h), full.at[index].max(h),
            full.at[index].set(h), half.at[index].max(h), half.at[index].add(h),
            jax.ops.segment_sum(h, segments, 3), jax.ops.segment_max(h, segments, 3),
            jax.ops.segment_min(h, segments, 3))

  w, u = jnp.eye(3), jnp.arange(12.0).reshape(4, 3) / 8  # exact in both half dtypes
  got = jaxamp.autocast(f, low)(w, u)  # warnings are errors in this suite
  for g, want in zip(got, f(w, u)):
    np.testing.assert_array_equal(g, want)
  scatters = [in_dtypes(e) for e in eqns_of(jaxamp.autocast(f, low), w, u, prim=None)
              if e.primitive.name.startswith("scatter")]
  # Float32 buffers take the half-precision updates at float32, half ones stay in half.
  assert [(a, u) for a, _, u in scatters] == [(F32, F32)] * 4 + [(low, low)] * 2 + [(F32, F32)] * 3
  grads = jax.grad(lambda w: sum(jnp.sum(o.astype(jnp.float32))
                                 for o in jaxamp.autocast(f, low)(w, u)))(w)
  assert grads.dtype == F32 and bool(jnp.all(jnp.isfinite(grads)))


# ----------------------------------------------------------------------------- opt-out regions


A = jnp.full((1, 8), 150.0, jnp.float32)
B = jnp.full((8, 1), 150.0, jnp.float32)  # A @ B = 180000: finite in bfloat16, not in float16


def test_an_explicit_cast_inside_an_autocast_region_is_overruled_as_by_torch():
  f = lambda a, b: a.astype(jnp.bfloat16) @ b.astype(jnp.bfloat16)
  got = jaxamp.autocast(f)(A, B)
  assert got.dtype == F16 and bool(jnp.isinf(got)[0, 0])


@pytest.mark.parametrize("opt_out", ["autocast_disabled", "enabled_false"])
def test_an_opt_out_region_keeps_the_programs_casts(opt_out):
  region = (jaxamp.autocast_disabled if opt_out == "autocast_disabled"
            else lambda fn: jaxamp.autocast(fn, jnp.float16, enabled=False))

  def f(a, b):
    kept = region(lambda a, b: a.astype(jnp.bfloat16) @ b.astype(jnp.bfloat16))(a, b)
    return kept, a @ b

  kept, cast = jaxamp.autocast(f)(A, B)
  assert kept.dtype == BF16 and float(kept[0, 0]) == float(jnp.bfloat16(180000.0))
  assert cast.dtype == F16 and bool(jnp.isinf(cast)[0, 0])


def test_an_opt_out_region_takes_its_inputs_at_their_traced_dtypes():
  x, w = jnp.linspace(-1, 1, 12).reshape(3, 4), jnp.linspace(1, -1, 16).reshape(4, 4)

  def f(x, w):
    h = jnp.tanh(x @ w)  # float16 under autocast
    exact = jaxamp.autocast_disabled(lambda h, w: jnp.sum(jnp.tanh(h @ w)))(h, w)
    return exact, jnp.sum(jnp.tanh(h @ w))

  dots = [in_dtypes(e) for e in eqns_of(jaxamp.autocast(f), x, w, prim="dot_general")]
  assert dots == [(F16, F16), (F32, F32), (F16, F16)]
  g = jax.grad(lambda w: jaxamp.autocast(f)(x, w)[0])(w)
  assert g.dtype == F32
  np.testing.assert_allclose(g, jax.grad(lambda w: f(x, w)[0])(w), rtol=2e-2, atol=2e-2)


def test_an_opt_out_region_inside_a_scan_and_autocast_again_inside_it():
  def f(w, x):
    def layer(h, _):
      h = jnp.tanh(h @ w)  # float16
      h = jaxamp.autocast_disabled(lambda a: jnp.tanh(a @ w))(h)  # float32
      # Enabled again inside the opt-out region: a region of its own, which keeps bfloat16.
      h = jaxamp.autocast_disabled(jaxamp.autocast(lambda a: jnp.tanh(a @ w), "bf16"))(h)
      return h.astype(jnp.float32), None
    return lax.scan(layer, x, None, length=2)[0]

  w, x = DEQ[0], jnp.ones((2, 16))
  (loop,) = eqns_of(jaxamp.autocast(f), w, x, prim="scan")
  dots = [in_dtypes(e)[0] for e in all_eqns(loop.params["jaxpr"])
          if e.primitive.name == "dot_general"]
  assert dots == [F16, F32, BF16]
  np.testing.assert_allclose(jaxamp.autocast(f)(w, x), f(w, x), rtol=5e-2, atol=5e-2)


def test_a_nested_autocast_takes_the_outer_dtype_unless_opted_out():
  w, x = jnp.eye(2), jnp.ones((2, 2))
  inner = jaxamp.autocast(lambda a: a @ w, "bf16")
  assert jaxamp.autocast(lambda a: inner(a))(x).dtype == F16
  assert jaxamp.autocast(lambda a: jaxamp.autocast_disabled(inner)(a))(x).dtype == BF16


def test_an_opt_out_region_outside_autocast_is_the_function():
  f = lambda a, b: a @ b
  np.testing.assert_array_equal(jaxamp.autocast_disabled(f)(A, B), f(A, B))
  assert jaxamp.autocast_disabled(f) == jaxamp.autocast(f, enabled=False)


# ----------------------------------------------------------------------------- linear solves


@LOW
def test_linear_solves_stay_at_their_traced_dtypes_without_a_warning(low):
  m = jnp.asarray([[4.0, 1.0, 0.5], [1.0, 3.0, 0.25], [0.5, 0.25, 2.0]])
  b = jnp.asarray([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])

  def f(m, b):
    return jnp.linalg.solve(m, b), jsp.linalg.cho_solve(jsp.linalg.cho_factor(m), b)

  got = jaxamp.autocast(f, low)(m, b)  # warnings are errors in this suite
  for g, want in zip(got, jax.jit(f)(m, b)):
    assert g.dtype == F32
    np.testing.assert_array_equal(g, want)
  assert all(d == (F32, F32) for e in eqns_of(jaxamp.autocast(f, low), m, b, prim="dot_general")
             for d in [in_dtypes(e)])
  grads = jax.grad(lambda m: jnp.sum(jaxamp.autocast(f, low)(m, b)[0]))(m)
  np.testing.assert_allclose(grads, jax.grad(lambda m: jnp.sum(f(m, b)[0]))(m), rtol=1e-5)
