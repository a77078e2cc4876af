"""Tests of jaxamp.accumulate_gradients: windows, remainders, NaN safety, loss scaling, cost."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxamp
from jaxamp._src import accumulation
from tests._optax import adam

PARAMS = {"w": jnp.array([0.5, -1.0, 2.0], jnp.float32), "b": jnp.array([-0.0, 0.25], jnp.float32)}
RTOL = 1e-6


def micro_grads(n, seed=0):
  """n gradient pytrees like PARAMS, deterministic."""
  rng = np.random.default_rng(seed)
  return [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), PARAMS)
          for _ in range(n)]


def make_step(tx):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, updates

  return jax.jit(step)


def run(tx, grads_seq, params=PARAMS):
  step = make_step(tx)
  state = tx.init(params)
  out = []
  for g in grads_seq:
    params, state, updates = step(params, state, g)
    out.append((params, state, updates))
  return out


def tree_sum(trees):
  return jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *trees)


# --- Equivalence with one step on the mean (or summed) gradient -----------------------------


@pytest.mark.parametrize("make_inner", [lambda: optax.sgd(0.1, momentum=0.9),
                                        lambda: adam(0.05)], ids=["sgd", "adam"])
@pytest.mark.parametrize("average", [True, False])
def test_window_equals_one_step_on_mean(make_inner, average):
  k, windows = 3, 2
  grads = micro_grads(k * windows)
  out = run(jaxamp.accumulate_gradients(make_inner(), k, average=average), grads)
  ref_tx = make_inner()
  ref_params, ref_state = PARAMS, ref_tx.init(PARAMS)
  for w in range(windows):
    total = tree_sum(grads[w * k:(w + 1) * k])
    fed = jax.tree.map(lambda t: t / k, total) if average else total
    updates, ref_state = ref_tx.update(fed, ref_state, ref_params)
    ref_params = optax.apply_updates(ref_params, updates)
    for i in range(w * k, (w + 1) * k - 1):  # non-closing micro-steps change nothing
      params, state, updates = out[i]
      assert not bool(jaxamp.get_accumulation_state(state).updated)
      assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates))
    params, state, _ = out[(w + 1) * k - 1]
    assert bool(jaxamp.get_accumulation_state(state).updated)
    assert int(state.gradient_step) == w + 1
    assert int(state.mini_step) == 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-7),
                 params, ref_params)


def test_every_k_one_is_the_inner_transformation():
  tx = jaxamp.accumulate_gradients(adam(0.1), 1)
  state = tx.init(PARAMS)
  assert state.acc_grads == optax.EmptyState()
  ref_tx = adam(0.1)
  ref_state = ref_tx.init(PARAMS)
  for g in micro_grads(3):
    updates, state = tx.update(g, state, PARAMS)
    ref_updates, ref_state = ref_tx.update(g, ref_state, PARAMS)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL), updates, ref_updates)
    assert bool(jaxamp.get_accumulation_state(state).updated)
  assert int(state.gradient_step) == 3


# --- mmengine's counting: the remainder table -------------------------------------------------


def window_trace(k, total, calls, init_counts=0):
  """Runs sgd(1) on gradient 1.0 per call; returns (closing calls, divisor of each close)."""
  params = {"w": jnp.zeros([], jnp.float32)}
  tx = jaxamp.accumulate_gradients(optax.sgd(1.0), k, total_steps=total)
  state = tx.init(params)
  # Resuming mmengine-style: the counters say init_counts micro-steps were done.
  state = state._replace(micro_step=jnp.int32(init_counts), mini_step=jnp.int32(init_counts % k))
  step = make_step(tx)
  closes, divisors, seen = [], [], 0
  for call in range(init_counts, init_counts + calls):
    params_before = params
    params, state, updates = step(params, state, {"w": jnp.float32(1.0)})
    seen += 1
    if bool(state.updated):
      closes.append(call + 1)  # mmengine's inner_count after the call
      divisors.append(seen / -float(updates["w"]))  # sum of `seen` ones / divisor
      seen = 0
    del params_before
  return closes, divisors


@pytest.mark.parametrize("k,init,total,closes,divisors", [
    (3, 0, 10, [3, 6, 9, 10], [3, 3, 3, 1]),
    (4, 0, 10, [4, 8, 10], [4, 4, 2]),
    (3, 4, 10, [6, 9, 10], [3, 3, 1]),  # resume: the first window (2 grads) divides by 3
    (4, 0, 3, [3], [3]),
])
def test_mmengine_remainder_table(k, init, total, closes, divisors):
  got_closes, got_divisors = window_trace(k, total, total - init, init)
  assert got_closes == closes
  np.testing.assert_allclose(got_divisors, divisors, rtol=RTOL)


def test_no_total_steps_keeps_windows_of_k():
  closes, divisors = window_trace(4, None, 10)
  assert closes == [4, 8]
  np.testing.assert_allclose(divisors, [4, 4])


def test_past_total_steps_raises_a_clear_error():
  # mmengine's defect: acc 3, max 9, a 10th call divides the loss by 0.
  tx = jaxamp.accumulate_gradients(optax.sgd(1.0), 3, total_steps=9)
  step = make_step(tx)
  params, state = PARAMS, tx.init(PARAMS)
  for g in micro_grads(9):
    params, state, _ = step(params, state, g)
  with pytest.raises(RuntimeError, match=r"micro-step 10 is past total_steps=9"):
    jax.block_until_ready(step(params, state, micro_grads(1)[0]))


def test_past_total_steps_changes_nothing(monkeypatch):
  calls = []
  monkeypatch.setattr(accumulation, "_past_end",
                      lambda flag, micro_step, total_steps: calls.append(bool(np.any(flag))))
  tx = jaxamp.accumulate_gradients(adam(0.1), 2, total_steps=3)
  step = make_step(tx)
  params, state = PARAMS, tx.init(PARAMS)
  for g in micro_grads(3):
    params, state, _ = step(params, state, g)
  nan = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), PARAMS)
  new_params, new_state, updates = step(params, state, nan)
  jax.effects_barrier()
  assert calls[-1] is True and not any(calls[:-1])
  jax.tree.map(np.testing.assert_array_equal, new_params, params)
  jax.tree.map(np.testing.assert_array_equal, new_state.acc_grads, state.acc_grads)
  jax.tree.map(np.testing.assert_array_equal, new_state.inner_state, state.inner_state)
  assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates))
  assert int(new_state.micro_step) == 4 and not bool(new_state.updated)


def test_past_total_steps_without_the_callback():
  tx = jaxamp.accumulate_gradients(optax.sgd(1.0), 2, total_steps=3, raise_past_end=False)
  step = make_step(tx)
  params, state = PARAMS, tx.init(PARAMS)
  # No host callback: the step keeps JAX's fast dispatch path and can be exported.
  assert not jax.make_jaxpr(step)(params, state, PARAMS).effects
  assert jax.make_jaxpr(make_step(jaxamp.accumulate_gradients(optax.sgd(1.0), 2, total_steps=3))
                        )(params, state, PARAMS).effects
  for g in micro_grads(3):
    params, state, _ = step(params, state, g)
  new_params, new_state, updates = step(params, state, micro_grads(1)[0])
  jax.tree.map(np.testing.assert_array_equal, new_params, params)
  assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates))
  assert int(new_state.micro_step) == 4 > 3 and int(new_state.gradient_step) == 2


# --- NaN safety ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nan_runner():
  k = 3
  tx = jaxamp.accumulate_gradients(optax.sgd(0.1), k)

  @jax.jit
  def trajectory(grads):  # grads: leaves with a leading micro-step axis
    def body(carry, g):
      params, state = carry
      updates, state = tx.update(g, state, params)
      return (optax.apply_updates(params, updates), state), None

    (params, state), _ = jax.lax.scan(body, (PARAMS, tx.init(PARAMS)), grads)
    return params, state

  return k, trajectory


@pytest.mark.parametrize("window,micro,bad", [(0, 0, jnp.nan), (1, 2, jnp.inf), (2, 1, -jnp.inf),
                                              (1, 0, jnp.nan)])
def test_nan_window_is_dropped_whole_and_never_leaks(nan_runner, window, micro, bad):
  k, trajectory = nan_runner
  windows = 4
  clean = micro_grads(windows * k, seed=3)
  poisoned = list(clean)
  i = window * k + micro
  poisoned[i] = jax.tree.map(lambda g: g.at[0].set(bad), clean[i])
  # The run that never saw window `window`: the same gradients without it.
  without = clean[:window * k] + clean[(window + 1) * k:]
  stack = lambda gs: jax.tree.map(lambda *xs: jnp.stack(xs), *gs)  # noqa: E731
  params, state = trajectory(stack(poisoned))
  expected, _ = trajectory(stack(without))
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(expected)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
  assert int(state.skipped_windows) == 1
  assert int(state.gradient_step) == windows
  assert all(bool(jnp.all(a == 0)) for a in jax.tree.leaves(state.acc_grads))


def test_nan_window_with_adam_leaves_the_inner_state_untouched():
  k = 2
  grads = micro_grads(3 * k, seed=5)
  poisoned = list(grads)
  poisoned[2] = jax.tree.map(lambda g: g * jnp.nan, grads[2])
  out = run(jaxamp.accumulate_gradients(adam(0.1), k), poisoned)
  ref = run(jaxamp.accumulate_gradients(adam(0.1), k), grads[:2] + grads[4:])
  jax.tree.map(np.testing.assert_array_equal, out[-1][0], ref[-1][0])
  jax.tree.map(np.testing.assert_array_equal, out[-1][1].inner_state, ref[-1][1].inner_state)
  assert int(out[3][1].skipped_windows) == 1 and bool(out[3][1].updated)


def test_multisteps_is_poisoned_where_we_are_not():
  # The defect this transformation avoids: optax.MultiSteps resets with nan * 0.
  k = 2
  grads = micro_grads(4, seed=7)
  grads[0] = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads[0])
  ms = optax.MultiSteps(optax.sgd(0.1), k)
  state = ms.init(PARAMS)
  with jax.numpy_dtype_promotion("standard"):  # MultiSteps mixes float and int32
    update = jax.jit(ms.update)
    for g in grads:
      _, state = update(g, state, PARAMS)
  assert any(bool(jnp.isnan(a).any()) for a in jax.tree.leaves(state.acc_grads))
  out = run(jaxamp.accumulate_gradients(optax.sgd(0.1), k), grads)
  assert all(bool(jnp.isfinite(p).all()) for p in jax.tree.leaves(out[-1][0]))


# --- Composition with dynamic loss scaling: PyTorch's recipe ---------------------------------

K, WINDOWS, INIT_SCALE, INTERVAL, LR = 3, 5, 8.0, 2, 0.1


def torch_recipe(grads, bad):
  """Pure-Python model of scale(loss / k).backward() per micro-batch, step/update per window."""
  w = np.asarray(grads[0]["w"], np.float64) * 0 + np.asarray(PARAMS["w"], np.float64)
  scale, tracker = INIT_SCALE, 0
  scales, skips, params = [], [], []
  for win in range(WINDOWS):
    acc = np.zeros_like(w)
    found_inf = False
    for i in range(win * K, (win + 1) * K):
      scales.append(scale)  # the scale the micro-batch's loss is multiplied by
      if bad[i]:
        found_inf = True
      acc += scale * np.asarray(grads[i]["w"], np.float64) / K
    if found_inf:
      scale, tracker = scale * 0.5, 0
    else:
      w = w - LR * acc / scale
      tracker += 1
      if tracker == INTERVAL:
        scale, tracker = scale * 2.0, 0
    skips.append(found_inf)
    params.append(w.copy())
  return np.array(scales), skips, params


@pytest.fixture(scope="module")
def scaled_trajectory():
  tx = jaxamp.accumulate_gradients(
      jaxamp.dynamic_loss_scale(optax.sgd(LR), init_scale=INIT_SCALE, growth_interval=INTERVAL),
      K)

  @jax.jit
  def trajectory(grads, bad):
    def body(carry, xs):
      params, state = carry
      g, is_bad = xs
      scale = jaxamp.loss_scale(state)
      # The gradient of scale_loss(loss, state): scale * g, inf when the micro-batch overflows.
      scaled = jax.tree.map(lambda x: jnp.where(is_bad, jnp.inf, x * scale), g)
      updates, state = tx.update(scaled, state, params)
      params = optax.apply_updates(params, updates)
      inner = jaxamp.get_loss_scale_state(state)
      return (params, state), (scale, params["w"], state.updated, inner.skipped)

    (_, state), out = jax.lax.scan(body, (PARAMS, tx.init(PARAMS)), (grads, bad))
    return state, out

  return trajectory


@settings(max_examples=25, derandomize=True, deadline=None)
@given(st.lists(st.booleans(), min_size=K * WINDOWS, max_size=K * WINDOWS))
def test_composition_matches_pytorch_recipe(scaled_trajectory, bad):
  grads = micro_grads(K * WINDOWS, seed=11)
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *grads)
  state, (scales, ws, updated, skipped) = scaled_trajectory(stacked, jnp.asarray(bad))
  ref_scales, ref_skips, ref_params = torch_recipe(grads, bad)
  np.testing.assert_array_equal(np.asarray(scales), ref_scales.astype(np.float32))
  closing = [(w + 1) * K - 1 for w in range(WINDOWS)]
  np.testing.assert_array_equal(np.flatnonzero(np.asarray(updated)), closing)
  assert list(np.asarray(skipped)[closing]) == ref_skips
  for w, i in enumerate(closing):
    np.testing.assert_allclose(np.asarray(ws[i]), ref_params[w], rtol=1e-5, atol=1e-6)
  assert int(state.skipped_windows) == 0  # the loss scaler skips, and counts, itself
  assert int(jaxamp.get_loss_scale_state(state).skipped_steps) == sum(ref_skips)


def test_loss_scale_helpers_reach_through_the_wrapper():
  tx = jaxamp.accumulate_gradients(jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=4.0), 2)
  state = tx.init(PARAMS)
  assert float(jaxamp.loss_scale(state)) == 4.0
  assert float(jaxamp.scale_loss(jnp.float32(0.5), state)) == 2.0
  state = jaxamp.set_loss_scale(state, 32.0)
  assert isinstance(state, jaxamp.AccumulationState)
  assert float(jaxamp.loss_scale(state)) == 32.0


def test_scaler_outside_the_accumulator_warns():
  # The per-micro-step nesting: a trap for code ported from PyTorch.
  tx = jaxamp.dynamic_loss_scale(jaxamp.accumulate_gradients(optax.sgd(0.1), 2))
  with pytest.warns(UserWarning, match=re.escape("jaxamp.accumulate_gradients(jaxamp.dynamic")):
    tx.init(PARAMS)
  wrapped = optax.chain(optax.identity(), jaxamp.accumulate_gradients(optax.sgd(0.1), 2))
  with pytest.warns(UserWarning, match="checked and adjusted on every micro-step"):
    jaxamp.static_loss_scale(wrapped, 8.0).init(PARAMS)


# --- Schedules, recompilation, dtypes ---------------------------------------------------------


def test_inner_schedule_advances_once_per_optimizer_step():
  schedule = optax.linear_schedule(1.0, 0.0, transition_steps=10)
  inner = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
  k = 4
  out = run(jaxamp.accumulate_gradients(inner, k), micro_grads(3 * k))
  for i, (_, state, _) in enumerate(out):
    steps = (i + 1) // k
    assert int(state.inner_state.count) == steps
    # The learning rate used by the last emitted step is schedule(steps - 1).
    if steps:
      np.testing.assert_allclose(state.inner_state.hyperparams["learning_rate"],
                                 schedule(steps - 1), rtol=RTOL)


@pytest.mark.parametrize("total_steps", [None, 50])
def test_no_recompilation_across_fifty_micro_steps(count_traces, total_steps):
  tx = jaxamp.accumulate_gradients(
      jaxamp.dynamic_loss_scale(adam(0.01), init_scale=2.0**10, growth_interval=3), 4,
      total_steps=total_steps)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  traced, counter = count_traces(step)
  jitted = jax.jit(traced, donate_argnums=(0, 1))
  params, state = jax.tree.map(jnp.copy, PARAMS), tx.init(PARAMS)
  grads = micro_grads(50, seed=2)
  grads[13] = jax.tree.map(lambda g: g * jnp.inf, grads[13])
  for g in grads:
    params, state = jitted(params, state, g)
  assert counter["n"] == 1
  # 12 windows of 4; with total_steps=50 a 13th, of the last 2 micro-steps.
  assert int(state.micro_step) == 50
  assert int(state.gradient_step) == (12 if total_steps is None else 13)
  assert int(jaxamp.get_loss_scale_state(state).skipped_steps) == 1


def test_structure_and_dtypes_stable_under_scan_with_bf16():
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), PARAMS)
  tx = jaxamp.accumulate_gradients(adam(0.01), 3)
  state0 = tx.init(params)
  assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(state0.acc_grads))
  grads = jax.tree.map(lambda *xs: jnp.stack(xs).astype(jnp.bfloat16), *micro_grads(7))

  def body(carry, g):
    params, state = carry
    updates, state = tx.update(g, state, params)
    assert all(u.dtype == jnp.bfloat16 for u in jax.tree.leaves(updates))
    return (optax.apply_updates(params, updates), state), None

  (params1, state1), _ = jax.jit(lambda c, g: jax.lax.scan(body, c, g))((params, state0), grads)
  assert jax.tree.structure(state1) == jax.tree.structure(state0)
  for a, b in zip(jax.tree.leaves(state1), jax.tree.leaves(state0)):
    assert (a.dtype, a.shape) == (b.dtype, b.shape)
  assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(params1))
  assert int(state1.gradient_step) == 2 and int(state1.mini_step) == 1
  # One micro-batch is waiting in the float32 accumulator.
  np.testing.assert_allclose(state1.acc_grads["w"],
                             grads["w"][6].astype(jnp.float32), rtol=RTOL)
  # And it survives a flatten/unflatten with every field.
  leaves, treedef = jax.tree.flatten(state1)
  assert jax.tree.unflatten(treedef, leaves)._fields == jaxamp.AccumulationState._fields


def test_accumulator_dtype():
  tx = jaxamp.accumulate_gradients(optax.sgd(1.0), 2, accumulator_dtype=jnp.bfloat16)
  state = tx.init(PARAMS)
  assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(state.acc_grads))
  updates, state = tx.update(micro_grads(1)[0], state, PARAMS)
  updates, state = tx.update(micro_grads(1)[0], state, PARAMS)
  assert all(u.dtype == jnp.float32 for u in jax.tree.leaves(updates))
  half = {"w": jnp.ones(2, jnp.float16)}
  state = jaxamp.accumulate_gradients(optax.sgd(1.0), 2).init(half)
  assert state.acc_grads["w"].dtype == jnp.float32


def test_the_accumulation_state_is_found_anywhere():
  tx = optax.chain(optax.clip(1.0), jaxamp.accumulate_gradients(optax.sgd(1.0), 2))
  state = tx.init(PARAMS)
  assert not bool(jaxamp.get_accumulation_state(state).updated)
  _, state = tx.update(micro_grads(1)[0], state, PARAMS)
  _, state = tx.update(micro_grads(1)[0], state, PARAMS)
  assert bool(jaxamp.get_accumulation_state(state).updated)
  assert jaxamp.get_accumulation_state(state).gradient_step.dtype == jnp.int32
  with pytest.raises(ValueError, match="No accumulation state"):
    jaxamp.get_accumulation_state(optax.sgd(1.0).init(PARAMS))


def test_extra_args_reach_the_inner_on_closing_micro_steps():
  seen = []

  def update(updates, state, params=None, *, tag=None):
    seen.append(tag)
    return updates, state

  inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
  tx = jaxamp.accumulate_gradients(inner, 2)
  state = tx.init(PARAMS)
  updates, state = tx.update(micro_grads(1)[0], state, PARAMS, tag="x")
  assert seen == ["x"]  # traced once, run only when the window closes


# --- Data parallelism on one device: vmap with a named axis -----------------------------------


def test_axis_name_reduces_once_per_window_under_vmap():
  devices, k = 4, 2
  inner = jaxamp.dynamic_loss_scale(adam(0.1), init_scale=4.0)
  tx = jaxamp.accumulate_gradients(inner, k, axis_name="data")
  per_device = [micro_grads(2 * k, seed=20 + d) for d in range(devices)]
  per_device[2][1] = jax.tree.map(lambda g: g.at[0].set(jnp.inf), per_device[2][1])
  state = jax.tree.map(lambda x: jnp.stack([x] * devices), tx.init(PARAMS))
  params = jax.tree.map(lambda x: jnp.stack([x] * devices), PARAMS)
  step = jax.jit(jax.vmap(lambda p, s, g: tx.update(g, s, p), axis_name="data"))
  ref_tx = jaxamp.accumulate_gradients(inner, k)
  ref_state = ref_tx.init(PARAMS)
  ref_update = jax.jit(ref_tx.update)
  for i in range(2 * k):
    grads = jax.tree.map(lambda *xs: jnp.stack(xs), *[per_device[d][i] for d in range(devices)])
    updates, state = step(params, state, grads)
    params = optax.apply_updates(params, updates)
    # The same computation on the device-mean gradients, unmapped.
    mean = jax.tree.map(lambda x: x.mean(0), grads)
    ref_updates, ref_state = ref_update(mean, ref_state, PARAMS)
    for u, r in zip(jax.tree.leaves(updates), jax.tree.leaves(ref_updates)):
      np.testing.assert_allclose(u, jnp.broadcast_to(r, u.shape), rtol=1e-5, atol=1e-7)
  scale = jaxamp.loss_scale(state)
  # The window with an inf on one device is skipped on every device; the next one is taken.
  np.testing.assert_array_equal(scale, jnp.full(devices, 2.0))
  np.testing.assert_array_equal(jaxamp.get_loss_scale_state(state).skipped_steps, [1] * devices)
  np.testing.assert_array_equal(state.gradient_step, [2] * devices)


# --- Cost: no copy of the accumulator or the inner state, donation works ----------------------


@pytest.mark.parametrize("total_steps", [None, 10**6])
def test_compiled_step_copies_no_buffer(total_steps):
  params = {f"l{i}": jnp.zeros((4096,), jnp.float32) for i in range(3)}
  tx = jaxamp.accumulate_gradients(adam(1e-3), 4, total_steps=total_steps)
  state = tx.init(params)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params)
  compiled = lowered.compile()
  # A copy of an existing buffer (a parameter, a branch output); the zero-fills
  # of identical shapes that XLA shares and then copies into each output are fine.
  copies = [line for line in compiled.as_text().splitlines()
            if re.search(r"= f32\[\d+\]\S* copy\(", line) and "broadcast" not in line]
  assert not copies, copies[:3]
  memory = compiled.memory_analysis()
  if memory is not None:  # every donated byte (params and state) is reused for the outputs
    state_bytes = sum(x.nbytes for x in jax.tree.leaves((params, state)))
    assert memory.alias_size_in_bytes >= state_bytes - 64
  # Donation takes: the inputs are consumed.
  new_params, _ = jax.jit(step, donate_argnums=(0, 1))(params, state, jax.tree.map(jnp.ones_like,
                                                                                    params))
  assert all(p.is_deleted() for p in jax.tree.leaves(params))
  del new_params


# --- Arguments --------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(every_k=0), ValueError, "every_k must be an int >= 1, got 0"),
    (dict(every_k=2.0), TypeError, "every_k must be an int"),
    (dict(every_k=True), TypeError, "every_k must be an int"),
    (dict(every_k=2, total_steps=0), ValueError, "total_steps must be an int >= 1"),
    (dict(every_k=2, average="yes"), TypeError, "average must be a bool"),
    (dict(every_k=2, accumulator_dtype=jnp.int32), ValueError, "accumulator_dtype"),
    (dict(every_k=2, accumulator_dtype="nope"), TypeError, "accumulator_dtype"),
    (dict(every_k=2, raise_past_end=None), TypeError, "raise_past_end must be a bool"),
])
def test_bad_arguments(kwargs, error, match):
  with pytest.raises(error, match=match):
    jaxamp.accumulate_gradients(optax.sgd(0.1), **kwargs)


def test_inner_must_be_a_transformation():
  with pytest.raises(TypeError, match="inner must be an optax GradientTransformation"):
    jaxamp.accumulate_gradients(lambda g: g, 2)
