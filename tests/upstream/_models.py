"""The upstream tests' toy models, as parameter pytrees and loss functions.

mmengine's ``ToyModel`` holds three 1x1 convolutions with one channel
(``conv1``, ``conv2``, ``conv3``; ``forward`` uses the first two), PyTorch's
scaling tests a ``Sequential(Linear(8, 8), Linear(8, 8))`` trained with
``MSELoss`` on four random ``(8, 8)`` batches, skipping iteration 2.
"""

import jax
import jax.numpy as jnp
import numpy as np


def toy_model(seed: int = 0) -> dict:
  """mmengine's ``ToyModel``: ``conv1``..``conv3``, each a 1x1 convolution of one channel."""
  rng = np.random.default_rng(seed)
  return {f"conv{i}": {"weight": jnp.asarray(rng.uniform(-1, 1, (1, 1, 1, 1)), jnp.float32),
                       "bias": jnp.asarray(rng.uniform(-1, 1, (1,)), jnp.float32)}
          for i in (1, 2, 3)}


def conv1x1(p: dict, x: jax.Array) -> jax.Array:
  """A 1x1 convolution of one channel on NCHW input."""
  return x * p["weight"][0, 0, 0, 0].astype(x.dtype) + p["bias"][0].astype(x.dtype)


def toy_forward(params: dict, x: jax.Array) -> jax.Array:
  """``ToyModel.forward``: ``conv2(conv1(x))``."""
  return conv1x1(params["conv2"], conv1x1(params["conv1"], x))


def toy_loss(params: dict, x: jax.Array) -> jax.Array:
  """The sum of ``ToyModel(x)``, the loss the tests backpropagate."""
  return jnp.sum(toy_forward(params, x))


def scaling_model(seed: int = 0) -> list:
  """``Sequential(Linear(8, 8), Linear(8, 8))`` with PyTorch's default initialization."""
  rng = np.random.default_rng(seed)
  bound = 1 / np.sqrt(8)
  return [{"weight": jnp.asarray(rng.uniform(-bound, bound, (8, 8)), jnp.float32),
           "bias": jnp.asarray(rng.uniform(-bound, bound, (8,)), jnp.float32)} for _ in range(2)]


def scaling_forward(params: list, x: jax.Array) -> jax.Array:
  for layer in params:
    x = x @ layer["weight"].T.astype(x.dtype) + layer["bias"].astype(x.dtype)[None, :]
  return x


def mse_loss(params: list, x: jax.Array, target: jax.Array) -> jax.Array:
  """``MSELoss()(model(x), target)``, computed in float32."""
  out = scaling_forward(params, x).astype(jnp.float32)
  return jnp.mean((out - target) ** 2)


def scaling_data(seed: int = 0) -> list:
  """Four ``(input, target)`` pairs of shape ``(8, 8)``, as ``_create_scaling_case``."""
  rng = np.random.default_rng(seed)
  return [(jnp.asarray(rng.standard_normal((8, 8)), jnp.float32),
           jnp.asarray(rng.standard_normal((8, 8)), jnp.float32)) for _ in range(4)]


SKIP_ITER = 2
