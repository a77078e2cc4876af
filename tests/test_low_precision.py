"""jaxamp.low_precision_params: bfloat16 parameters without a float32 master copy.

The updates it returns must give, through ``optax.apply_updates``, exactly the
rounded sum (checked against numpy's float32 addition and ml_dtypes' rounding
over bit patterns); the roundings must do what they promise over many steps
(drift, convergence); and the transformation must compose with the loss
scaler, accumulation, micro-batching, clipping, TrainState and nnx.Optimizer.

The property test over bit patterns runs 40 derandomized examples; with
``HYPOTHESIS_PROFILE=soundness-long`` it runs 1000 random ones.
"""

import os

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from benchmarks import bench_low_precision as bench

BF16 = jnp.bfloat16
ROUNDINGS = ["stochastic", "kahan", "nearest"]


def standard():
  return jax.numpy_dtype_promotion("standard")


def apply(params, updates):
  with standard():
    return optax.apply_updates(params, updates)


def make_step(tx):
  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return apply(params, updates), state
  return step


def standard_promotion(tx):
  """``tx`` traced under standard promotion (optax's Adam mixes a float and an int32 count)."""

  def update(updates, state, params=None):
    with standard():
      return tx.update(updates, state, params)

  return optax.GradientTransformation(tx.init, update)


def adam(lr):
  return standard_promotion(optax.adam(lr))


def adamw(lr):
  return standard_promotion(optax.adamw(lr))


def bits16(x):
  return np.asarray(x).view(np.uint16)


# --- construction -------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, exc, words", [
    ({"rounding": "round"}, ValueError, "rounding must be one of 'stochastic', 'kahan', 'nearest'"),
    ({"rounding": None}, ValueError, "rounding must be one of"),
    ({"seed": -1}, ValueError, "seed must be an int >= 0"),
    ({"seed": 2**32}, ValueError, "seed must be an int <="),
    ({"seed": 1.5}, TypeError, "seed must be an int"),
    ({"seed": True}, TypeError, "seed must be an int"),
    ({"state_dtype": jnp.float16}, ValueError, "state_dtype must be float32 or bfloat16"),
    ({"state_dtype": jnp.int32}, ValueError, "state_dtype must be a floating-point dtype"),
    ({"state_dtype": "nope"}, TypeError, "state_dtype must be a floating-point dtype"),
])
def test_bad_arguments_are_refused_at_construction(kwargs, exc, words):
  with pytest.raises(exc, match=words.replace("(", r"\(")):
    jaxamp.low_precision_params(optax.sgd(0.1), **kwargs)


def test_inner_must_be_a_transformation():
  with pytest.raises(TypeError, match="inner must be an optax GradientTransformation"):
    jaxamp.low_precision_params(optax.sgd)


def test_float16_params_are_refused_with_the_leaf_named():
  tx = jaxamp.low_precision_params(optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"the params leaf \['h'\] is float16"):
    tx.init({"w": jnp.ones(2, BF16), "h": jnp.ones(2, jnp.float16)})


def test_update_needs_params():
  tx = jaxamp.low_precision_params(optax.sgd(0.1))
  params = {"w": jnp.ones(2, BF16)}
  with pytest.raises(ValueError, match="needs the parameters"):
    tx.update(params, tx.init(params))


# --- exactness of the returned updates ----------------------------------------------------------

def _flush(x):
  """x with float32 subnormals replaced by zeros of their sign, as XLA's arithmetic reads and writes them."""
  x = np.asarray(x, np.float32)
  return np.where(np.abs(x) < np.finfo(np.float32).tiny, np.copysign(np.float32(0), x), x)


def _sum(p, u):
  """float32(p) + u as XLA computes it (subnormal operands and results flushed to zero)."""
  with np.errstate(over="ignore", invalid="ignore"):
    return _flush(_flush(p.astype(np.float32)) + _flush(u))


def _touches_subnormals(p, u):
  """Where p, u or their exact sum is a float32 subnormal.

  How XLA treats those depends on the CPU: most flush them all to zero (as ``_sum`` does), but
  where bfloat16 arithmetic is native a subnormal parameter can survive an update flushed to zero.
  The tests check every other element bit for bit.
  """
  with np.errstate(over="ignore", invalid="ignore"):
    values = (p.astype(np.float32), np.asarray(u, np.float32),
              p.astype(np.float32) + np.asarray(u, np.float32))
  tiny = np.finfo(np.float32).tiny
  return np.any([(x != 0) & (np.abs(x) < tiny) for x in values], axis=0)


