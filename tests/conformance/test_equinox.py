"""Conformance: Equinox models in the style of Equinox's examples, built from ``eqx.nn`` layers.

An MLP whose activation is an ``eqx.filter_custom_vjp``, a one-block
transformer (``eqx.nn.MultiheadAttention``, ``eqx.nn.LayerNorm``,
``eqx.nn.Embedding``), and a CNN with ``eqx.nn.BatchNorm`` whose statistics
live in an ``eqx.nn.State``. Steps are ``eqx.filter_jit`` functions over
``eqx.filter(model, eqx.is_array)`` parameters; the state of a skipped step is
kept with ``jaxamp.keep_if_skipped``.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import jaxamp
from tests.conformance import _harness

DTYPES = [jnp.float16, jnp.bfloat16]
X = jax.random.normal(jax.random.key(6), (8, 8))
LABELS = jax.random.randint(jax.random.key(4), (8,), 0, 4)
IMAGES = jax.random.normal(jax.random.key(3), (8, 1, 8, 8))
TOKENS = jax.random.randint(jax.random.key(1), (4, 8), 0, 32)
SEQ_LABELS = jax.random.randint(jax.random.key(2), (4,), 0, 4)


def _xent(logits, labels):
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


@eqx.filter_custom_vjp
def clipped_tanh(vjp_arg, scale):
  """tanh whose backward clips the cotangent; ``scale`` passes through as a residual input."""
  return jnp.tanh(vjp_arg) * scale


@clipped_tanh.def_fwd
def _clipped_tanh_fwd(perturbed, vjp_arg, scale):
  del perturbed
  out = jnp.tanh(vjp_arg) * scale
  return out, (out, scale)


@clipped_tanh.def_bwd
def _clipped_tanh_bwd(residuals, grad_obj, perturbed, vjp_arg, scale):
  del perturbed, vjp_arg
  out, scale = residuals
  g = jnp.clip(grad_obj, -1.0, 1.0)
  return g * (scale - out * out / scale)


class MLP(eqx.Module):
  layers: list

  def __init__(self, key):
    k1, k2, k3 = jax.random.split(key, 3)
    self.layers = [eqx.nn.Linear(8, 16, key=k1), eqx.nn.Linear(16, 16, key=k2),
                   eqx.nn.Linear(16, 4, key=k3)]

  def __call__(self, x):
    for layer in self.layers[:-1]:
      x = clipped_tanh(layer(x), jnp.float32(1.0))
    return self.layers[-1](x)


class TinyTransformer(eqx.Module):
  embed: eqx.nn.Embedding
  norm1: eqx.nn.LayerNorm
  attn: eqx.nn.MultiheadAttention
  norm2: eqx.nn.LayerNorm
  mlp: eqx.nn.MLP
  head: eqx.nn.Linear

  def __init__(self, key):
    ks = jax.random.split(key, 4)
    self.embed = eqx.nn.Embedding(32, 16, key=ks[0])
    self.norm1 = eqx.nn.LayerNorm(16)
    self.attn = eqx.nn.MultiheadAttention(2, 16, key=ks[1])
    self.norm2 = eqx.nn.LayerNorm(16)
    self.mlp = eqx.nn.MLP(16, 16, 32, 1, activation=jax.nn.gelu, key=ks[2])
    self.head = eqx.nn.Linear(16, 4, key=ks[3])

  def __call__(self, tokens):
    x = jax.vmap(self.embed)(tokens)
    h = jax.vmap(self.norm1)(x)
    x = x + self.attn(h, h, h)
    x = x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))
    return self.head(jnp.mean(x, axis=0))


class CNN(eqx.Module):
  conv: eqx.nn.Conv2d
  bn: eqx.nn.BatchNorm
  linear: eqx.nn.Linear

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.conv = eqx.nn.Conv2d(1, 8, 3, padding=1, key=k1)
    self.bn = eqx.nn.BatchNorm(8, axis_name="batch", momentum=0.9, mode="ema")
    self.linear = eqx.nn.Linear(8, 4, key=k2)

  def __call__(self, x, state):
    x = self.conv(x)
    x, state = self.bn(x, state)
    x = jax.nn.relu(x)
    return self.linear(jnp.mean(x, axis=(1, 2))), state


def _batched_loss(model, state, batch):
  """The loss of a model with state, vmapped over the batch as Equinox's BatchNorm example does."""
  x, labels = batch
  logits, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
      x, state)
  return _xent(logits, labels), state


