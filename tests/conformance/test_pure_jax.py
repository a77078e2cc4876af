"""Conformance: plain JAX programs written as JAX's documentation writes them.

Custom differentiation rules (a ``custom_vjp`` whose forward calls the primal,
the documentation's ``clip_gradient`` that keeps an input as residual,
``optax.scale_gradient``), ``jax.nn.dot_product_attention``, ``jax.checkpoint``
with a policy, ``fori_loop``, ``named_scope``, integer embeddings, dropout
keys and a running statistic, a deep-equilibrium layer (a ``while_loop``
solver differentiated implicitly), products with an explicit
``preferred_element_type``, message passing with ``segment_sum`` and
``segment_max``, and an ``autocast_disabled`` region, each through the checks
of ``_harness``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxamp
from tests.conformance import _harness

DTYPES = [jnp.float16, jnp.bfloat16]
KEY = jax.random.key(0)
K1, K2, K3, K4, K5 = jax.random.split(KEY, 5)


def _dense(key, n_in, n_out):
  return {"w": jax.random.normal(key, (n_in, n_out)) / jnp.sqrt(float(n_in)),
          "b": jnp.zeros((n_out,))}


def _affine(h, p):
  return h @ p["w"] + jnp.expand_dims(p["b"], tuple(range(h.ndim - 1)))


# ---------------------------------------------------------------------------------------- rules


@jax.custom_vjp
def sin2(x):
  """The custom_vjp documentation's example: its forward rule calls the primal."""
  return jnp.sin(x) * 2.0


def _sin2_fwd(x):
  return sin2(x), jnp.cos(x)


def _sin2_bwd(cos_x, g):
  return (2.0 * cos_x * g,)


sin2.defvjp(_sin2_fwd, _sin2_bwd)


@jax.custom_vjp
def clip_gradient(x):
  """The documentation's clip_gradient: identity forward, the residual is the input itself."""
  return x


def _clip_fwd(x):
  return x, x


def _clip_bwd(x, g):
  del x
  return (jnp.clip(g, -1.0, 1.0),)


clip_gradient.defvjp(_clip_fwd, _clip_bwd)


def _mlp_params():
  return {"l1": _dense(K1, 8, 16), "l2": _dense(K2, 16, 16), "out": _dense(K3, 16, 4)}


def _mlp(params, x, act):
  h = act(_affine(x, params["l1"]))
  h = act(_affine(h, params["l2"]))
  return _affine(h, params["out"])


def _xent(logits, labels):
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


X = jax.random.normal(K4, (16, 8))
LABELS = jax.random.randint(K5, (16,), 0, 4)

ACTIVATIONS = {
    "custom_vjp_fwd_calls_primal": lambda h: sin2(h),
    "custom_vjp_input_residual": lambda h: jnp.tanh(clip_gradient(h)),
    "optax_scale_gradient": lambda h: jnp.tanh(optax.scale_gradient(h, 0.5)),
}


def _rule_case(kind, rule_sees_scale=False):
  act = ACTIVATIONS[kind]

  def loss(params, batch):
    x, labels = batch
    return _xent(_mlp(params, x, act), labels)

  def loss_with_stats(params, batch, stats):
    return loss(params, batch), stats

  params = _mlp_params()
  return _harness.Case(
      loss=loss, params=params, batch=(X, LABELS), nan_batch=(_harness.nan_like(X), LABELS),
      rule_sees_scale=rule_sees_scale,
      trainer=lambda dtype: _harness.FunctionalTrainer(loss_with_stats, params, {}, dtype))


# ------------------------------------------------------------- a layer stack in a fori_loop


def _stack_params():
  keys = jax.random.split(K1, 4)
  return {"inp": _dense(K2, 8, 16),
          "layers": {"w": jnp.stack([jax.random.normal(k, (16, 16)) / 4.0 for k in keys]),
                     "b": jnp.zeros((4, 16))},
          "ln": {"scale": jnp.ones((16,)), "bias": jnp.zeros((16,))},
          "out": _dense(K3, 16, 4)}


