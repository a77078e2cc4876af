"""jaxamp.paddle.GradScaler: Paddle's hysteresis rule, API, errors and state dicts."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import jaxamp
from tests.test_grad_scaler import Holder

F32_TINY = float(np.finfo(np.float32).tiny)
W0 = {"w": jnp.array([1.0, -2.0, 0.5], jnp.float32)}
SGD = optax.sgd(0.5)
GOOD = [0.5, 1.0, -1.0]
BAD = [np.inf, 1.0, 1.0]


def _raises(exc, message):
  return pytest.raises(exc, match="^" + re.escape(message) + "$")


def _set_grads(opt, scaler, values):
  opt.grads = {"w": jnp.asarray(values, jnp.float32) * scaler.state.scale}


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def _run(scaler, bad_steps, n, how="minimize"):
  opt = Holder(W0, SGD)
  scales = []
  for i in range(n):
    _set_grads(opt, scaler, BAD if i in bad_steps else GOOD)
    before = _bits(opt.params)
    if how == "minimize":
      scaler.minimize(opt)
    else:
      if how == "unscale":
        scaler.unscale_(opt)
      scaler.step(opt)
      scaler.update()
    if i in bad_steps:
      assert _bits(opt.params) == before
    scales.append(float(scaler.state.scale))
  return scales, opt


@pytest.mark.parametrize("how", ["minimize", "step", "unscale"])
def test_reference_hysteresis_example(how):
  scaler = jaxamp.paddle.GradScaler(init_loss_scaling=8.0, incr_every_n_steps=3,
                                    decr_every_n_nan_or_inf=2)
  scales, _ = _run(scaler, {2, 3, 7, 8, 9}, 12, how)
  assert scales == [8, 8, 8, 4, 4, 4, 8, 8, 4, 4, 4, 4]


def test_alternating_good_and_bad_never_lowers_the_scale():
  scaler = jaxamp.paddle.GradScaler(init_loss_scaling=64.0, decr_every_n_nan_or_inf=2)
  scales, opt = _run(scaler, set(range(1, 20, 2)), 20)
  assert scales == [64.0] * 20
  assert scaler.state_dict()["decr_count"] == 1 and scaler.state_dict()["incr_count"] == 0
  # Every bad step was skipped: ten good SGD steps were applied.
  np.testing.assert_allclose(opt.params["w"], W0["w"] - 10 * 0.5 * np.asarray(GOOD), rtol=1e-6)


def test_two_bad_one_good_patterns():
  scaler = jaxamp.paddle.GradScaler(init_loss_scaling=64.0, incr_every_n_steps=2,
                                    decr_every_n_nan_or_inf=2)
  pattern = [1, 1, 0, 1, 1, 0, 0, 1, 0, 0]  # 1 = bad
  scales, _ = _run(scaler, {i for i, b in enumerate(pattern) if b}, len(pattern))
  assert scales == [64, 32, 32, 32, 16, 16, 32, 32, 32, 64]


def _paddle_rule(scale, incr, decr, found, incr_ratio, decr_ratio, n_incr, n_decr):
  """Paddle's _update in Python (power-of-two ratios: float32 products are exact), plus guards."""
  if found:
    incr, decr = 0, decr + 1
    if decr == n_decr:
      scale, decr = max(scale * decr_ratio, F32_TINY), 0
  else:
    decr, incr = 0, incr + 1
    if incr == n_incr:
      grown = scale * incr_ratio
      scale = grown if grown <= float(np.finfo(np.float32).max) else scale
      incr = 0
  return scale, incr, decr


@settings(max_examples=20, deadline=None, derandomize=True)
@given(bad=st.lists(st.booleans(), min_size=1, max_size=12), n_incr=st.integers(1, 3),
       n_decr=st.integers(1, 3), init=st.sampled_from([1.0, 2.0**20, 2.0**126, 2.0**-124]),
       decr_ratio=st.sampled_from([0.5, 0.25]))
