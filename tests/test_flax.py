"""Flax integration: jaxamp.TrainState (Linen), jaxamp.nnx.Optimizer (NNX), update_applied."""

import dataclasses
import functools
from typing import Any

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import dynamic_scale as flax_dynamic_scale
from flax.training import train_state as flax_train_state

import jaxamp
import jaxamp.nnx
from jaxamp._src.nnx_optimizer import _as_pure as as_pure  # nnx.pure on Flax up to 0.12.6
from tests._optax import adam as _adam

F16, F32 = jnp.float16, jnp.float32
MICRO_BATCH, IN, HIDDEN, CLASSES, K = 16, 8, 32, 4, 2
OVERFLOWING_SCALE = 2.0**40  # scaled float16 gradients overflow at this scale


def _data(num_micro_batches):
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (num_micro_batches, MICRO_BATCH, IN))
  labels = jnp.argmax(x @ jax.random.normal(kw, (IN, CLASSES)), axis=-1).astype(jnp.int32)
  return x, labels


def _cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(F32), labels).mean()


def _tx(init_scale=2.0**15):
  inner = optax.chain(optax.clip_by_global_norm(1.0), _adam(3e-2))
  return jaxamp.accumulate_gradients(jaxamp.dynamic_loss_scale(inner, init_scale=init_scale), K)


def _adam_count(opt_state):
  nodes = jax.tree.leaves(opt_state, is_leaf=lambda n: isinstance(n, optax.ScaleByAdamState))
  (adam,) = [n for n in nodes if isinstance(n, optax.ScaleByAdamState)]
  return int(jnp.asarray(adam.count))


# --------------------------------------------------------------------------- Linen


class LinenMLP(nn.Module):
  """Float16 compute, float32 parameters."""

  @nn.compact
  def __call__(self, x):
    x = nn.gelu(nn.Dense(HIDDEN, dtype=F16, param_dtype=F32)(x))
    return nn.Dense(CLASSES, dtype=F16, param_dtype=F32)(x)


@pytest.fixture(scope="module")
def linen_run():
  """Eight windows of two micro-batches; window 3 holds a non-finite input."""
  model = LinenMLP()
  xs, labels = _data(2 * K)
  params = model.init(jax.random.key(1), xs[0])["params"]
  state = jaxamp.TrainState.create(apply_fn=model.apply, params=params, tx=_tx())
  traces = {"n": 0}

  @functools.partial(jax.jit, donate_argnums=0)
  def train_step(state, x, y):
    traces["n"] += 1

    def loss_fn(params):
      loss = _cross_entropy(state.apply_fn({"params": params}, x), y)
      return state.scale_loss(loss), loss

    grads, loss = jax.grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), loss

  records = []
  for window in range(8):
    before = jax.device_get(state.params)
    for micro in range(K):
      i = (window * K + micro) % len(xs)
      x = xs[i].at[0, 0].set(jnp.inf) if (window, micro) == (3, 0) else xs[i]
      state, loss = train_step(state, x, labels[i])
      records.append(dict(window=window, loss=float(loss), step=int(state.step),
                          scale=float(state.loss_scale), skipped=int(state.skipped_steps),
                          updated=bool(jaxamp.get_accumulation_state(state.opt_state).updated)))
    records[-1]["params_before"] = before
    records[-1]["params_after"] = jax.device_get(state.params)
  return dict(state=state, records=records, traces=traces, model=model, xs=xs, labels=labels)


def test_linen_trains_in_float16_with_scaling_and_accumulation(linen_run):
  state = linen_run["state"]
  assert all(p.dtype == F32 for p in jax.tree.leaves(state.params))
  xs, labels, model = linen_run["xs"], linen_run["labels"], linen_run["model"]
  loss = jax.jit(lambda p: _cross_entropy(jax.vmap(lambda x: model.apply({"params": p}, x))(xs),
                                          labels))
  params0 = model.init(jax.random.key(1), xs[0])["params"]
  assert loss(state.params) < 0.6 * loss(params0)
  assert linen_run["traces"]["n"] == 1  # no recompilation


