"""The skip decision holds inside compiled steps that compute their own gradients.

Every public path runs a step whose gradients come from a producer (tests/_soundness.py) inside
the same compiled program, on data hypothesis chooses; each step is checked against the eager
rule: skipped exactly when an unscaled gradient is inf or nan, nothing changed when skipped, no
non-finite parameter written, the same scale as the step run without ``jit``. Run the long profile
with ``JAXAMP_SOUNDNESS=long``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import example, given, settings

import jaxamp
from tests import _soundness as S

settings.load_profile(S.PROFILE)
SCALE0 = 2.0**16


def _sgd():
  return optax.sgd(0.1, momentum=0.9)


def _functional(make_tx, producer, micro_steps=1):
  """A path of the functional core: (run(params, state, x, scale) -> checks' inputs)."""
  tx = make_tx()
  loss = S.PRODUCERS[producer]

  def step(params, state, xs):
    grads = []
    for x in xs:  # micro-steps (accumulation): the first may be bad, the last is not
      g = jax.grad(lambda p: jaxamp.scale_loss(loss(p, x), state))(params)
      updates, state = tx.update(g, state, params)
      params = optax.apply_updates(params, updates)
      grads.append(g)
    return params, state, grads

  compiled = jax.jit(step)
  params = S.params0()
  base = tx.init(params)

  def run(x, scale):
    xs = [x] + [jnp.ones_like(x)] * (micro_steps - 1)
    state = jaxamp.set_loss_scale(base, scale)
    new_params, new_state, grads = compiled(params, state, xs)
    with jax.disable_jit():
      _, eager_state, eager_grads = step(params, state, xs)
    ls, eager_ls = jaxamp.get_loss_scale_state(new_state), jaxamp.get_loss_scale_state(eager_state)
    if micro_steps > 1:  # the scaler checks the window's mean
      grads, eager_grads = [_window_mean(grads)], [_window_mean(eager_grads)]
    S.check_step((params, jaxamp.get_loss_scale_state(state).inner_state),
                 (new_params, ls.inner_state), grads[-1], bool(ls.skipped), ls.scale,
                 (bool(eager_ls.skipped), eager_ls.scale, eager_grads[-1]), scale)

  return run


def _window_sum(micro_grads):
  """The sum of a window's gradients, added in float32 as the accumulators add them."""
  with np.errstate(over="ignore", invalid="ignore"):
    return jax.tree.map(lambda *g: sum(np.asarray(x, np.float32) for x in g), *micro_grads)


def _window_mean(micro_grads):
  """The mean of a window's gradients (accumulate_gradients' default)."""
  return jax.tree.map(lambda g: g / np.float32(len(micro_grads)), _window_sum(micro_grads))


PATHS = {
    "dynamic": lambda: jaxamp.dynamic_loss_scale(_sgd(), init_scale=SCALE0),
    "dynamic_clip": lambda: jaxamp.dynamic_loss_scale(
        optax.chain(optax.clip_by_global_norm(1.0), _sgd()), init_scale=SCALE0),
    "static": lambda: jaxamp.static_loss_scale(_sgd(), SCALE0),
}
CASES = [(path, producer) for path in PATHS for producer in S.PRODUCERS
         if path == "dynamic" or producer in ("multiply", "gain_bias", "matmul", "nan")]


@pytest.mark.parametrize("path,producer", CASES)
def test_functional_paths(path, producer):
  run = _functional(PATHS[path], producer)

  @given(S.data())
  @example(S.HIDDEN_OVERFLOW)
  def check(case):
    run(*case)

  check()


@pytest.mark.parametrize("producer", ["multiply", "gain_bias", "nan"])
def test_accumulation_around_a_scaler(producer):
  run = _functional(lambda: jaxamp.accumulate_gradients(
      jaxamp.dynamic_loss_scale(_sgd(), init_scale=SCALE0), 2), producer, micro_steps=2)

  @given(S.data())
  @example(S.HIDDEN_OVERFLOW)
  def check(case):
    run(*case)

  check()


def test_the_reported_defect_skips_under_jit():
  x = jnp.array([1.779, -3.37, 1.209, 1.717], jnp.float32)
  w = jnp.array([.1, .2, .3, .4], jnp.float32)
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**127, growth_interval=1)
  s = tx.init(w)

  def step(w, s, x):
    g = jax.grad(lambda p: jaxamp.scale_loss(jnp.sum(p * x), s))(w)
    u, s2 = tx.update(g, s, w)
    return optax.apply_updates(w, u), s2

  for fn in (step, jax.jit(step)):
    new_w, new_s = fn(w, s, x)
    np.testing.assert_array_equal(np.asarray(new_w).view(np.uint32), np.asarray(w).view(np.uint32))
    assert bool(new_s.skipped) and float(new_s.scale) == 2.0**126


