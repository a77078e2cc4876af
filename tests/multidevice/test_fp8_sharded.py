"""Flax's fp8 values across devices: each device's amax is combined by a maximum, never averaged.

An fp8 layer's backward pass returns amax values where the gradients would be.
Averaged over the devices, as the gradients are, an amax would understate the
largest value any device saw, and the next step's fp8 scale would overflow on
the device that saw it. Here each device sees other data, so that the mean and
the maximum differ.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxamp

OWG = "_overwrite_with_gradient"
VARIABLES = {"params": {"w": jnp.ones(4)}, OWG: {"amax": jnp.zeros(4)}}


def _loss(variables, batch):
  """A mean loss whose 'gradient' for the fp8 collection is the batch's amax, column by column."""
  rows = batch @ variables["params"]["w"]
  amax = jax.lax.stop_gradient(jnp.max(jnp.abs(batch), axis=0))
  return jnp.mean(rows) + jnp.sum(variables[OWG]["amax"] * amax)


def _data(mesh, rows):
  x = np.random.default_rng(0).standard_normal((rows, 4)).astype(np.float32)
  x[3] *= 10.0  # one device sees a much larger value: mean and maximum differ
  return x, jax.device_put(x, NamedSharding(mesh, P("data")))


def _check(grads, x):
  np.testing.assert_allclose(grads["params"]["w"], x.mean(0), rtol=1e-5)
  np.testing.assert_array_equal(grads[OWG]["amax"], np.abs(x).max(0))


def test_train_state_value_and_grad_takes_the_fp8_values_maximum_over_devices(mesh):
  state = jaxamp.TrainState.create(apply_fn=_loss, params=VARIABLES, tx=optax.sgd(0.1))
  x, sharded = _data(mesh, 8)

  def per_device(state, batch):
    _, grads = state.value_and_grad(state.apply_fn, axis_name="data")(state.params, batch)
    return grads

  grads = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data")),
                                out_specs=P()))(state, sharded)
  _check(grads, x)


def test_microbatched_gradients_take_the_fp8_values_maximum_over_devices(mesh):
  fn = jaxamp.microbatch_value_and_grad(_loss, 2, axis_name="data")
  x, sharded = _data(mesh, 16)  # two rows, one per micro-batch, on each device
  _, grads = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("data")),
                                   out_specs=P()))(VARIABLES, sharded)
  _check(grads, x)
