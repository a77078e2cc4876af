"""Compiled versus eager: the skip decision holds when the gradients are made in the same program.

Each public path runs steps whose gradients come from a producer (tests/_soundness.py) computed
inside the compiled step (or inside the facade's own compiled backward), on data and scales that
hypothesis chooses; every step is checked against the eager rule (see tests/_soundness.py).

Profiles: the default ``soundness`` runs a few derandomized examples per case; the long one runs
with ``HYPOTHESIS_PROFILE=soundness-long python -m pytest tests/test_soundness.py`` (it also
crosses every path with every producer, where the default crosses the core path with every
producer and each other path with a few).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import example
from hypothesis import given

import jaxamp
from tests import _optax
from tests import _soundness as S
from tests._soundness import Outcome

ADAM = functools.partial(_optax.adam, 1e-3)  # optax.adam, traced with standard promotion


def _sgd():
  return optax.sgd(0.1, momentum=0.9)


def _clip(inner):
  return lambda: optax.chain(optax.clip_by_global_norm(1.0), inner())


# -------------------------------------------------------------------------------------------------
# Paths. Each builder returns ``run(x, scale, eager) -> Outcome``, built once per (path, producer):
# the jitted functions are reused across examples (data and scale are arguments).


def _functional(make_tx, producer, *, window=1, microbatches=0):
  """dynamic/static_loss_scale, accumulate_gradients and microbatch_value_and_grad: the user's
  own step, gradients and update in one jitted function, one call per micro-step."""
  tx = make_tx()
  loss = producer.loss
  params0 = jax.tree.map(jnp.asarray, producer.params())
  state0 = tx.init(params0)
  if microbatches:
    mvg = jaxamp.microbatch_value_and_grad(lambda p, mb: loss(p, mb[0]), microbatches)

    def grads_of(params, state, x):
      return mvg(params, x, loss_scale=state)[1]
  else:
    def grads_of(params, state, x):
      return jax.grad(lambda p: jaxamp.scale_loss(loss(p, x), state))(params)

  def step(params, state, x):
    g = grads_of(params, state, x)
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state, g

  jitted = jax.jit(step)

  def run(xs, scale, eager):
    state = jaxamp.set_loss_scale(state0, scale)
    params, grads, consistent = params0, [], []
    batches = [xs] if microbatches else list(xs)
    with S.mode(eager):
      for i, x in enumerate(batches):
        before = S.to_host(params)
        params, state, g = (step if eager else jitted)(params, state, jnp.asarray(x))
        grads.append(S.to_host(g))
        if i < len(batches) - 1:  # a micro-step that does not close its window
          consistent.append((S.same_bits(before, params), f"micro-step {i} changed the params"))
    ls = S.loss_scale_state(state)
    return Outcome(S.to_host(params0), S.to_host(S.loss_scale_state(state0).inner_state),
                   S.to_host(params), S.to_host(ls.inner_state), bool(ls.skipped),
                   np.float32(ls.scale), grads, window, tuple(consistent))

  return run


def _torch(producer, *, variant):
  """jaxamp.GradScaler with a jaxamp.OptimWrapper: the gradients come from the wrapper's own
  jitted backward (or, for ``user_jit``, from a user-jitted function of ``scaler.scale``)."""
  params0 = jax.tree.map(jnp.asarray, producer.params())
  opt = jaxamp.OptimWrapper(ADAM(), params0)
  fresh = opt.state_dict()
  loss = producer.loss

  @jax.jit
  def user_grads(params, scaled_loss, x):
    return jax.grad(scaled_loss)(params, x)

  def run(xs, scale, eager):
    (x,) = xs
    x = jnp.asarray(x)
    opt.params = params0
    opt.load_state_dict(fresh)
    opt.zero_grad()
    scaler = jaxamp.GradScaler(init_scale=scale, growth_interval=1)
    scale0 = np.float32(scaler.get_scale())
    with S.mode(eager):
      if variant == "user_jit":
        opt.grads = (user_grads.__wrapped__ if eager else user_grads)(opt.params,
                                                                      scaler.scale(loss), x)
      else:
        opt.backward(scaler.scale(loss), x)
      grads = S.to_host(opt.grads)
      if variant == "unscale_step":
        scaler.unscale_(opt)
      scaler.step(opt)
      scaler.update()
    scale1 = np.float32(scaler.state.scale)
    skipped = bool(scale1 < scale0)  # growth_interval=1: a good step grows or holds the scale
    state1 = S.to_host(opt.opt_state)
    count_ok = S.counts(state1) == ([0] if skipped else [1])
    out = Outcome(S.to_host(params0), S.to_host(fresh["state"]), S.to_host(opt.params), state1,
                  skipped, scale1, [grads],
                  consistent=((count_ok, f"adam count {S.counts(state1)} vs skipped={skipped}"),))
    opt.zero_grad()
    return out

  return run


def _amp_update_params(producer):
  """AmpOptimWrapper.update_params: backward, unscale, clip, check and step in ONE jitted call.
  Its gradients are not exposed: those of the same scaled objective, computed by a separate
  jitted (and eager) function, stand for them."""
  params0 = jax.tree.map(jnp.asarray, producer.params())
  amp = jaxamp.AmpOptimWrapper(ADAM(), params0, clip_grad=dict(max_norm=1.0),
                               loss_scale=dict(init_scale=2.0**16, growth_interval=1))
  fresh = amp.state_dict()
  loss = producer.loss

  def scaled_grads(params, x, scale):
    return jax.grad(lambda p: (loss(p, x) / jnp.float32(1.0)) * scale)(params)

  jitted_grads = jax.jit(scaled_grads)

  def run(xs, scale, eager):
    (x,) = xs
    x = jnp.asarray(x)
    amp.params = params0
    amp.load_state_dict(dict(fresh, loss_scaler=dict(fresh["loss_scaler"], scale=float(scale))))
    with S.mode(eager):
      grads = S.to_host((scaled_grads if eager else jitted_grads)(
          params0, x, jnp.float32(amp.loss_scaler.scale)))
      amp.update_params(loss, x)
    ls = amp.loss_scaler
    state1 = S.to_host(amp.opt_state)
    skipped = bool(ls.skipped)
    return Outcome(S.to_host(params0), S.to_host(fresh["state"]), S.to_host(amp.params), state1,
                   skipped, np.float32(ls.scale), [grads],
                   consistent=((S.counts(state1) == ([0] if skipped else [1]),
                                f"adam count {S.counts(state1)} vs skipped={skipped}"),))

  return run


def _paddle_minimize(producer):
  """jaxamp.paddle.GradScaler.minimize on a jaxamp.OptimWrapper (gradients from its backward)."""
  params0 = jax.tree.map(jnp.asarray, producer.params())
  opt = jaxamp.OptimWrapper(ADAM(), params0)
  fresh = opt.state_dict()
  loss = producer.loss

  def run(xs, scale, eager):
    (x,) = xs
    x = jnp.asarray(x)
    opt.params = params0
    opt.load_state_dict(fresh)
    opt.zero_grad()
    scaler = jaxamp.paddle.GradScaler(init_loss_scaling=float(scale), incr_every_n_steps=1,
                                      decr_every_n_nan_or_inf=1)
    scale0 = np.float32(scaler.state.scale)
    with S.mode(eager):
      opt.backward(scaler.scale(loss), x)
      grads = S.to_host(opt.grads)
      scaler.minimize(opt)
    opt.zero_grad()
    scale1 = np.float32(scaler.state.scale)
    skipped = bool(scale1 < scale0)
    state1 = S.to_host(opt.opt_state)
    return Outcome(S.to_host(params0), S.to_host(fresh["state"]), S.to_host(opt.params), state1,
                   skipped, scale1, [grads],
                   consistent=((S.counts(state1) == ([0] if skipped else [1]),
                                f"adam count {S.counts(state1)} vs skipped={skipped}"),))

  return run


def _train_state(producer):
  """jaxamp.TrainState: state.scale_loss in the user's jitted step, then apply_gradients."""
  params0 = jax.tree.map(jnp.asarray, producer.params())
  ts0 = jaxamp.TrainState.create(apply_fn=producer.loss, params=params0,
                                 tx=jaxamp.dynamic_loss_scale(ADAM(), growth_interval=1))

  def step(ts, x):
    grads = jax.grad(lambda p: ts.scale_loss(ts.apply_fn(p, x)))(ts.params)
    return ts.apply_gradients(grads=grads), grads

  jitted = jax.jit(step)

  def run(xs, scale, eager):
    (x,) = xs
    ts = ts0.replace(opt_state=jaxamp.set_loss_scale(ts0.opt_state, scale))
    with S.mode(eager):
      new, grads = (step if eager else jitted)(ts, jnp.asarray(x))
    ls = S.loss_scale_state(new.opt_state)
    skipped = bool(ls.skipped)
    return Outcome(S.to_host(params0), S.to_host(S.loss_scale_state(ts0.opt_state).inner_state),
                   S.to_host(new.params), S.to_host(ls.inner_state), skipped,
                   np.float32(ls.scale), [S.to_host(grads)],
                   consistent=((int(new.step) == (0 if skipped else 1),
                                f"TrainState.step {int(new.step)} vs skipped={skipped}"),))

  return run


