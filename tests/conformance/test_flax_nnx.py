"""Conformance: Flax NNX models in the style of NNX's guides, trained with ``jaxamp.nnx.Optimizer``.

A CNN with BatchNorm and Dropout (the MNIST tutorial's shape), and a layer
stack created with ``nnx.vmap`` and applied with ``nnx.scan`` over
``nnx.remat`` blocks; each through the checks of ``_harness``. The train step
is the idiomatic one, ``nnx.value_and_grad(jaxamp.autocast(loss_fn, dtype))``
inside ``nnx.jit``, and keeps the BatchNorm statistics of a skipped step
with ``jaxamp.keep_if_skipped``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxamp
import jaxamp.nnx
from jaxamp._src.nnx_optimizer import _as_pure as as_pure  # nnx.pure on Flax up to 0.12.6
from tests.conformance import _harness

DTYPES = [jnp.float16, jnp.bfloat16]
IMAGES = jax.random.normal(jax.random.key(3), (8, 8, 8, 1))
LABELS = jax.random.randint(jax.random.key(4), (8,), 0, 4)
X = jax.random.normal(jax.random.key(6), (8, 8))


def _xent(logits, labels):
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


def _avg_pool(x):
  # 2x2 average pooling (nnx.avg_pool divides by an int32 count, refused under strict promotion;
  # max pooling in bfloat16 routes gradients by ties that float32 does not have).
  b, h, w, c = x.shape
  return jnp.mean(x.reshape(b, h // 2, 2, w // 2, 2, c), axis=(2, 4))


class CNN(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
    self.bn1 = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
    self.conv2 = nnx.Conv(8, 8, kernel_size=(3, 3), rngs=rngs)
    self.bn2 = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
    self.dropout = nnx.Dropout(0.1, rngs=rngs)
    self.linear = nnx.Linear(8 * 2 * 2, 4, rngs=rngs)

  def __call__(self, x):
    x = _avg_pool(nnx.relu(self.bn1(self.conv1(x))))
    x = _avg_pool(nnx.relu(self.bn2(self.conv2(x))))
    x = x.reshape(x.shape[0], -1)
    return self.linear(self.dropout(x))


class Block(nnx.Module):
  def __init__(self, dim: int, *, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(dim, rngs=rngs)
    self.linear = nnx.Linear(dim, dim, rngs=rngs)

  def __call__(self, x):
    return x + nnx.gelu(self.linear(self.norm(x)))


class ScannedStack(nnx.Module):
  def __init__(self, layers: int = 3, dim: int = 8, *, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create_block(rngs: nnx.Rngs):
      return Block(dim, rngs=rngs)

    self.blocks = create_block(rngs)
    self.head = nnx.Linear(dim, 4, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def forward(x, block):
      return block(x)

    return self.head(forward(x, self.blocks))


def _pure(tree):
  return nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree


class NNXTrainer:
  """The NNX guides' train step with ``jaxamp.nnx.Optimizer`` and a loss-scaled ``tx``."""

  def __init__(self, make_model, dtype):
    self.model = make_model()
    self.optimizer = jaxamp.nnx.Optimizer(self.model, _harness.make_tx(), wrt=nnx.Param)
    self.traces = 0

    @nnx.jit
    def train_step(model, optimizer, x, y):
      self.traces += 1
      old_stats = as_pure(nnx.state(model, nnx.BatchStat))
      before = as_pure(optimizer.opt_state)

      def loss_fn(model):
        return optimizer.scale_loss(_xent(model(x), y))

      scaled_loss, grads = nnx.value_and_grad(jaxamp.autocast(loss_fn, dtype))(model)
      scale = optimizer.loss_scale
      optimizer.update(model, grads)
      kept = jaxamp.keep_if_skipped(as_pure(nnx.state(model, nnx.BatchStat)), old_stats,
                                    before, as_pure(optimizer.opt_state))
      nnx.update(model, kept)
      return scaled_loss / scale, jax.tree.map(lambda g: g / scale, _pure(as_pure(grads)))

    self._step = train_step

  def step(self, batch):
    return self._step(self.model, self.optimizer, *batch)

  def snapshot(self):
    return {"params": jax.device_get(_pure(as_pure(nnx.state(self.model, nnx.Param)))),
            "stats": jax.device_get(_pure(as_pure(nnx.state(self.model, nnx.BatchStat)))),
            "inner_opt_state": _harness.inner_opt_state(self.opt_state())}

  def opt_state(self):
    return as_pure(self.optimizer.opt_state)

  def params(self):
    return _pure(as_pure(nnx.state(self.model, nnx.Param)))


def _case(make_model, batch, nan_batch, has_stats, low_ops):
  graphdef, params, rest = nnx.split(make_model(), nnx.Param, ...)

  def loss(params, batch):
    model = nnx.merge(graphdef, params, jax.tree.map(jnp.asarray, rest))  # fresh variables
    return _xent(model(batch[0]), batch[1])

  return _harness.Case(loss=loss, params=params, batch=batch, nan_batch=nan_batch,
                       has_stats=has_stats, low_ops=low_ops,
                       trainer=lambda dtype: NNXTrainer(make_model, dtype))


CASES = {
    "cnn_batchnorm_dropout": lambda: _case(
        lambda: CNN(rngs=nnx.Rngs(0, dropout=1)), (IMAGES, LABELS),
        (_harness.nan_like(IMAGES), LABELS), True, _harness.CONV),
    "scan_remat_stack": lambda: _case(
        lambda: ScannedStack(rngs=nnx.Rngs(0)), (X, LABELS), (_harness.nan_like(X), LABELS),
        False, _harness.MATMUL),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", [
    "cnn_batchnorm_dropout", "scan_remat_stack"])
def test_nnx_model(name, dtype):
  _harness.check(CASES[name](), dtype, "nnx/" + name)