def test_linen_step_counts_only_applied_windows(linen_run):
  records = linen_run["records"]
  # Accumulation: the step advances on the closing micro-step of each window only.
  assert [r["updated"] for r in records] == [False, True] * 8
  # Window 3 overflowed: skipped, scale halved once, params untouched, step unchanged.
  assert [r["step"] for r in records] == [0, 1, 1, 2, 2, 3, 3, 3, 3, 4, 4, 5, 5, 6, 6, 7]
  assert records[7]["scale"] == 2.0**14 and records[7]["skipped"] == 1
  jax.tree.map(np.testing.assert_array_equal, records[7]["params_before"],
               records[7]["params_after"])
  assert records[5]["scale"] == 2.0**15 and records[5]["skipped"] == 0
  # The step equals the inner optimizer's own count.
  state = linen_run["state"]
  assert int(state.step) == _adam_count(state.opt_state) == 7


def test_flax_dynamic_scale_recipe_advances_step_on_a_skipped_step():
  # Flax's recipe: DynamicScale.value_and_grad, apply_gradients, then select the
  # old params and opt_state where the grads were not finite. The step advances anyway.
  params = {"w": jnp.ones(2)}
  loss_fn = lambda p: jnp.sum(p["w"].astype(F16) ** 2).astype(F32)

  @jax.jit
  def flax_step(state, dyn):
    dyn, is_fin, _, grads = dyn.value_and_grad(loss_fn)(state.params)
    new_state = state.apply_gradients(grads=grads)
    select = functools.partial(jnp.where, is_fin)
    return new_state.replace(
        params=jax.tree.map(select, new_state.params, state.params),
        opt_state=jax.tree.map(select, new_state.opt_state, state.opt_state)), is_fin

  state = flax_train_state.TrainState.create(apply_fn=None, params=params, tx=_adam(0.1))
  dyn = flax_dynamic_scale.DynamicScale(scale=jnp.float32(OVERFLOWING_SCALE),
                                        fin_steps=jnp.int32(0))
  new_state, is_fin = flax_step(state, dyn)
  assert not bool(is_fin)
  assert int(new_state.step) == 1 and _adam_count(new_state.opt_state) == 0

  # jaxamp.TrainState on the same overflow: nothing moves.
  @jax.jit
  def our_step(state):
    return state.apply_gradients(grads=jax.grad(lambda p: state.scale_loss(loss_fn(p)))(
        state.params))

  ours = our_step(jaxamp.TrainState.create(apply_fn=None, params=params, tx=jaxamp.dynamic_loss_scale(
      _adam(0.1), init_scale=OVERFLOWING_SCALE)))
  assert int(ours.step) == 0 and _adam_count(ours.opt_state) == 0
  assert int(ours.skipped_steps) == 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BatchNormState(jaxamp.TrainState):
  batch_stats: Any


class LinenBatchNormMLP(nn.Module):

  @nn.compact
  def __call__(self, x, train):
    x = nn.Dense(HIDDEN, dtype=F16, param_dtype=F32)(x)
    x = nn.BatchNorm(use_running_average=not train, dtype=F16, param_dtype=F32)(x)
    return nn.Dense(CLASSES, dtype=F16, param_dtype=F32)(nn.relu(x))


@jax.numpy_dtype_promotion("standard")  # flax's BatchNorm mixes float16 and float32
def test_subclass_with_batch_stats():
  model = LinenBatchNormMLP()
  xs, labels = _data(2)
  variables = jax.jit(functools.partial(model.init, train=False))(jax.random.key(0), xs[0])
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**8)
  state = BatchNormState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                                batch_stats=variables["batch_stats"])

  @jax.jit
  def train_step(state, x, y):
    def loss_fn(params):
      logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats}, x,
                                       train=True, mutable=["batch_stats"])
      return state.scale_loss(_cross_entropy(logits, y)), updates["batch_stats"]

    grads, batch_stats = jax.grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, batch_stats=batch_stats)

  state = train_step(state, xs[0], labels[0])
  assert isinstance(state, BatchNormState) and int(state.step) == 1
  mean = state.batch_stats["BatchNorm_0"]["mean"]
  assert mean.dtype == F32 and float(jnp.abs(mean).sum()) > 0
  names = {jax.tree_util.keystr(path[:1]) for path, _ in
           jax.tree_util.tree_leaves_with_path(state)}
  assert names == {".step", ".params", ".opt_state", ".batch_stats"}


# --------------------------------------------------------------------------- TrainState basics


def _tiny_state(tx):
  return jaxamp.TrainState.create(apply_fn=lambda p, x: x @ p["w"].astype(x.dtype),
                                  params={"w": jnp.zeros((3, 1))}, tx=tx)