def _nnx_optimizer(producer):
  """jaxamp.nnx.Optimizer: nnx.grad of optimizer.scale_loss inside nnx.jit, then update."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  import jaxamp.nnx  # pylint: disable=import-outside-toplevel,redefined-outer-name
  from jaxamp._src.nnx_optimizer import _as_pure as as_pure  # nnx.pure on Flax up to 0.12.6

  names = sorted(producer.params())

  class Model(nnx.Module):

    def __init__(self, params):
      for k in names:
        setattr(self, k, nnx.Param(jnp.asarray(params[k])))

    def values(self):
      return {k: getattr(self, k)[...] for k in names}

  loss = producer.loss
  tx = jaxamp.dynamic_loss_scale(ADAM(), growth_interval=1)
  model0 = Model(producer.params())
  template = (model0, jaxamp.nnx.Optimizer(model0, tx, wrt=nnx.Param))
  params0 = {k: np.asarray(producer.params()[k]) for k in names}

  def step(model, optimizer, x):
    grads = nnx.grad(lambda m: optimizer.scale_loss(loss(m.values(), x)))(model)
    optimizer.update(model, grads)
    return nnx.to_pure_dict(grads)

  jitted = nnx.jit(step)

  def run(xs, scale, eager):
    (x,) = xs
    model, optimizer = nnx.clone(template)  # a deep copy: the eager step mutates in place
    jaxamp.get_loss_scale_state(optimizer.opt_state).scale[...] = jnp.float32(scale)
    inner0 = S.to_host(S.loss_scale_state(as_pure(optimizer.opt_state)).inner_state)
    with S.mode(eager):
      grads = (step if eager else jitted)(model, optimizer, jnp.asarray(x))
    ls = S.loss_scale_state(as_pure(optimizer.opt_state))
    skipped = bool(ls.skipped)
    params1 = {k: np.asarray(v) for k, v in model.values().items()}
    steps = int(optimizer.step[...])
    return Outcome(params0, inner0, params1, S.to_host(ls.inner_state), skipped,
                   np.float32(ls.scale), [{k: np.asarray(grads[k]) for k in names}],
                   consistent=((steps == (0 if skipped else 1),
                                f"nnx Optimizer.step {steps} vs skipped={skipped}"),))

  return run


PATHS = {
    "dynamic_sgd": lambda p: _functional(lambda: jaxamp.dynamic_loss_scale(
        _sgd(), growth_interval=1), p),
    "dynamic_adam": lambda p: _functional(lambda: jaxamp.dynamic_loss_scale(
        ADAM(), growth_interval=1), p),
    "dynamic_clip_sgd": lambda p: _functional(lambda: jaxamp.dynamic_loss_scale(
        _clip(_sgd)(), growth_interval=1), p),
    "dynamic_clip_adam": lambda p: _functional(lambda: jaxamp.dynamic_loss_scale(
        _clip(ADAM)(), growth_interval=1), p),
    "static_adam": lambda p: _functional(lambda: jaxamp.static_loss_scale(ADAM(), 2.0**16), p),
    "accumulate_3": lambda p: _functional(lambda: jaxamp.accumulate_gradients(
        jaxamp.dynamic_loss_scale(ADAM(), growth_interval=1), 3), p, window=3),
    "microbatch_2": lambda p: _functional(lambda: jaxamp.dynamic_loss_scale(
        _clip(ADAM)(), growth_interval=1), p, microbatches=2),
    "torch_step": lambda p: _torch(p, variant="step"),
    "torch_unscale_step": lambda p: _torch(p, variant="unscale_step"),
    "torch_user_jit": lambda p: _torch(p, variant="user_jit"),
    "amp_update_params": _amp_update_params,
    "paddle_minimize": _paddle_minimize,
    "train_state": _train_state,
    "nnx_optimizer": _nnx_optimizer,
}
ROWS = {"accumulate_3": 3, "microbatch_2": 2}

# The default crosses the core path with every producer and each other path with three.
_OTHERS = ["gain_bias", "matmul", "conv", "float16", "bfloat16", "checkpoint", "scan",
           "custom_vjp", "nan"]


def _cases():
  cases = []
  for i, path in enumerate(PATHS):
    if S.LONG or path == "dynamic_sgd":
      producers = list(S.PRODUCERS)
    else:
      producers = ["mul"] + [_OTHERS[(2 * i + j) % len(_OTHERS)] for j in range(2)]
    cases += [(path, producer) for producer in producers]
  return cases


@functools.lru_cache(maxsize=None)
def runner(path, producer):
  return PATHS[path](S.PRODUCERS[producer])


@pytest.mark.parametrize("path,producer", _cases())
def test_compiled_step_skips_exactly_when_eager_rule_says(path, producer):
  run = runner(path, producer)
  rows = ROWS.get(path, 1)

  @S.SETTINGS
  @example(case=S.repro_case(rows))
  @given(case=S.cases(rows))
  def prop(case):
    x, scale = case
    S.run_both(run, x, scale, f"{path}/{producer}")

  prop()


# -------------------------------------------------------------------------------------------------
# Fixed cases: the repro, a window whose bad micro-step is not the last, the extreme scales.

_X = np.array([1.779, -3.37, 1.209, 1.717], np.float32)
_W = np.array([0.1, 0.2, 0.3, 0.4], np.float32)


def _repro_step(tx, s):
  def step(w, s, x):
    g = jax.grad(lambda p: jaxamp.scale_loss(jnp.sum(p * x), s))(w)
    u, s2 = tx.update(g, s, w)
    return optax.apply_updates(w, u), s2
  return step


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "jit"])
def test_repro_overflowing_multiply_is_skipped(compiled):
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**127, growth_interval=1)
  w, x = jnp.asarray(_W), jnp.asarray(_X)
  s = tx.init(w)
  step = _repro_step(tx, s)
  w2, s2 = (jax.jit(step) if compiled else step)(w, s, x)
  assert bool(jaxamp.get_loss_scale_state(s2).skipped), f"applied: params {w2!r}"
  assert float(jaxamp.loss_scale(s2)) == 2.0**126
  S.assert_bit_identical(w, w2, "params")


@pytest.mark.parametrize("bad", [0, 1, 2])
@pytest.mark.parametrize("producer", ["mul", "matmul"])
def test_accumulation_window_with_a_bad_micro_step_anywhere(bad, producer):
  x = np.tile(np.linspace(-1.0, 1.0, S.N, dtype=np.float32), (3, 1))
  x[bad, 3] = -3.37
  x[bad, 1] = 1.779
  S.run_both(runner("accumulate_3", producer), x, 2.0**127, f"accumulate_3/{producer}/bad={bad}")


@pytest.mark.parametrize("scale", [2.0**127, 2.0**126, 3e38, 1000.0, 3.0, 0.5, 2.0**-10],
                         ids=lambda s: f"{s:g}")
@pytest.mark.parametrize("path", ["dynamic_sgd", "dynamic_clip_adam", "amp_update_params"])
def test_fixed_scales_on_overflowing_and_denormal_gradients(path, scale):
  run = runner(path, "mul")
  for x in (np.array([1.779, -3.37, 1.209, 1.717, 2e38, -1.0, 0.5, 1e-40], np.float32),
            np.array([1e-40, -1e-40, 1e-39, 0.0, -0.0, 1e-45, 3e-41, 1e-38], np.float32),
            np.array([1.0, np.nan, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], np.float32)):
    S.run_both(run, x[None], scale, f"{path}/mul/fixed")


def test_amp_optim_wrapper_fused_backward_and_update_skips_the_hidden_overflow():
  """update_params differentiates and updates in one compiled call: the producer's multiply and
  the check share a program (its clip path is covered above; this one has no clip)."""
  x = jnp.asarray(np.stack([S.REPRO_ROW[:4]] * 2))
  params = {"g": jnp.array([.1, .2, .3, .4], jnp.float32)}
  wrapper = jaxamp.AmpOptimWrapper(optax.sgd(0.1, momentum=0.9), params,
                                   loss_scale=dict(init_scale=2.0**127))
  wrapper.update_params(lambda p, x: jnp.sum(p["g"] * x[0]), x)
  np.testing.assert_array_equal(np.asarray(wrapper.params["g"]).view(np.uint32),
                                np.asarray(params["g"]).view(np.uint32))
  assert wrapper.get_scale() == 2.0**126
