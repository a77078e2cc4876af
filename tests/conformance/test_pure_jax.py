"""Conformance: plain JAX programs written as JAX's documentation writes them.

Custom differentiation rules (a ``custom_vjp`` whose forward calls the primal,
the documentation's ``clip_gradient`` that keeps an input as residual,
``optax.scale_gradient``), ``jax.nn.dot_product_attention``, ``jax.checkpoint``
with a policy, ``fori_loop``, ``named_scope``, integer embeddings, dropout
keys and a running statistic, each through the checks of ``_harness``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

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


CASES = {
    "custom_vjp_fwd_calls_primal": lambda: _rule_case("custom_vjp_fwd_calls_primal"),
    # Its backward rule clips the cotangent: it clips the loss-scaled one.
    "custom_vjp_input_residual": lambda: _rule_case("custom_vjp_input_residual", True),
    "optax_scale_gradient": lambda: _rule_case("optax_scale_gradient"),
    "fori_loop_checkpoint_policy_named_scope": _stack_case,
    "attention_embeddings_dropout_stats": _attn_case,
}



@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", sorted(CASES))
def test_pure_jax_model(name, dtype):
  _harness.check(CASES[name](), dtype, "jax/" + name)
