"""jaxamp.GradScaler: PyTorch's GradScaler behaviour, errors, state dicts and training recipes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import jaxamp
from tests._tracing import trace_counts
from jaxamp._src.facade import holder, scaler_state
from jaxamp._src.facade import torch as facade

F32_TINY = float(np.finfo(np.float32).tiny)
_NOT_SCALED = ("but _scale is None.  This may indicate your script did not use "
               "scaler.scale(loss or outputs) earlier in the iteration.")


# ---------------------------------------------------------------------------------------------
# A minimal optimizer holder with the protocol GradScaler documents (OptimWrapper is tested below).


def _split_fn(fn):
  leaves, treedef = jax.tree.flatten(fn)
  arrays = [x if isinstance(x, jax.Array) else None for x in leaves]
  static = tuple(None if isinstance(x, jax.Array) else x for x in leaves)
  return arrays, treedef, static


@functools.partial(jax.jit, static_argnums=(1, 2))
def _grad(arrays, treedef, static, params, args):
  fn = jax.tree.unflatten(treedef, [a if s is None else s for a, s in zip(arrays, static)])
  return jax.grad(fn)(params, *args)


@jax.jit
def _add(a, b):
  return jax.tree.map(jnp.add, a, b)


@functools.lru_cache(maxsize=None)
def _apply_fn(tx):

  @jax.jit
  def apply(params, opt_state, grads, skip):
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes float and int32
      updates, new_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(skip, o, n), new, old)
    return keep(new_params, params), keep(new_state, opt_state)

  return apply


class Holder:
  """params / opt_state / grads, backward(loss_fn, *args), apply_gradients(grads, skip=)."""

  def __init__(self, params, tx):
    self.params = params
    self.tx = tx
    self.opt_state = tx.init(params)
    self.grads = None
    self.applied = 0

  def zero_grad(self):
    self.grads = None

  def backward(self, loss_fn, *args, has_aux=False):
    assert not has_aux
    arrays, treedef, static = _split_fn(loss_fn)
    g = _grad(arrays, treedef, static, self.params, args)
    self.grads = g if self.grads is None else _add(self.grads, g)

  def apply_gradients(self, grads=None, *, skip=None):
    grads = self.grads if grads is None else grads
    skip = jnp.zeros([], jnp.bool_) if skip is None else skip
    self.params, self.opt_state = _apply_fn(self.tx)(self.params, self.opt_state, grads, skip)
    self.applied += 1


SGD = optax.sgd(0.5)
ADAM = optax.adam(0.1)
W0 = {"w": jnp.array([1.0, -2.0, 0.5], jnp.float32)}


def _loss(params, x):
  return jnp.sum(jnp.tanh(params["w"] * x) ** 2)


def _started(**kw):
  """A scaler whose state exists (PyTorch creates it on the first scale())."""
  scaler = jaxamp.GradScaler(**kw)
  scaler.scale(jnp.ones([], jnp.float32))
  return scaler


def _set_grads(opt, scaler, values):
  """Puts ``values * scale`` (the scaled gradients of an iteration) into the holder."""
  opt.grads = {"w": jnp.asarray(values, jnp.float32) * np.float32(scaler.get_scale())}


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def _run_pattern(scaler, bad_steps, n):
  opt = Holder(W0, SGD)
  scales, trackers = [], []
  for i in range(n):
    _set_grads(opt, scaler, [np.inf, 1.0, 1.0] if i in bad_steps else [0.5, 1.0, -1.0])
    before = _bits(opt.params)
    scaler.step(opt)
    if i in bad_steps:
      assert _bits(opt.params) == before
    scaler.update()
    scales.append(scaler.get_scale())
    trackers.append(scaler._get_growth_tracker())
  return scales, trackers


# ---------------------------------------------------------------------------------------------
# Trajectories (REFERENCE section 1).


def test_reference_trajectory():
  scaler = _started(init_scale=8.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
  scales, trackers = _run_pattern(scaler, {2, 3, 7}, 12)
  assert scales == [8, 8, 4, 2, 2, 2, 4, 2, 2, 2, 4, 4]
  assert trackers == [1, 2, 0, 0, 1, 2, 0, 0, 1, 2, 0, 1]


def test_non_power_of_two_factors_round_like_float64():
  scaler = _started(init_scale=1000.0, growth_factor=1.5, backoff_factor=0.3, growth_interval=1)
  scales, _ = _run_pattern(scaler, {1, 3}, 4)
  assert scales == [1500.0, 450.0, 675.0, 202.5]


def _torch_rule(scale, tracker, found, gf, bf, gi):
  """PyTorch's _amp_update_scale_ in Python: float64 products rounded to float32 (plus the floor)."""
  if found:
    return max(float(np.float32(scale * bf)), F32_TINY), 0
  tracker += 1
  if tracker == gi:
    with np.errstate(over="ignore"):
      grown = np.float32(scale * gf)
    if np.isfinite(grown):
      scale = float(grown)
    tracker = 0
  return scale, tracker


