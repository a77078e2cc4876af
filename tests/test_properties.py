"""Properties users rely on, across elements, leaves and steps, and the rules every entry shares.

Each test here fails for a bug of the kind a developer writes (a streak never
reset, a stall one skip early, a counter that wraps, every leaf drawing the same
random bits, a compensation decoded in the wrong binade...): the semantic
mutants of ``.ci/semantic_mutants.toml`` plant them one at a time, and
``.ci/mutation --semantic`` checks that these tests catch each.

- The scale rule (the scale, its counters, the skip streak and the stall) over
  a long run with sparse overflows, through every loss scaler: the functional
  core, ``TrainState``, ``jaxamp.nnx.Optimizer``, both ``GradScaler``s and
  ``AmpOptimWrapper``, step by step against a pure-Python model; each stall
  reported once, a later one again.
- Counters saturate at their dtype's maximum.
- ``validate_opt_state`` refuses each field's out-of-range values.
- Statistics are written on every micro-step that is not skipped.
- Stochastic rounding draws independent bits for each leaf, position and step;
  Kahan's compensation survives a parameter crossing a power of two; an
  unchanged parameter keeps its bits.
- Older behaviours: the scalers check the unscaled gradients, Paddle's takes
  float16 gradients, the skip counts of a scaler and an accumulator add up
  (``'-inf'`` norms and ``flat_decay_mult`` on scalars are tested in
  ``tests/test_train_state_edges.py`` and ``tests/test_facade_edges.py``).

Flax's fp8 values have theirs in ``tests/test_fp8.py`` and, across devices,
``tests/multidevice/test_fp8_sharded.py``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
import jaxamp.nnx

BF16 = jnp.bfloat16
INT32_MAX = int(np.iinfo(np.int32).max)

# -- the scale rule over a long run -----------------------------------------------------------

STALL_AFTER = 4
INIT_SCALE = 2.0**12
GROWTH_INTERVAL = 3
# Sparse overflows, with bursts of STALL_AFTER - 1 skips (never a stall) and one burst of
# STALL_AFTER (a stall on its last skip, over at the next good step). More overflows in all
# than STALL_AFTER, so a streak that a good step does not reset stalls early.
SPARSE = {2, 9, 10, 17, 24, 25, 26, 33, 41, 42, 43, 50, 58}
WITH_A_STALL = SPARSE | {64, 65, 66, 67, 71}
STEPS = 75


def _model(bad_steps, steps, *, hysteresis=1, dynamic=True):
  """The rule as a pure-Python state machine.

  Per step ``(scale, skipped, skipped_steps, skip_streak, stalled)``.
  """
  scale, tracker, overflow, skipped, streak = INIT_SCALE, 0, 0, 0, 0
  rows = []
  for i in range(steps):
    if i in bad_steps:
      tracker, overflow = 0, overflow + 1
      if dynamic and overflow >= hysteresis:
        scale, overflow = scale / 2, 0
      skipped, streak = skipped + 1, streak + 1
    else:
      overflow, tracker, streak = 0, tracker + 1, 0
      if dynamic and tracker >= GROWTH_INTERVAL:
        scale, tracker = scale * 2, 0
    rows.append((scale, i in bad_steps, skipped, streak, streak >= STALL_AFTER))
  return rows


def _x(bad):
  return jnp.array([jnp.inf if bad else 1.0, 1.0, -1.0], jnp.float32)


def _loss(params, x):
  return jnp.sum(params["w"] * x)


W = {"w": jnp.array([0.5, -1.0, 2.0], jnp.float32)}
RULE = dict(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, stall_after=STALL_AFTER)


def _metrics(m):
  return (float(m["loss_scale"]), bool(m["skipped"]), int(m["skipped_steps"]),
          int(m["skip_streak"]), bool(m["stalled"]))


def _core_run(bad_steps, steps, on_stall, static=False):
  if static:
    tx = jaxamp.static_loss_scale(optax.sgd(0.1), INIT_SCALE, stall_after=STALL_AFTER,
                                  on_stall=on_stall)
  else:
    tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), on_stall=on_stall, **RULE)
  params, state = W, tx.init(W)

  @jax.jit
  def step(params, state, x):
    grads = jax.grad(lambda p: jaxamp.scale_loss(_loss(p, x), state))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for i in range(steps):
    params, state = step(params, state, _x(i in bad_steps))
    yield _metrics(jaxamp.step_metrics(state))


def _train_state_run(bad_steps, steps, on_stall):
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), on_stall=on_stall, **RULE)
  state = jaxamp.TrainState.create(apply_fn=_loss, params=W, tx=tx)

  @jax.jit
  def step(state, x):
    _, grads = state.value_and_grad(state.apply_fn)(state.params, x)
    return state.apply_gradients(grads=grads)

  for i in range(steps):
    state = step(state, _x(i in bad_steps))
    yield _metrics(state.step_metrics())


class _Linear(nnx.Module):
  def __init__(self):
    self.w = nnx.Param(W["w"])


def _nnx_run(bad_steps, steps, on_stall):
  model = _Linear()
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), on_stall=on_stall, **RULE)
  opt = jaxamp.nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, x):
    grads = nnx.grad(lambda m: opt.scale_loss(jnp.sum(m.w[...] * x)))(model)
    opt.update(model, grads)

  for i in range(steps):
    step(model, opt, _x(i in bad_steps))
    yield _metrics(opt.step_metrics())


def _torch_run(bad_steps, steps, on_stall):
  opt = jaxamp.OptimWrapper(optax.sgd(0.1), W)
  scaler = jaxamp.GradScaler(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL,
                             stall_after=STALL_AFTER, on_stall=on_stall, stall_check_every=1)
  for i in range(steps):
    opt.zero_grad()
    opt.backward(scaler.scale(_loss), _x(i in bad_steps))
    scaler.step(opt)
    scaler.update()
    yield _metrics(scaler.step_metrics())


def _paddle_run(bad_steps, steps, on_stall, hysteresis=2):
  opt = jaxamp.OptimWrapper(optax.sgd(0.1), W)
  scaler = jaxamp.paddle.GradScaler(
      init_loss_scaling=INIT_SCALE, incr_every_n_steps=GROWTH_INTERVAL,
      decr_every_n_nan_or_inf=hysteresis, stall_after=STALL_AFTER, on_stall=on_stall,
      stall_check_every=1)
  for i in range(steps):
    opt.backward(scaler.scale(_loss), _x(i in bad_steps))
    scaler.minimize(opt)
    opt.zero_grad()
    yield _metrics(scaler.step_metrics())


def _mmengine_run(bad_steps, steps, on_stall):
  wrapper = jaxamp.AmpOptimWrapper(
      optax.sgd(0.1), W, loss_scale=dict(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL),
      stall_after=STALL_AFTER, on_stall=on_stall, stall_check_every=1)
  for i in range(steps):
    wrapper.update_params(_loss, _x(i in bad_steps))
    yield _metrics(wrapper.step_metrics())


# name: (run, the model's keyword arguments)
SCALERS = {
    "dynamic_loss_scale": (_core_run, {}),
    "static_loss_scale": (lambda *a: _core_run(*a, static=True), {"dynamic": False}),
    "TrainState": (_train_state_run, {}),
    "nnx.Optimizer": (_nnx_run, {}),
    "GradScaler": (_torch_run, {}),
    "paddle.GradScaler": (_paddle_run, {"hysteresis": 2}),
    "AmpOptimWrapper": (_mmengine_run, {}),
}


@pytest.mark.parametrize("scaler", sorted(SCALERS))
def test_the_scale_rule_and_its_counters_over_a_long_run_with_sparse_overflows(scaler):
  run, model_kwargs = SCALERS[scaler]
  want = _model(WITH_A_STALL, STEPS, **model_kwargs)
  got = list(run(WITH_A_STALL, STEPS, "ignore"))
  for i, (g, w) in enumerate(zip(got, want)):
    assert g == w, f"step {i}: got (scale, skipped, skipped_steps, skip_streak, stalled) {g}, " \
                   f"want {w}"
  assert [i for i, row in enumerate(want) if row[-1]] == [67]  # the model stalls once


@pytest.mark.parametrize("scaler", ["GradScaler", "paddle.GradScaler", "AmpOptimWrapper"])
def test_sparse_overflows_never_raise_a_stall(scaler):
  run, _ = SCALERS[scaler]
  rows = list(run(SPARSE, STEPS, "raise"))  # a false stall would raise StalledError here
  assert not any(stalled for *_, stalled in rows)
  assert rows[-1][2] == len(SPARSE)


@pytest.mark.parametrize("scaler", ["GradScaler", "paddle.GradScaler", "AmpOptimWrapper"])
def test_each_stall_is_reported_once_and_a_later_one_again(scaler):
  run, _ = SCALERS[scaler]
  two_stalls = set(range(6)) | set(range(10, 16))  # applied steps 6 to 9 end the first stall
  with pytest.warns(jaxamp.StallWarning) as record:
    rows = list(run(two_stalls, 18, "warn"))
  assert [i for i, row in enumerate(rows) if row[-1]] == [3, 4, 5, 13, 14, 15]
  assert len(record) == 2


# -- counters saturate --------------------------------------------------------------------------


def test_the_skip_counters_saturate():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), on_stall="ignore")
  full = tx.init(W)._replace(skipped_steps=jnp.int32(INT32_MAX), skip_streak=jnp.int32(INT32_MAX))
  _, state = jax.jit(tx.update)({"w": _x(True)}, full, W)
  assert int(state.skipped_steps) == INT32_MAX and int(state.skip_streak) == INT32_MAX
  assert bool(state.stalled)


def test_train_state_step_saturates():
  state = jaxamp.TrainState.create(apply_fn=_loss, params=W, tx=optax.sgd(0.1))
  state = state.replace(step=jnp.int32(INT32_MAX))
  state = jax.jit(lambda s: s.apply_gradients(grads=W))(state)
  assert int(state.step) == INT32_MAX


@pytest.mark.parametrize("start", ["max", "max - 1"])
def test_nnx_optimizer_step_saturates_at_its_dtypes_maximum(start):
  model = _Linear()
  opt = jaxamp.nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  top = np.iinfo(opt.step[...].dtype).max
  opt.step[...] = jnp.asarray(top if start == "max" else top - 1, opt.step[...].dtype)
  opt.update(model, nnx.grad(lambda m: jnp.sum(m.w[...]))(model))
  assert int(opt.step[...]) == top


def test_the_accumulation_counters_saturate():
  tx = jaxamp.accumulate_gradients(optax.sgd(0.1), 2)
  state = tx.init(W)
  full = state._replace(gradient_step=jnp.int32(INT32_MAX), micro_step=jnp.int32(INT32_MAX),
                        skipped_windows=jnp.int32(INT32_MAX), mini_step=jnp.int32(1))
  _, after = jax.jit(tx.update)({"w": _x(True)}, full, W)  # closes a window and drops it
  assert int(after.gradient_step) == INT32_MAX and int(after.micro_step) == INT32_MAX
  assert int(after.skipped_windows) == INT32_MAX


# -- every validated field refuses its out-of-range values -------------------------------------


def _scaled_state():
  return jaxamp.accumulate_gradients(
      jaxamp.dynamic_loss_scale(optax.adam(1e-3)), 2).init(W)


def _with(state, path, value):
  """``state`` with the field at ``path`` (attribute names through the nesting) set to ``value``."""
  head, *rest = path
  node = getattr(state, head) if isinstance(head, str) else state[head]
  new = value if not rest else _with(node, rest, value)
  if isinstance(head, str):
    return state._replace(**{head: new})
  return type(state)(new if i == head else n for i, n in enumerate(state))


# (path of the field in _scaled_state(), a bad value, the name the error gives)
BAD_FIELDS = [
    (("inner_state", "scale"), jnp.float32(0.0), "scale"),
    (("inner_state", "scale"), jnp.float32(-1.0), "scale"),
    (("inner_state", "scale"), jnp.float32(jnp.nan), "scale"),
    (("inner_state", "scale"), jnp.float32(jnp.inf), "scale"),
    (("inner_state", "scale"), jnp.float32(1e-40), "scale"),  # denormal
    (("inner_state", "growth_tracker"), jnp.int32(-1), "growth_tracker"),
    (("inner_state", "overflow_count"), jnp.int32(-1), "overflow_count"),
    (("inner_state", "skipped_steps"), jnp.int32(-1), "skipped_steps"),
    (("inner_state", "skip_streak"), jnp.int32(-1), "skip_streak"),
    (("inner_state", "skipped"), jnp.int32(1), "skipped"),
    (("inner_state", "stalled"), jnp.int32(1), "stalled"),
    (("inner_state", "nonfinite_leaves"), jnp.zeros([1], jnp.int32), "nonfinite_leaves"),
    (("mini_step",), jnp.int32(-1), "mini_step"),
    (("gradient_step",), jnp.int32(-1), "gradient_step"),
    (("micro_step",), jnp.int32(-1), "micro_step"),
    (("skipped_windows",), jnp.int32(-1), "skipped_windows"),
    (("updated",), jnp.int32(1), "updated"),
    (("inner_state", "inner_state", 0, "count"), jnp.int32(-1), "count"),
    (("inner_state", "inner_state", 0, "mu"), {"w": jnp.full(3, jnp.nan)}, "mu"),
    (("acc_grads",), {"w": jnp.full(3, jnp.inf)}, "acc_grads"),
]


@pytest.mark.parametrize("path,value,name", BAD_FIELDS,
                         ids=[f"{p[-1]}={v!r}" for p, v, _ in BAD_FIELDS])
def test_validate_opt_state_refuses_each_fields_out_of_range_values(path, value, name):
  good = _scaled_state()
  jaxamp.validate_opt_state(good)
  with pytest.raises((ValueError, TypeError), match=name):
    jaxamp.validate_opt_state(_with(good, path, value))


# -- statistics are written on every step that is not skipped ----------------------------------


class _WithStats(jaxamp.TrainState):
  batch_stats: Any


def test_statistics_are_written_on_accumulating_micro_steps_and_kept_on_skipped_ones():
  tx = jaxamp.accumulate_gradients(jaxamp.dynamic_loss_scale(optax.sgd(0.1)), 3)
  state = _WithStats.create(apply_fn=_loss, params=W, tx=tx, batch_stats=jnp.float32(0.0))
  step = jax.jit(lambda s, g, stats: s.apply_gradients(grads=g, batch_stats=stats))
  good = jax.tree.map(lambda w: w * state.loss_scale, W)
  bad = {"w": _x(True) * state.loss_scale}
  written = []
  for i, grads in enumerate([good, good, good, good, bad, good]):
    state = step(state, grads, jnp.float32(i + 1))
    written.append(float(state.batch_stats))
  # Micro-steps 1, 2, 4 only accumulate, 3 closes a window; the window of 4 to 6 is skipped
  # when it closes (at 6), and a skipped step keeps the statistics it would have written.
  assert written == [1.0, 2.0, 3.0, 4.0, 5.0, 5.0]
  assert int(state.step) == 1 and int(state.skipped_steps) == 1


# -- stochastic rounding: independent bits across leaves, positions and steps ------------------

# 1 + 2**-8 lies halfway between the bfloat16 neighbours 1 and 1 + 2**-7: stochastic rounding
# rounds it up or down with probability 1/2, an error of +-2**-8, one random bit per element.
HALF_SPACING = 2.0**-8
SHAPE = (64, 64)


def _stochastic_errors(leaves=1, steps=1, seed=0):
  """The rounding errors in units of half a spacing (+-1), per leaf and step: ``[steps][leaf]``."""
  params = {f"w{i}": jnp.ones(SHAPE, BF16) for i in range(leaves)}
  grads = {k: jnp.full(SHAPE, -HALF_SPACING, BF16) for k in params}
  tx = jaxamp.low_precision_params(optax.sgd(1.0), "stochastic", seed=seed)
  state = tx.init(params)

  @jax.jit
  def step(state):
    updates, state = tx.update(grads, state, params)
    with jax.numpy_dtype_promotion("standard"):
      new = optax.apply_updates(params, updates)
    return new, state

  out = []
  for _ in range(steps):
    new, state = step(state)  # always from the same parameters: only the bits differ
    errors = [(np.asarray(new[k], np.float32) - (1.0 + HALF_SPACING)) / HALF_SPACING
              for k in sorted(params)]
    for e in errors:
      assert set(np.unique(e)) <= {-1.0, 1.0}
    out.append(errors)
  return out


def _correlation(a, b):
  return float(np.corrcoef(np.ravel(a), np.ravel(b))[0, 1])


# With 4096 (or about 4000) independent +-1 pairs, a correlation has a standard deviation of
# about 1/64: 0.1 is more than six of them. Equal bits give 1.
MAX_CORRELATION = 0.1


def test_stochastic_rounding_is_unbiased_over_a_leaf():
  (errors,), = _stochastic_errors()
  assert abs(float(np.mean(errors))) < 4 / 64


def test_stochastic_rounding_errors_of_same_shaped_leaves_are_uncorrelated():
  (a, b, c), = _stochastic_errors(leaves=3)
  for x, y in [(a, b), (a, c), (b, c)]:
    assert abs(_correlation(x, y)) < MAX_CORRELATION


@pytest.mark.parametrize("shift", [(0, 1), (1, 0), (1, -1), (1, 1), (2, -2), (0, 2)],
                         ids=lambda s: f"d{s[0]}{s[1]:+d}")
def test_stochastic_rounding_errors_are_uncorrelated_across_positions(shift):
  """Rows against rows, columns against columns, and the diagonals (an index without strides)."""
  (e,), = _stochastic_errors()
  dr, dc = shift
  rows, cols = e.shape
  a = e[:rows - dr, max(0, -dc):cols - max(0, dc)]  # e[r, c] ...
  b = e[dr:, max(0, dc):cols - max(0, -dc)]  # ... against e[r + dr, c + dc]
  assert abs(_correlation(a, b)) < MAX_CORRELATION


def test_stochastic_rounding_errors_of_consecutive_steps_are_uncorrelated():
  (first,), (second,) = _stochastic_errors(steps=2)
  assert abs(_correlation(first, second)) < MAX_CORRELATION


@pytest.mark.parametrize("rounding", ["stochastic", "kahan", "nearest"])
def test_a_parameter_the_step_does_not_change_keeps_its_bits_signed_zeros_included(rounding):
  params = {"w": jnp.array([-0.0, 0.0, -1.0, 1.0], BF16)}
  grads = {"w": jnp.array([0.0, -0.0, 0.0, -0.0], BF16)}
  tx = jaxamp.low_precision_params(optax.sgd(1.0), rounding)
  updates, _ = tx.update(grads, tx.init(params), params)
  with jax.numpy_dtype_promotion("standard"):
    new = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(np.asarray(new["w"]).view(np.uint16),
                                np.asarray(params["w"]).view(np.uint16))


# -- Kahan summation across binades ------------------------------------------------------------


@pytest.mark.parametrize("direction", [1.0, -1.0], ids=["up", "down"])
def test_kahan_keeps_the_float32_sum_while_the_weight_crosses_powers_of_two(direction):
  # Start a few bfloat16 spacings below (or above) 0.5, 1, 2, 4 and 8, and add the same update
  # each step: every element crosses its power of two on the way.
  powers = np.array([0.5, 1.0, 2.0, 4.0, 8.0], np.float32)
  start = (powers * (1 - direction * 2.0**-6)).astype(BF16)
  update = np.float32(direction) * powers * np.float32(3.1e-4)
  steps = 120
  params = {"w": jnp.asarray(start)}
  tx = jaxamp.low_precision_params(optax.sgd(1.0), "kahan")
  state = tx.init(params)
  grads = {"w": jnp.asarray(-update)}

  @jax.jit
  def step(params, state):
    updates, state = tx.update(grads, state, params)
    with jax.numpy_dtype_promotion("standard"):
      return optax.apply_updates(params, updates), state

  master = np.asarray(start, np.float32)  # the float32 master weight Kahan stands in for
  crossed = np.zeros(len(powers), bool)
  for _ in range(steps):
    params, state = step(params, state)
    master = (master + update).astype(np.float32)
    w = np.asarray(params["w"], np.float32)
    crossed |= (w >= powers) if direction > 0 else (w < powers)
    tracked = w + np.asarray(jaxamp.decode_compensation(state.compensation[0], params["w"]))
    # The float32 sum, up to a few roundings at float32's spacing (3 measured; a compensation
    # decoded in the wrong binade is off by up to 2**15 of them).
    ulps = np.abs(tracked - master) / (powers * 2.0**-23)
    assert ulps.max() <= 16, ulps
    # The visible weight is the nearest bfloat16 to it.
    np.testing.assert_array_equal(w, np.asarray(tracked.astype(BF16), np.float32))
  assert crossed.all()


# -- older behaviours --------------------------------------------------------------------------


@pytest.mark.parametrize("unscale_first", [True, False], ids=["unscale_", "step"])
def test_grad_scaler_checks_the_unscaled_gradients(unscale_first):
  # Below a scale of 1 the unscaling multiplies: a finite scaled gradient can overflow. The
  # check reads the unscaled gradients, those the update reads, and skips the step.
  scaler = jaxamp.GradScaler(init_scale=0.5)
  scaler.scale(jnp.ones([], jnp.float32))
  opt = jaxamp.OptimWrapper(optax.sgd(0.1), W)
  opt.grads = {"w": jnp.array([3e38, 1.0, 1.0], jnp.float32)}  # 6e38 once unscaled
  if unscale_first:
    scaler.unscale_(opt)
  scaler.step(opt)
  scaler.update()
  np.testing.assert_array_equal(opt.params["w"], W["w"])
  assert int(scaler.step_metrics()["skipped_steps"]) == 1 and scaler.get_scale() == 0.25


@pytest.mark.parametrize("how", ["minimize", "unscale_"])
def test_paddle_scaler_takes_float16_gradients(how):
  # Paddle unscales float16 gradients (PyTorch refuses them: "Attempting to unscale FP16
  # gradients.").
  params = {"w": jnp.ones(2, jnp.float16)}
  opt = jaxamp.OptimWrapper(optax.sgd(0.5), params)
  scaler = jaxamp.paddle.GradScaler(init_loss_scaling=4.0)
  opt.grads = {"w": jnp.full(2, 4.0, jnp.float16)}  # 1.0 once unscaled
  if how == "unscale_":
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
  else:
    scaler.minimize(opt)
  np.testing.assert_array_equal(opt.params["w"], np.full(2, 0.5, np.float16))


def test_skipped_steps_add_up_over_the_scalers_of_several_optimizers():
  # Two optimizers, each with its own scaler (a generator and a discriminator), in one state
  # tree: the skipped steps are their total, whichever skipped more.
  txs = {k: jaxamp.dynamic_loss_scale(optax.sgd(0.1)) for k in ("gen", "disc")}
  states = {k: tx.init(W) for k, tx in txs.items()}
  skips = {"gen": [True, False, True], "disc": [True, True, False, True, False]}
  for k, pattern in skips.items():
    update = jax.jit(txs[k].update)
    for bad in pattern:
      _, states[k] = update({"w": _x(bad)}, states[k], W)
  assert int(jaxamp.skipped_steps(states)) == 2 + 3
  assert int(jaxamp.step_metrics(states)["skipped_steps"]) == 5


def test_step_metrics_count_the_windows_the_accumulator_dropped():
  # The per-micro-step nesting: the scaler checks each micro-step, and the accumulator drops a
  # window whose finite micro-steps sum to an inf. Both count as skipped steps.
  with pytest.warns(UserWarning, match="wraps jaxamp.accumulate_gradients"):
    tx = jaxamp.dynamic_loss_scale(jaxamp.accumulate_gradients(optax.sgd(0.1), 2),
                                   init_scale=1.0)
    state = tx.init(W)
  big = {"w": jnp.array([3e38, 1.0, 1.0], jnp.float32)}
  for grads in [big, big, {"w": _x(True)}]:  # a window dropped, then a micro-step skipped
    _, state = jax.jit(tx.update)(grads, state, W)
  assert int(jaxamp.get_accumulation_state(state).skipped_windows) == 1
  assert int(jaxamp.get_loss_scale_state(state).skipped_steps) == 1
  assert int(jaxamp.skipped_steps(state)) == 2
  assert int(jaxamp.step_metrics(state)["skipped_steps"]) == 2