def test_trajectory_matches_the_paddle_rule(bad, n_incr, n_decr, init, decr_ratio):
  scaler = jaxamp.paddle.GradScaler(init_loss_scaling=init, decr_ratio=decr_ratio,
                                    incr_every_n_steps=n_incr, decr_every_n_nan_or_inf=n_decr)
  scales, _ = _run(scaler, {i for i, b in enumerate(bad) if b}, len(bad))
  scale, incr, decr = init, 0, 0
  for i, b in enumerate(bad):
    scale, incr, decr = _paddle_rule(scale, incr, decr, b, 2.0, decr_ratio, n_incr, n_decr)
    assert scales[i] == scale
  sd = scaler.state_dict()
  assert (sd["incr_count"], sd["decr_count"]) == (incr, decr)


def test_scale_never_grows_to_inf_nor_falls_below_the_floor():
  top = jaxamp.paddle.GradScaler(init_loss_scaling=2.0**127, incr_every_n_steps=1)
  assert _run(top, set(), 3)[0] == [2.0**127] * 3
  bottom = jaxamp.paddle.GradScaler(init_loss_scaling=4 * F32_TINY, decr_every_n_nan_or_inf=1)
  assert _run(bottom, {0, 1, 2, 3}, 4)[0] == [2 * F32_TINY, F32_TINY, F32_TINY, F32_TINY]


def test_two_optimizers_any_overflow_counts():
  scaler = jaxamp.paddle.GradScaler(init_loss_scaling=16.0, incr_every_n_steps=1,
                                    decr_every_n_nan_or_inf=1)
  a, b = Holder(W0, SGD), Holder(W0, SGD)
  _set_grads(a, scaler, BAD)
  _set_grads(b, scaler, GOOD)
  scaler.step(a)
  scaler.step(b)  # Paddle would use only b's flag and grow
  scaler.update()
  assert float(scaler.state.scale) == 8.0
  assert _bits(a.params) == _bits(W0) and _bits(b.params) != _bits(W0)


def test_update_without_a_step_repeats_the_last_flag():
  scaler = jaxamp.paddle.GradScaler(init_loss_scaling=16.0, decr_every_n_nan_or_inf=1,
                                    incr_every_n_steps=1)
  scaler.update()  # nothing stepped yet: a good iteration
  assert float(scaler.state.scale) == 32.0
  _run(scaler, {0}, 1, how="step")
  assert float(scaler.state.scale) == 16.0
  scaler.update()
  assert float(scaler.state.scale) == 8.0


def test_fixed_scale_still_skips_bad_steps():
  scaler = jaxamp.paddle.GradScaler(init_loss_scaling=128.0, use_dynamic_loss_scaling=False,
                                    incr_every_n_steps=1, decr_every_n_nan_or_inf=1)
  assert not scaler.is_use_dynamic_loss_scaling()
  opt = Holder(W0, SGD)
  for values in (GOOD, BAD, GOOD):
    _set_grads(opt, scaler, values)
    before = _bits(opt.params)
    scaler.step(opt)  # no update needed: the stage is reset by step
    assert (_bits(opt.params) == before) == (values is BAD)
  scaler.update()
  assert float(scaler.state.scale) == 128.0
  np.testing.assert_allclose(opt.params["w"], W0["w"] - 2 * 0.5 * np.asarray(GOOD), rtol=1e-6)
  assert scaler.state_dict()["use_dynamic_loss_scaling"] is False


def test_disabled_scaler():
  scaler = jaxamp.paddle.GradScaler(enable=False)
  x = jnp.ones(2)
  assert scaler.scale(x) is x
  assert not scaler.is_enable() and not scaler.is_use_dynamic_loss_scaling()
  assert scaler.get_init_loss_scaling() == 1.0 and scaler.state_dict() == {}
  opt = Holder(W0, SGD)
  opt.grads = {"w": jnp.asarray(GOOD)}
  scaler.unscale_(opt)
  scaler.step(opt)
  scaler.update()
  scaler.minimize(opt)
  assert opt.applied == 2
  scaler.load_state_dict({})
  with pytest.raises(TypeError, match="'var'"):
    scaler.scale(3.0)