@pytest.mark.parametrize("producer", ["multiply", "matmul", "nan"])
def test_microbatch_value_and_grad(producer):
  tx = jaxamp.dynamic_loss_scale(_sgd(), init_scale=SCALE0)
  loss = S.PRODUCERS[producer]
  fn = jaxamp.microbatch_value_and_grad(lambda p, batch: loss(p, batch["x"][0]), 2)

  def step(params, state, x):
    batch = {"x": jnp.stack([x, jnp.ones_like(x)])}  # micro-batch 0 may be bad
    _, grads = fn(params, batch, loss_scale=state)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, grads

  compiled, params, base = jax.jit(step), S.params0(), tx.init(S.params0())

  @given(S.data())
  @example(S.HIDDEN_OVERFLOW)
  def check(case):
    x, scale = case
    state = jaxamp.set_loss_scale(base, scale)
    new_params, new_state, grads = compiled(params, state, x)
    with jax.disable_jit():
      _, eager_state, eager_grads = step(params, state, x)
    S.check_step((params, state.inner_state), (new_params, new_state.inner_state), grads,
                 bool(new_state.skipped), new_state.scale,
                 (bool(eager_state.skipped), eager_state.scale, eager_grads), scale)

  check()


@pytest.mark.parametrize("producer", ["multiply", "matmul"])
def test_train_state(producer):
  loss = S.PRODUCERS[producer]
  tx = jaxamp.dynamic_loss_scale(_sgd(), init_scale=SCALE0)
  base = jaxamp.TrainState.create(apply_fn=None, params=S.params0(), tx=tx)

  def step(state, x):
    grads = jax.grad(lambda p: state.scale_loss(loss(p, x)))(state.params)
    return state.apply_gradients(grads=grads), grads

  compiled = jax.jit(step)

  @given(S.data())
  @example(S.HIDDEN_OVERFLOW)
  def check(case):
    x, scale = case
    state = base.replace(opt_state=jaxamp.set_loss_scale(base.opt_state, scale))
    new, grads = compiled(state, x)
    with jax.disable_jit():
      eager, eager_grads = step(state, x)
    ls, els = (jaxamp.get_loss_scale_state(s.opt_state) for s in (new, eager))
    S.check_step((state.params, state.opt_state.inner_state), (new.params, ls.inner_state), grads,
                 bool(ls.skipped), ls.scale, (bool(els.skipped), els.scale, eager_grads), scale)

  check()


def test_nnx_optimizer():
  nnx = pytest.importorskip("flax.nnx")
  import jaxamp.nnx as jnnx

  class Model(nnx.Module):
    def __init__(self):
      p = S.params0()
      self.g, self.w = nnx.Param(p["g"]), nnx.Param(p["w"])

    def __call__(self, x):
      return jnp.sum((x @ self.w[...]) * x) + jnp.sum(self.g[...] * x[0])

  def make():
    model = Model()
    return model, jnnx.Optimizer(model, jaxamp.dynamic_loss_scale(_sgd(), init_scale=SCALE0),
                                 wrt=nnx.Param)

  def step(model, optimizer, x):
    grads = nnx.grad(lambda m: optimizer.scale_loss(m(x)))(model)
    optimizer.update(model, grads)
    return grads

  compiled = nnx.jit(step)

  @given(S.data())
  @example(S.HIDDEN_OVERFLOW)
  def check(case):
    x, scale = case
    runs = []
    for run_step in (compiled, step):
      model, optimizer = make()
      optimizer.opt_state.scale[...] = jnp.float32(scale)  # the chosen scale
      before = (nnx.state(model, nnx.Param), nnx.as_pure(optimizer.opt_state).inner_state)
      if run_step is step:
        with jax.disable_jit():
          grads = run_step(model, optimizer, x)
      else:
        grads = run_step(model, optimizer, x)
      ls = jaxamp.get_loss_scale_state(nnx.as_pure(optimizer.opt_state))
      runs.append((before, (nnx.state(model, nnx.Param), ls.inner_state), grads, ls))
    (before, after, grads, ls), (_, _, eager_grads, els) = runs
    S.check_step(before, after, grads, bool(ls.skipped), ls.scale,
                 (bool(els.skipped), els.scale, eager_grads), scale)

  check()