def _nearest_reference(p, u):
  """bfloat16(float32(p) + u), by numpy and ml_dtypes."""
  return _sum(p, u).astype(BF16)


def _same(got, want):
  """Bit-identical, NaN for NaN, or both zeros (a zero's sign may follow p's; see the docstring)."""
  got, want = np.asarray(got), np.asarray(want)
  g32, w32 = got.astype(np.float32), want.astype(np.float32)
  return (bits16(got) == bits16(want)) | (np.isnan(g32) & np.isnan(w32)) | ((g32 == 0) & (w32 == 0))


_STEPS: dict = {}


def _identity_step(rounding):
  if rounding not in _STEPS:
    tx = jaxamp.low_precision_params(optax.identity(), rounding, seed=3)
    _STEPS[rounding] = tx, make_step(tx)
  return _STEPS[rounding]


def test_nearest_is_exact_for_every_bfloat16_parameter_and_ratio():
  p = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(BF16)
  p = p[np.isfinite(p.astype(np.float32))]
  ratios = [1e-6, 1e-3, 0.3, 1.0, 10.0, 1e4, 1e30]
  p_all = np.concatenate([p] * (2 * len(ratios) + 4))
  with np.errstate(over="ignore"):
    us = [p.astype(np.float32) * np.float32(r * s) for r in ratios for s in (1, -1)]
  us += [np.full(p.shape, v, np.float32) for v in (1e-40, -1e-45, 3e38, -1e-3)]
  u_all = np.concatenate(us).astype(np.float32)
  tx, step = _identity_step("nearest")
  params = {"w": jnp.asarray(p_all)}
  new, _ = step(params, tx.init(params), {"w": jnp.asarray(u_all)})
  want = _nearest_reference(p_all, u_all)
  ok = _same(new["w"], want) | _touches_subnormals(p_all, u_all)
  assert ok.all(), (p_all[~ok][:5], u_all[~ok][:5], np.asarray(new["w"])[~ok][:5], want[~ok][:5])


LONG = os.environ.get("HYPOTHESIS_PROFILE") == "soundness-long"


@hypothesis.settings(max_examples=1000 if LONG else 40, derandomize=not LONG, deadline=None,
                     database=None)
@hypothesis.given(st.lists(st.tuples(st.integers(0, 2**16 - 1), st.integers(0, 2**32 - 1)),
                           min_size=64, max_size=64))
