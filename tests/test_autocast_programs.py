"""autocast on the programs people write: custom derivative rules, control flow, NNX, Equinox.

The control-flow matrix (``test_control_flow_matrix_*``) runs every construct
whose jaxpr parameters jaxamp reads (jit with shardings, cond, while, scan,
remat with a policy, custom rules, shard_map, named scopes) through autocast
and through the fused selection; ``.ci/newest`` runs this file on the newest
jax.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp._src import jaxpr_interp
from jaxamp._src import selective_update
from jaxamp._src import compat

F16, BF16, F32 = jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
LOW = pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
TOL = {F16: 1e-2, BF16: 5e-2}

X = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)
W = jnp.linspace(-0.5, 0.5, 16, dtype=jnp.float32).reshape(4, 4) + jnp.eye(4)


def all_eqns(jaxpr):
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in compat.jaxprs_in_params(eqn.params):
      yield from all_eqns(sub)


def dot_dtypes(fn, *args):
  return [tuple(v.aval.dtype for v in e.invars) for e in all_eqns(jax.make_jaxpr(fn)(*args))
          if e.primitive.name == "dot_general"]


def assert_grads_close(f, args, dtype, argnums=0):
  """Gradients under autocast are float32 and within the dtype's tolerance of float32's."""
  got = jax.jit(jax.grad(jaxamp.autocast(f, dtype), argnums=argnums))(*args)
  ref = jax.grad(f, argnums=argnums)(*args)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    assert g.dtype == F32
    np.testing.assert_allclose(g, r, rtol=TOL[dtype], atol=TOL[dtype])
  return got


# ----------------------------------------------------------------------------- custom rules


@jax.custom_vjp
def _sin2(x):
  return jnp.sin(x) * 2.0


# The pattern of JAX's custom_vjp documentation: the forward rule calls the function.
_sin2.defvjp(lambda x: (_sin2(x), x), lambda x, g: (2.0 * jnp.cos(x) * g,))


@jax.custom_vjp
def _clip_gradient(x):
  return x


# JAX's clip_gradient: the residual is the input itself.
_clip_gradient.defvjp(lambda x: (x, x), lambda x, g: (jnp.clip(g, -1.0, 1.0),))


@jax.custom_vjp
def _times3(x):
  return x * 3.0


# A residual that is a constant of the forward rule.
_times3.defvjp(lambda x: (x * 3.0, jnp.full((3, 4), 3.0, jnp.float32)), lambda r, g: (g * r,))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _apply(fn, x):
  return fn(x)


_apply.defvjp(lambda fn, x: (fn(x), x), lambda fn, x, g: (g * 2.0 * x,))


@jax.custom_vjp
def _pair(a, b):
  return a * b, a + b


_PERTURBED = []


def _pair_fwd(a, b):  # symbolic zeros: the forward rule sees which inputs are perturbed
  _PERTURBED.append((a.perturbed, b.perturbed))
  return _pair(a.value, b.value), (a.value, b.value)


def _pair_bwd(res, g):
  a, b = res
  _PERTURBED.append(tuple(isinstance(t, jax.custom_derivatives.SymbolicZero) for t in g))
  g1, g2 = (jnp.zeros_like(a) if isinstance(t, jax.custom_derivatives.SymbolicZero) else t
            for t in g)
  return g1 * b + g2, g1 * a + g2


_pair.defvjp(_pair_fwd, _pair_bwd, symbolic_zeros=True)


@jax.custom_jvp
def _product(a, b):
  return a * b


_product.defjvps(lambda t, ans, a, b: t * b, lambda t, ans, a, b: t * a)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _apply_jvp(fn, x):
  return fn(x)


_apply_jvp.defjvp(lambda fn, p, t: (fn(p[0]), t[0] * 5.0))


@jax.custom_jvp
def _product_sz(a, b):
  return a * b


def _product_sz_jvp(primals, tangents):
  a, b = primals
  ta, tb = (jnp.zeros_like(p) if isinstance(t, jax.custom_derivatives.SymbolicZero) else t
            for p, t in zip(primals, tangents))
  return _product_sz(a, b), ta * b + a * tb


_product_sz.defjvp(_product_sz_jvp, symbolic_zeros=True)


@jax.custom_vjp
def _times_int(x, n):
  return x * n.astype(x.dtype)


_times_int.defvjp(lambda x, n: (_times_int(x, n), n), lambda n, g: (g * n.astype(g.dtype), None))


CUSTOM_RULES = {
    "fwd_calls_the_function": lambda w: jnp.sum(_sin2(X @ w)),
    "residual_is_the_input": lambda w: jnp.sum(_clip_gradient(X @ w * 2.0)),
    "residual_is_a_constant": lambda w: jnp.sum(_times3(X @ w)),
    "nondiff_argnums": lambda w: jnp.sum(_apply(jnp.tanh, X @ w)),
    "symbolic_zeros": lambda w: jnp.sum(_pair(X @ w, jnp.ones((3, 4)))[0]),
    "custom_jvp_defjvps": lambda w: jnp.sum(_product(X @ w, X @ w)),
    "custom_jvp_nondiff_argnums": lambda w: jnp.sum(_apply_jvp(jnp.sin, X @ w)),
    "custom_jvp_symbolic_zeros": lambda w: jnp.sum(_product_sz(X @ w, jnp.ones((3, 4)))),
    "integer_input": lambda w: jnp.sum(_times_int(X @ w, jnp.int32(3))),
    "optax_scale_gradient": lambda w: jnp.sum(optax.scale_gradient(jnp.tanh(X @ w), 0.5)),
    "relu": lambda w: jnp.sum(jax.nn.relu(X @ w)),
    "dot_product_attention": lambda w: jnp.sum(jax.nn.dot_product_attention(
        (X @ w)[None, :, None], (X @ w)[None, :, None], (X @ w)[None, :, None])),
}


@LOW
@pytest.mark.parametrize("name", sorted(CUSTOM_RULES))
def test_custom_rule_patterns(name, dtype):
  f = CUSTOM_RULES[name]
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no fallback: each pattern is interpreted
    np.testing.assert_allclose(jaxamp.autocast(f, dtype)(W), f(W), rtol=TOL[dtype])
    assert_grads_close(f, (W,), dtype)
    assert dot_dtypes(jaxamp.autocast(f, dtype), W)[0] == (dtype, dtype)


@LOW
def test_symbolic_zeros_reach_the_rules_as_without_autocast(dtype):
  f = CUSTOM_RULES["symbolic_zeros"]
  seen = []
  for fn in (f, jaxamp.autocast(lambda w: f(w), dtype)):  # a new function: traced anew
    _PERTURBED.clear()
    jax.grad(fn)(W)
    seen.append(list(_PERTURBED))
  # The constant second input is not perturbed; the unused second output's cotangent is zero.
  assert seen[0] == seen[1] == [(True, False), (False, True)]


def test_the_backward_rule_runs_at_the_dtypes_it_was_written_for():
  seen = []

  @jax.custom_vjp
  def f(x):
    return x * 2.0

  def bwd(res, g):
    seen.append((res.dtype, g.dtype))
    return (g * 2.0,)

  f.defvjp(lambda x: (f(x), x), bwd)
  grad = jax.grad(jaxamp.autocast(lambda w: jnp.sum(f(X @ w))))(W)
  assert seen[-1] == (F32, F32) and grad.dtype == F32
  # The clip of the input-residual rule sees float32 cotangents and clips them exactly.
  g = jax.grad(jaxamp.autocast(lambda x: jnp.sum(_clip_gradient(x * 2.0) * 5.0)))(jnp.ones(3))
  np.testing.assert_array_equal(g, jnp.full(3, 2.0))


@LOW
def test_equinox_filter_custom_vjp_and_modules(dtype):
  eqx = pytest.importorskip("equinox")

  @eqx.filter_custom_vjp
  def scaled(vjp_arg, other):
    (a,) = vjp_arg
    return a * other["s"]

  def fwd(perturbed, vjp_arg, other):
    (a,) = vjp_arg
    return a * other["s"], a  # a pass-through residual

  def bwd(res, g, perturbed, vjp_arg, other):
    return (g * other["s"] * 2.0,)

  scaled.def_fwd(fwd)
  scaled.def_bwd(bwd)
  f = lambda w: jnp.sum(scaled((X @ w,), {"s": 3.0, "act": jnp.tanh}))
  assert_grads_close(f, (W,), dtype)

  mlp = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0))
  loss = lambda m, x: jnp.sum(jax.vmap(m)(x).astype(jnp.float32) ** 2)
  grads = eqx.filter_jit(eqx.filter_grad(jaxamp.autocast(loss, dtype)))(mlp, X)
  ref = eqx.filter_grad(loss)(mlp, X)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
    assert g.dtype == F32
    np.testing.assert_allclose(g, r, rtol=5 * TOL[dtype], atol=5 * TOL[dtype])
  dots = dot_dtypes(lambda x: jaxamp.autocast(loss, dtype)(mlp, x), X)
  assert dots and all(d == (dtype, dtype) for d in dots)


@pytest.mark.skipif(not hasattr(jax.custom_vjp, "defvjp_with_logs"),
                    reason="backward rules log from jax 0.12 on")
def test_the_logs_of_a_backward_rule_reach_the_vjp_under_autocast():
  @jax.custom_vjp
  def f(x):
    return jnp.sin(x)

  f.defvjp_with_logs(lambda x: (f(x), x), lambda x, g: ((g * jnp.cos(x),), {"sum": jnp.sum(g)}))
  loss = lambda w: jnp.sum(f(X @ w))
  _, vjp = jax.vjp(jaxamp.autocast(loss), W)
  (ct,), logs = vjp.with_logs(jnp.float32(1.0))
  _, want_vjp = jax.vjp(loss, W)
  (want,), want_logs = want_vjp.with_logs(jnp.float32(1.0))
  assert ct.dtype == F32 and logs.keys() == want_logs.keys()
  np.testing.assert_array_equal(logs["sum"], want_logs["sum"])
  np.testing.assert_allclose(ct, want, rtol=1e-2, atol=1e-2)


def test_a_rule_closing_over_traced_values_warns_and_runs_as_traced():
  def loss(w, y):
    @jax.custom_vjp
    def f(a):
      return a * y

    f.defvjp(lambda a: (f(a), None), lambda r, c: (c * y,))
    return jnp.sum(f(X @ w))

  y = jnp.full((3, 4), 2.0)
  with pytest.warns(jaxamp.AutocastWarning, match="'custom_vjp_call'.*closes over traced"):
    np.testing.assert_allclose(jaxamp.autocast(loss)(W, y), loss(W, y), rtol=1e-2)


def test_unknown_control_flow_warns_once_naming_the_primitive():
  def f(x, w):  # two 'reduce' equations, whose computation is a body autocast does not enter
    a = lax.reduce(x @ w, 0.0, lambda u, v: u + jnp.abs(v), (1,))
    b = lax.reduce(x * 2.0, 0.0, lambda u, v: u + jnp.abs(v), (0,))
    return jnp.sum(a) + jnp.sum(b)

  w = jnp.eye(4)
  with pytest.warns(jaxamp.AutocastWarning, match="'reduce'") as record:
    out = jaxamp.autocast(f)(X, w)
  assert len(record) == 1
  np.testing.assert_allclose(out, f(X, w), rtol=1e-3)  # x @ w is a float16 product
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # an 'off' override says it is meant
    jaxamp.autocast(f, overrides={"reduce": "off"})(X, w)


# ----------------------------------------------------------------------------- the matrix


def _mesh():
  return jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))


def _programs():
  """Programs of ``(w, x) -> scalar``, each built around one construct."""
  mesh = _mesh()
  rep = NamedSharding(mesh, P())

  def jit_shardings(w, x):
    inner = jax.jit(lambda a, b: jnp.tanh(a @ b), in_shardings=(rep, rep), out_shardings=rep)
    return jnp.sum(inner(x, w))

  def cond(w, x):
    h = lax.cond(jnp.sum(x) > -100.0, lambda a: jnp.tanh(a @ w), lambda a: -a, x)
    return jnp.sum(h)

  def while_loop(w, x):
    return jnp.sum(lax.fori_loop(0, 2, lambda i, a: jnp.tanh(a @ w), x))

  def scan(w, x):
    def layer(h, _):
      return jnp.tanh(h @ w), jnp.sum(h)
    h, sums = lax.scan(layer, x, None, length=3)
    return jnp.sum(h) + jnp.sum(sums)

  def remat(w, x):
    body = jax.checkpoint(lambda a: jnp.exp(jnp.tanh(a @ w)),
                          policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    return jnp.sum(body(x))

  def custom_rules(w, x):
    return jnp.sum(_sin2(x @ w)) + jnp.sum(jax.nn.relu(_clip_gradient(x @ w)))

  def shard_map(w, x):
    body = jax.shard_map(lambda a, b: jnp.tanh(a @ b), mesh=mesh, in_specs=(P(), P()),
                         out_specs=P())
    return jnp.sum(body(x, w))

  def named_scope(w, x):
    with jax.named_scope("matrix_scope"):
      return jnp.sum(jnp.tanh(x @ w))

  return {f.__name__: f for f in (jit_shardings, cond, while_loop, scan, remat, custom_rules,
                                  shard_map, named_scope)}


PROGRAMS = sorted(_programs())


@LOW
@pytest.mark.parametrize("name", PROGRAMS)
def test_control_flow_matrix_autocast(name, dtype):
  f = _programs()[name]

  def scoped(w, x):
    with jax.named_scope("outer_scope"):
      return f(w, x)

  with jax.set_mesh(_mesh()):
    g = jaxamp.autocast(scoped, dtype)
    np.testing.assert_allclose(g(W, X), f(W, X), rtol=TOL[dtype], atol=TOL[dtype])
    dots = dot_dtypes(g, W, X)
    assert dots and all(d == (dtype, dtype) for d in dots), dots
    if name != "while_loop":  # fori_loop with a traced trip count is forward-only in JAX
      assert_grads_close(scoped, (W, X), dtype)
    # Names survive into the lowered program, the inner scopes' included.
    text = jax.jit(g).lower(W, X).as_text(debug_info=True)
    assert "outer_scope/" in text and "outer_scope/outer_scope" not in text
    assert "test_autocast_programs.py" in text  # the source lines of the operations
    if name == "named_scope":
      assert "outer_scope/matrix_scope/" in text
    assert "outer_scope/" in jax.jit(jax.grad(g)).lower(W, X).as_text(debug_info=True)


def _update_with(name):
  """An optimizer update whose computation goes through one construct of the matrix."""
  f = _programs()[name]

  def update(grads, state):
    direction = jax.grad(f)(grads, X) if name != "while_loop" else jnp.tanh(grads) * f(grads, X)
    with jax.named_scope("update_scope"):
      mu = 0.9 * state + direction
    return -0.1 * mu, mu

  return update


@pytest.mark.parametrize("name", PROGRAMS)
def test_control_flow_matrix_fused_selection(name):
  update = _update_with(name)
  state = jnp.full((4, 4), 0.5, jnp.float32)

  @jax.jit
  def step(pred, grads, state):
    fused = selective_update.select_update(pred, lambda: update(grads, state), state)
    plain_updates, plain_state = update(grads, state)
    return fused, (plain_updates, plain_state)

  with jax.set_mesh(_mesh()), warnings.catch_warnings():
    warnings.simplefilter("error")  # the interpretation does not fall back
    (u, s), (pu, ps) = step(True, W, state)
    np.testing.assert_allclose(u, pu, rtol=1e-6)
    np.testing.assert_allclose(s, ps, rtol=1e-6)
    (u, s), _ = step(False, W, state)
    np.testing.assert_array_equal(s, state)
    assert bool(jnp.all((u == 0) & jnp.signbit(u)))
    text = step.lower(True, W, state).as_text(debug_info=True)
    assert "update_scope" in text


def test_the_guarded_entry_point_names_what_moved(monkeypatch):
  jaxpr_interp.check()
  eqn = jax.make_jaxpr(lambda x: lax.cond(x > 0, jnp.sin, jnp.cos, x))(1.0).jaxpr.eqns[-1]
  with pytest.raises(jaxpr_interp.InterpretError, match=r"jax .*'cond'.*no parameter 'gone'"):
    jaxpr_interp.param(eqn, "gone")
  _check_again(monkeypatch)
  monkeypatch.setattr(jaxpr_interp, "_source_info", None)
  with pytest.raises(jaxpr_interp.InterpretError, match="user_context"):
    jaxpr_interp.check()


def test_the_check_takes_every_family_it_enters_through_the_code_that_enters_it():
  assert set(jaxpr_interp._PROBES) == set(jaxpr_interp.FAMILIES)
  assert jaxpr_interp.check() == {}


def _check_again(monkeypatch):
  monkeypatch.setattr(jaxpr_interp, "_checked", {})


@pytest.mark.parametrize("key, families", [
    ("num_consts", {"custom_jvp", "custom_vjp"}),
    ("bwd", {"custom_vjp"}),
    ("jvp_jaxpr_fun", {"custom_jvp"}),
    ("check_vma", {"shard_map"}),
])
def test_a_renamed_parameter_disables_the_families_that_read_it(monkeypatch, key, families):
  # As on a release that renamed the parameter: the interpreter reads it under the old name and
  # finds nothing. The families that read it are reported; the others read no name.
  real = jaxpr_interp.param
  monkeypatch.setattr(jaxpr_interp, "param",
                      lambda eqn, k: real(eqn, k + "_renamed" if k == key else k))
  _check_again(monkeypatch)
  broken = jaxpr_interp.check()
  assert set(broken) == families
  assert all(f"no parameter '{key}_renamed'" in reason for reason in broken.values())


@LOW
def test_a_renamed_parameter_falls_back_to_the_traced_dtypes_with_one_warning(monkeypatch, dtype):
  real = jaxpr_interp.param
  monkeypatch.setattr(jaxpr_interp, "param",
                      lambda eqn, k: real(eqn, "fwd_thunk" if k == "fwd_jaxpr_thunk" else k))
  _check_again(monkeypatch)

  def f(w, x):  # three custom_vjp functions, a scan and a cond
    h = _sin2(x @ w) + _clip_gradient(x @ w) + _times3(x)
    h = lax.scan(lambda c, _: (jnp.tanh(c @ w), None), h, None, length=2)[0]
    return jnp.sum(lax.cond(jnp.sum(h) > -100.0, lambda a: a @ w, lambda a: -a, h))

  with pytest.warns(jaxamp.AutocastWarning) as record:
    g = jaxamp.autocast(f, dtype)
    out, grads = g(W, X), jax.grad(g)(W, X)
  messages = [str(r.message) for r in record]
  assert len(messages) == 1, messages
  assert "'custom_vjp_call'" in messages[0] and "'fwd_jaxpr_thunk'" in messages[0]
  # The custom_vjp functions run at their traced dtypes (float32, their half-precision
  # arguments cast back); scan and cond, which read no parameter by name, are entered.
  eqns = list(all_eqns(jax.make_jaxpr(g)(W, X)))
  custom = [e for e in eqns if e.primitive.name == "custom_vjp_call"]
  assert len(custom) == 3 and all(v.aval.dtype == F32 for e in custom for v in e.invars)
  assert dot_dtypes(g, W, X) == [(dtype, dtype)] * 4
  np.testing.assert_allclose(out, f(W, X), rtol=TOL[dtype], atol=TOL[dtype])
  np.testing.assert_allclose(grads, jax.grad(f)(W, X), rtol=TOL[dtype], atol=TOL[dtype])


def test_when_binding_itself_moves_autocast_runs_the_function_as_traced_with_a_warning(
    monkeypatch):
  _check_again(monkeypatch)
  monkeypatch.setattr(jaxpr_interp, "_source_info", None)
  f = lambda w, x: jnp.sum(jnp.tanh(x @ w))
  with pytest.warns(jaxamp.AutocastWarning, match="cannot interpret jaxprs.*user_context"):
    out = jax.jit(jaxamp.autocast(f))(W, X)
  np.testing.assert_array_equal(out, jax.jit(f)(W, X))


def test_a_body_whose_types_cannot_be_kept_falls_back_to_its_traced_dtypes(monkeypatch):
  # As if a release's scan needed a body of other types than the one it was traced with.
  real = jaxpr_interp.retrace
  monkeypatch.setattr(jaxpr_interp, "retrace", lambda jaxpr, fn, avals: real(
      jaxpr, lambda *xs: [x * 1 for x in fn(*xs)][:-1], avals))
  f = _programs()["scan"]
  with pytest.warns(jaxamp.AutocastWarning, match="cannot interpret 'scan'.*interpreted again"):
    out = jaxamp.autocast(f)(W, X)
  np.testing.assert_array_equal(out, jax.jit(f)(W, X))


# ----------------------------------------------------------------------------- Flax NNX


def _nnx_model(nnx, dropout_seed=1):
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.bn = nnx.BatchNorm(4, rngs=rngs)
      self.drop = nnx.Dropout(0.5, rngs=rngs)
      self.lin = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
      return self.lin(self.drop(self.bn(x)))

  return Net(nnx.Rngs(0, dropout=dropout_seed))


@LOW
def test_nnx_step_updates_batch_stats_and_rng_as_without_autocast(dtype):
  nnx = pytest.importorskip("flax.nnx")
  x = jax.random.normal(jax.random.key(0), (8, 4)) * 3.0 + 1.0
  y = jnp.ones((8, 2))

  traces = []

  def loss_fn(model, x, y):
    traces.append(None)
    return jnp.mean((model(x).astype(jnp.float32) - y) ** 2)

  results = []
  for wrap in (lambda f: f, lambda f: jaxamp.autocast(f, dtype)):
    model = _nnx_model(nnx)

    @nnx.jit
    def step(model, x, y, wrap=wrap):
      return nnx.grad(wrap(loss_fn))(model, x, y)

    for _ in range(2):
      grads = step(model, x, y)
    results.append((nnx.state(model, nnx.BatchStat), model.drop.rngs.count[...],
                    model.drop.rngs.key[...], grads))
  assert len(traces) == 2  # one trace with autocast, one without: the step compiles once
  (stats, count, key, grads), (stats_a, count_a, key_a, grads_a) = results
  assert int(count) == 2 and int(count_a) == 2
  np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(key_a))
  for s, s_a in zip(jax.tree.leaves(stats), jax.tree.leaves(stats_a)):
    assert float(jnp.max(jnp.abs(s))) > 0  # they moved
    np.testing.assert_array_equal(s, s_a)
  for g, g_a in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_a)):
    assert g_a.dtype == F32
    np.testing.assert_allclose(g_a, g, rtol=TOL[dtype], atol=TOL[dtype])


def test_nnx_module_as_the_function_and_outside_state_refused():
  nnx = pytest.importorskip("flax.nnx")
  x = jnp.full((8, 4), 3.0)
  bn = nnx.BatchNorm(4, rngs=nnx.Rngs(0))
  jaxamp.autocast(bn)(x)  # the module itself, a bound method, a partial: its state is split
  lin = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  assert jaxamp.autocast(lin.__call__)(x).dtype == F32
  assert jaxamp.autocast(functools.partial(lambda m, a: m(a), lin))(x).dtype == F32
  np.testing.assert_allclose(bn.mean[...], jnp.full(4, 0.03), rtol=1e-6)  # momentum 0.99
  with pytest.raises(ValueError, match=r"reads the NNX object BatchNorm.*as an argument"):
    jaxamp.autocast(lambda a: jnp.sum(bn(a)))(x)

  class Grows(nnx.Module):
    def __call__(self, a):
      self.extra = nnx.BatchStat(jnp.zeros(()))
      return a

  with pytest.raises(ValueError, match="changed the structure of the NNX objects"):
    jaxamp.autocast(lambda m, a: m(a))(Grows(), x)