# ------------------------------------------------------------------------------- the facades


def _scaled_grads(loss, params, x, scale):
  return jax.grad(lambda p: loss(p, x) * jnp.float32(scale))(params)


def _facade_run(make, loss, steps_per_check=1):
  """Runs ``make()``'s loop compiled and eagerly on the same data; checks every example."""
  compiled_run, eager_run = make(), make()
  proxy = jax.jit(_scaled_grads, static_argnums=0)

  @given(S.data())
  @example(S.HIDDEN_OVERFLOW)
  def check(case):
    x, scale = case
    results = []
    for run, eager in ((compiled_run, False), (eager_run, True)):
      if eager:
        with jax.disable_jit():
          results.append(run(x, scale))
      else:
        results.append(run(x, scale))
    (before, after, grads, skipped, new_scale), (_, _, eager_grads, e_skipped, e_scale) = results
    if grads is None:  # the gradients stay inside the fused step: judge by a compiled twin
      grads = proxy(loss, before[0], x, scale)
      if S.unscaled_finite(grads, scale) != S.unscaled_finite(eager_grads, scale):
        return  # the two programs rounded differently at the edge: no reference decision
    S.check_step(before, after, grads, skipped, new_scale, (e_skipped, e_scale, eager_grads), scale)

  check()


def _torch_loop(loss, one_call):
  def make():
    opt = jaxamp.OptimWrapper(_sgd(), S.params0())
    scaler = jaxamp.GradScaler(init_scale=SCALE0, on_stall="ignore")

    def run(x, scale):
      scaler.update(float(np.float32(scale)))  # the chosen scale
      opt.zero_grad()
      opt.backward(scaler.scale(loss), x)
      grads = opt.grads
      before = (opt.params, opt.opt_state)
      if not one_call:
        scaler.unscale_(opt)
      scaler.step(opt)
      scaler.update()
      metrics = jaxamp.step_metrics(scaler)
      return (before, (opt.params, opt.opt_state), grads, bool(metrics["skipped"]),
              float(metrics["loss_scale"]))

    scaler.scale(jnp.float32(1.0))  # creates the state, as PyTorch's first scale() does
    return run

  return make


@pytest.mark.parametrize("one_call", [False, True], ids=["unscale_step", "one_call_step"])
def test_grad_scaler_with_optim_wrapper(one_call):
  _facade_run(_torch_loop(S.PRODUCERS["multiply"], one_call), S.PRODUCERS["multiply"])


@pytest.mark.parametrize("counts", [1, 2])
def test_amp_optim_wrapper_update_params(counts):
  loss = S.PRODUCERS["multiply"]  # backward and update in one compiled call
  divided = lambda p, x: loss(p, x) / counts

  def make():
    wrapper = jaxamp.AmpOptimWrapper(_sgd(), S.params0(), accumulative_counts=counts,
                                     on_stall="ignore")

    def run(x, scale):
      wrapper._state = jaxamp.set_loss_scale(wrapper._state, float(np.float32(scale)))
      before = (wrapper.params, wrapper.opt_state)
      for micro in [x] + [jnp.ones_like(x)] * (counts - 1):  # a bad micro-step is not the last
        wrapper.update_params(loss, micro)
      metrics = jaxamp.step_metrics(wrapper)
      # mmengine divides each micro-batch's loss by the count and sums the gradients.
      grads = None if counts == 1 else _window_sum(
          [_scaled_grads(divided, before[0], m, scale) for m in [x] + [jnp.ones_like(x)] * (counts - 1)])
      return (before, (wrapper.params, wrapper.opt_state), grads, bool(metrics["skipped"]),
              float(metrics["loss_scale"]))

    return run

  _facade_run(make, divided)


def test_paddle_grad_scaler_minimize():
  loss = S.PRODUCERS["matmul"]

  def make():
    opt = jaxamp.OptimWrapper(_sgd(), S.params0())
    scaler = jaxamp.paddle.GradScaler(init_loss_scaling=SCALE0, on_stall="ignore")

    def run(x, scale):
      scaler.set_init_loss_scaling(float(np.float32(scale)))
      opt.backward(scaler.scale(loss), x)
      grads = opt.grads
      before = (opt.params, opt.opt_state)
      scaler.minimize(opt)
      opt.zero_grad()
      metrics = jaxamp.step_metrics(scaler)
      return (before, (opt.params, opt.opt_state), grads, bool(metrics["skipped"]),
              float(metrics["loss_scale"]))

    return run

  _facade_run(make, loss)