def test_updates_give_the_rounded_sum_exactly_over_bit_patterns(pairs):
  p = np.array([a for a, _ in pairs], np.uint16).view(BF16)
  u = np.array([b for _, b in pairs], np.uint32).view(np.float32)
  total = _sum(p, u)
  nearest = total.astype(BF16)
  subnormal = _touches_subnormals(p, u)
  params = {"w": jnp.asarray(p)}
  for rounding in ROUNDINGS:
    tx, step = _identity_step(rounding)
    new, _ = step(params, tx.init(params), {"w": jnp.asarray(u)})
    new = np.asarray(new["w"])
    if rounding != "stochastic":  # Kahan's first step: no compensation yet
      assert (_same(new, nearest) | subnormal).all(), rounding
      continue
    # One of the two bfloat16 neighbours of the float32 sum (its truncation or the next one out).
    low = (total.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    with np.errstate(over="ignore"):
      high = (total.view(np.uint32).astype(np.uint64) + 0x10000).astype(np.uint32)
    high = (high & np.uint32(0xFFFF0000)).view(np.float32)
    ok = (_same(new, low.astype(BF16)) | _same(new, high.astype(BF16))
          | (np.isnan(total) & np.isnan(new.astype(np.float32))) | subnormal)
    assert ok.all(), (p[~ok], u[~ok], new[~ok])


def test_float32_leaves_pass_through_untouched():
  params = {"w": jnp.ones(3, BF16), "f": jnp.linspace(0.0, 1.0, 5)}
  grads = {"w": jnp.ones(3, BF16), "f": jnp.linspace(-1.0, 3.0, 5)}
  inner = adam(1e-2)
  tx = jaxamp.low_precision_params(inner, "stochastic")
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  alone = {"f": params["f"]}
  ref, _ = jax.jit(inner.update)({"f": grads["f"]}, inner.init(alone), alone)
  np.testing.assert_allclose(np.asarray(updates["f"]), np.asarray(ref["f"]), rtol=1e-6)
  assert updates["w"].dtype == jnp.float32


@pytest.mark.parametrize("state_dtype", [jnp.float32, BF16])
def test_inner_state_is_stored_in_state_dtype_and_keeps_its_dtypes(state_dtype):
  params = {"w": jnp.ones((4, 3), BF16), "f": jnp.ones(2)}
  tx = jaxamp.low_precision_params(adamw(1e-3), "kahan", state_dtype=state_dtype)
  state = tx.init(params)
  moments = state.inner_state[0]
  assert moments.mu["w"].dtype == state_dtype and moments.nu["w"].dtype == state_dtype
  assert moments.mu["f"].dtype == jnp.float32
  step = make_step(tx)
  grads = {"w": jnp.full((4, 3), 0.5, BF16), "f": jnp.ones(2)}
  _, new_state = step(params, state, grads)
  assert jax.tree.map(lambda x: x.dtype, new_state) == jax.tree.map(lambda x: x.dtype, state)
  assert new_state.compensation[0].dtype == jnp.int16 and new_state.key.dtype == jnp.uint32


def test_same_seed_same_bits_other_seed_other_bits():
  params = {"w": jnp.ones(512, BF16)}
  grads = {"w": jnp.full(512, 1e-3, BF16)}

  step = make_step(jaxamp.low_precision_params(optax.sgd(1.0), "stochastic"))

  def run(seed):  # the seed lives in the state: one compiled step serves every seed
    p, s = params, jaxamp.low_precision_params(optax.sgd(1.0), "stochastic", seed=seed).init(params)
    for _ in range(3):
      p, s = step(p, s, grads)
    return bits16(p["w"])

  np.testing.assert_array_equal(run(7), run(7))
  assert (run(7) != run(8)).any()


# --- evidence: drift and convergence ------------------------------------------------------------

def test_drift_nearest_stalls_stochastic_is_unbiased_kahan_keeps_the_sum():
  target = 1.2
  ulp = 2.0**-7  # bfloat16 spacing in [1, 2)
  p, _ = bench.drift("nearest")
  assert (np.asarray(p["w"], np.float32) == 1.0).all()
  p, _ = bench.drift("stochastic")
  assert abs(np.asarray(p["w"], np.float32).mean() - target) < 2e-3
  p, s = bench.drift("kahan")
  w = np.asarray(p["w"], np.float32)
  assert (np.abs(w - target) <= ulp).all()
  total = w + np.asarray(jaxamp.decode_compensation(s.compensation[0], p["w"]))
  assert (np.abs(total - target) < 1e-4).all()
  assert float(s.stale_fraction[0]) == 1.0  # every update is below half a spacing of 1.2


def test_convergence_parity_on_linear_regression():
  f32 = bench.regression(jnp.float32, None)
  stochastic = bench.regression(BF16, "stochastic")
  kahan = bench.regression(BF16, "kahan")
  nearest = bench.regression(BF16, "nearest")
  assert stochastic <= 1.2 * f32
  assert kahan <= 1.05 * f32
  assert nearest > 100 * f32  # stalled far from the optimum


# --- composition --------------------------------------------------------------------------------

@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_a_step_skipped_by_the_loss_scaler_changes_no_bit(rounding):
  params = {"w": jnp.linspace(-1.0, 1.0, 16).astype(BF16), "b": jnp.zeros(2)}
  tx = jaxamp.dynamic_loss_scale(jaxamp.low_precision_params(adam(1e-2), rounding),
                                 init_scale=4.0)
  step = make_step(tx)
  good = {"w": jnp.full(16, 0.3, BF16), "b": jnp.ones(2)}
  params, state = step(params, tx.init(params), good)
  params, state = step(params, state, good)
  bad = {"w": good["w"].at[3].set(jnp.inf), "b": good["b"]}
  new_params, new_state = step(params, state, bad)
  assert bool(new_state.skipped)
  low, new_low = state.inner_state, new_state.inner_state
  for a, b in [(params, new_params), (low.key, new_low.key), (low.compensation, new_low.compensation),
               (low.inner_state, new_low.inner_state)]:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_array_equal(np.asarray(x).reshape(-1).view(np.uint8),
                                    np.asarray(y).reshape(-1).view(np.uint8))
  # The next good step goes on as if the bad one had not happened.
  after_bad, _ = step(new_params, new_state, good)
  unscaled_state = state._replace(scale=new_state.scale)
  direct, _ = step(params, unscaled_state, good)
  np.testing.assert_array_equal(bits16(after_bad["w"]), bits16(direct["w"]))


def test_accumulation_with_a_clip_inside_equals_the_update_on_the_mean_gradient():
  k = 3
  params = {"w": jnp.linspace(0.5, 2.0, 8).astype(BF16)}
  inner = jaxamp.low_precision_params(
      optax.chain(optax.clip_by_global_norm(0.05), adam(1e-3)), "stochastic", seed=1)
  tx = jaxamp.accumulate_gradients(inner, k)
  step = make_step(tx)
  micro = [{"w": jnp.linspace(-1.0, 1.0, 8).astype(BF16) * (i + 1)} for i in range(2 * k)]
  p, s = params, tx.init(params)
  for g in micro:
    p, s = step(p, s, g)
  q, t = params, inner.init(params)
  ref_step = make_step(inner)
  for w in range(2):
    window = micro[w * k:(w + 1) * k]
    mean = {"w": sum(g["w"].astype(jnp.float32) for g in window) / k}
    q, t = ref_step(q, t, mean)
  np.testing.assert_array_equal(bits16(p["w"]), bits16(q["w"]))
  assert step._cache_size() == 1


def test_microbatched_gradients_feed_it_with_bfloat16_params():
  x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 4)), jnp.float32)
  y = jnp.ones((8,), jnp.float32)
  params = {"w": jnp.full((4,), 0.25, BF16)}

  def loss(p, batch):
    xb, yb = batch
    return jnp.mean((xb @ p["w"].astype(jnp.float32) - yb) ** 2)

  tx = jaxamp.low_precision_params(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)),
                                   "kahan")
  grad_fn = jaxamp.microbatch_value_and_grad(loss, num_microbatches=4)

  @jax.jit
  def step(p, s):
    _, g = grad_fn(p, (x, y))
    updates, s = tx.update(g, s, p)
    return apply(p, updates), s

  @jax.jit
  def whole(p, s):
    g = jax.grad(loss)(p, (x, y))
    updates, s = tx.update(g, s, p)
    return apply(p, updates), s

  p, s = step(params, tx.init(params))
  q, _ = whole(params, tx.init(params))
  assert p["w"].dtype == BF16
  np.testing.assert_allclose(np.asarray(p["w"], np.float32), np.asarray(q["w"], np.float32),
                             atol=2.0**-8)
  assert not np.array_equal(np.asarray(p["w"], np.float32), np.asarray(params["w"], np.float32))