def test_scale_arrays_and_functions():
  scaler = jaxamp.paddle.GradScaler(init_loss_scaling=1024)
  assert float(scaler.scale(jnp.float16(0.5))) == 512.0
  assert scaler.scale(jnp.float16(0.5)).dtype == jnp.float32
  loss = lambda p, x: jnp.sum(p["w"] * x)
  f = scaler.scale(loss)
  assert f == scaler.scale(loss) and float(jax.tree.leaves(f)[0]) == 1024.0
  opt = Holder(W0, SGD)
  opt.backward(f, jnp.ones(3))
  np.testing.assert_array_equal(opt.grads["w"], [1024.0] * 3)
  scaler.minimize(opt, scaled_loss=None)
  np.testing.assert_allclose(opt.params["w"], W0["w"] - 0.5, rtol=1e-6)
  for bad in (3.0, [jnp.ones(1)], "loss"):
    with pytest.raises(TypeError, match=re.escape("The type of 'var' in GradScaler.scale()")):
      scaler.scale(bad)


def test_stage_errors():
  scaler = jaxamp.paddle.GradScaler()
  opt = Holder(W0, SGD)
  _set_grads(opt, scaler, GOOD)
  scaler.unscale_(opt)
  with _raises(RuntimeError,
               "unscale_() has already been called on this optimizer since the last update()."):
    scaler.unscale_(opt)
  scaler.step(opt)
  with _raises(RuntimeError, "unscale_() is being called after step()."):
    scaler.unscale_(opt)
  with _raises(RuntimeError, "step() has already been called since the last update()."):
    scaler.step(opt)
  scaler.update()
  _set_grads(opt, scaler, GOOD)
  scaler.step(opt)


def test_constructor_and_setter_errors():
  with _raises(AssertionError, "The incr_ratio must be > 1.0."):
    jaxamp.paddle.GradScaler(incr_ratio=1.0)
  with _raises(ValueError, "The decr_ratio must be < 1.0."):
    jaxamp.paddle.GradScaler(decr_ratio=1.0)
  scaler = jaxamp.paddle.GradScaler()
  with _raises(AssertionError, "The new_incr_ratio must be > 1.0."):
    scaler.set_incr_ratio(0.5)
  with _raises(ValueError, "The new_decr_ratio must be < 1.0."):
    scaler.set_decr_ratio(2.0)
  with pytest.raises(ValueError, match="^incr_every_n_steps must be an int >= 1, got 0"):
    scaler.set_incr_every_n_steps(0)
  with pytest.raises(ValueError, match="^decr_every_n_nan_or_inf must be an int >= 1, got 0"):
    scaler.set_decr_every_n_nan_or_inf(0)
  with pytest.raises(ValueError, match="init_loss_scaling"):
    jaxamp.paddle.GradScaler(init_loss_scaling=0.0)
  with pytest.raises(TypeError, match="enable"):
    jaxamp.paddle.GradScaler(enable="yes")
  assert (scaler.get_incr_ratio(), scaler.get_decr_ratio()) == (2.0, 0.5)


