"""Tests of jaxamp.microbatch_value_and_grad: equal to the full batch, aux, loss scale, dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

BATCH, FEATURES, HIDDEN, NUM = 24, 5, 7, 4


def init_params(dtype=jnp.float32):
  rng = np.random.default_rng(0)
  return {
      "w1": jnp.asarray(rng.standard_normal((FEATURES, HIDDEN)) / 2, dtype),
      "b1": jnp.asarray(rng.standard_normal(HIDDEN) / 4, dtype),
      "w2": jnp.asarray(rng.standard_normal(HIDDEN) / 2, dtype),
  }


def make_batch():
  rng = np.random.default_rng(1)
  return {"x": jnp.asarray(rng.standard_normal((BATCH, FEATURES)), jnp.float32),
          "y": jnp.asarray(rng.standard_normal(BATCH), jnp.float32)}


def loss_fn(params, batch):
  x = batch["x"].astype(params["w1"].dtype)
  h = jnp.tanh(x @ params["w1"] + params["b1"][None, :])
  pred = (h @ params["w2"]).astype(jnp.float32)
  return jnp.mean((pred - batch["y"]) ** 2)


def loss_with_aux(params, batch):
  loss = loss_fn(params, batch)
  return loss, {"loss": loss, "first_y": batch["y"][0]}


def assert_tree_close(a, b, rtol=1e-5, atol=1e-6):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x, np.float32),
                                                       np.asarray(y, np.float32),
                                                       rtol=rtol, atol=atol), a, b)


@pytest.fixture(scope="module")
def reference():
  params, batch = init_params(), make_batch()
  loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
  return params, batch, loss, grads


@pytest.mark.parametrize("num", [1, NUM, BATCH])
def test_equals_the_full_batch(reference, num):
  params, batch, loss, grads = reference
  fn = jax.jit(jaxamp.microbatch_value_and_grad(loss_fn, num))
  got_loss, got_grads = fn(params, batch)
  assert got_loss.dtype == jnp.float32
  np.testing.assert_allclose(got_loss, loss, rtol=1e-5)
  assert_tree_close(got_grads, grads)
  assert jax.tree.structure(got_grads) == jax.tree.structure(grads)


def test_aux_is_stacked_per_micro_batch(reference):
  params, batch, loss, grads = reference
  fn = jax.jit(jaxamp.microbatch_value_and_grad(loss_with_aux, NUM, has_aux=True))
  (got_loss, aux), got_grads = fn(params, batch)
  np.testing.assert_allclose(got_loss, loss, rtol=1e-5)
  assert_tree_close(got_grads, grads)
  assert aux["loss"].shape == (NUM,)
  np.testing.assert_allclose(aux["loss"].mean(), loss, rtol=1e-5)
  # Micro-batch j holds examples j, j + NUM, j + 2 NUM, ...
  np.testing.assert_array_equal(aux["first_y"], batch["y"][:NUM])
  for j in range(NUM):
    sub = jax.tree.map(lambda x, j=j: x[j::NUM], batch)
    np.testing.assert_allclose(aux["loss"][j], jax.jit(loss_fn)(params, sub), rtol=1e-5)


def test_loss_scale_scales_the_gradients_not_the_loss(reference):
  params, batch, loss, grads = reference
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**10)
  opt_state = tx.init(params)
  fn = jax.jit(jaxamp.microbatch_value_and_grad(loss_with_aux, NUM, has_aux=True))
  for scale_arg in (opt_state, jnp.float32(2.0**10), 1024.0):
    (got_loss, _), got_grads = fn(params, batch, loss_scale=scale_arg)
    np.testing.assert_allclose(got_loss, loss, rtol=1e-5)
    assert_tree_close(got_grads, jax.tree.map(lambda g: g * 2.0**10, grads), atol=1e-3)
  # Straight into the loss scaler: unscaled, checked, applied.
  (_, _), scaled = fn(params, batch, loss_scale=opt_state)
  updates, opt_state = jax.jit(tx.update)(scaled, opt_state, params)
  assert_tree_close(updates, jax.tree.map(lambda g: -0.1 * g, grads))
  assert not bool(opt_state.skipped)


def test_bf16_params_accumulate_in_float32(reference):
  params, batch, _, grads = reference
  half = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
  loss, got = jax.jit(jaxamp.microbatch_value_and_grad(loss_fn, NUM))(half, batch)
  assert loss.dtype == jnp.float32
  assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(got))
  assert_tree_close(got, grads, rtol=5e-2, atol=5e-2)


def test_axis_name_averages_across_devices():
  params = init_params()
  batches = [make_batch() for _ in range(3)]
  batches[1] = jax.tree.map(lambda x: x * 2.0, batches[1])
  batches[2] = jax.tree.map(lambda x: x - 1.0, batches[2])
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *batches)
  fn = jaxamp.microbatch_value_and_grad(loss_fn, NUM, axis_name="data")
  loss, grads = jax.jit(jax.vmap(fn, in_axes=(None, 0), axis_name="data"))(params, stacked)
  full = jax.tree.map(lambda x: jnp.concatenate(list(x)), stacked)
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_fn))(params, full)
  np.testing.assert_allclose(loss, jnp.full(3, ref_loss), rtol=1e-5)
  assert_tree_close(jax.tree.map(lambda g: g[1], grads), ref_grads)


def test_args_and_kwargs_reach_every_micro_batch(reference, count_traces):
  params, batch, _, _ = reference

  def weighted(params, batch, weight, *, offset):
    return loss_fn(params, batch) * weight + offset

  traced, counter = count_traces(jaxamp.microbatch_value_and_grad(weighted, NUM))
  fn = jax.jit(traced)
  loss1, _ = fn(params, batch, jnp.float32(2.0), offset=jnp.float32(1.0))
  loss2, _ = fn(params, batch, jnp.float32(3.0), offset=jnp.float32(0.0))
  base = jax.jit(loss_fn)(params, batch)
  np.testing.assert_allclose(loss1, 2.0 * base + 1.0, rtol=1e-5)
  np.testing.assert_allclose(loss2, 3.0 * base, rtol=1e-5)
  assert counter["n"] == 1  # no recompilation


def test_one_jitted_step_with_the_loss_scaler():
  params, batch = init_params(), make_batch()
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=4.0, growth_interval=1)
  grad_fn = jaxamp.microbatch_value_and_grad(loss_fn, NUM)

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = grad_fn(params, batch, loss_scale=opt_state)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = tx.init(params)
  losses = []
  for _ in range(3):
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(float(loss))
  assert losses[2] < losses[0]
  assert float(jaxamp.loss_scale(opt_state)) == 32.0


@pytest.mark.parametrize("args,error,match", [
    ((loss_fn, 0), ValueError, "num_microbatches must be an int >= 1, got 0"),
    ((loss_fn, 2.0), TypeError, "num_microbatches must be an int"),
    ((None, 2), TypeError, "loss_fn must be callable"),
])
def test_bad_arguments(args, error, match):
  with pytest.raises(error, match=match):
    jaxamp.microbatch_value_and_grad(*args)


def test_bad_batches(reference):
  params, batch, _, _ = reference
  with pytest.raises(ValueError, match="batch size 24 is not a multiple of num_microbatches=5"):
    jaxamp.microbatch_value_and_grad(loss_fn, 5)(params, batch)
  with pytest.raises(ValueError, match="same leading"):
    jaxamp.microbatch_value_and_grad(loss_fn, 2)(params, {"x": batch["x"], "y": batch["y"][:4]})
  with pytest.raises(ValueError, match="scalar loss"):
    jaxamp.microbatch_value_and_grad(lambda p, b: b["y"] * p["w2"][0], 2)(params, batch)
  with pytest.raises(ValueError, match="loss_scale must be a scalar"):
    jaxamp.microbatch_value_and_grad(loss_fn, 2)(params, batch, loss_scale=jnp.ones(2))
