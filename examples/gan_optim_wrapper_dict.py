"""Several optimizers: a small GAN trained with ``jaxamp.OptimWrapperDict``.

As in mmengine, a model with several optimizers gets one wrapper per part,
collected in an ``OptimWrapperDict``: here a generator and a discriminator,
each an ``AmpOptimWrapper`` with its own optimizer, its own loss scale and
float16 compute. Each wrapper steps its own parameters; the other part's
parameters enter its loss as an ordinary argument. The dict gives the
mapping access, ``get_lr()`` with ``'generator.lr'``-style keys, and one
``state_dict()`` for the checkpoint.

The real data are a 2-d Gaussian away from the origin; the generator starts
near the origin, and its samples should move to the data.

Run: ``python examples/gan_optim_wrapper_dict.py [--iters 400] [--dtype float16]``
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, Optional, Sequence

import jax
import jax.numpy as jnp

import jaxamp

NOISE, HIDDEN = 4, 32
DATA_MEAN = jnp.array([2.0, -1.0])


def mlp_init(key: jax.Array, sizes: Sequence[int]) -> Dict[str, jax.Array]:
  keys = jax.random.split(key, len(sizes) - 1)
  params = {}
  for i, (k, n_in, n_out) in enumerate(zip(keys, sizes[:-1], sizes[1:])):
    params[f"w{i}"] = jax.random.normal(k, (n_in, n_out)) * n_in**-0.5
    params[f"b{i}"] = jnp.zeros((1, n_out))
  return params


def mlp(params: Dict[str, jax.Array], x: jax.Array) -> jax.Array:
  layers = len(params) // 2
  for i in range(layers):
    x = x @ params[f"w{i}"] + params[f"b{i}"]
    if i < layers - 1:
      x = jax.nn.leaky_relu(x, 0.2)
  return x


def discriminator_loss(d_params, g_params, z, real):
  fake = jax.lax.stop_gradient(mlp(g_params, z))
  real_logits = mlp(d_params, real).astype(jnp.float32)
  fake_logits = mlp(d_params, fake).astype(jnp.float32)
  return jnp.mean(jax.nn.softplus(-real_logits) + jax.nn.softplus(fake_logits))


def generator_loss(g_params, d_params, z):
  fake_logits = mlp(d_params, mlp(g_params, z)).astype(jnp.float32)
  return jnp.mean(jax.nn.softplus(-fake_logits))  # the non-saturating loss


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--iters", type=int, default=400)
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--dtype", default="float16", help="compute dtype of both wrappers")
  parser.add_argument("--lr", type=float, default=2e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--log-every", type=int, default=100)
  args = parser.parse_args(argv)

  key_g, key_d, key_data = jax.random.split(jax.random.key(args.seed), 3)
  adam = dict(type="Adam", lr=args.lr, betas=(0.5, 0.999))

  # --8<-- [start:wrappers]
  wrappers = jaxamp.OptimWrapperDict(
      generator=jaxamp.build_optim_wrapper(
          mlp_init(key_g, [NOISE, HIDDEN, HIDDEN, 2]),
          dict(type="AmpOptimWrapper", optimizer=adam, dtype=args.dtype)),
      discriminator=jaxamp.build_optim_wrapper(
          mlp_init(key_d, [2, HIDDEN, HIDDEN, 1]),
          dict(type="AmpOptimWrapper", optimizer=adam, dtype=args.dtype)),
  )
  gen, disc = wrappers["generator"], wrappers["discriminator"]
  # --8<-- [end:wrappers]

  def fake_mean() -> jax.Array:
    z = jax.random.normal(jax.random.key(12345), (1024, NOISE))
    return jnp.mean(mlp(gen.params, z), axis=0)

  start_distance = float(jnp.linalg.norm(fake_mean() - DATA_MEAN))
  # --8<-- [start:loop]
  for i in range(args.iters):
    k_z, k_real = jax.random.split(jax.random.fold_in(key_data, i))
    z = jax.random.normal(k_z, (args.batch_size, NOISE))
    real = DATA_MEAN + 0.5 * jax.random.normal(k_real, (args.batch_size, 2))
    d_loss = disc.update_params(discriminator_loss, gen.params, z, real)
    g_loss = gen.update_params(generator_loss, disc.params, z)
  # --8<-- [end:loop]
    if (i + 1) % args.log_every == 0:
      print(f"iter {i + 1:4d}  d_loss {float(d_loss):.3f}  g_loss {float(g_loss):.3f}  "
            f"fake mean {fake_mean()}  scales {gen.get_scale():g}/{disc.get_scale():g}")

  distance = float(jnp.linalg.norm(fake_mean() - DATA_MEAN))
  print(f"distance of the fake mean to the data mean: {start_distance:.3f} -> {distance:.3f}")
  print(f"get_lr(): {wrappers.get_lr()}")
  state = wrappers.state_dict()
  return {"start_distance": start_distance, "distance": distance, "lr": wrappers.get_lr(),
          "state_keys": sorted(state), "scales": (gen.get_scale(), disc.get_scale())}


if __name__ == "__main__":
  main()