def test_getters_setters_and_defaults():
  scaler = jaxamp.paddle.GradScaler()
  assert scaler.is_enable() and scaler.is_use_dynamic_loss_scaling()
  # Paddle 3.3.1's paddle.amp.GradScaler defaults.
  assert (scaler.get_init_loss_scaling(), scaler.get_incr_ratio(), scaler.get_decr_ratio(),
          scaler.get_incr_every_n_steps(), scaler.get_decr_every_n_nan_or_inf()) == (
              65536.0, 2.0, 0.5, 2000, 1)
  scaler.set_init_loss_scaling(1000)
  scaler.set_incr_ratio(3.0)
  scaler.set_decr_ratio(0.1)
  scaler.set_incr_every_n_steps(1)
  scaler.set_decr_every_n_nan_or_inf(1)
  assert scaler.get_init_loss_scaling() == 1000 and float(scaler.state.scale) == 1000.0
  assert (scaler.get_incr_ratio(), scaler.get_decr_ratio(), scaler.get_incr_every_n_steps(),
          scaler.get_decr_every_n_nan_or_inf()) == (3.0, 0.1, 1, 1)
  scales, _ = _run(scaler, {1}, 2)
  assert scales == [3000.0, 300.0]


def test_state_dict_format_and_round_trip():
  kw = dict(init_loss_scaling=16.0, incr_every_n_steps=2, decr_every_n_nan_or_inf=2)
  bad = {1, 4, 5}
  full, _ = _run(jaxamp.paddle.GradScaler(**kw), bad, 9)
  first = jaxamp.paddle.GradScaler(**kw)
  _run(first, bad, 5)
  sd = first.state_dict()
  assert list(sd) == ["scale", "incr_ratio", "decr_ratio", "incr_every_n_steps",
                      "decr_every_n_nan_or_inf", "incr_count", "decr_count",
                      "use_dynamic_loss_scaling"]
  assert isinstance(sd["scale"], np.ndarray) and sd["scale"].shape == (1,)
  assert sd["scale"].dtype == np.float32 and (sd["incr_count"], sd["decr_count"]) == (0, 1)
  assert type(sd["incr_count"]) is int and type(sd["use_dynamic_loss_scaling"]) is bool
  resumed = jaxamp.paddle.GradScaler()
  resumed.load_state_dict(sd)
  assert resumed.get_init_loss_scaling() == sd["scale"][0]
  rest, _ = _run(resumed, {b - 5 for b in bad if b >= 5}, 4)
  assert rest == full[5:]
  plain = jaxamp.paddle.GradScaler()
  plain.load_state_dict(dict(sd, scale=float(sd["scale"][0])))  # a plain number is accepted
  assert float(plain.state.scale) == float(sd["scale"][0])
  with _raises(RuntimeError, "The input state dict is empty, possibly because it was saved "
               "from a disabled instance of GradScaler."):
    plain.load_state_dict({})


def test_loop_compiles_once():
  scaler = jaxamp.paddle.GradScaler(init_loss_scaling=2.0**10, incr_every_n_steps=3)
  _run(scaler, {2, 3}, 4)
  from jaxamp._src.facade import holder, scaler_state
  update = scaler_state.update_fn(scaler._rule, scaler._stall_after)
  sizes = update._cache_size(), holder._unscale_and_check._cache_size()
  _run(scaler, {1, 5, 6}, 20)
  assert (update._cache_size(), holder._unscale_and_check._cache_size()) == sizes


def test_the_loop_never_reads_device_values(monkeypatch):
  from tests.test_grad_scaler import _forbid_host_reads
  opt = jaxamp.OptimWrapper(SGD, W0)
  scaler = jaxamp.paddle.GradScaler(init_loss_scaling=2.0**8, incr_every_n_steps=1)
  loss = lambda p, x: jnp.sum(p["w"] * x)
  opt.backward(scaler.scale(loss), jnp.ones(3))  # compile outside the check
  scaler.minimize(opt)
  _forbid_host_reads(monkeypatch)
  for x in (jnp.ones(3), jnp.array([np.inf, 1.0, 1.0]), jnp.ones(3)):
    opt.zero_grad()
    opt.backward(scaler.scale(loss), x)
    scaler.minimize(opt)
    opt.zero_grad()
    opt.backward(scaler.scale(loss), x)
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
  with pytest.raises(AssertionError, match="host sync"):
    scaler.state_dict()


# ---------------------------------------------------------------------------------------------
# Against paddle.amp.GradScaler itself, when Paddle is installed (the 'reference' extra).


