"""jaxamp.dynamic_loss_scale / static_loss_scale: the scale rule, skipping, composition, errors."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st
from jax import lax

import jaxamp

F32_TINY = float(np.finfo(np.float32).tiny)
F32_MAX = float(np.finfo(np.float32).max)
standard_promotion = jax.numpy_dtype_promotion("standard")  # optax's Adam mixes float and int32

# Gradient kinds of a step: finite, +inf, nan, -inf, and a finite value (3e38) that
# overflows when unscaled by a scale below 1.
FINITE, INF, NAN, NEG_INF, HUGE = range(5)
_BAD_VALUE = {INF: np.inf, NAN: np.nan, NEG_INF: -np.inf, HUGE: 3e38}


def bits(tree):
  return [np.atleast_1d(np.asarray(x)).view(np.uint8).tobytes() for x in jax.tree.leaves(tree)]


def f32(x) -> float:
  with np.errstate(over="ignore"):
    return float(np.float32(x))


def is_bad(kind, scale):
  """Whether an unscaled gradient (g * float32(1 / scale)) of this kind is not finite."""
  return kind in (INF, NAN, NEG_INF) or (
      kind == HUGE and not math.isfinite(f32(3e38 * f32(1.0 / scale))))


def rule_step(scale, tracker, overflow, bad, *, growth_factor, backoff_factor, growth_interval,
              hysteresis, min_scale, max_scale):
  """One update of the rule in plain Python: PyTorch's (float64 products rounded to float32)
  with Paddle's hysteresis and jaxamp's floor and ceiling."""
  if bad:
    tracker = 0
    overflow += 1
    if overflow == hysteresis:
      scale = max(f32(scale * backoff_factor), min_scale)
      overflow = 0
  else:
    overflow = 0
    tracker += 1
    if tracker == growth_interval:
      grown = f32(scale * growth_factor)
      if math.isfinite(grown):
        scale = min(grown, max_scale)
      tracker = 0
  return scale, tracker, overflow


def model(kinds, *, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
          growth_interval=2000, hysteresis=1, min_scale=None, max_scale=None):
  """The states after each step of ``kinds``, as dicts (see :func:`as_dicts`)."""
  hyper = dict(growth_factor=growth_factor, backoff_factor=backoff_factor,
               growth_interval=growth_interval, hysteresis=hysteresis,
               min_scale=f32(F32_TINY if min_scale is None else min_scale),
               max_scale=f32(F32_MAX if max_scale is None else max_scale))
  scale, tracker, overflow, skipped_steps = f32(init_scale), 0, 0, 0
  out = []
  for kind in kinds:
    bad = is_bad(kind, scale)
    skipped_steps += bad
    scale, tracker, overflow = rule_step(scale, tracker, overflow, bad, **hyper)
    out.append(dict(scale=scale, growth_tracker=tracker, overflow_count=overflow, skipped=bad,
                    skipped_steps=skipped_steps))
  return out


def grads_for(kind, scale, base=(0.5, -0.25, 1.0)):
  """Scaled gradients of one step: ``base * scale`` with the first value replaced when bad."""
  g = np.float32(base) * np.float32(scale)
  if kind != FINITE:
    g[0] = _BAD_VALUE[kind]
  return {"w": jnp.asarray(g, jnp.float32)}


def run_eager(tx, kinds, params=None):
  """Steps ``tx`` through ``kinds`` op by op; returns the states and params after each step."""
  params = {"w": jnp.array([1.0, -0.0, 2.0])} if params is None else params
  state = tx.init(params)
  states, all_params = [], []
  for kind in kinds:
    updates, state = tx.update(grads_for(kind, float(state.scale)), state, params)
    params = optax.apply_updates(params, updates)
    states.append(state)
    all_params.append(params)
  return states, all_params


def as_dicts(states):
  return [dict(scale=float(s.scale), growth_tracker=int(s.growth_tracker),
               overflow_count=int(s.overflow_count), skipped=bool(s.skipped),
               skipped_steps=int(s.skipped_steps)) for s in states]


def kinds_with(bad_steps, n, kind=INF):
  return [kind if i in bad_steps else FINITE for i in range(n)]


def _scaled_grads(kind, scale):
  """Traced: gradients of a loss scaled by ``scale``, the first one poisoned as ``kind`` says."""
  base = jnp.array([0.5, -0.25, 1.0], jnp.float32) * scale
  bad = jnp.array([jnp.nan, jnp.inf, jnp.nan, -jnp.inf, 3e38], jnp.float32)[kind]
  return {"w": base.at[0].set(jnp.where(kind == FINITE, base[0], bad))}


@functools.lru_cache(maxsize=None)
def scan_runner(**hyper):
  """A jitted lax.scan over a sequence of step kinds (one compilation per hyperparameter set)."""
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.5), **hyper, on_stall="ignore")

  @jax.jit
  def run(kinds, state, params):

    def body(carry, kind):
      state, params = carry
      g = _scaled_grads(kind, state.scale)
      updates, state = tx.update(g, state, params)
      return (state, optax.apply_updates(params, updates)), state

    return lax.scan(body, (state, params), kinds)[1]

  return tx, run


# ------------------------------------------------------------------------ reference trajectories


def test_pytorch_reference_trajectory():
  # REFERENCE.md section 1: init 8, growth 2, backoff 0.5, interval 3, bad at 2, 3, 7.
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0, growth_interval=3)
  states, _ = run_eager(tx, kinds_with({2, 3, 7}, 12))
  assert [float(s.scale) for s in states] == [8, 8, 4, 2, 2, 2, 4, 2, 2, 2, 4, 4]
  assert [int(s.growth_tracker) for s in states] == [1, 2, 0, 0, 1, 2, 0, 0, 1, 2, 0, 1]
  assert [bool(s.skipped) for s in states] == [i in {2, 3, 7} for i in range(12)]
  assert int(states[-1].skipped_steps) == 3


def test_pytorch_non_power_of_two_factors_round_like_float64():
  # init 1000, growth 1.5, backoff 0.3, interval 1, good, bad, good, bad.
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=1000.0, growth_factor=1.5,
                                 backoff_factor=0.3, growth_interval=1)
  states, _ = run_eager(tx, [FINITE, INF, FINITE, INF])
  assert [float(s.scale) for s in states] == [1500.0, 450.0, 675.0, 202.5]
  assert f32(f32(1500.0) * np.float32(0.3)) != 450.0  # what float32 arithmetic would give


def test_paddle_hysteresis_reference_trajectory():
  # REFERENCE.md section 2: init 8, incr every 3, decr every 2, bad at {2, 3, 7, 8, 9}.
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0, growth_interval=3,
                                 hysteresis=2)
  states, _ = run_eager(tx, kinds_with({2, 3, 7, 8, 9}, 12))
  assert [float(s.scale) for s in states] == [8, 8, 8, 4, 4, 4, 8, 8, 4, 4, 4, 4]
  assert [bool(s.skipped) for s in states] == [i in {2, 3, 7, 8, 9} for i in range(12)]
  assert as_dicts(states) == model(kinds_with({2, 3, 7, 8, 9}, 12), init_scale=8.0,
                                   growth_interval=3, hysteresis=2)


def test_hysteresis_alternation_never_backs_off():
  tx, run = scan_runner(init_scale=64.0, growth_interval=1000, hysteresis=2)
  params = {"w": jnp.array([1.0, -0.0, 2.0])}
  states = run(jnp.array([INF, FINITE] * 10), tx.init(params), params)
  np.testing.assert_array_equal(states.scale, 64.0)
  np.testing.assert_array_equal(states.skipped, [True, False] * 10)
  np.testing.assert_array_equal(states.overflow_count, [1, 0] * 10)


@pytest.mark.parametrize("growth,backoff", [(1.1, 0.9), (1.5, 0.3), (3.0, 0.7)])
def test_non_power_of_two_factors_are_within_one_ulp_of_pytorch(growth, backoff):
  kinds = [FINITE, FINITE, INF, FINITE, NAN, INF, FINITE, FINITE, FINITE, INF, FINITE, FINITE]
  hyper = dict(growth_factor=growth, backoff_factor=backoff, growth_interval=2, hysteresis=1,
               min_scale=F32_TINY, max_scale=F32_MAX)
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=777.0, growth_factor=growth,
                                 backoff_factor=backoff, growth_interval=2)
  states, _ = run_eager(tx, kinds)
  prev = (f32(777.0), 0, 0)
  for kind, state in zip(kinds, as_dicts(states)):  # each transition, from our previous state
    want = rule_step(*prev, kind != FINITE, **hyper)
    got = (state["scale"], state["growth_tracker"], state["overflow_count"])
    assert got[1:] == want[1:]
    assert abs(int(np.float32(got[0]).view(np.int32)) - int(np.float32(want[0]).view(np.int32))) <= 1
    prev = got
  # The whole trajectory stays within a few ulps of PyTorch's float64 rule.
  want = [d["scale"] for d in model(kinds, init_scale=777.0, growth_factor=growth,
                                    backoff_factor=backoff, growth_interval=2)]
  np.testing.assert_allclose([float(s.scale) for s in states], want, rtol=4e-7)


def test_scale_2_127_unscales_like_pytorch_and_never_grows_to_inf():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(1.0), init_scale=2.0**127, growth_interval=1)
  params = {"w": jnp.zeros(3)}
  state = tx.init(params)
  grads = {"w": jnp.array([2.0**127, -(2.0**126), 2.0**125])}
  updates, state = jax.jit(tx.update)(grads, state, params)
  # The reciprocal 2^-127 is a denormal: a flushed reciprocal would give zero updates.
  np.testing.assert_array_equal(updates["w"], [-1.0, 0.5, -0.25])
  assert float(state.scale) == 2.0**127  # 2^128 is inf: growth refused ...
  assert int(state.growth_tracker) == 0  # ... and the tracker reset, as PyTorch does
  assert not bool(state.skipped)
  updates, state = jax.jit(tx.update)({"w": jnp.array([jnp.inf, 0.0, 0.0])}, state, params)
  assert float(state.scale) == 2.0**126 and bool(state.skipped)


def test_growth_to_inf_is_refused_from_any_scale():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(1.0), init_scale=3e38, growth_interval=1)
  states, _ = run_eager(tx, [FINITE, FINITE])
  assert [float(s.scale) for s in states] == [f32(3e38)] * 2
  assert [int(s.growth_tracker) for s in states] == [0, 0]


def test_default_floor_stops_the_slide_to_zero():
  tx, run = scan_runner(init_scale=1.0)
  params = {"w": jnp.array([1.0, -0.0, 2.0])}
  states = run(jnp.array([INF] * 200 + [FINITE]), tx.init(params), params)
  scales = np.asarray(states.scale)
  assert scales.min() == np.float32(jaxamp.DEFAULT_MIN_SCALE) > 0
  assert scales[-1] == np.float32(jaxamp.DEFAULT_MIN_SCALE)
  assert not bool(states.skipped[-1])  # a finite step still goes through at the floor
  assert jaxamp.DEFAULT_MIN_SCALE == F32_TINY and jaxamp.DEFAULT_MAX_SCALE == F32_MAX


def test_explicit_min_and_max_are_honoured():
  kinds = [FINITE] * 5 + [INF] * 6
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=4.0, growth_interval=1,
                                 min_scale=1.5, max_scale=16.0, on_stall="ignore")
  states, _ = run_eager(tx, kinds)
  assert [float(s.scale) for s in states] == [8, 16, 16, 16, 16, 8, 4, 2, 1.5, 1.5, 1.5]
  assert as_dicts(states) == model(kinds, init_scale=4.0, growth_interval=1, min_scale=1.5,
                                   max_scale=16.0)


def test_a_finite_gradient_that_overflows_when_unscaled_is_skipped():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=0.5, growth_interval=100)
  states, params = run_eager(tx, [HUGE, FINITE])
  assert [bool(s.skipped) for s in states] == [True, False]
  assert [float(s.scale) for s in states] == [0.25, 0.25]
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0, growth_interval=100)
  states, _ = run_eager(tx, [HUGE])
  assert not bool(states[0].skipped)  # 3e38 / 2 is finite


# ------------------------------------------------------------------------------ property tests

kinds_strategy = st.lists(st.sampled_from([FINITE, FINITE, FINITE, INF, NAN, NEG_INF, HUGE]),
                          min_size=1, max_size=10)


@settings(derandomize=True, deadline=None, max_examples=25)
@given(kinds=kinds_strategy,
       growth_factor=st.sampled_from([2.0, 4.0, 8.0, 1.5]),
       backoff_factor=st.sampled_from([0.5, 0.25, 0.125, 0.3]),
       growth_interval=st.integers(1, 4), hysteresis=st.integers(1, 3),
       init_exp=st.integers(-8, 127),
       bounds=st.sampled_from([(None, None), (0.25, 2.0**20), (1.0, 64.0), (2.0**-6, None)]))
def test_random_steps_follow_the_python_model(kinds, growth_factor, backoff_factor,
                                              growth_interval, hysteresis, init_exp, bounds):
  min_scale, max_scale = bounds
  init_scale = float(np.clip(2.0**init_exp, min_scale or 0, max_scale or F32_MAX))
  hyper = dict(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
               growth_interval=growth_interval, hysteresis=hysteresis, min_scale=min_scale,
               max_scale=max_scale)
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.5), **hyper, on_stall="ignore")
  params0 = {"w": jnp.array([1.0, -0.0, 2.0])}
  states, params = run_eager(tx, kinds, params0)
  want = model(kinds, **hyper)
  got = as_dicts(states)
  if growth_factor == 1.5 or backoff_factor == 0.3:
    for g, w in zip(got, want):  # non-power-of-two factors: the scale within 1 ulp per step
      assert math.isclose(g.pop("scale"), w.pop("scale"), rel_tol=2.4e-7 * len(kinds))
  assert got == want
  previous = [params0] + params[:-1]
  for kind_state, before, after in zip(states, previous, params):
    if bool(kind_state.skipped):  # bit-identical params after a skipped step
      assert bits(after) == bits(before)
    else:
      assert bits(after) != bits(before)


INNER_CONFIGS = [
    dict(growth_interval=2, hysteresis=1),
    dict(growth_interval=1, hysteresis=2, init_scale=0.5),
    dict(growth_interval=3, hysteresis=3, backoff_factor=0.25, init_scale=2.0**120),
]


@functools.lru_cache(maxsize=None)
def adam_runner(config_index):
  """A jitted scan of dynamic_loss_scale(inject_hyperparams(adam) with a schedule)."""
  schedule = optax.linear_schedule(1e-2, 1e-3, 10)
  inner = optax.inject_hyperparams(optax.adam)(learning_rate=schedule)
  tx = jaxamp.dynamic_loss_scale(inner, **INNER_CONFIGS[config_index])

  @jax.jit
  def run(kinds, state, params):

    def body(carry, kind):
      state, params = carry
      g = _scaled_grads(kind, state.scale)
      with standard_promotion:
        updates, state = tx.update(g, state, params)
      params = optax.apply_updates(params, updates)
      inner = state.inner_state
      return (state, params), (state, params, inner.count, inner.inner_state[0].count,
                               inner.hyperparams["learning_rate"])

    return lax.scan(body, (state, params), kinds)[1]

  return tx, run


@settings(derandomize=True, deadline=None, max_examples=15)
@given(kinds=st.lists(st.sampled_from([FINITE, FINITE, INF, NAN, NEG_INF, HUGE]),
                      min_size=12, max_size=12),
       config=st.integers(0, len(INNER_CONFIGS) - 1))
def test_skipped_steps_leave_params_and_the_inner_state_untouched(kinds, config):
  tx, run = adam_runner(config)
  params = {"w": jnp.array([1.0, -0.0, 2.0])}
  with standard_promotion:
    state = tx.init(params)
  states, all_params, inject_count, adam_count, lr = run(jnp.array(kinds, jnp.int32), state,
                                                        params)
  want = model(kinds, **INNER_CONFIGS[config])
  assert as_dicts([jax.tree.map(lambda x: x[i], states) for i in range(len(kinds))]) == want
  good = np.cumsum([not w["skipped"] for w in want])
  np.testing.assert_array_equal(inject_count, good)  # the schedule's step
  np.testing.assert_array_equal(adam_count, good)  # adam's bias-correction count
  schedule = optax.linear_schedule(1e-2, 1e-3, 10)
  np.testing.assert_allclose(lr, [schedule(max(n - 1, 0)) for n in good], rtol=1e-6)
  previous = np.concatenate([np.asarray(params["w"])[None], np.asarray(all_params["w"])[:-1]])
  for w, before, after in zip(want, previous, np.asarray(all_params["w"])):
    if w["skipped"]:
      assert before.tobytes() == after.tobytes()


# ------------------------------------------------------------------ no recompilation, issue example


def loss_fn(params, batch):
  x, y = batch
  pred = jnp.tanh(x @ params["w"]) @ params["v"]
  return jnp.mean((pred - y) ** 2)


def make_data(n=16):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((n, 4)), jnp.float32)
  y = jnp.asarray(np.sin(np.asarray(x).sum(1, keepdims=True)), jnp.float32)
  params = {"w": jnp.asarray(rng.standard_normal((4, 8)) * 0.5, jnp.float32),
            "v": jnp.asarray(rng.standard_normal((8, 1)) * 0.5, jnp.float32)}
  return params, x, y


def test_issue_train_step_trains_and_compiles_once(count_traces):
  params, x, y = make_data()
  tx = jaxamp.dynamic_loss_scale(optax.adamw(1e-2), growth_interval=3, init_scale=2.0**10)
  with standard_promotion:
    opt_state = tx.init(params)

  def train_step(params, opt_state, batch):
    with standard_promotion:
      loss, grads = jax.value_and_grad(
          lambda p: jaxamp.scale_loss(loss_fn(p, batch), opt_state))(params)
      updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  traced, counter = count_traces(train_step)
  train_step = jax.jit(traced)
  first = float(loss_fn(params, (x, y)))
  scales, skipped = [], []
  for i in range(50):
    # Every 7th batch holds an inf, so the scale and the skip decision change.
    xb = x.at[0, 0].set(jnp.inf) if i % 7 == 3 else x
    before = params
    params, opt_state, _ = train_step(params, opt_state, (xb, y))
    scales.append(float(opt_state.scale))
    skipped.append(bool(opt_state.skipped))
    if skipped[-1]:
      assert bits(params) == bits(before)
  assert counter["n"] == 1
  assert skipped == [i % 7 == 3 for i in range(50)]
  assert len(set(scales)) > 2
  assert float(loss_fn(params, (x, y))) < 0.5 * first


# ----------------------------------------------------------------- dtypes, structure, cond, scan


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_state_is_dtype_and_structure_stable_under_cond_and_scan(dtype):
  tx = jaxamp.dynamic_loss_scale(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
                                 init_scale=4.0, growth_interval=2)
  params = {"w": jnp.ones(3, dtype), "b": jnp.zeros((), dtype)}
  with standard_promotion:
    state = tx.init(params)
  assert state.scale.dtype == jnp.float32 and state.skipped.dtype == jnp.bool_
  assert {x.dtype for x in (state.growth_tracker, state.overflow_count, state.skipped_steps)} == {
      jnp.dtype(jnp.int32)}
  leaves, treedef = jax.tree.flatten(state)
  assert jax.tree.unflatten(treedef, leaves)._fields == state._fields

  def step(carry, bad):
    state, params = carry
    grads = jax.tree.map(lambda p: jnp.where(bad, jnp.inf, 1.0).astype(dtype) + 0 * p, params)
    with standard_promotion:
      updates, new_state = lax.cond(bad > 10, lambda: (jax.tree.map(jnp.zeros_like, params), state),
                                    lambda: tx.update(grads, state, params))
    return (new_state, optax.apply_updates(params, updates)), new_state.scale

  (final, new_params), scales = jax.jit(lambda c, xs: lax.scan(step, c, xs))(
      (state, params), jnp.array([0, 1, 0, 0, 1, 0]))
  assert jax.tree.structure(final) == jax.tree.structure(state)
  assert jax.tree.map(lambda x: x.dtype, final) == jax.tree.map(lambda x: x.dtype, state)
  assert jax.tree.map(lambda x: x.dtype, new_params) == jax.tree.map(lambda x: x.dtype, params)
  np.testing.assert_array_equal(scales, [4, 2, 2, 4, 2, 2])


def test_float16_gradients_and_params_are_refused_like_pytorch():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))
  params = {"w": jnp.ones(2, jnp.float32)}
  state = tx.init(params)
  message = re.escape("Attempting to unscale FP16 gradients.")
  with pytest.raises(ValueError, match=message):
    tx.update({"w": jnp.ones(2, jnp.float16)}, state, params)
  with pytest.raises(ValueError, match=message):  # inside jit, cond and scan too
    jax.jit(lambda g: lax.cond(True, lambda: tx.update(g, state, params)[1].scale,
                               lambda: state.scale))({"w": jnp.ones(2, jnp.float16)})
  with pytest.raises(ValueError, match=message + ".*params leaf \\['w'\\] is float16"):
    tx.init({"w": jnp.ones(2, jnp.float16)})


def test_integer_leaves_are_left_alone_with_a_warning():
  tx = jaxamp.dynamic_loss_scale(optax.identity(), init_scale=2.0)
  params = {"w": jnp.ones(2), "n": jnp.array([1], jnp.int32)}
  with pytest.warns(UserWarning, match=r"params leaf \['n'\] has non-floating dtype int32"):
    state = tx.init(params)
  with pytest.warns(UserWarning, match=r"gradient leaf \['n'\] has non-floating dtype int32"):
    updates, state = jax.eval_shape(tx.update, {"w": jnp.ones(2), "n": jnp.array([3], jnp.int32)},
                                    state, params)
  assert updates["n"].dtype == jnp.int32 and state.skipped.dtype == jnp.bool_


# ---------------------------------------------------------------------------------- bad input

BAD_HYPERPARAMETERS = [
    (dict(growth_factor=1.0), ValueError, "growth_factor must be > 1, got 1.0"),
    (dict(growth_factor=0.5), ValueError, "growth_factor must be > 1, got 0.5"),
    (dict(growth_factor=math.inf), ValueError, "growth_factor must be finite, got inf"),
    (dict(growth_factor="2"), TypeError, "growth_factor must be a real number, got '2' of type str"),
    (dict(backoff_factor=1.0), ValueError,
     "backoff_factor must be in the open interval (0, 1), got 1.0"),
    (dict(backoff_factor=0.0), ValueError,
     "backoff_factor must be in the open interval (0, 1), got 0.0"),
    (dict(backoff_factor=-0.5), ValueError,
     "backoff_factor must be in the open interval (0, 1), got -0.5"),
    (dict(backoff_factor=math.nan), ValueError, "backoff_factor must be finite, got nan"),
    (dict(growth_interval=0), ValueError, "growth_interval must be an int >= 1"),
    (dict(growth_interval=2**31), ValueError, "growth_interval must be an int <= 2147483647"),
    (dict(growth_interval=2.0), TypeError, "growth_interval must be an int, got 2.0 of type float"),
    (dict(growth_interval=True), TypeError, "growth_interval must be an int, got True of type bool"),
    (dict(hysteresis=0), ValueError, "hysteresis must be an int >= 1"),
    (dict(hysteresis=None), TypeError, "hysteresis must be an int, got None of type NoneType"),
    (dict(init_scale=0.0), ValueError, "init_scale must be a positive, finite number, got 0.0"),
    (dict(init_scale=-1.0), ValueError, "init_scale must be a positive, finite number, got -1.0"),
    (dict(init_scale=math.inf), ValueError, "init_scale must be finite, got inf"),
    (dict(init_scale=math.nan), ValueError, "init_scale must be finite, got nan"),
    (dict(init_scale=[1.0]), TypeError, "init_scale must be a real number, got [1.0] of type list"),
    (dict(init_scale=1 + 1j), TypeError, "init_scale must be a real number, got (1+1j)"),
    (dict(init_scale=1.0, min_scale=2.0), ValueError,
     "init_scale must lie in [min_scale, max_scale] = [2.0, "),
    (dict(init_scale=100.0, max_scale=10.0), ValueError,
     "init_scale must lie in [min_scale, max_scale] = [1.1754943508222875e-38, 10.0], got 100.0"),
    (dict(min_scale=4.0, max_scale=2.0), ValueError,
     "min_scale must be <= max_scale, got min_scale=4.0 > max_scale=2.0"),
    (dict(min_scale=0.0), ValueError, "min_scale must be a normal float32, at least"),
    (dict(min_scale=1e-40), ValueError, "min_scale must be a normal float32, at least"),
    (dict(max_scale=1e39), ValueError, "max_scale must be a finite float32, at most"),
    (dict(min_scale="1"), TypeError, "min_scale must be a real number, got '1' of type str"),
]


@pytest.mark.parametrize("kwargs,exc,message", BAD_HYPERPARAMETERS)
def test_bad_hyperparameters_are_refused_at_construction(kwargs, exc, message):
  with pytest.raises(exc, match="^" + re.escape(message)):
    jaxamp.dynamic_loss_scale(optax.sgd(0.1), **kwargs)


@pytest.mark.parametrize("inner", [None, optax.sgd, "adam", (lambda p: p, None)])
def test_inner_must_be_a_transformation(inner):
  with pytest.raises(TypeError, match="^inner must be an optax GradientTransformation"):
    jaxamp.dynamic_loss_scale(inner)
  with pytest.raises(TypeError, match="^inner must be an optax GradientTransformation"):
    jaxamp.static_loss_scale(inner, 2.0)


@pytest.mark.parametrize("scale,exc", [(0.0, ValueError), (-2.0, ValueError),
                                       (math.inf, ValueError), ("8", TypeError),
                                       (True, TypeError), (None, TypeError)])
def test_static_scale_is_checked(scale, exc):
  with pytest.raises(exc, match="^scale must be"):
    jaxamp.static_loss_scale(optax.sgd(0.1), scale)


def test_numpy_and_concrete_jax_scalars_are_accepted_traced_ones_explained():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=np.float32(8.0),
                                 growth_interval=np.int64(3), growth_factor=jnp.float32(4.0))
  assert float(tx.init({"w": jnp.ones(1)}).scale) == 8.0

  @jax.jit
  def build(factor):
    return jaxamp.dynamic_loss_scale(optax.sgd(0.1), growth_factor=factor)

  with pytest.raises(TypeError, match="growth_factor must be a real number: got the traced value"):
    build(2.0)


# --------------------------------------------------------------------------------- composition


def test_clipping_inside_sees_the_unscaled_gradients():
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  tx = jaxamp.dynamic_loss_scale(inner, init_scale=2.0**12)
  params = {"w": jnp.array([1.0, 2.0, -1.0]), "b": jnp.array([0.5])}
  grads = {"w": jnp.array([0.3, -0.2, 0.1]), "b": jnp.array([0.4])}  # norm 0.55 < 1: no clip
  scaled = jax.tree.map(lambda g: g * 2.0**12, grads)
  with standard_promotion:
    got = jax.jit(tx.update)(scaled, tx.init(params), params)
    want = jax.jit(inner.update)(grads, inner.init(params), params)
    wrong = jax.jit(inner.update)(scaled, inner.init(params), params)  # clips the scaled ones
  got = (got[0], got[1].inner_state)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-6)
  # Adam's first moment shows the difference: clipping the scaled gradients shrinks them.
  mu = lambda state: state[1][0].mu["w"]
  np.testing.assert_allclose(mu(got[1]), 0.1 * grads["w"], rtol=1e-6)
  assert not np.allclose(mu(wrong[1]), mu(want[1]), rtol=1e-2)


def test_inject_hyperparams_inner_learning_rate_is_readable_and_settable():
  inner = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
  tx = jaxamp.dynamic_loss_scale(inner, init_scale=4.0)
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  assert float(state.inner_state.hyperparams["learning_rate"]) == 0.5
  inner_state = state.inner_state._replace(
      hyperparams=dict(state.inner_state.hyperparams, learning_rate=jnp.float32(0.25)))
  updates, state = jax.jit(tx.update)({"w": jnp.full(2, 4.0)}, state._replace(
      inner_state=inner_state), params)
  np.testing.assert_array_equal(updates["w"], [-0.25, -0.25])
  assert float(state.inner_state.hyperparams["learning_rate"]) == 0.25


def test_extra_args_reach_an_inner_gradient_transformation_extra_args():

  def update(updates, state, params=None, *, multiplier, **extra):
    del params, extra
    return jax.tree.map(lambda u: u * multiplier, updates), state + 1

  inner = optax.GradientTransformationExtraArgs(lambda p: jnp.zeros([], jnp.int32), update)
  tx = jaxamp.dynamic_loss_scale(inner, init_scale=2.0)
  state = tx.init({"w": jnp.ones(2)})
  updates, state = jax.jit(tx.update)({"w": jnp.array([2.0, 4.0])}, state, None,
                                      multiplier=jnp.float32(3.0))
  np.testing.assert_array_equal(updates["w"], [3.0, 6.0])
  assert int(state.inner_state) == 1
  updates, state = tx.update({"w": jnp.array([jnp.nan, 4.0])}, state, None, multiplier=3.0)
  assert int(state.inner_state) == 1 and bool(state.skipped)
  # A plain optax transformation inside ignores extra arguments, as optax.chain does.
  tx = jaxamp.dynamic_loss_scale(optax.sgd(1.0), init_scale=2.0)
  updates, _ = tx.update({"w": jnp.array([2.0])}, tx.init({"w": jnp.ones(1)}), None, loss=1.0)
  np.testing.assert_array_equal(updates["w"], [-1.0])


def _nestings():
  params = {"w": jnp.ones(2)}
  chained = optax.chain(optax.identity(), jaxamp.dynamic_loss_scale(optax.sgd(0.1),
                                                                    init_scale=8.0))
  injected = optax.inject_hyperparams(
      lambda learning_rate: jaxamp.dynamic_loss_scale(optax.sgd(learning_rate), init_scale=8.0))(
          learning_rate=0.1)
  both = optax.chain(optax.identity(), optax.inject_hyperparams(
      lambda learning_rate: jaxamp.static_loss_scale(optax.sgd(learning_rate), 8.0))(
          learning_rate=0.1))
  return params, {"chain": chained, "inject_hyperparams": injected, "chain+inject": both}


@pytest.mark.parametrize("name", ["chain", "inject_hyperparams", "chain+inject"])
def test_get_scale_and_set_loss_scale_through_nesting(name):
  params, txs = _nestings()
  tx = txs[name]
  state = tx.init(params)
  assert float(jaxamp.loss_scale(state)) == 8.0
  assert float(jaxamp.scale_loss(jnp.float32(0.5), state)) == 4.0
  assert isinstance(jaxamp.get_loss_scale_state(state), jaxamp.LossScaleState)
  state = jaxamp.set_loss_scale(state, 32.0)
  assert float(jaxamp.loss_scale(state)) == 32.0
  updates, state = jax.jit(tx.update)({"w": jnp.full(2, 32.0)}, state, params)
  assert float(jaxamp.loss_scale(state)) == 32.0
  np.testing.assert_allclose(updates["w"], -0.1)


_BROKEN_COMPOSITIONS = {
    "multisteps": (lambda: optax.MultiSteps(jaxamp.dynamic_loss_scale(optax.adam(0.1)), 2),
                   "jaxamp.accumulate_gradients(jaxamp.dynamic_loss_scale(inner), k)"),
    "apply_if_finite": (
        lambda: optax.apply_if_finite(jaxamp.dynamic_loss_scale(optax.adam(0.1)), 3),
        "jaxamp.dynamic_loss_scale(inner) alone"),
    "optimizer_after": (
        lambda: optax.chain(jaxamp.dynamic_loss_scale(optax.identity()), optax.adam(0.1)),
        "jaxamp.dynamic_loss_scale(optax.chain(...))"),
    "optimizer_before": (
        lambda: optax.chain(optax.adam(0.1), jaxamp.dynamic_loss_scale(optax.identity())),
        "jaxamp.dynamic_loss_scale(optax.chain(...))"),
}


@pytest.mark.parametrize("name", sorted(_BROKEN_COMPOSITIONS))
def test_compositions_that_cannot_work_are_refused_at_first_trace(name):
  make, working = _BROKEN_COMPOSITIONS[name]
  params = {"w": jnp.ones(2)}
  state = make().init(params)
  with pytest.raises(ValueError, match=re.escape(working)):
    jax.jit(jaxamp.scale_loss)(jnp.float32(1.0), state)
  with pytest.raises(ValueError, match=re.escape(working)):
    jaxamp.loss_scale(state)
  with pytest.raises(ValueError, match=re.escape(working)):  # where the state is first built
    jaxamp.TrainState.create(apply_fn=None, params=params, tx=make())


@pytest.mark.parametrize("tx", [
    jaxamp.accumulate_gradients(jaxamp.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9)), 2),
    jaxamp.dynamic_loss_scale(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9))),
    optax.chain(optax.clip_by_global_norm(1.0), optax.identity(),
                jaxamp.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9))),
], ids=["accumulate", "chain_inside", "stateless_outside"])
def test_working_compositions_still_train(tx):
  params = {"w": jnp.ones(2)}
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    grads = jax.grad(lambda p: jaxamp.scale_loss(jnp.sum(p["w"] ** 2), state))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for _ in range(4):
    params, state = step(params, state)
  assert float(jnp.sum(params["w"] ** 2)) < 2.0 and int(jaxamp.skipped_steps(state)) == 0


def test_scale_loss_promotes_half_precision_losses():
  state = jaxamp.dynamic_loss_scale(optax.sgd(0.1)).init({"w": jnp.ones(1)})
  out = jaxamp.scale_loss(jnp.float16(2.0), state)
  assert out.dtype == jnp.float32 and float(out) == 2.0**17
  assert jaxamp.scale_loss(jnp.bfloat16(1.0), state).dtype == jnp.float32


def test_states_without_a_loss_scale_are_a_clear_error():
  state = optax.adam(1e-3).init({"w": jnp.ones(2)})
  for call in (jaxamp.loss_scale, lambda s: jaxamp.scale_loss(1.0, s),
               lambda s: jaxamp.set_loss_scale(s, 2.0), jaxamp.get_loss_scale_state):
    with pytest.raises(ValueError, match="^No loss-scale state found in the optimizer state"):
      call(state)


@pytest.mark.parametrize("value,exc,message", [
    (0.0, ValueError, "scale must be a positive, finite number, got 0.0"),
    (-1.0, ValueError, "scale must be a positive, finite number, got -1.0"),
    (math.nan, ValueError, "scale must be finite, got nan"),
    ("2", TypeError, "scale must be a real number, got '2' of type str"),
    (True, TypeError, "scale must be a real number, got True of type bool"),
    (jnp.ones(2), ValueError, "scale must be a scalar, got an array of shape (2,)"),
])
def test_set_loss_scale_checks_its_value(value, exc, message):
  state = jaxamp.dynamic_loss_scale(optax.sgd(0.1)).init({"w": jnp.ones(1)})
  with pytest.raises(exc, match="^" + re.escape(message)):
    jaxamp.set_loss_scale(state, value)


def test_static_loss_scale_keeps_its_scale_skips_and_changes_without_recompiling(count_traces):
  tx = jaxamp.static_loss_scale(optax.sgd(1.0), 128.0)
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)

  def step(grads, state):
    updates, state = tx.update(grads, state, params)
    return updates, state

  traced, counter = count_traces(step)
  step = jax.jit(traced)
  updates, state = step({"w": jnp.array([128.0, -256.0])}, state)
  np.testing.assert_array_equal(updates["w"], [-1.0, 2.0])
  updates, state = step({"w": jnp.array([jnp.inf, 1.0])}, state)
  assert bool(state.skipped) and float(state.scale) == 128.0 and int(state.skipped_steps) == 1
  for _ in range(3):
    updates, state = step({"w": jnp.array([128.0, 128.0])}, state)
  assert float(state.scale) == 128.0 and int(state.growth_tracker) == 0
  state = jaxamp.set_loss_scale(state, 4.0)
  updates, state = step({"w": jnp.array([4.0, 8.0])}, state)
  np.testing.assert_array_equal(updates["w"], [-1.0, -2.0])
  state = jax.jit(jaxamp.set_loss_scale)(state, jnp.float32(2.0))  # traced values too
  assert float(state.scale) == 2.0
  updates, state = step({"w": jnp.array([2.0, 2.0])}, state)
  assert counter["n"] == 1


@pytest.mark.parametrize("outer", ["dynamic", "static"])
def test_a_loss_scaler_inside_another_is_refused_at_init_with_the_fix(outer):
  inner = jaxamp.dynamic_loss_scale(optax.sgd(0.1))
  tx = (jaxamp.dynamic_loss_scale(inner) if outer == "dynamic"
        else jaxamp.static_loss_scale(inner, 8.0))
  with pytest.raises(ValueError, match=r"unscaled twice.*dynamic_loss_scale\(optax.chain"):
    tx.init({"w": jnp.zeros(2)})


@pytest.mark.skipif(jax.__version_info__ < (0, 10), reason=(
    "XLA:CPU before jax 0.10 fuses the update differently (on 0.7.1 the clipped update moves "
    "five gradients more than clip + adam); the bound is that of the releases measured"))
@pytest.mark.parametrize("clip", [False, True], ids=["adam", "clip+adam"])
def test_the_compiled_update_moves_three_gradients_more_than_its_optimizer(clip):
  # XLA's own optimized program, kernel by kernel (benchmarks/update_traffic.py): a finite step
  # moves adam's bytes plus the unscaled gradients written out and read back by the check's
  # reduction, after the gradients' read by the unscaling (see docs/benchmarks.md). With a clip,
  # the clip's norm reads those same unscaled gradients: nothing more.
  from benchmarks import update_traffic

  leaves, elements = 2, 65_536
  with jax.numpy_dtype_promotion("standard"):  # optax's adam mixes float and int32
    moved = {v: update_traffic.traffic(v, leaves, elements, clip) for v in ("adam", "jaxamp")}
  extra = sum(moved["jaxamp"][k] - moved["adam"][k] for k in ("read", "written"))
  assert extra / (4 * leaves * elements) <= 3.01, moved