@settings(max_examples=15, deadline=None, derandomize=True)
@given(bad=st.lists(st.booleans(), min_size=1, max_size=10), interval=st.integers(1, 3),
       growth=st.sampled_from([2.0, 1.5, 3.0]), backoff=st.sampled_from([0.5, 0.3, 0.125]),
       init=st.sampled_from([1.0, 1000.0, 2.0**120, 3e-38]))
def test_trajectory_matches_the_pytorch_rule(bad, interval, growth, backoff, init):
  scaler = _started(init_scale=init, growth_factor=growth, backoff_factor=backoff,
                    growth_interval=interval)
  scales, trackers = _run_pattern(scaler, {i for i, b in enumerate(bad) if b}, len(bad))
  scale, tracker = float(np.float32(init)), 0
  for i, b in enumerate(bad):
    scale, tracker = _torch_rule(scale, tracker, b, growth, backoff, interval)
    assert scales[i] == scale and trackers[i] == tracker


def test_scale_never_grows_to_inf_and_unscales_at_the_top():
  scaler = _started(init_scale=2.0**127, growth_interval=1)
  opt = Holder(W0, SGD)
  _set_grads(opt, scaler, [0.25, 1.0, -1.0])
  scaler.unscale_(opt)
  np.testing.assert_array_equal(opt.grads["w"], [0.25, 1.0, -1.0])  # not flushed to zero
  scaler.step(opt)
  scaler.update()
  assert scaler.get_scale() == 2.0**127 and scaler._get_growth_tracker() == 0
  np.testing.assert_array_equal(opt.params["w"], [0.875, -2.5, 1.0])


def test_scale_stops_at_the_floor():
  scaler = _started(init_scale=4 * F32_TINY)
  scales, _ = _run_pattern(scaler, set(range(4)), 4)
  assert scales == [2 * F32_TINY, F32_TINY, F32_TINY, F32_TINY]
  assert jaxamp.DEFAULT_MIN_SCALE == F32_TINY


def test_unscale_keeps_inf_and_nan():
  scaler = _started(init_scale=4.0)
  opt = Holder(W0, SGD)
  opt.grads = {"w": jnp.array([np.inf, np.nan, 8.0], jnp.float32)}
  scaler.unscale_(opt)
  g = np.asarray(opt.grads["w"])
  assert np.isposinf(g[0]) and np.isnan(g[1]) and g[2] == 2.0
  before = _bits((opt.params, opt.opt_state))
  assert scaler.step(opt) is None
  assert _bits((opt.params, opt.opt_state)) == before


def test_skipped_step_leaves_params_and_optimizer_state_bit_identical():
  scaler = _started(init_scale=2.0)
  opt = Holder(W0, ADAM)
  _set_grads(opt, scaler, [1.0, 2.0, 3.0])
  scaler.step(opt)
  scaler.update()
  before = _bits((opt.params, opt.opt_state))
  _set_grads(opt, scaler, [1.0, np.nan, 3.0])
  assert scaler.step(opt) is None
  scaler.update()
  assert _bits((opt.params, opt.opt_state)) == before
  assert int(opt.opt_state[0].count) == 1  # Adam's step count did not advance


# ---------------------------------------------------------------------------------------------
# update(new_scale)


def test_update_with_new_scale():
  scaler = _started(init_scale=8.0, growth_interval=3)
  opt = Holder(W0, SGD)
  _set_grads(opt, scaler, [1.0, 1.0, 1.0])
  scaler.step(opt)
  scaler.update()
  scaler.update(100.0)
  assert scaler.get_scale() == 100.0 and scaler._get_growth_tracker() == 1
  scaler.update(jnp.array([32.0]))
  assert scaler.get_scale() == 32.0
  scaler.update(np.float32(0.1))
  assert scaler.get_scale() == float(np.float32(0.1))
  assert isinstance(scaler.state.scale, jax.Array) and scaler.state.scale.dtype == jnp.float32
  # The stage machine was reset by update(new_scale): a new iteration may step again.
  _set_grads(opt, scaler, [1.0, 1.0, 1.0])
  scaler.step(opt)


@pytest.mark.parametrize("bad", ["x", 3, [2.0], object()])
def test_update_rejects_bad_new_scale_types(bad):
  scaler = _started()
  with pytest.raises(AttributeError, match="new_scale should be a float") as info:
    scaler.update(bad)
  assert isinstance(info.value, (TypeError, AssertionError))