def test_train_state_is_a_pytree_with_static_apply_fn_and_tx():
  state = _tiny_state(_tx())
  leaves, treedef = jax.tree.flatten(state)
  again = jax.tree.unflatten(treedef, leaves)
  assert again.apply_fn is state.apply_fn and again.tx is state.tx
  for field in ("step", "params", "opt_state"):
    jax.tree.map(np.testing.assert_array_equal, getattr(again, field), getattr(state, field))
  assert not any(callable(leaf) for leaf in leaves)
  assert state.step.dtype == jnp.int32 and state.step.shape == ()
  assert state.loss_scale.dtype == F32 and float(state.loss_scale) == 2.0**15
  with pytest.raises(dataclasses.FrozenInstanceError):
    state.step = 3


def test_train_state_under_scan_with_float16_compute():
  state = _tiny_state(_tx(init_scale=2.0**8))
  x = jnp.ones((5, 4, 3), F16)

  def body(state, x):
    loss_fn = lambda p: state.scale_loss(jnp.mean(state.apply_fn(p, x).astype(F32) - 1.0) ** 2)
    new = state.apply_gradients(grads=jax.grad(loss_fn)(state.params))
    return new, new.loss_scale

  final, scales = jax.jit(lambda s: jax.lax.scan(body, s, x))(state)
  assert jax.tree.structure(final) == jax.tree.structure(state)
  jax.tree.map(lambda a, b: np.testing.assert_equal(a.dtype, b.dtype), final, state)
  assert int(final.step) == 2 and scales.dtype == F32


def test_train_state_without_loss_scaling():
  state = _tiny_state(optax.sgd(0.1))
  assert float(state.loss_scale) == 1.0 and int(state.skipped_steps) == 0
  np.testing.assert_array_equal(state.scale_loss(jnp.float16(3.0)), jnp.float32(3.0))
  state = state.apply_gradients(grads={"w": jnp.ones((3, 1))})
  assert int(state.step) == 1
  np.testing.assert_allclose(state.params["w"], -0.1)


def test_create_rejects_what_is_not_an_optax_transformation():
  with pytest.raises(TypeError, match="tx must be an optax GradientTransformation, got"):
    jaxamp.TrainState.create(apply_fn=None, params={"w": jnp.zeros(2)}, tx=optax.sgd)


# --------------------------------------------------------------------------- update_applied


def _python_model(pattern, k, scaler):
  """Steps applied and skipped after feeding ``pattern`` (True = finite) in windows of ``k``."""
  steps = skipped = 0
  for start in range(0, len(pattern) - len(pattern) % k, k):
    if all(pattern[start:start + k]):
      steps += 1
    else:
      skipped += 1
  del scaler  # the same count whether the scaler or the accumulator drops the window
  return steps, skipped


@functools.lru_cache(maxsize=None)
def _compiled_step(k, scaler):
  inner = optax.sgd(0.1)
  if scaler:
    inner = jaxamp.dynamic_loss_scale(inner, init_scale=1.0)
  tx = jaxamp.accumulate_gradients(inner, k) if k > 1 else inner
  state = jaxamp.TrainState.create(apply_fn=None, params={"w": jnp.zeros(2)}, tx=tx)

  @jax.jit
  def step(state, finite):
    # The gradient of the scaled loss sum(w) * scale, or a nan.
    grads = {"w": jnp.where(finite, jnp.full(2, state.loss_scale), jnp.full(2, jnp.nan))}
    new = state.apply_gradients(grads=grads)
    return new, jaxamp.update_applied(state.opt_state, new.opt_state)

  return state, step


@hypothesis.settings(derandomize=True, deadline=None, max_examples=30)
@hypothesis.given(pattern=st.lists(st.booleans(), min_size=1, max_size=9),
                  k=st.sampled_from([1, 2, 3]), scaler=st.booleans())
def test_step_counts_applied_updates_for_any_pattern(pattern, k, scaler):
  hypothesis.assume(scaler or k > 1)  # plain sgd never skips
  state, step = _compiled_step(k, scaler)
  applied = []
  for finite in pattern:
    state, ok = step(state, jnp.asarray(finite))
    applied.append(bool(ok))
  expected_steps, expected_skipped = _python_model(pattern, k, scaler)
  assert int(state.step) == sum(applied) == expected_steps
  assert int(state.skipped_steps) == expected_skipped
  np.testing.assert_allclose(state.params["w"], -0.1 * expected_steps, rtol=1e-6)