class EqxTrainer:
  """An ``eqx.filter_jit`` step on ``eqx.filter(model, eqx.is_array)`` with a loss-scaled tx."""

  def __init__(self, model, state, loss_fn, dtype):
    self.model, self.state = model, state
    self.tx = _harness.make_tx()
    self._opt_state = self.tx.init(eqx.filter(model, eqx.is_array))
    self.traces = 0
    loss_fn = jaxamp.autocast(loss_fn, dtype)

    @eqx.filter_jit
    def step(model, state, opt_state, batch):
      self.traces += 1
      params, static = eqx.partition(model, eqx.is_array)

      def scaled(params):
        loss, new_state = loss_fn(params, state, batch)
        return jaxamp.scale_loss(loss, opt_state), (loss, new_state)

      grads, (loss, new_state) = jax.grad(scaled, has_aux=True)(params)
      updates, new_opt_state = self.tx.update(grads, opt_state, params)
      model = eqx.combine(eqx.apply_updates(params, updates), static)
      new_state = jaxamp.keep_if_skipped(new_state, state, opt_state, new_opt_state)
      return model, new_state, new_opt_state, (loss, _harness.unscaled(grads, opt_state))

    self._step = step
    self._static = eqx.partition(model, eqx.is_array)[1]

  def step(self, batch):
    self.model, self.state, self._opt_state, out = self._step(
        self.model, self.state, self._opt_state, batch)
    return out

  def snapshot(self):
    return {"params": jax.device_get(eqx.filter(self.model, eqx.is_array)),
            "stats": jax.device_get(self.state),
            "inner_opt_state": _harness.inner_opt_state(self._opt_state)}

  def opt_state(self):
    return self._opt_state

  def params(self):
    return eqx.filter(self.model, eqx.is_array)


def _case(model, state, loss_with_state, batch, nan_batch, has_stats=False,
          low_ops=_harness.MATMUL, rule_sees_scale=False):
  params, static = eqx.partition(model, eqx.is_array)

  def with_static(params, st, batch):
    return loss_with_state(eqx.combine(params, static), st, batch)

  def loss(params, batch):
    return with_static(params, state, batch)[0]

  return _harness.Case(loss=loss, params=params, batch=batch, nan_batch=nan_batch,
                       has_stats=has_stats, low_ops=low_ops, rule_sees_scale=rule_sees_scale,
                       trainer=lambda dtype: EqxTrainer(model, state, with_static, dtype))


def _no_state(call):
  def loss(model, state, batch):
    x, labels = batch
    return _xent(jax.vmap(model)(x) if call == "vmap" else model(x), labels), state
  return loss


def _mlp_case():
  # Its backward rule (filter_custom_vjp) clips the cotangent: it clips the loss-scaled one.
  return _case(MLP(jax.random.key(0)), None, _no_state("vmap"), (X, LABELS),
               (_harness.nan_like(X), LABELS), rule_sees_scale=True)


def _weighted_loss(model, state, batch):
  tokens, labels, weights = batch
  logp = jax.nn.log_softmax(jax.vmap(model)(tokens).astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(logp, labels[:, None], axis=-1)[:, 0]
  return jnp.sum(nll * weights) / jnp.sum(weights), state


SEQ_WEIGHTS = jnp.ones((4,))


def _transformer_case():
  return _case(TinyTransformer(jax.random.key(0)), None, _weighted_loss,
               (TOKENS, SEQ_LABELS, SEQ_WEIGHTS),
               (TOKENS, SEQ_LABELS, _harness.nan_like(SEQ_WEIGHTS)))


def _cnn_case():
  model, state = eqx.nn.make_with_state(CNN)(jax.random.key(0))
  return _case(model, state, _batched_loss, (IMAGES, LABELS),
               (_harness.nan_like(IMAGES), LABELS), has_stats=True, low_ops=_harness.CONV)


CASES = {
    "mlp_filter_custom_vjp": _mlp_case,
    "transformer": _transformer_case,
    "cnn_batchnorm_state": _cnn_case,
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", sorted(CASES))
def test_equinox_model(name, dtype):
  _harness.check(CASES[name](), dtype, "equinox/" + name)