def test_update_rejects_a_multi_element_array():
  scaler = _started()
  with pytest.raises(AssertionError) as info:
    scaler.update(jnp.ones(2))
  assert str(info.value) == facade._NEW_SCALE_REASON
  with pytest.raises(ValueError, match="new_scale"):
    scaler.update(-1.0)


# ---------------------------------------------------------------------------------------------
# PyTorch's exceptions and messages.


def _raises(exc, message):
  return pytest.raises(exc, match="^" + __import__("re").escape(message) + "$")


def test_stage_machine_errors():
  scaler = _started()
  opt = Holder(W0, SGD)
  _set_grads(opt, scaler, [1.0, 1.0, 1.0])
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
  # A new iteration: all stages are READY again.
  _set_grads(opt, scaler, [1.0, 1.0, 1.0])
  scaler.unscale_(opt)
  scaler.step(opt)
  scaler.update()
  with _raises(AssertionError, "No inf checks were recorded prior to update."):
    scaler.update()
  with _raises(RuntimeError, "Closure use is not currently supported if GradScaler is enabled."):
    scaler.step(opt, closure=lambda: 0.0)


def test_errors_before_the_first_scale():
  scaler = jaxamp.GradScaler()
  opt = Holder(W0, SGD)
  opt.grads = {"w": jnp.ones(3)}
  for name, call in (("unscale_", lambda: scaler.unscale_(opt)),
                     ("step", lambda: scaler.step(opt)), ("update", scaler.update)):
    with _raises(AssertionError, f"Attempted {name} " + _NOT_SCALED):
      call()


def test_step_without_gradients():
  scaler = _started()
  opt = Holder(W0, SGD)
  with _raises(AssertionError, "No inf checks were recorded for this optimizer."):
    scaler.step(opt)
  assert opt.applied == 0


def test_fp16_gradients_are_refused():
  scaler = _started()
  opt = Holder(W0, SGD)
  opt.grads = {"w": jnp.ones(3, jnp.float16)}
  with _raises(ValueError, "Attempting to unscale FP16 gradients."):
    scaler.unscale_(opt)
  with _raises(ValueError, "Attempting to unscale FP16 gradients."):
    scaler.step(opt)
  # Nothing was recorded: the stage is still READY.
  opt.grads = {"w": jnp.ones(3, jnp.bfloat16)}
  scaler.unscale_(opt)
  assert opt.grads["w"].dtype == jnp.bfloat16


def test_constructor_errors():
  with _raises(AssertionError, "The growth factor must be > 1.0."):
    jaxamp.GradScaler(growth_factor=1.0)
  with _raises(ValueError, "The backoff factor must be < 1.0."):
    jaxamp.GradScaler(backoff_factor=1.0)
  with pytest.raises(ValueError, match="growth_interval"):
    jaxamp.GradScaler(growth_interval=0)
  with pytest.raises(ValueError, match="init_scale"):
    jaxamp.GradScaler(init_scale=-1.0)
  with pytest.raises(ValueError, match="backoff_factor"):
    jaxamp.GradScaler(backoff_factor=0.0)
  with pytest.raises(TypeError, match="growth_factor"):
    jaxamp.GradScaler(growth_factor="2")
  with pytest.raises(TypeError, match="device"):
    jaxamp.GradScaler(device=0)
  # Disabled: nothing is validated (as PyTorch).
  assert not jaxamp.GradScaler(growth_factor=0.5, enabled=False).is_enabled()


def test_scale_rejects_other_types():
  scaler = jaxamp.GradScaler()
  for bad in (3.0, "loss", [jnp.ones(1), 2.0]):
    with _raises(ValueError, "outputs must be a Tensor or an iterable of Tensors"):
      scaler.scale(bad)


# ---------------------------------------------------------------------------------------------
# scale()


def test_scale_arrays_and_structures():
  scaler = jaxamp.GradScaler(init_scale=4.0)
  assert float(scaler.state.scale) == 4.0  # there from the first access, for the user's own jit
  out = scaler.scale([jnp.ones(2), (jnp.full(1, 2.0), [jnp.float32(3.0)])])
  assert isinstance(out, list) and isinstance(out[1], tuple) and isinstance(out[1][1], list)
  np.testing.assert_array_equal(out[0], [4.0, 4.0])
  assert float(out[1][1][0]) == 12.0
  lazy = scaler.scale(iter([jnp.ones(1)]))
  assert isinstance(lazy, map) and float(next(lazy)[0]) == 4.0
  assert scaler.scale(jnp.ones(3, jnp.float16)).dtype == jnp.float32
  assert scaler.scale(jnp.ones(3, jnp.bfloat16)).dtype == jnp.float32
  assert scaler.scale([]) == []


