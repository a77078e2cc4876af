"""Tests of jaxamp.microbatch_value_and_grad: equal to the full batch, aux, loss scale, dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxamp
from tests._floats import enable_x64

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
    ((loss_fn, True), TypeError, "^num_microbatches must be an int, got True"),
    ((loss_fn, np.int64(0)), ValueError, "^num_microbatches must be an int >= 1"),
])
def test_bad_arguments(args, error, match):
  with pytest.raises(error, match=match):
    jaxamp.microbatch_value_and_grad(*args)


def test_has_aux_must_be_a_bool():
  with pytest.raises(TypeError, match="^has_aux must be a bool, got 'yes'"):
    jaxamp.microbatch_value_and_grad(loss_fn, 2, has_aux="yes")
  jaxamp.microbatch_value_and_grad(loss_fn, 2, has_aux=np.bool_(False))  # numpy's bool is one


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


def test_a_bad_accumulator_dtype_is_refused_by_name():
  with pytest.raises(ValueError, match=r"^accumulator_dtype must be a floating-point dtype, got int32"):
    jaxamp.microbatch_value_and_grad(loss_fn, 2, accumulator_dtype=jnp.int32)
  with pytest.raises(TypeError, match=r"^accumulator_dtype must be a floating-point dtype"):
    jaxamp.microbatch_value_and_grad(loss_fn, 2, accumulator_dtype="no such dtype")


@pytest.mark.parametrize("scale", [np.complex64(2.0), jnp.complex64(2.0), True, np.bool_(True)],
                         ids=["numpy-complex", "jax-complex", "bool", "numpy-bool"])
def test_loss_scale_must_be_a_real_number(reference, scale):
  params, batch, _, _ = reference
  with pytest.raises(ValueError, match=r"^loss_scale must be a scalar"):
    jaxamp.microbatch_value_and_grad(loss_fn, 2)(params, batch, loss_scale=scale)


def test_one_micro_batch_stacks_aux_along_a_leading_axis_of_one(reference):
  params, batch, loss, grads = reference

  def with_aux(p, b):
    value = loss_fn(p, b)
    return value, {"loss": value, "y": b["y"]}

  fn = jax.jit(jaxamp.microbatch_value_and_grad(with_aux, 1, has_aux=True))
  (got_loss, aux), got = fn(params, batch)
  np.testing.assert_allclose(got_loss, loss, rtol=1e-5)
  assert_tree_close(got, grads)
  assert aux["loss"].shape == (1,) and aux["y"].shape == (1, BATCH)
  np.testing.assert_allclose(aux["loss"][0], loss, rtol=1e-5)
  np.testing.assert_array_equal(aux["y"][0], batch["y"])


def test_complex_gradients_keep_their_imaginary_parts():
  params = {"w": jnp.array([1 + 2j, 0.5 - 1j], jnp.complex64)}
  x = jnp.arange(16.0, dtype=jnp.float32).reshape(8, 2) / 4

  def complex_loss(p, x):
    return jnp.mean(jnp.abs(x.astype(jnp.complex64) * p["w"][None, :] - 1.0) ** 2)

  want_loss, want = jax.jit(jax.value_and_grad(complex_loss))(params, x)
  assert float(jnp.abs(want["w"].imag).min()) > 1.0
  loss, got = jax.jit(jaxamp.microbatch_value_and_grad(complex_loss, 4))(params, x)
  assert got["w"].dtype == jnp.complex64
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  np.testing.assert_allclose(got["w"], want["w"], rtol=1e-5)
  # A complex64 leaf sums in complex64 (float32 parts) under the float32 accumulator.
  # jax.grad of real(w * g) is g here: 2**24, 1, 1, 1 in both parts, as float32 sums them.
  g = jnp.array([2.0**24, 1.0, 1.0, 1.0], jnp.float32).astype(jnp.complex64) * (1 - 1j)
  _, got = jax.jit(jaxamp.microbatch_value_and_grad(lambda p, g: jnp.real(p["w"] * g[0]), 4))(
      {"w": jnp.complex64(1 + 1j)}, g)
  np.testing.assert_array_equal(got["w"], jnp.complex64(2.0**22 - 2.0**22 * 1j))
  # complex128 keeps complex128 (float64 parts) under x64.
  with enable_x64(True):
    params = {"w": jnp.array([1 + 2j, 0.5 - 1j], jnp.complex128)}
    x = jnp.sin(jnp.arange(16.0, dtype=jnp.float64).reshape(8, 2))

    def loss128(p, x):
      return jnp.mean(jnp.abs(x.astype(jnp.complex128) * p["w"][None, :] - 1.0) ** 2)

    want_loss, want = jax.jit(jax.value_and_grad(loss128))(params, x)
    loss, got = jax.jit(jaxamp.microbatch_value_and_grad(loss128, 4))(params, x)
    assert loss.dtype == jnp.float64 and got["w"].dtype == jnp.complex128
    np.testing.assert_allclose(loss, want_loss, rtol=1e-13)
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-13)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.int32])
def test_a_loss_of_any_real_dtype_comes_back_as_a_float32_mean(dtype):
  # A count of the examples >= w: 2 in each micro-batch ([0, 2, 4, 6] and [1, 3, 5, 7]).
  def count(p, x):
    return jnp.sum((x >= p["w"]).astype(dtype))

  loss, grads = jax.jit(jaxamp.microbatch_value_and_grad(count, 2))(
      {"w": jnp.float32(3.5)}, jnp.arange(8.0, dtype=jnp.float32))
  assert loss.dtype == jnp.float32 and float(loss) == 2.0
  assert float(grads["w"]) == 0.0


def test_a_leaf_wider_than_the_accumulator_dtype_keeps_its_own():
  # float32 gradients and loss under a bfloat16 accumulator still sum in float32.
  fn = jaxamp.microbatch_value_and_grad(lambda p, x: jnp.mean(p["w"] * x), 4,
                                        accumulator_dtype=jnp.bfloat16)
  loss, grads = jax.jit(fn)({"w": jnp.float32(1.0)}, jnp.array([256.0, 1, 1, 1], jnp.float32))
  assert loss.dtype == jnp.float32 and grads["w"].dtype == jnp.float32
  assert float(loss) == 259.0 / 4 and float(grads["w"]) == 259.0 / 4


def test_the_accumulator_dtype_asked_for_wins_over_a_leaf_of_the_same_width():
  def mean_loss(p, x):
    return jnp.mean(p["w"] * x).astype(jnp.float32)

  # float16 gradients summed in bfloat16: within bfloat16's range, not float16's (max 65504).
  fn = jaxamp.microbatch_value_and_grad(mean_loss, 2, accumulator_dtype=jnp.bfloat16)
  _, grads = jax.jit(fn)({"w": jnp.float16(1.0)}, jnp.array([40000.0, 40000.0], jnp.float16))
  assert grads["w"].dtype == jnp.float16
  assert float(grads["w"]) == float(jnp.asarray(40000.0, jnp.bfloat16))
  # bfloat16 gradients summed in float16: its 11 bits keep 256 + 1 + 1 + 1 exact.
  fn = jaxamp.microbatch_value_and_grad(mean_loss, 4, accumulator_dtype=jnp.float16)
  _, grads = jax.jit(fn)({"w": jnp.bfloat16(1.0)}, jnp.array([256.0, 1, 1, 1], jnp.bfloat16))
  assert grads["w"].dtype == jnp.bfloat16
  assert float(grads["w"]) == float(jnp.asarray(259.0 / 4, jnp.bfloat16))


def test_under_x64_float64_gradients_and_losses_keep_float64():
  with enable_x64(True):
    rng = np.random.default_rng(2)
    params = {"w": jnp.asarray(rng.standard_normal(FEATURES), jnp.float64)}
    batch = {"x": jnp.asarray(rng.standard_normal((BATCH, FEATURES)), jnp.float64),
             "y": jnp.asarray(rng.standard_normal(BATCH), jnp.float64)}

    def loss64(p, b):
      return jnp.mean(jnp.sin(b["x"] @ p["w"] - b["y"]) ** 2)

    want_loss, want = jax.jit(jax.value_and_grad(loss64))(params, batch)
    loss, got = jax.jit(jaxamp.microbatch_value_and_grad(loss64, NUM))(params, batch)
    assert loss.dtype == jnp.float64 and got["w"].dtype == jnp.float64
    np.testing.assert_allclose(loss, want_loss, rtol=1e-13)
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-13)


def test_under_x64_float32_losses_and_gradients_stay_float32(reference):
  params, batch, loss, grads = reference
  with enable_x64(True):
    got_loss, got = jax.jit(jaxamp.microbatch_value_and_grad(loss_fn, NUM))(params, batch)
    assert got_loss.dtype == jnp.float32
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(got))
    np.testing.assert_allclose(got_loss, loss, rtol=1e-5)
    assert_tree_close(got, grads)


def test_a_float64_accumulator_sums_float32_losses_and_gradients_in_float64():
  with enable_x64(True):
    x = jnp.array([2.0**24, 1.0, 1.0, 1.0], jnp.float32)
    fn = jaxamp.microbatch_value_and_grad(lambda p, x: jnp.mean(p["w"] * x), 4,
                                          accumulator_dtype=jnp.float64)
    loss, grads = jax.jit(fn)({"w": jnp.float32(1.0)}, x)
    # The mean formed in float64 and rounded once (a float32 sum loses the ones).
    want = float(jnp.asarray((2.0**24 + 3) / 4, jnp.float32))
    assert want != 2.0**22
    assert loss.dtype == jnp.float32 and grads["w"].dtype == jnp.float32
    assert float(loss) == want and float(grads["w"]) == want


def test_under_x64_a_number_scales_as_the_scalers_state_holding_it_does():
  # loss_scale=3.1 and loss_scale=<a scaler's state made with 3.1> give the same float64
  # gradients: a number is taken, as the state holds it, as a float32 scale.
  with enable_x64(True):
    params = {"w": jnp.array([0.3, -1.7], jnp.float64)}
    x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float64).reshape(4, 2)

    def loss64(p, x):
      return jnp.mean(jnp.sin(x @ p["w"]))

    fn = jax.jit(jaxamp.microbatch_value_and_grad(loss64, 2))
    state = jaxamp.static_loss_scale(optax.sgd(1.0), 3.1).init(params)
    _, from_state = fn(params, x, loss_scale=state)
    for number in (3.1, np.float64(3.1), jnp.float64(3.1)):
      _, got = fn(params, x, loss_scale=number)
      assert got["w"].dtype == jnp.float64
      np.testing.assert_array_equal(got["w"], from_state["w"])


def test_inside_shard_map_the_loss_sees_this_devices_copy_of_the_params():
  # A recurrent loss whose scan carry starts from the params: inside shard_map (check_vma)
  # the carry's type must vary over the data axis from the start, as the batch does.
  mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  rng = np.random.default_rng(3)
  params = {"h0": jnp.asarray(rng.standard_normal(3), jnp.float32),
            "w": jnp.asarray(rng.standard_normal(3), jnp.float32)}
  batch = {"x": jnp.asarray(rng.standard_normal((8, 4, 3)), jnp.float32),
           "y": jnp.asarray(rng.standard_normal(8), jnp.float32)}

  def recurrent(p, b):
    def step(h, x_t):
      return jnp.tanh(h * p["w"][None, :] + x_t), None

    h0 = jnp.broadcast_to(p["h0"][None, :], b["x"][:, 0].shape)
    h, _ = jax.lax.scan(step, h0, jnp.swapaxes(b["x"], 0, 1))
    return jnp.mean((jnp.sum(h, axis=1) - b["y"]) ** 2)

  fn = jaxamp.microbatch_value_and_grad(recurrent, 2, axis_name="data")
  sharded = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
  loss, grads = sharded(params, batch)
  want_loss, want = jax.jit(jax.value_and_grad(recurrent))(params, batch)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  assert_tree_close(grads, want)