def test_train_state_with_bfloat16_params_and_a_loss_scaler():
  params = {"w": jnp.full((3, 1), 0.5, BF16)}
  tx = jaxamp.dynamic_loss_scale(jaxamp.low_precision_params(adam(1e-2), "kahan"),
                                 init_scale=2.0**8)
  state = jaxamp.TrainState.create(apply_fn=lambda p, x: x @ p["w"].astype(x.dtype),
                                   params=params, tx=tx)

  @jax.jit
  def step(state, x):
    def loss(p):
      return state.scale_loss(jnp.mean(state.apply_fn(p, x) ** 2))
    return state.apply_gradients(grads=jax.grad(loss)(state.params))

  x = jnp.ones((2, 3))
  state = step(state, x)
  state = step(state, x.at[0, 0].set(jnp.inf))  # skipped
  state = step(state, x)
  assert int(state.step) == 2 and state.params["w"].dtype == BF16
  assert float(state.params["w"][0, 0]) < 0.5
  metrics = jaxamp.step_metrics(state)
  assert {"loss_scale", "stale_fraction", "stale_fraction_per_leaf"} <= set(metrics)
  assert step._cache_size() == 1


def test_nnx_optimizer_with_bfloat16_params():
  from flax import nnx
  import jaxamp.nnx

  model = nnx.Linear(4, 2, param_dtype=BF16, dtype=jnp.float32, rngs=nnx.Rngs(0))
  tx = jaxamp.low_precision_params(adamw(1e-2), "stochastic", state_dtype=BF16)
  optimizer = jaxamp.nnx.Optimizer(model, tx, wrt=nnx.Param)
  before = np.asarray(model.kernel[...], np.float32)

  @nnx.jit
  def step(model, optimizer, x):
    grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)

  for _ in range(3):
    step(model, optimizer, jnp.ones((3, 4)))
  assert model.kernel[...].dtype == BF16
  assert not np.array_equal(before, np.asarray(model.kernel[...], np.float32))
  assert int(optimizer.step[...]) == 3
  metrics = jaxamp.step_metrics(optimizer)
  assert metrics["stale_fraction_per_leaf"].shape == (2,)