def test_scaled_loss_function_is_a_pytree_of_the_current_scale():
  scaler = jaxamp.GradScaler(init_scale=4.0)
  f = scaler.scale(_loss)
  g = scaler.scale(_loss)
  assert f == g and hash(f) == hash(g) and f != scaler.scale(lambda p, x: 0.0)
  leaves, treedef = jax.tree.flatten(f)
  assert len(leaves) == 1 and float(leaves[0]) == 4.0 and treedef == jax.tree.structure(g)
  x = jnp.array([1.0, 0.5, 2.0])
  assert float(f(W0, x)) == pytest.approx(4.0 * float(_loss(W0, x)), rel=1e-6)
  scaler.update(8.0)
  assert float(jax.tree.leaves(f)[0]) == 8.0  # read at flatten time
  assert float(f(W0, x)) == pytest.approx(8.0 * float(_loss(W0, x)), rel=1e-6)
  aux = scaler.scale(lambda p, x: (_loss(p, x), {"n": 3}), has_aux=True)
  value, extra = aux(W0, x)
  assert extra == {"n": 3} and float(value) == pytest.approx(8.0 * float(_loss(W0, x)), rel=1e-6)


def test_scaled_loss_does_not_retrace_inside_jit():
  traces = {"n": 0}

  def loss(params, x):
    traces["n"] += 1
    return _loss(params, x)

  scaler = jaxamp.GradScaler(init_scale=4.0)
  grad = jax.jit(lambda f, p, x: jax.grad(f)(p, x))
  x = jnp.array([1.0, 0.5, 2.0])
  g1 = grad(scaler.scale(loss), W0, x)
  scaler.update(16.0)
  g2 = grad(scaler.scale(loss), W0, x)
  assert traces["n"] == 1
  np.testing.assert_array_equal(g2["w"], 4.0 * g1["w"])


# ---------------------------------------------------------------------------------------------
# enabled=False


def test_disabled_scaler():
  scaler = jaxamp.GradScaler(enabled=False)
  x = jnp.ones(2)
  assert scaler.scale(x) is x and scaler.scale(_loss) is _loss
  opt = Holder(W0, SGD)
  opt.grads = {"w": jnp.array([np.inf, 1.0, 1.0])}
  scaler.unscale_(opt)
  assert scaler.step(opt) is None  # unconditional: the inf goes through
  assert opt.applied == 1 and np.isneginf(opt.params["w"][0])
  scaler.update()
  assert scaler.get_scale() == 1.0 and scaler.state_dict() == {} and not scaler.is_enabled()
  scaler.load_state_dict({})  # a no-op
  scaler.load_state_dict({"scale": 3.0})


# ---------------------------------------------------------------------------------------------
# state_dict


def test_state_dict_types_and_setters():
  scaler = jaxamp.GradScaler(init_scale=8, growth_factor=3, backoff_factor=0.25, growth_interval=4)
  sd = scaler.state_dict()
  assert sd == {"scale": 8.0, "growth_factor": 3.0, "backoff_factor": 0.25, "growth_interval": 4,
                "_growth_tracker": 0}
  assert [type(v) for v in sd.values()] == [float, float, float, int, int]
  scaler.set_growth_factor(4.0)
  scaler.set_backoff_factor(0.125)
  scaler.set_growth_interval(1)
  assert (scaler.get_growth_factor(), scaler.get_backoff_factor(),
          scaler.get_growth_interval()) == (4.0, 0.125, 1)
  scaler.scale(jnp.ones([]))
  opt = Holder(W0, SGD)
  _set_grads(opt, scaler, [1.0, 1.0, 1.0])
  scaler.step(opt)
  scaler.update()
  assert scaler.get_scale() == 32.0
  with pytest.raises(ValueError, match="growth_factor"):
    scaler.set_growth_factor(1.0)
  with pytest.raises(ValueError, match="backoff_factor"):
    scaler.set_backoff_factor(1.5)
  with pytest.raises(ValueError, match="growth_interval"):
    scaler.set_growth_interval(0)
  assert scaler.get_growth_factor() == 4.0


def test_load_state_dict_errors():
  scaler = jaxamp.GradScaler()
  with _raises(RuntimeError, "The source state dict is empty, possibly because it was saved "
               "from a disabled instance of GradScaler."):
    scaler.load_state_dict({})
  with pytest.raises(KeyError):
    scaler.load_state_dict({"scale": 2.0})