def _layer_norm(p, h):
  mean = jnp.mean(h, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
  return (h - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"][None, :] + p["bias"][None, :]


def _stack_loss(params, batch):
  x, labels = batch
  with jax.named_scope("embed"):
    h = _affine(x, params["inp"])

  @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
  def block(h, w, b):
    with jax.named_scope("block"):
      return h + jax.nn.gelu(_affine(_layer_norm(params["ln"], h), {"w": w, "b": b}))

  def body(i, h):
    return block(h, params["layers"]["w"][i], params["layers"]["b"][i])

  h = jax.lax.fori_loop(0, 4, body, h)
  with jax.named_scope("head"):
    return _xent(_affine(h, params["out"]), labels)


def _stack_case():
  params = _stack_params()
  return _harness.Case(
      loss=_stack_loss, params=params, batch=(X, LABELS), nan_batch=(_harness.nan_like(X), LABELS),
      trainer=lambda dtype: _harness.FunctionalTrainer(
          lambda p, b, s: (_stack_loss(p, b), s), params, {}, dtype))


# ------------------------------------- attention over integer tokens, dropout, a running mean

VOCAB, SEQ, DIM, HEADS = 32, 8, 16, 2
TOKENS = jax.random.randint(K4, (4, SEQ), 0, VOCAB)
WEIGHTS = jnp.ones((4, SEQ))


def _attn_params():
  ks = jax.random.split(K5, 4)
  return {"emb": jax.random.normal(ks[0], (VOCAB, DIM)) * 0.5,
          "qkv": jax.random.normal(ks[1], (DIM, 3, HEADS, DIM // HEADS)) / 4.0,
          "proj": jax.random.normal(ks[2], (HEADS, DIM // HEADS, DIM)) / 4.0,
          "out": _dense(ks[3], DIM, VOCAB)}


def _attn_forward(params, batch, stats):
  tokens, weights, key = batch
  h = params["emb"][tokens]  # integer embedding lookup
  qkv = jnp.einsum("bsd,dthk->tbshk", h, params["qkv"])
  att = jax.nn.dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
  h = h + jnp.einsum("bshk,hkd->bsd", att, params["proj"])
  keep = jax.random.bernoulli(key, 0.9, h.shape)  # dropout, the key passed in with the batch
  h = jnp.where(keep, h / 0.9, jnp.zeros_like(h))
  batch_mean = jnp.mean(h, axis=(0, 1)).astype(jnp.float32)
  new_stats = {"mean": 0.9 * stats["mean"] + 0.1 * batch_mean}
  logits = _affine(h, params["out"]).astype(jnp.float32)
  targets = jnp.roll(tokens, -1, axis=1)
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return jnp.sum(nll * weights) / jnp.sum(weights), new_stats


def _attn_case():
  params = _attn_params()
  stats = {"mean": jnp.zeros((DIM,))}
  batch = (TOKENS, WEIGHTS, jax.random.key(3, impl="rbg"))
  nan_batch = (TOKENS, _harness.nan_like(WEIGHTS), jax.random.key(3, impl="rbg"))
  return _harness.Case(
      loss=lambda p, b: _attn_forward(p, b, stats)[0], params=params, batch=batch,
      nan_batch=nan_batch, has_stats=True,
      trainer=lambda dtype: _harness.FunctionalTrainer(_attn_forward, params, stats, dtype))


# ---------------------- a deep-equilibrium layer: a while_loop solver, implicitly differentiated


def _solve(f, params, z0):
  """Iterates ``z = f(params, z)`` until the change is under 1e-5 (at most 200 times)."""
  def unsettled(carry):
    z_prev, z, n = carry
    return (jnp.max(jnp.abs(z - z_prev)) > 1e-5) & (n < 200)

  def step(carry):
    _, z, n = carry
    return z, f(params, z), n + 1

  return jax.lax.while_loop(unsettled, step, (z0, f(params, z0), 0))[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def equilibrium(f, params, z0):
  """The fixed point of ``f(params, .)``, differentiated through the implicit function theorem."""
  return _solve(f, params, z0)


def _equilibrium_fwd(f, params, z0):
  z = equilibrium(f, params, z0)
  return z, (params, z)


def _equilibrium_bwd(f, res, z_bar):
  params, z = res
  _, vjp_z = jax.vjp(lambda z: f(params, z), z)
  # u = z_bar + u (df/dz): a fixed point too, solved by the same loop.
  u = _solve(lambda _, u: z_bar + vjp_z(u)[0], None, z_bar)
  _, vjp_params = jax.vjp(lambda p: f(p, z), params)
  return vjp_params(u)[0], jnp.zeros_like(z)


equilibrium.defvjp(_equilibrium_fwd, _equilibrium_bwd)


def _deq_cell(params, z):
  w, injection = params
  return jnp.tanh(z @ w + injection)


def _deq_params():
  return {"inp": _dense(K1, 8, 16), "w": jax.random.normal(K2, (16, 16)) / 16.0,
          "out": _dense(K3, 16, 4)}


def _deq_loss(params, batch):
  x, labels = batch
  injection = _affine(x, params["inp"])  # in the autocast dtype
  z = equilibrium(_deq_cell, (params["w"], injection), jnp.zeros_like(injection))
  return _xent(_affine(z, params["out"]), labels)


def _deq_case():
  params = _deq_params()
  return _harness.Case(
      loss=_deq_loss, params=params, batch=(X, LABELS), nan_batch=(_harness.nan_like(X), LABELS),
      kept=("while",),  # the solver's predicate reads its iterate: it runs at float32
      trainer=lambda dtype: _harness.FunctionalTrainer(
          lambda p, b, s: (_deq_loss(p, b), s), params, {}, dtype))


# ------------------------------------- a float32 result requested of half-precision operands


def _requested_loss(params, batch):
  # Mixed precision written by hand: bfloat16 operands, a float32 result and accumulator.
  x, labels = batch
  bf16 = lambda a: a.astype(jnp.bfloat16)
  h = jax.nn.relu(jnp.einsum("bi,io->bo", bf16(x), bf16(params["l1"]["w"]),
                             preferred_element_type=jnp.float32) + params["l1"]["b"][None, :])
  logits = jax.lax.dot_general(bf16(h), bf16(params["out"]["w"]), (((1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)
  return _xent(logits + params["out"]["b"][None, :], labels)


def _requested_case():
  params = {"l1": _dense(K1, 8, 16), "out": _dense(K3, 16, 4)}
  return _harness.Case(
      loss=_requested_loss, params=params, batch=(X, LABELS),
      nan_batch=(_harness.nan_like(X), LABELS),
      trainer=lambda dtype: _harness.FunctionalTrainer(
          lambda p, b, s: (_requested_loss(p, b), s), params, {}, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_a_requested_float32_result_stays_float32_under_autocast(dtype):
  case = _requested_case()
  jaxpr = jax.make_jaxpr(jaxamp.autocast(case.loss, dtype))(case.params, case.batch).jaxpr
  products = [eqn for eqn, _ in _harness.equations(jaxpr) if eqn.primitive.name == "dot_general"]
  assert len(products) == 2
  assert all(eqn.outvars[0].aval.dtype == jnp.float32 for eqn in products)


# ------------------------------------------ message passing with segment sums and maxima


NODES, EDGES = 12, 30
GRAPH_X = jax.random.normal(K4, (NODES, 8))
# Every node receives an edge from itself (no empty segment), and 18 more edges.
SENDERS = jnp.concatenate([jnp.arange(NODES), jax.random.randint(K5, (EDGES - NODES,), 0, NODES)])
RECEIVERS = jnp.concatenate([jnp.arange(NODES),
                             jax.random.randint(K1, (EDGES - NODES,), 0, NODES)])
GRAPH_LABELS = jax.random.randint(K2, (NODES,), 0, 4)


def _graph_loss(params, batch):
  x, labels = batch
  h = jax.nn.relu(_affine(x, params["inp"]))
  for layer in params["layers"]:
    messages = jax.nn.relu(_affine(h[SENDERS], layer["msg"]))
    total = jax.ops.segment_sum(messages, RECEIVERS, num_segments=NODES)
    peak = jax.ops.segment_max(messages, RECEIVERS, num_segments=NODES)
    h = h + _affine(jnp.concatenate([total, peak], axis=-1), layer["upd"])
  return _xent(_affine(h, params["out"]), labels)


def _graph_case():
  keys = jax.random.split(K3, 4)
  params = {"inp": _dense(keys[0], 8, 16),
            "layers": [{"msg": _dense(keys[1], 16, 16), "upd": _dense(keys[2], 32, 16)}],
            "out": _dense(keys[3], 16, 4)}
  return _harness.Case(
      loss=_graph_loss, params=params, batch=(GRAPH_X, GRAPH_LABELS),
      nan_batch=(_harness.nan_like(GRAPH_X), GRAPH_LABELS),
      trainer=lambda dtype: _harness.FunctionalTrainer(
          lambda p, b, s: (_graph_loss(p, b), s), params, {}, dtype))


# ------------------------------------------------- attention with float32 scores, opted out


def _scores(q, k):
  return jnp.einsum("bqd,bkd->bqk", q, k) / jnp.sqrt(float(q.shape[-1]))


def _opt_out_loss(params, batch):
  x, labels = batch  # x: (batch, 8), read as 4 tokens of 2 features
  h = _affine(x.reshape(-1, 4, 2), params["emb"])
  q, k, v = (h @ params[name] for name in ("q", "k", "v"))
  # The scores and their softmax at float32, as the program wrote them: an opt-out region.
  weights = jaxamp.autocast_disabled(lambda q, k: jax.nn.softmax(_scores(q, k), axis=-1))(q, k)
  h = jnp.einsum("bqk,bkd->bqd", weights, v)
  return _xent(_affine(jnp.mean(h, axis=1), params["out"]), labels)


def _opt_out_case():
  keys = jax.random.split(K4, 5)
  params = {"emb": _dense(keys[0], 2, 16),
            **{name: jax.random.normal(key, (16, 16)) / 4.0
               for name, key in zip("qkv", keys[1:4])},
            "out": _dense(keys[4], 16, 4)}
  return _harness.Case(
      loss=_opt_out_loss, params=params, batch=(X, LABELS),
      nan_batch=(_harness.nan_like(X), LABELS), kept=("autocast_disabled",),
      trainer=lambda dtype: _harness.FunctionalTrainer(
          lambda p, b, s: (_opt_out_loss(p, b), s), params, {}, dtype))


CASES = {
    "custom_vjp_fwd_calls_primal": lambda: _rule_case("custom_vjp_fwd_calls_primal"),
    # Its backward rule clips the cotangent: it clips the loss-scaled one.
    "custom_vjp_input_residual": lambda: _rule_case("custom_vjp_input_residual", True),
    "optax_scale_gradient": lambda: _rule_case("optax_scale_gradient"),
    "fori_loop_checkpoint_policy_named_scope": _stack_case,
    "attention_embeddings_dropout_stats": _attn_case,
    "while_loop_solver_implicit_gradient": _deq_case,
    "requested_preferred_element_type": _requested_case,
    "segment_sum_segment_max_message_passing": _graph_case,
    "opt_out_region_float32_attention_scores": _opt_out_case,
}



@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", sorted(CASES))
def test_pure_jax_model(name, dtype):
  _harness.check(CASES[name](), dtype, "jax/" + name)