def test_update_applied_with_the_scaler_outside_the_accumulator():
  params = {"w": jnp.zeros(2)}
  with pytest.warns(UserWarning, match="wraps jaxamp.accumulate_gradients"):
    tx = jaxamp.dynamic_loss_scale(jaxamp.accumulate_gradients(optax.sgd(0.1), 2))
    state = tx.init(params)

  @jax.jit
  def step(state, g):
    _, new = tx.update({"w": jnp.full(2, g)}, state, params)
    return new, jaxamp.update_applied(state, new)

  applied = []
  for g in [1.0, jnp.nan, 1.0, 1.0, 1.0]:
    state, ok = step(state, jnp.float32(g))
    applied.append(bool(ok))
  # The bad micro-step is dropped from its window, which closes one call later.
  assert applied == [False, False, True, False, True]
  assert int(jaxamp.skipped_steps(state)) == 1


def test_skipped_steps_and_update_applied_need_no_loss_scaler():
  state = optax.sgd(0.1).init({"w": jnp.zeros(2)})
  assert int(jaxamp.skipped_steps(state)) == 0
  assert bool(jaxamp.update_applied(state, state))


# --------------------------------------------------------------------------- NNX


class NNXMLP(nnx.Module):
  """Float16 compute, float32 parameters."""

  def __init__(self, rngs):
    self.hidden = nnx.Linear(IN, HIDDEN, dtype=F16, param_dtype=F32, rngs=rngs)
    self.out = nnx.Linear(HIDDEN, CLASSES, dtype=F16, param_dtype=F32, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.gelu(self.hidden(x)))


_NNX_TRACES = {"n": 0}


@nnx.jit
def _nnx_train_step(model, optimizer, x, y):
  _NNX_TRACES["n"] += 1

  def loss_fn(model):
    loss = _cross_entropy(model(x), y)
    return jaxamp.scale_loss(loss, optimizer.opt_state), loss

  (_, loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  optimizer.update(model, grads)
  return loss


def _nnx_run(optimizer_cls):
  model = NNXMLP(nnx.Rngs(1))
  optimizer = optimizer_cls(model, _tx(), wrt=nnx.Param)
  xs, labels = _data(2 * K)
  evaluate = nnx.jit(lambda model: _cross_entropy(nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(
      model, xs), labels))
  first = float(evaluate(model))
  steps = []
  for window in range(6):
    for micro in range(K):
      i = (window * K + micro) % len(xs)
      x = xs[i].at[0, 0].set(jnp.inf) if (window, micro) == (2, 1) else xs[i]
      _nnx_train_step(model, optimizer, x, labels[i])
      steps.append(int(optimizer.step[...]))
  last = float(evaluate(model))
  return model, optimizer, steps, first, last


@pytest.fixture(scope="module")
def nnx_runs():
  return {"flax": _nnx_run(nnx.Optimizer), "jaxamp": _nnx_run(jaxamp.nnx.Optimizer)}


def test_nnx_trains_in_float16_with_scaling_and_accumulation(nnx_runs):
  for name in ("flax", "jaxamp"):
    model, optimizer, _, first, last = nnx_runs[name]
    assert last < 0.7 * first, name
    assert all(p.dtype == F32 for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert float(jaxamp.loss_scale(as_pure(optimizer.opt_state))) == 2.0**14
    assert _adam_count(as_pure(optimizer.opt_state)) == 5
  assert _NNX_TRACES["n"] == 2  # one trace per optimizer class, none after
  # Same updates either way: only the counter differs.
  jax.tree.map(np.testing.assert_array_equal, nnx.state(nnx_runs["flax"][0], nnx.Param),
               nnx.state(nnx_runs["jaxamp"][0], nnx.Param))


def test_nnx_optimizer_step_counts_every_call_ours_counts_applied_updates(nnx_runs):
  assert nnx_runs["flax"][2] == list(range(1, 13))
  assert nnx_runs["jaxamp"][2] == [0, 1, 1, 2, 2, 2, 2, 3, 3, 4, 4, 5]
  optimizer = nnx_runs["jaxamp"][1]
  assert optimizer.step[...].dtype == jnp.uint32
  assert int(optimizer.skipped_steps) == 1
  assert optimizer.loss_scale.dtype == F32
  assert optimizer.scale_loss(jnp.float16(1.0)).dtype == F32