def test_state_dict_round_trip_continues_the_trajectory():
  kw = dict(init_scale=16.0, growth_interval=3)
  bad = {1, 5, 6}
  full = _started(**kw)
  scales, trackers = _run_pattern(full, bad, 10)
  first = _started(**kw)
  _run_pattern(first, bad, 5)
  saved = first.state_dict()
  # A PyTorch-format dict of plain Python values, loaded into a fresh scaler before scale().
  resumed = jaxamp.GradScaler()
  resumed.load_state_dict(dict(saved))
  assert resumed.state_dict() == saved
  resumed.scale(jnp.ones([]))
  rest, rest_trackers = _run_pattern(resumed, {b - 5 for b in bad if b >= 5}, 5)
  assert rest == scales[5:] and rest_trackers == trackers[5:]


def test_load_pytorch_checkpoint_values():
  # What torch.amp.GradScaler("cpu").state_dict() holds after some iterations.
  torch_sd = {"scale": 512.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3,
              "_growth_tracker": 2}
  scaler = _started()
  scaler.load_state_dict(torch_sd)  # after the first scale(): the state is refilled
  scales, trackers = _run_pattern(scaler, set(), 2)
  assert scales == [1024.0, 1024.0] and trackers == [0, 1]


# ---------------------------------------------------------------------------------------------
# Recipes of PyTorch's own grad-scaling tests, each against a float32 run without scaling.

X = jnp.array([0.3, -1.2, 0.8], jnp.float32)
BATCHES = [X * (1.0 + 0.25 * i) for i in range(6)]


@jax.numpy_dtype_promotion("standard")  # optax's Adam mixes float and int32
def _control(tx, batches, transform=None, skip=(), params=W0):
  state = tx.init(params)
  for i, b in enumerate(batches):
    if i in skip:
      continue
    g = jax.grad(_loss)(params, b)
    if transform is not None:
      g = transform(g)
    updates, state = tx.update(g, state, params)
    params = optax.apply_updates(params, updates)
  return params


def test_recipe_plain_loop_matches_float32_control():
  scaler = jaxamp.GradScaler(init_scale=2.0**10, growth_interval=2)
  opt = Holder(W0, ADAM)
  for b in BATCHES:
    opt.zero_grad()
    opt.backward(scaler.scale(_loss), b)
    scaler.step(opt)
    scaler.update()
  np.testing.assert_allclose(opt.params["w"], _control(ADAM, BATCHES)["w"], rtol=1e-6)
  assert scaler.get_scale() == 2.0**13


def test_recipe_clipping_after_unscale():
  clip = optax.clip_by_global_norm(0.1)
  clip_fn = lambda g: clip.update(g, clip.init(g))[0]
  scaler = jaxamp.GradScaler(init_scale=2.0**12)
  opt = Holder(W0, SGD)
  for b in BATCHES:
    opt.zero_grad()
    opt.backward(scaler.scale(_loss), b)
    scaler.unscale_(opt)
    opt.grads = clip_fn(opt.grads)  # the gradients are unscaled here
    scaler.step(opt)
    scaler.update()
  np.testing.assert_allclose(opt.params["w"], _control(SGD, BATCHES, clip_fn)["w"], rtol=1e-6)


def _inf_loss(params, x):
  return _loss(params, x) * jnp.float32(np.inf)


@pytest.mark.parametrize("poison", [None, 4])
def test_recipe_accumulation(poison):
  k = 3
  scaler = jaxamp.GradScaler(init_scale=2.0**8, growth_interval=1)
  opt = Holder(W0, SGD)
  per_micro = lambda p, x: _loss(p, x) / k
  micro = [X * (1.0 + 0.1 * i) for i in range(2 * k)]
  scales = []
  for i, b in enumerate(micro):
    opt.backward(scaler.scale(_inf_loss if i == poison else per_micro), b)
    if (i + 1) % k == 0:
      scaler.step(opt)
      scaler.update()
      opt.zero_grad()
      scales.append(scaler.get_scale())
  windows = [sum(jax.grad(_loss)(W0, b)["w"] for b in micro[j:j + k]) / k for j in (0, k)]
  expected = W0["w"] - 0.5 * windows[0]
  if poison is None:
    assert scales == [2.0**9, 2.0**10]
    p1 = {"w": expected}
    expected = expected - 0.5 * sum(jax.grad(_loss)(p1, b)["w"] for b in micro[k:]) / k
  else:  # an inf in one micro-batch skips the whole window and backs off once
    assert scales == [2.0**9, 2.0**8]
  np.testing.assert_allclose(opt.params["w"], expected, rtol=1e-6)


