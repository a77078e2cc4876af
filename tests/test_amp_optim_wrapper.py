"""jaxamp.AmpOptimWrapper: mmengine's AMP wrapper on dynamic/static loss scaling and a compute dtype."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from tests._tracing import trace_counts

X = jnp.array([3.0, 4.0], jnp.float32)


def bad_loss(params, x, bad):
  return jnp.sum(params["w"] * x) * jnp.where(bad, jnp.float32(jnp.inf), jnp.float32(1.0))


def w_params(value=(1.0, 1.0)):
  return {"w": jnp.asarray(value, jnp.float32)}


def run(wrapper, pattern, x=X):
  out = []
  for bad in pattern:
    wrapper.update_params(bad_loss, x, jnp.asarray(bad))
    out.append((wrapper.get_scale(), np.asarray(wrapper.params["w"])))
  return out


def test_reference_example():
  wrapper = jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(), clip_grad=dict(max_norm=1.0),
                                   loss_scale=dict(init_scale=4, growth_interval=2))
  out = run(wrapper, [False, False, True, False, False, False])
  assert [s for s, _ in out] == [4.0, 8.0, 4.0, 4.0, 8.0, 8.0]
  expected = [[.94, .92], [.88, .84], [.88, .84], [.82, .76], [.76, .68], [.70, .60]]
  np.testing.assert_allclose([w for _, w in out], expected, rtol=1e-6)
  assert float(wrapper.last_grad_norm) == pytest.approx(5.0)


def test_skipped_step_reports_the_non_finite_norm_and_keeps_everything():
  wrapper = jaxamp.AmpOptimWrapper(optax.sgd(0.1, momentum=0.9), {"w": jnp.array([-0.0, 1.0])},
                                   clip_grad=dict(max_norm=1.0), loss_scale=dict(init_scale=4.0))
  wrapper.update_params(bad_loss, X, jnp.asarray(False))
  params, opt_state = wrapper.params, wrapper.opt_state
  wrapper.update_params(bad_loss, X, jnp.asarray(True))
  assert not np.isfinite(wrapper.last_grad_norm)
  for a, b in zip(jax.tree.leaves((params, opt_state)),
                  jax.tree.leaves((wrapper.params, wrapper.opt_state))):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  assert wrapper.get_scale() == 2.0
  assert bool(wrapper.loss_scaler.skipped) and int(wrapper.loss_scaler.skipped_steps) == 1


def test_accumulation_window_skips_once_and_scale_moves_per_step():
  wrapper = jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(), accumulative_counts=2,
                                   loss_scale=dict(init_scale=8.0, growth_interval=1))
  scales = [s for s, _ in run(wrapper, [False, False])]
  assert scales == [8.0, 16.0]  # grows once per optimizer step, not per micro-batch
  np.testing.assert_allclose(wrapper.params["w"], 1 - 0.1 * np.asarray(X), rtol=1e-6)
  before = np.asarray(wrapper.params["w"])
  out = run(wrapper, [False, True])  # an overflow in the window: the whole window is skipped
  assert [s for s, _ in out] == [16.0, 8.0]
  np.testing.assert_array_equal(wrapper.params["w"], before)
  run(wrapper, [False, False])
  np.testing.assert_allclose(wrapper.params["w"], before - 0.1 * np.asarray(X), rtol=1e-6)


def test_static_and_dynamic_loss_scale():
  wrapper = jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params())
  assert wrapper.get_scale() == 65536.0
  assert wrapper.state_dict()["loss_scaler"] == {
      "scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
      "_growth_tracker": 0}
  static = jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(), loss_scale=512.0)
  out = run(static, [False, True, False])
  assert [s for s, _ in out] == [512.0] * 3
  np.testing.assert_array_equal(out[1][1], out[0][1])  # the bad step is still skipped
  assert static.state_dict()["loss_scaler"]["_growth_tracker"] == 0


def test_hysteresis_and_bounds_in_dict():
  wrapper = jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(),
                                   loss_scale=dict(init_scale=8.0, hysteresis=2, min_scale=4.0))
  scales = [s for s, _ in run(wrapper, [True, True, True, True])]
  assert scales == [8.0, 4.0, 4.0, 4.0]
  assert wrapper.state_dict()["loss_scaler"]["_hysteresis_tracker"] == 0


@pytest.mark.parametrize("loss_scale,err,match", [
    (512, TypeError, 'loss_scale must be of type float, dict, or "dynamic", but got 512'),
    ("static", TypeError, "but got static"),
    (None, TypeError, "but got None"),
    (dict(init_scale=4.0, foo=1), TypeError, "unexpected keyword argument 'foo'"),
    (dict(growth_factor=0.5), ValueError, "growth_factor"),
    (-1.0, ValueError, r"^loss_scale must be a positive, finite number, got -1.0"),
    (np.array([512.0]), TypeError, 'loss_scale must be of type float, dict, or "dynamic"'),
    (np.array(512), TypeError, 'loss_scale must be of type float, dict, or "dynamic", but got 512'),
    (jnp.int32(512), TypeError, 'loss_scale must be of type float, dict, or "dynamic", but got 512'),
    (dict(enabled="no"), TypeError, r"^enabled must be a bool, got 'no'"),
])
def test_bad_loss_scale(loss_scale, err, match):
  with pytest.raises(err, match=match):
    jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(), loss_scale=loss_scale)


@pytest.mark.parametrize("scale", [np.array(512.0), jnp.float32(512.0)], ids=["numpy", "jax"])
def test_a_0d_float_array_loss_scale_is_the_same_static_scale_as_the_float(scale):
  expected = run(jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(), loss_scale=512.0),
                 [False, True, False])
  out = run(jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(), loss_scale=scale),
            [False, True, False])
  assert [s for s, _ in out] == [s for s, _ in expected] == [512.0] * 3
  np.testing.assert_array_equal([w for _, w in out], [w for _, w in expected])


def test_a_loss_scale_dict_takes_pytorchs_defaults_and_ignores_the_device():
  # GradScaler(growth_interval=1, device='cuda'): init_scale 65536, x2, x0.5, device unused.
  wrapper = jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(),
                                   loss_scale=dict(growth_interval=1, device="cuda"))
  assert wrapper.state_dict()["loss_scaler"] == {
      "scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 1,
      "_growth_tracker": 0}
  assert [s for s, _ in run(wrapper, [False, True])] == [131072.0, 65536.0]


def test_max_scale_and_backoff_factor_in_dict():
  wrapper = jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(), loss_scale=dict(
      init_scale=8.0, growth_interval=1, max_scale=16.0, backoff_factor=0.25))
  assert [s for s, _ in run(wrapper, [False, False, True, True])] == [16.0, 16.0, 4.0, 1.0]


def test_a_bad_stall_after_is_refused_by_its_name():
  with pytest.raises(ValueError, match=r"^stall_after must be an int >= 1, got 0"):
    jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(), stall_after=0)


@pytest.mark.parametrize("loss_scale", [512.0, dict(init_scale=512.0)], ids=["static", "dynamic"])
def test_stall_after_sets_the_stalled_flag_and_on_stall_ignore_stays_silent(loss_scale):
  wrapper = jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(), loss_scale=loss_scale,
                                   stall_after=2, stall_check_every=1, on_stall="ignore")
  stalled = []
  for bad in (True, True, True, False):
    wrapper.update_params(bad_loss, X, jnp.asarray(bad))
    stalled.append(bool(wrapper.step_metrics()["stalled"]))
  jax.effects_barrier()  # a warning from inside the step (an error here) would surface by now
  assert stalled == [False, True, True, False]


def _stalled_at(bad, steps, **kwargs):
  """The step (1-based) that raised the stall, or None; the first ``bad`` steps overflow."""
  wrapper = jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(), stall_after=1, on_stall="raise",
                                   **kwargs)
  for i in range(1, steps + 1):
    try:
      wrapper.update_params(bad_loss, X, jnp.asarray(i <= bad))
    except jaxamp.StalledError:
      return i
    jax.block_until_ready(wrapper.loss_scaler)  # the flag kept is computed by the next step
  return None


def test_the_stall_flag_is_read_every_stall_check_every_steps_ten_by_default():
  # The flag of every stall_check_every-th step is read: with the default (10) a stall over
  # steps 1-10 is found, at step 10 or (when its flag was not computed yet) 11, and one that
  # ends sooner is not.
  assert _stalled_at(2, 4, stall_check_every=2) in (2, 3)
  assert _stalled_at(10, 12) in (10, 11)
  assert _stalled_at(9, 12) is None


def test_step_metrics_hold_the_norm_before_clipping_only_when_clipping_by_norm():
  clipped = jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(), clip_grad=dict(max_norm=1.0),
                                   loss_scale=dict(init_scale=4.0))
  plain = jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(), loss_scale=dict(init_scale=4.0))
  for wrapper in (clipped, plain):
    wrapper.update_params(bad_loss, X, jnp.asarray(False))
  keys = {"loss_scale", "skipped", "skipped_steps", "skip_streak", "stalled"}
  assert set(clipped.step_metrics()) == keys | {"grad_norm"}  # what a logger writes
  assert float(clipped.step_metrics()["grad_norm"]) == 5.0  # |(3, 4)|, unscaled, not clipped
  assert set(plain.step_metrics()) == keys


def test_a_bfloat16_dtype_runs_the_matmuls_in_bfloat16():
  # 1 + 2**-9 rounds to 1 in bfloat16 (8 significant bits) but not in float16 or float32.
  x = jnp.array([1.0 + 2.0**-9, 0.0], jnp.float32)
  loss_fn = lambda p, x: jnp.dot(x, p["w"])
  by_hand = jnp.dot(x.astype(jnp.bfloat16), w_params()["w"].astype(jnp.bfloat16))
  wrapper = jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(), dtype="bfloat16")
  loss = wrapper.update_params(loss_fn, x=x)  # keyword arguments reach the loss function too
  assert loss.dtype == jnp.float32 and float(loss) == float(by_hand) == 1.0


def test_a_disabled_scaler_is_the_plain_optim_wrapper():
  # GradScaler(enabled=False): the optimizer steps unconditionally, inf gradients included.
  plain = jaxamp.OptimWrapper(optax.sgd(0.1, momentum=0.9), w_params())
  amp = jaxamp.AmpOptimWrapper(optax.sgd(0.1, momentum=0.9), w_params(),
                               loss_scale=dict(enabled=False))
  for bad in (False, True, False):
    if bad:
      amp.load_state_dict(amp.state_dict())  # loads nothing into the scaler, breaks nothing
    for wrapper in (plain, amp):
      wrapper.update_params(bad_loss, X, jnp.asarray(bad))
    assert _bits((amp.params, amp.opt_state)) == _bits((plain.params, plain.opt_state))
  assert not np.isfinite(np.asarray(amp.params["w"])).any()
  for wrapper in (plain, amp):
    with pytest.raises(TypeError, match=r"step\(closure=...\) is not supported"):
      wrapper.step(closure=lambda: 0.0)


def test_disabled_scaler():
  wrapper = jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(), loss_scale=dict(enabled=False))
  assert wrapper.get_scale() == 1.0 and wrapper.loss_scaler is None
  wrapper.update_params(bad_loss, X, jnp.asarray(False))
  np.testing.assert_allclose(wrapper.params["w"], 1 - 0.1 * np.asarray(X), rtol=1e-6)
  sd = wrapper.state_dict()
  assert sd["loss_scaler"] == {}
  wrapper.load_state_dict(sd)


def test_compute_dtype_casts_inside_and_keeps_float32_masters():
  seen = []

  def loss(params, x):
    seen.append((params["w"].dtype, x.dtype))
    return jnp.sum(params["w"] * x)

  wrapper = jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(), dtype="bfloat16",
                                   loss_scale=dict(init_scale=2.0**10), cast="whole")
  out = wrapper.update_params(loss, X)
  assert seen == [(jnp.bfloat16, jnp.bfloat16)]  # the whole cast: inputs arrive in bfloat16
  assert out.dtype == jnp.float32 and float(out) == 7.0
  assert wrapper.params["w"].dtype == jnp.float32
  wrapper.backward(loss, X)
  assert wrapper.grads["w"].dtype == jnp.float32
  np.testing.assert_array_equal(wrapper.grads["w"], 2.0**10 * np.asarray(X))  # the scaled loss
  with wrapper.optim_context() as cast:
    assert cast({"x": X, "n": jnp.arange(2)})["x"].dtype == jnp.bfloat16
    assert cast({"x": X, "n": jnp.arange(2)})["n"].dtype == jnp.int32
  with jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params()).optim_context() as cast:
    assert cast(X) is X  # dtype=None casts nothing
  assert jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(), dtype=jnp.float16).cast_dtype == \
      jnp.float16


def test_bad_dtype_and_float16_masters():
  with pytest.raises(AssertionError, match="dtype should be any of"):
    jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(), dtype="int8")
  with pytest.raises(ValueError, match="dtype should be any of"):
    jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(), dtype="half")
  with pytest.raises(TypeError, match="dtype"):
    jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(), dtype=jnp.int32)
  with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
    jaxamp.AmpOptimWrapper(optax.sgd(0.1), {"w": jnp.ones(2, jnp.float16)})


def test_update_params_loop_compiles_once_and_never_syncs():
  calls = []

  def loss(params, x, bad):  # runs in float16
    calls.append(1)
    y = jnp.sum(params["w"] * x)
    return y * jnp.where(bad, jnp.inf, 1.0).astype(y.dtype)

  wrapper = jaxamp.AmpOptimWrapper(optax.sgd(0.01, momentum=0.9), w_params(), dtype="float16",
                                   accumulative_counts=2, clip_grad=dict(max_norm=1.0),
                                   loss_scale=dict(init_scale=2.0**8, growth_interval=3))
  pattern = [jnp.asarray(i % 7 == 3) for i in range(100)]
  wrapper.update_params(loss, X, pattern[0])
  with jax.transfer_guard("disallow"):
    for bad in pattern[1:]:
      wrapper.update_params(loss, X, bad)
  assert dict(trace_counts(wrapper)) == {"grad": 1, "fused_acc": 1}
  assert len(calls) == 1  # autocast traces the loss once, for both compiled steps
  assert wrapper.inner_count == 100


def test_error_if_nonfinite_raises_on_overflow():
  wrapper = jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(), loss_scale=dict(init_scale=4.0),
                                   clip_grad=dict(max_norm=1.0, error_if_nonfinite=True))
  wrapper.update_params(bad_loss, X, jnp.asarray(False))
  scale = wrapper.get_scale()
  with pytest.raises(RuntimeError, match="non-finite"):
    wrapper.update_params(bad_loss, X, jnp.asarray(True))
  assert wrapper.get_scale() == scale


def test_apply_gradients_with_external_skip_keeps_the_scale():
  wrapper = jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(),
                                   loss_scale=dict(init_scale=4.0, growth_interval=1))
  state = wrapper._state
  wrapper.apply_gradients({"w": 4.0 * X}, skip=jnp.asarray(True))
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(wrapper._state)):
    np.testing.assert_array_equal(a, b)
  wrapper.apply_gradients({"w": 4.0 * X})  # gradients of the scaled loss: unscaled inside
  np.testing.assert_allclose(wrapper.params["w"], 1 - 0.1 * np.asarray(X), rtol=1e-6)
  assert wrapper.get_scale() == 8.0
  clipped = jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(), clip_grad=dict(max_norm=1.0),
                                   loss_scale=dict(init_scale=4.0))
  clipped.apply_gradients({"w": 4.0 * X}, skip=jnp.asarray(True))
  assert float(clipped.last_grad_norm) == 5.0  # the norm of the unscaled gradients, as logged
  l1 = jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(),
                              clip_grad=dict(max_norm=1.0, norm_type=1.0),
                              loss_scale=dict(init_scale=4.0))
  l1.apply_gradients({"w": 4.0 * X}, skip=jnp.asarray(True))
  assert float(l1.last_grad_norm) == 7.0  # of the order asked for
  with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
    wrapper.step(closure=lambda: 0.0)


@pytest.mark.parametrize("fused", [True, False])
def test_a_grad_scaler_stepping_the_wrapper_and_the_wrapper_each_undo_their_own_scale(fused):
  # The loss is differentiated under both scales; the wrapper's step unscales its own, the
  # GradScaler's step the other: the step is plain SGD's, the scales as no overflow leaves them.
  wrapper = jaxamp.AmpOptimWrapper(optax.sgd(0.5), w_params(),
                                   loss_scale=dict(init_scale=1024.0, growth_interval=1))
  scaler = jaxamp.GradScaler(init_scale=8.0)
  loss_fn = lambda p, x: jnp.sum(p["w"] * x)  # noqa: E731
  if fused:  # the wrapper's fused step, under the GradScaler's scale only (as torch without it)
    wrapper.update_params(scaler.scale(loss_fn), X)
    np.testing.assert_allclose(wrapper.params["w"], 1.0 - 0.5 * 8.0 * np.asarray(X))
  else:
    loss = wrapper.backward(scaler.scale(loss_fn), X)
    assert float(loss) == 7.0
    scaler.step(wrapper)
    scaler.update()
    np.testing.assert_allclose(wrapper.params["w"], 1.0 - 0.5 * np.asarray(X))
  assert wrapper.get_scale() == 2048.0


# -------------------------------------------------------------------------------------------------
# State dicts: PyTorch's GradScaler format, round trips, partial and bad loads.
# -------------------------------------------------------------------------------------------------


PATTERN = [False, True, False, False, False, True, False, False]


def make(**kw):
  kw.setdefault("loss_scale", dict(init_scale=16.0, growth_interval=2))
  opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
  return jaxamp.AmpOptimWrapper(opt, w_params(), clip_grad=dict(max_norm=2.0), **kw)


def test_round_trip_continues_the_trajectory():
  full = make()
  expected = run(full, PATTERN)
  first = make()
  run(first, PATTERN[:3])
  saved = copy.deepcopy(first.state_dict())
  scaler = saved["loss_scaler"]
  assert set(scaler) == {"scale", "growth_factor", "backoff_factor", "growth_interval",
                         "_growth_tracker"}
  assert type(scaler["scale"]) is float and type(scaler["_growth_tracker"]) is int
  assert type(scaler["growth_interval"]) is int
  resumed = make(loss_scale="dynamic")  # a different scaler config: the loaded one wins
  resumed.params = first.params
  resumed.load_state_dict(saved)
  assert resumed.get_scale() == first.get_scale()
  out = run(resumed, PATTERN[3:])
  for (s1, w1), (s2, w2) in zip(expected[3:], out):
    assert s1 == s2
    np.testing.assert_array_equal(w1, w2)
  assert resumed.state_dict()["loss_scaler"] == full.state_dict()["loss_scaler"]


def test_load_without_loss_scaler_loads_the_optimizer_only():
  a, b = make(), make()
  run(a, PATTERN[:4])
  sd = a.state_dict()
  del sd["loss_scaler"]
  b.load_state_dict(sd)
  assert b.get_scale() == 16.0
  jax.tree.map(np.testing.assert_array_equal, b.opt_state, a.opt_state)


def test_base_param_settings_are_restored_as_mmengine_does():
  params = {"a": jnp.ones(2), "b": jnp.ones(3)}
  cfg = dict(type="AmpOptimWrapper", optimizer=dict(type="SGD", lr=0.1),
             paramwise_cfg=dict(custom_keys={"a": dict(lr_mult=0.5)}))
  saved, fresh = (jaxamp.build_optim_wrapper(params, cfg) for _ in range(2))
  saved.base_param_settings["lr"] = 0.05  # what a scheduler does to the base group
  fresh.load_state_dict(saved.state_dict())
  assert fresh.base_param_settings["lr"] == 0.05
  assert fresh.get_lr()["base_lr"] == [0.05]


def test_bad_scaler_state_changes_nothing():
  wrapper = make()
  run(wrapper, PATTERN[:2])
  good = wrapper.state_dict()
  state = wrapper._state
  cases = [
      (dict(good, loss_scaler={}), RuntimeError,
       "The source state dict is empty, possibly because it was saved from a disabled instance "
       "of GradScaler."),
      (dict(good, loss_scaler={"scale": 2.0}), ValueError, "missing"),
      (dict(good, loss_scaler=dict(good["loss_scaler"], extra=1)), ValueError, "unexpected"),
      (dict(good, loss_scaler=dict(good["loss_scaler"], scale=-1.0)), ValueError, "scale"),
      (dict(good, loss_scaler=dict(good["loss_scaler"], growth_factor=0.5)), ValueError,
       "growth_factor"),
      (dict(good, loss_scaler=dict(good["loss_scaler"], _growth_tracker=1.5)), TypeError,
       "_growth_tracker"),
      (dict(good, state=optax.sgd(0.1).init(w_params())), ValueError, "different optimizer"),
  ]
  for sd, err, match in cases:
    with pytest.raises(err, match=match):
      wrapper.load_state_dict(sd)
    assert wrapper._state is state


def test_loading_other_scaler_factors_rebuilds_once():
  wrapper = make()
  run(wrapper, PATTERN[:2])
  sd = wrapper.state_dict()
  sd["loss_scaler"].update(growth_factor=4.0, growth_interval=1, scale=8.0, _growth_tracker=0)
  before = dict(trace_counts(wrapper))
  wrapper.load_state_dict(sd)
  run(wrapper, [False, False])
  assert dict(trace_counts(wrapper)) == {k: 2 * v for k, v in before.items()}  # rebuilt once
  assert wrapper.get_scale() == 128.0
  assert wrapper.state_dict()["loss_scaler"]["growth_factor"] == 4.0
  sd["loss_scaler"].update(backoff_factor=0.25, scale=128.0)
  wrapper.load_state_dict(sd)
  assert [s for s, _ in run(wrapper, [True])] == [32.0]


def test_a_load_keeps_the_configured_hysteresis_and_scale_bounds():
  # hysteresis, min_scale and max_scale are not in PyTorch's state dict: the configured ones stay.
  def slow():
    return jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(),
                                  loss_scale=dict(init_scale=8.0, hysteresis=2))

  first = slow()
  first.load_state_dict(first.state_dict())
  assert [s for s, _ in run(first, [True, True, True])] == [8.0, 4.0, 4.0]
  saved = first.state_dict()
  assert saved["loss_scaler"]["_hysteresis_tracker"] == 1  # one overflow not yet acted on
  resumed = slow()
  resumed.load_state_dict(saved)
  assert [s for s, _ in run(resumed, [True])] == [2.0]
  low = jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(),
                               loss_scale=dict(init_scale=8.0, min_scale=4.0))
  low.load_state_dict(low.state_dict())
  assert [s for s, _ in run(low, [True, True])] == [4.0, 4.0]
  high = jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(),
                                loss_scale=dict(init_scale=8.0, growth_interval=1, max_scale=16.0))
  high.load_state_dict(high.state_dict())
  assert [s for s, _ in run(high, [False, False])] == [16.0, 16.0]


def _loads_nothing(wrapper, state_dict, err, match):
  """Loads ``state_dict``, which must raise ``err``; checks that the wrapper kept its state."""
  before = wrapper.state_dict()
  params = _bits(wrapper.params)
  with pytest.raises(err, match=match):
    wrapper.load_state_dict(state_dict)
  after = wrapper.state_dict()
  assert after["loss_scaler"] == before["loss_scaler"]
  assert _bits(after["state"]) == _bits(before["state"]) and _bits(wrapper.params) == params


def test_bad_scaler_values_are_refused_by_their_key():
  wrapper = jaxamp.AmpOptimWrapper(optax.sgd(0.1, momentum=0.9), w_params(), loss_scale=dict(
      init_scale=8.0, max_scale=16.0, hysteresis=2))
  run(wrapper, [False, True])
  good = wrapper.state_dict()
  key = r"^state_dict\['loss_scaler'\]"
  for name, value, err, match in [
      ("scale", 32.0, ValueError,
       key + r"\['scale'\] must lie in \[min_scale, max_scale\] = \[.*, 16.0\], got 32.0"),
      ("scale", 0.0, ValueError, key + r"\['scale'\] must be a positive, finite number, got 0.0"),
      ("_growth_tracker", 1.5, TypeError, key + r"\['_growth_tracker'\] must be an int, got 1.5"),
      ("_hysteresis_tracker", -1, ValueError,
       key + r"\['_hysteresis_tracker'\] must be an int >= 0, got -1"),
  ]:
    bad = dict(good, loss_scaler=dict(good["loss_scaler"], **{name: value}))
    _loads_nothing(wrapper, bad, err, match)


def test_a_static_scale_round_trips_and_refuses_a_bad_loaded_scale():
  full = jaxamp.AmpOptimWrapper(optax.sgd(0.1, momentum=0.9), w_params(), loss_scale=512.0)
  expected = run(full, PATTERN[:5])
  first = jaxamp.AmpOptimWrapper(optax.sgd(0.1, momentum=0.9), w_params(), loss_scale=512.0)
  run(first, PATTERN[:2])
  saved = copy.deepcopy(first.state_dict())
  resumed = jaxamp.AmpOptimWrapper(optax.sgd(0.1, momentum=0.9), w_params(), loss_scale=512.0)
  resumed.params = first.params
  resumed.load_state_dict(saved)
  out = run(resumed, PATTERN[2:5])
  assert [s for s, _ in out] == [s for s, _ in expected[2:]]
  np.testing.assert_array_equal([w for _, w in out], [w for _, w in expected[2:]])
  bad = dict(saved, loss_scaler=dict(saved["loss_scaler"], scale=0.0))
  _loads_nothing(resumed, bad, ValueError,
                 r"^state_dict\['loss_scaler'\]\['scale'\] must be a positive, finite number, "
                 "got 0.0")
  # A static scale does not use the factors but keeps them, as GradScaler does; a bad one is
  # refused.
  kept = dict(saved["loss_scaler"], growth_factor=4.0, backoff_factor=0.25, growth_interval=7)
  resumed.load_state_dict(dict(saved, loss_scaler=kept))
  assert resumed.state_dict()["loss_scaler"] == kept
  assert [s for s, _ in run(resumed, [True, False])] == [512.0, 512.0]
  for name, value, err in [("growth_factor", 0.5, ValueError), ("backoff_factor", "x", TypeError),
                           ("growth_interval", 0, ValueError)]:
    bad = dict(saved, loss_scaler=dict(saved["loss_scaler"], **{name: value}))
    _loads_nothing(resumed, bad, err, "^" + name)


def test_a_scale_loaded_into_a_static_wrapper_serves_one_step_as_in_mmengine():
  # mmengine's static scale calls GradScaler.update(loss_scale) after every step: a scale loaded
  # from a dynamic run's state dict scales the next loss, then the configured one is back.
  dynamic = jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(), loss_scale=dict(init_scale=64.0))
  static = jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(), loss_scale=512.0)
  static.load_state_dict(dynamic.state_dict())
  assert static.get_scale() == 64.0
  static.backward(bad_loss, X, jnp.asarray(False))
  np.testing.assert_array_equal(static.grads["w"], 64.0 * np.asarray(X))  # the loaded scale
  static.step()
  static.zero_grad()
  assert static.get_scale() == 512.0
  assert static.state_dict()["loss_scaler"]["scale"] == 512.0
  np.testing.assert_allclose(static.params["w"], 1 - 0.1 * np.asarray(X), rtol=1e-6)
  assert [s for s, _ in run(static, [True, False])] == [512.0, 512.0]


def test_a_static_scale_gives_the_optimizer_the_params():
  # Weight decay reads the params: the static wrapper's step is plain optax's on the same grads.
  tx = optax.chain(optax.add_decayed_weights(0.5), optax.sgd(0.1))
  wrapper = jaxamp.AmpOptimWrapper(tx, w_params((1.0, -2.0)), loss_scale=512.0)
  wrapper.update_params(bad_loss, X, jnp.asarray(False))
  params = w_params((1.0, -2.0))
  updates, _ = tx.update({"w": X}, tx.init(params), params)
  np.testing.assert_allclose(wrapper.params["w"], optax.apply_updates(params, updates)["w"],
                             rtol=1e-6)


# -- donate=True: in-place buffers, identical numerics ----------------------------------------

DONATE_PATTERN = (False, True, False, False, "nan", False, True, True, False, False)


def nan_loss(params, x, bad):
  poison = jnp.where(bad == 2, jnp.float32(jnp.nan), jnp.where(bad == 1, jnp.float32(jnp.inf),
                                                               jnp.float32(1.0)))
  return jnp.sum(params["w"] * x + params["b"]) * poison


def _bits(tree):
  return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(tree)]


def _code(bad):
  return jnp.int32({False: 0, True: 1, "nan": 2}[bad])


@pytest.mark.parametrize("kind", ["amp", "amp_acc", "plain_skip"])
def test_donate_is_bit_identical_to_the_default(kind):
  runs = []
  for donate in (False, True):
    params = {"w": jnp.asarray([1.0, -2.0, 0.5], jnp.float32), "b": jnp.zeros((), jnp.float32)}
    tx = optax.sgd(0.05, momentum=0.9)
    clip = dict(max_norm=1.0)
    if kind == "plain_skip":
      wrapper = jaxamp.OptimWrapper(tx, params, clip_grad=clip, donate=donate)
    else:
      wrapper = jaxamp.AmpOptimWrapper(
          tx, params, clip_grad=clip, loss_scale=dict(init_scale=8.0, growth_interval=2),
          accumulative_counts=2 if kind == "amp_acc" else 1, donate=donate)
    trace = []
    for bad in DONATE_PATTERN:
      x = jnp.asarray([1.0, 2.0, 3.0], jnp.float32)
      if kind == "plain_skip":
        wrapper.backward(nan_loss, x, _code(bad))
        wrapper.apply_gradients(skip=jnp.asarray(bad is not False))
        wrapper.zero_grad()
      else:
        wrapper.update_params(nan_loss, x, _code(bad))
      scale = wrapper.get_scale() if kind != "plain_skip" else 1.0
      trace.append((_bits(wrapper.params), _bits(wrapper.state_dict()["state"]), scale,
                    _bits(wrapper.last_grad_norm)))
    runs.append(trace)
  assert runs[0] == runs[1]


def test_donate_invalidates_held_arrays_but_not_state_dict():
  wrapper = jaxamp.AmpOptimWrapper(optax.sgd(0.1, momentum=0.9), w_params(), donate=True)
  assert wrapper.donate
  wrapper.update_params(bad_loss, X, jnp.asarray(False))
  old_params, old_state = wrapper.params, wrapper.opt_state
  saved = wrapper.state_dict()
  wrapper.update_params(bad_loss, X, jnp.asarray(False))
  with pytest.raises(RuntimeError, match="deleted"):
    np.asarray(old_params["w"])
  with pytest.raises(RuntimeError, match="deleted"):
    np.asarray(jax.tree.leaves(old_state)[-1])
  for leaf in jax.tree.leaves(saved["state"]):
    np.asarray(leaf)  # still readable
  wrapper.load_state_dict(saved)
  wrapper.update_params(bad_loss, X, jnp.asarray(False))
  np.asarray(wrapper.params["w"])


def test_donate_compiles_once_in_a_100_step_loop():
  wrapper = jaxamp.AmpOptimWrapper(optax.sgd(0.01), w_params(), accumulative_counts=2,
                                   clip_grad=dict(max_norm=1.0), donate=True)
  for i in range(100):
    wrapper.update_params(bad_loss, X, jnp.asarray(i % 7 == 3))
  counts = dict(trace_counts(wrapper))
  assert counts and all(v == 1 for v in counts.values()), counts
  assert np.all(np.isfinite(np.asarray(wrapper.params["w"])))


def test_donate_must_be_a_bool():
  with pytest.raises(TypeError, match="donate"):
    jaxamp.AmpOptimWrapper(optax.sgd(0.1), w_params(), donate=1)


# ------------------------------------------------------------------------------------ autocast


def _dtypes_in_step(wrapper, loss_fn, x):
  """The (primitive, input dtypes) of the backward pass the wrapper compiles."""
  jaxpr = jax.make_jaxpr(lambda p: wrapper._compute_in_dtype(loss_fn)(p, x))(wrapper.params)
  found = set()

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      found.add((eqn.primitive.name, tuple(str(v.aval.dtype) for v in eqn.invars
                                          if hasattr(v.aval, "dtype"))))
      for value in eqn.params.values():
        inner = getattr(value, "jaxpr", value)
        if hasattr(inner, "eqns"):
          walk(inner)

  walk(jaxpr.jaxpr)
  return found


def test_a_half_dtype_runs_the_loss_under_autocast_by_default():
  params = {"w": jnp.ones((3, 3)) * 0.1}
  loss_fn = lambda p, x: jnp.mean(jnp.exp(x @ p["w"]))
  x = jnp.ones((2, 3))
  auto = jaxamp.AmpOptimWrapper(optax.sgd(0.1), params, dtype="float16")
  whole = jaxamp.AmpOptimWrapper(optax.sgd(0.1), params, dtype="float16", cast="whole")
  auto_ops = _dtypes_in_step(auto, loss_fn, x)
  whole_ops = _dtypes_in_step(whole, loss_fn, x)
  assert ("dot_general", ("float16", "float16")) in auto_ops
  assert ("exp", ("float32",)) in auto_ops  # kept in float32, as torch.autocast keeps it
  assert ("exp", ("float16",)) in whole_ops  # the whole cast runs everything in float16
  for _ in range(3):
    loss = auto.update_params(loss_fn, x)
  assert loss.dtype == jnp.float32 and auto.params["w"].dtype == jnp.float32
  assert set(trace_counts(auto).values()) == {1}  # compiled once
  with pytest.raises(ValueError, match="cast must be 'autocast'"):
    jaxamp.AmpOptimWrapper(optax.sgd(0.1), params, dtype="float16", cast="half")