def _paddle_scaler(**kw):
  from tests.reference._refs import import_reference, paddle_scaler_on_cpu
  return import_reference("paddle"), paddle_scaler_on_cpu(**kw)


def _outcome(call):
  try:
    call()
    return "ok", ""
  except Exception as e:  # noqa: BLE001 - comparing exception types is the point
    return type(e).__name__, str(e)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("seed", range(6))
def test_random_call_sequences_match_paddle(seed, capsys):
  rng = np.random.default_rng(seed)
  kw = dict(init_loss_scaling=float(rng.choice([1.0, 1024.0])), decr_ratio=float(rng.choice([0.5, 0.25])),
            incr_every_n_steps=int(rng.integers(1, 4)), decr_every_n_nan_or_inf=int(rng.integers(1, 4)),
            use_dynamic_loss_scaling=bool(rng.random() < 0.8))
  paddle, ps = _paddle_scaler(**kw)
  js = jaxamp.paddle.GradScaler(**kw)
  param = paddle.create_parameter([3], "float32", default_initializer=paddle.nn.initializer.Assign(
      np.asarray(W0["w"])))
  p_opt = paddle.optimizer.SGD(learning_rate=0.5, parameters=[param])
  j_opt = Holder(W0, SGD)
  loss = (param * 0.0).sum()
  for _ in range(40):
    op = rng.choice(["grad", "grad", "minimize", "step", "update", "update", "unscale"])
    if op == "grad":
      g = rng.choice([0.5, -1.0, 2.0, np.inf, np.nan], 3).astype(np.float32)
      with np.errstate(over="ignore", invalid="ignore"):
        g = (g * ps._scale.numpy().reshape(())).astype(np.float32)
      p_opt.clear_grad()
      loss = (param * paddle.to_tensor(g)).sum()
      loss.backward()
      j_opt.grads = {"w": jnp.asarray(g)}
      continue
    calls = {
        "minimize": (lambda: ps.minimize(p_opt, loss), lambda: js.minimize(j_opt)),
        "step": (lambda: ps.step(p_opt), lambda: js.step(j_opt)),
        "update": (ps.update, js.update),
        "unscale": (lambda: ps.unscale_(p_opt), lambda: js.unscale_(j_opt)),
    }[op]
    assert _outcome(calls[0]) == _outcome(calls[1]), op
    np.testing.assert_array_equal(param.numpy(), j_opt.params["w"])
    p_sd, j_sd = ps.state_dict(), js.state_dict()
    assert list(p_sd) == list(j_sd)
    for key in p_sd:
      np.testing.assert_array_equal(np.asarray(p_sd[key]), np.asarray(j_sd[key]), err_msg=key)
  capsys.readouterr()  # Paddle prints each decrease


def test_donating_holder_is_bit_identical():
  def loss(params, x, code):
    poison = jnp.where(code == 2, jnp.float32(jnp.nan),
                       jnp.where(code == 1, jnp.float32(jnp.inf), jnp.float32(1.0)))
    return jnp.sum(jnp.tanh(params["w"] * x) ** 2) * poison

  runs = []
  for donate in (False, True):
    opt = jaxamp.OptimWrapper(optax.sgd(0.1, momentum=0.9),
                              {"w": jnp.array([1.0, -2.0, 0.5], jnp.float32)}, donate=donate)
    scaler = jaxamp.paddle.GradScaler(init_loss_scaling=16.0, incr_every_n_steps=2)
    x = jnp.asarray([0.5, 1.0, 2.0], jnp.float32)
    out = []
    for code in (0, 1, 0, 0, 2, 0, 1, 1, 0, 0):
      opt.backward(scaler.scale(loss), x, jnp.int32(code))
      scaler.minimize(opt)
      opt.zero_grad()
      state = scaler._state
      out.append((_bits(opt.params), _bits(opt.opt_state), _bits(state)))
    runs.append(out)
  assert runs[0] == runs[1]