def test_recipe_multiple_optimizers():
  scaler = jaxamp.GradScaler(init_scale=2.0**6, growth_interval=1)
  w1 = {"w": W0["w"] * 2.0}
  a, b = Holder(W0, SGD), Holder(w1, ADAM)
  for i, x in enumerate(BATCHES[:4]):
    a.zero_grad()
    b.zero_grad()
    a.backward(scaler.scale(_inf_loss if i == 2 else _loss), x)
    b.backward(scaler.scale(_loss), x)
    scaler.unscale_(b)
    scaler.step(a)
    scaler.step(b)
    scaler.update()
    if i == 2:  # only a overflowed: a skipped, b stepped, the scale backed off once
      assert scaler.get_scale() == 2.0**7
  assert scaler.get_scale() == 2.0**8
  np.testing.assert_allclose(a.params["w"], _control(SGD, BATCHES[:4], skip={2})["w"], rtol=1e-6)
  np.testing.assert_allclose(b.params["w"], _control(ADAM, BATCHES[:4], params=w1)["w"],
                             rtol=1e-6)


def test_recipe_state_dict_before_first_scale():
  source = _started(init_scale=4.0, growth_interval=2)
  _run_pattern(source, {0}, 4)  # 2, 2, 4 (tracker 0), 4 (tracker 1)
  saved = source.state_dict()
  target = jaxamp.GradScaler(init_scale=1024.0, growth_interval=7)
  target.load_state_dict(saved)
  assert target.get_scale() == 4.0 and float(target.state.scale) == 4.0  # the loaded values
  opt = Holder(W0, SGD)
  opt.backward(target.scale(_loss), X)
  np.testing.assert_allclose(opt.grads["w"], 4.0 * jax.grad(_loss)(W0, X)["w"], rtol=1e-6)
  target.step(opt)
  target.update()
  assert target.get_scale() == 8.0 and target.get_growth_interval() == 2


# ---------------------------------------------------------------------------------------------
# With jaxamp.OptimWrapper: a 200-step loop compiles each function once.


def _optim_wrapper(params, tx, **kw):
  return jaxamp.OptimWrapper(tx, params, **kw)


def test_200_steps_with_optim_wrapper_compile_once():
  traces = {"n": 0}

  def loss(params, x):
    traces["n"] += 1
    return jnp.mean((params["w"] @ x - 1.0) ** 2)

  params = {"w": jnp.ones((4, 8), jnp.float32)}
  opt = _optim_wrapper(params, optax.sgd(1e-3))
  scaler = jaxamp.GradScaler(init_scale=2.0**20, growth_interval=5)
  xs = jnp.linspace(-1.0, 1.0, 8)
  rule = scaler._rule
  before_unscale = holder._unscale_and_check._cache_size()
  for i in range(200):
    opt.zero_grad()
    opt.backward(scaler.scale(loss), xs * (1.0 + 1e-3 * i))
    if i % 50 == 7:
      opt.grads = jax.tree.map(lambda g: g.at[0, 0].set(jnp.inf), opt.grads)
    scaler.step(opt)
    scaler.update()
  assert traces["n"] == 1
  assert set(trace_counts(opt).values()) == {1}
  assert scaler_state.update_fn(rule, scaler._stall_after)._cache_size() == 1
  assert holder._unscale_and_check._cache_size() - before_unscale <= 1
  assert scaler.get_scale() < 2.0**20 * 2.0**40  # grew, backed off, never inf
  assert np.all(np.isfinite(np.asarray(opt.params["w"])))


def test_optim_wrapper_clips_after_the_scaler_unscales():
  max_norm = 0.1

  def torch_clip(g):  # torch.nn.utils.clip_grad_norm_: coefficient max_norm / (norm + 1e-6)
    norm = jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g)))
    coef = jnp.minimum(max_norm / (norm + 1e-6), 1.0)
    return jax.tree.map(lambda x: x * coef, g)

  opt = _optim_wrapper(W0, SGD, clip_grad=dict(max_norm=max_norm))
  scaler = jaxamp.GradScaler(init_scale=2.0**12, growth_interval=2)
  for i, b in enumerate(BATCHES):
    opt.zero_grad()
    opt.backward(scaler.scale(_inf_loss if i == 3 else _loss), b)
    if i % 2:
      scaler.unscale_(opt)  # explicit or implicit: the wrapper clips unscaled gradients
    scaler.step(opt)
    scaler.update()
  control = _control(SGD, BATCHES, torch_clip, skip={3})
  np.testing.assert_allclose(opt.params["w"], control["w"], rtol=1e-6)
  assert scaler.get_scale() == 2.0**13  # grew at 1, backed off at 3, grew at 5


def _forbid_host_reads(monkeypatch):
  """Makes every read of a device array's value on the host (float(), bool(), np.asarray) fail."""
  from jax._src import array as array_lib

  def fail(self):
    raise AssertionError("host sync")

  monkeypatch.setattr(array_lib.ArrayImpl, "_value", property(fail))