# --- diagnostics --------------------------------------------------------------------------------

def test_stale_fraction_counts_the_updates_nearest_rounding_loses():
  params = {"a": jnp.ones(4, BF16), "b": jnp.full(4, 100.0, BF16), "f": jnp.ones(2)}
  tx = jaxamp.low_precision_params(optax.sgd(1.0), "stochastic")
  # 1e-3 is lost on 1.0 (half a spacing is 2**-8) only where it is not; on 100 always.
  grads = {"a": jnp.array([1e-3, -0.1, 0.0, 1e-3], BF16), "b": jnp.full(4, 1e-3, BF16),
           "f": jnp.ones(2)}
  _, state = tx.update(grads, tx.init(params), params)
  assert jaxamp.stale_report(state, params) == {"['a']": 0.5, "['b']": 1.0}
  metrics = jaxamp.step_metrics(state)
  assert float(metrics["stale_fraction"]) == 0.75
  assert "loss_scale" not in metrics


def test_step_metrics_without_any_state_still_refuses():
  with pytest.raises(ValueError, match="No loss-scale state"):
    jaxamp.step_metrics(optax.sgd(0.1).init({"w": jnp.ones(2)}))
  with pytest.raises(ValueError, match="No low-precision state"):
    jaxamp.stale_report(optax.sgd(0.1).init({"w": jnp.ones(2)}), {"w": jnp.ones(2)})


# --- compilation --------------------------------------------------------------------------------

@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_compiles_once_and_survives_scan(rounding, count_traces):
  params = {"w": jnp.ones((4, 4), BF16), "b": jnp.zeros(4)}
  tx = jaxamp.low_precision_params(adam(1e-3), rounding)

  def step(p, s, g):
    updates, s = tx.update(g, s, p)
    return apply(p, updates), s

  traced, counter = count_traces(step)
  jitted = jax.jit(traced)
  p, s = params, tx.init(params)
  grads = {"w": jnp.full((4, 4), 0.1, BF16), "b": jnp.ones(4)}
  for _ in range(3):
    p, s = jitted(p, s, grads)
  assert counter["n"] == 1

  def body(carry, _):
    return step(*carry, grads), None
  (q, t), _ = jax.lax.scan(body, (params, tx.init(params)), None, length=3)
  same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a).reshape(-1).view(np.uint8),
                                                  np.asarray(b).reshape(-1).view(np.uint8)),
                      (p, s), (q, t))
  assert all(jax.tree.leaves(same))




# --- facade: optimi's kahan_sum in an mmengine-style optimizer config ---------------------------

def _wrapper_run(kahan_sum, wrapper="OptimWrapper"):
  params = {"w": jnp.ones((2, 2), BF16)}
  cfg = dict(type=wrapper, optimizer=dict(type="AdamW", lr=1e-4, weight_decay=0.0,
                                          kahan_sum=kahan_sum))
  w = jaxamp.build_optim_wrapper(params, cfg)

  def loss_fn(p, x):
    return jnp.sum(p["w"].astype(jnp.float32) * x)

  for _ in range(5):
    w.update_params(loss_fn, jnp.ones((2, 2)))
  return w


@pytest.mark.parametrize("wrapper", ["OptimWrapper", "AmpOptimWrapper"])
def test_kahan_sum_in_the_optimizer_config_keeps_updates_that_bfloat16_loses(wrapper):
  with standard():
    plain = _wrapper_run(False, wrapper)
    kahan = _wrapper_run(True, wrapper)
  # Adam's steps of 1e-4 are below half a bfloat16 spacing of 1.0: lost without compensation.
  assert (np.asarray(plain.params["w"], np.float32) == 1.0).all()
  (low,) = [n for n in jax.tree.leaves(kahan.opt_state, is_leaf=lambda n: isinstance(
      n, jaxamp.LowPrecisionState)) if isinstance(n, jaxamp.LowPrecisionState)]
  w = kahan.params["w"]
  assert w.dtype == BF16
  total = np.asarray(w, np.float32) + np.asarray(jaxamp.decode_compensation(low.compensation[0], w))
  np.testing.assert_allclose(total, 1.0 - 5e-4, rtol=1e-5)


def test_kahan_sum_must_be_a_bool():
  with pytest.raises(TypeError, match="kahan_sum must be a bool"):
    jaxamp.build_optim_wrapper({"w": jnp.ones(2, BF16)},
                               dict(type="OptimWrapper", optimizer=dict(type="AdamW", kahan_sum=1)))