def test_the_loop_never_reads_device_values(monkeypatch):
  opt = _optim_wrapper(W0, optax.sgd(0.1, momentum=0.9))
  scaler = jaxamp.GradScaler(init_scale=2.0**8, growth_interval=1)
  opt.backward(scaler.scale(_loss), X)  # compile outside the check
  scaler.step(opt)
  scaler.update()
  _forbid_host_reads(monkeypatch)
  for i, b in enumerate(BATCHES):
    opt.zero_grad()
    opt.backward(scaler.scale(_inf_loss if i == 2 else _loss), b)
    if i % 2:
      scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update(jnp.float32(64.0) if i == 4 else None)
  with pytest.raises(AssertionError, match="host sync"):
    scaler.get_scale()  # an API that returns a Python value does sync


# ---------------------------------------------------------------------------------------------
# Against torch.amp.GradScaler itself, when PyTorch is installed (the 'reference' extra).


def _outcome(call):
  try:
    call()
    return "ok", ""
  except Exception as e:  # noqa: BLE001 - comparing exception types is the point
    return type(e).__name__, str(e)


@pytest.mark.parametrize("seed", range(6))
def test_random_call_sequences_match_pytorch(seed):
  from tests.reference._refs import import_reference
  torch = import_reference("torch")
  rng = np.random.default_rng(seed)
  kw = dict(init_scale=float(rng.choice([1.0, 1000.0, 2.0**100])),
            growth_factor=float(rng.choice([2.0, 1.5])), backoff_factor=float(rng.choice([0.5, 0.3])),
            growth_interval=int(rng.integers(1, 4)))
  ts, js = torch.amp.GradScaler("cpu", **kw), jaxamp.GradScaler(**kw)
  t_params = [torch.nn.Parameter(torch.tensor(np.asarray(W0["w"]))) for _ in range(2)]
  t_opts = [torch.optim.SGD([p], lr=0.25) for p in t_params]
  j_opts = [Holder(W0, optax.sgd(0.25)) for _ in range(2)]
  for _ in range(40):
    op, k = rng.choice(["scale", "grad", "grad", "unscale", "step", "step", "update", "update",
                        "new_scale"]), int(rng.integers(2))
    if op == "grad":
      g = rng.choice([0.5, -1.0, 2.0, np.inf, np.nan, 1e30], 3).astype(np.float32)
      with np.errstate(over="ignore", invalid="ignore"):
        g = g * np.float32(ts.get_scale())
      t_params[k].grad = torch.tensor(g)
      j_opts[k].grads = {"w": jnp.asarray(g)}
      continue
    calls = {
        "scale": (lambda: ts.scale(torch.ones(())), lambda: js.scale(jnp.ones([]))),
        "unscale": (lambda: ts.unscale_(t_opts[k]), lambda: js.unscale_(j_opts[k])),
        "step": (lambda: ts.step(t_opts[k]), lambda: js.step(j_opts[k])),
        "update": (ts.update, js.update),
        "new_scale": (lambda: ts.update(16.0), lambda: js.update(16.0)),
    }[op]
    assert _outcome(calls[0]) == _outcome(calls[1]), op
    for tp, jo in zip(t_params, j_opts):
      np.testing.assert_array_equal(tp.detach().numpy(), jo.params["w"])
    assert ts.state_dict() == js.state_dict()


# ---------------------------------------------------------------------------------------------
# step() without unscale_(): one fused call (apply_scaled_gradients), bit-identical to two.


def _scaler_loop(opt, codes, unscale_first):
  """Steps ``opt`` with a GradScaler through :func:`_poisoned_loss` codes; yields the scaler."""
  scaler = jaxamp.GradScaler(init_scale=2.0**4, growth_interval=2)
  x = jnp.asarray([0.5, 1.0, 2.0], jnp.float32)
  for code in codes:
    opt.zero_grad()
    opt.backward(scaler.scale(_poisoned_loss), x, jnp.int32(code))
    if unscale_first:
      scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    yield scaler


@pytest.mark.parametrize("clip_grad", [None, {"max_norm": 0.5}])
def test_fused_step_equals_unscale_then_step(clip_grad):
  """The same decisions and scales, skipped steps bit for bit; applied steps up to the last
  bit (in one jitted program XLA may round the unscale together with the update)."""
  codes = [0, 1, 0, 0, 2, 0, 1, 1, 0, 0, 0]
  with jax.numpy_dtype_promotion("standard"):  # optax.adam promotes an int32 count
    fused, two_calls = (_adam_loop(unscale_first, clip_grad, codes)
                        for unscale_first in (False, True))
  for i, code in enumerate(codes):
    f, t = fused[i], two_calls[i]
    assert f["scale"] == t["scale"]
    for key in ("grads", "params", "mu"):
      np.testing.assert_allclose(f[key], t[key], rtol=1e-5, atol=1e-6)
    if code and i:  # skipped: nothing moved
      assert _bits(f["params"]) == _bits(fused[i - 1]["params"])


def _adam_loop(unscale_first, clip_grad, codes):
  opt = jaxamp.OptimWrapper(optax.adam(0.1), jax.tree.map(jnp.copy, W0), clip_grad=clip_grad)
  # After step the holder's gradients read unscaled, as PyTorch's .grad.
  trajectory = [{"params": np.array(opt.params["w"]), "mu": np.array(opt.opt_state[0].mu["w"]),
                 "grads": np.array(opt.grads["w"]), "scale": scaler.get_scale()}
                for scaler in _scaler_loop(opt, codes, unscale_first)]
  assert ("apply_scaled" in trace_counts(opt)) is not unscale_first
  return trajectory


def test_gradients_accumulated_after_a_fused_step_add_to_the_unscaled_ones():
  x = jnp.asarray([0.5, 1.0, 2.0], jnp.float32)
  opt = jaxamp.OptimWrapper(optax.sgd(0.1), jax.tree.map(jnp.copy, W0))
  scaler = jaxamp.GradScaler(init_scale=2.0**4)
  opt.backward(scaler.scale(_poisoned_loss), x, jnp.int32(0))
  scaled = opt.grads
  scaler.step(opt)
  opt.backward(scaler.scale(_poisoned_loss), x, jnp.int32(0))  # no zero_grad: PyTorch adds
  want = jax.tree.map(lambda s, n: s / 16.0 + n, scaled, _grad_of(opt.params, x, 16.0))
  np.testing.assert_allclose(opt.grads["w"], want["w"], rtol=1e-6)


def _grad_of(params, x, scale):
  return jax.grad(lambda p: _poisoned_loss(p, x, jnp.int32(0)) * scale)(params)


# ---------------------------------------------------------------------------------------------
# A donating holder (OptimWrapper(donate=True)): same trajectory, gradients unscaled in place.


def _poisoned_loss(params, x, code):
  poison = jnp.where(code == 2, jnp.float32(jnp.nan),
                     jnp.where(code == 1, jnp.float32(jnp.inf), jnp.float32(1.0)))
  return jnp.sum(jnp.tanh(params["w"] * x) ** 2) * poison


def _torch_loop(donate, codes, clip):
  opt = jaxamp.OptimWrapper(optax.sgd(0.1, momentum=0.9), jax.tree.map(jnp.copy, W0), donate=donate)
  out = [(_bits(opt.params), _bits(opt.opt_state), scaler.get_scale())
         for scaler in _scaler_loop(opt, codes, clip)]
  return out, opt


@pytest.mark.parametrize("clip", [False, True])
def test_donating_holder_is_bit_identical(clip):
  codes = [0, 1, 0, 0, 2, 0, 1, 1, 0, 0]
  plain, _ = _torch_loop(False, codes, clip)
  donated, _ = _torch_loop(True, codes, clip)
  assert plain == donated


def test_donating_holder_compiles_once_and_invalidates_held_arrays():
  opt = jaxamp.OptimWrapper(optax.sgd(0.1, momentum=0.9), jax.tree.map(jnp.copy, W0), donate=True)
  scaler = jaxamp.GradScaler(init_scale=2.0**4, growth_interval=3)
  x = jnp.asarray([0.5, 1.0, 2.0], jnp.float32)
  for i in range(100):
    opt.zero_grad()
    opt.backward(scaler.scale(_poisoned_loss), x, jnp.int32(int(i % 9 == 4)))
    scaler.step(opt)
    scaler.update()
  counts = dict(trace_counts(opt))
  assert counts and all(v == 1 for v in counts.values()), counts
  held, saved = opt.params, opt.state_dict()
  opt.zero_grad()
  scaled = opt.backward(scaler.scale(_poisoned_loss), x, jnp.int32(0))
  grads, scale = opt.grads, np.float32(scaler.get_scale())
  unscaled = grads["w"] / scale  # on the device: a host read would pin the buffer
  scaler.step(opt)
  scaler.update()
  with pytest.raises(RuntimeError, match="deleted"):  # params stepped in place
    np.asarray(held["w"])
  # The one-call step unscales the gradients in place, as unscale_ does.
  assert grads["w"].is_deleted()
  np.testing.assert_array_equal(opt.grads["w"], unscaled)
  np.asarray(scaled)
  for leaf in jax.tree.leaves(saved["state"]):
    np.asarray(leaf)
  assert np.all(np.isfinite(np.asarray(opt.params["w"])))
  opt.zero_grad()
  opt.backward(scaler.scale(_poisoned_loss), x, jnp.int32(0))
  grads = opt.grads
  scaler.unscale_(opt)  # unscaled in place
  with pytest.raises(RuntimeError, match="deleted"):
    np.asarray(grads["w"])
  scaler.step(opt)
