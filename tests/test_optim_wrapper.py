"""jaxamp.OptimWrapper / OptimWrapperDict: mmengine's counting, clipping, state dicts, no retracing."""

import contextlib
import copy
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import jaxamp
from tests._tracing import trace_counts

X = jnp.array([3.0, 4.0], jnp.float32)


def loss_fn(params, x):
  return jnp.sum(params["w"] * x)


def bad_loss(params, x, bad):
  return jnp.sum(params["w"] * x) * jnp.where(bad, jnp.float32(jnp.inf), jnp.float32(1.0))


def w_params(value=(1.0, 1.0)):
  return {"w": jnp.asarray(value, jnp.float32)}


# -------------------------------------------------------------------------------------------------
# Counting: a pure-Python model of mmengine's OptimWrapper.
# -------------------------------------------------------------------------------------------------


def mmengine_counting(acc, init, max_counts, calls):
  """(loss factor, updated after the call) per call, as mmengine computes them."""
  inner, remainder = init, (max_counts % acc if max_counts != -1 else -1)
  out = []
  for _ in range(calls):
    if acc == 1:
      factor = 1
    elif max_counts == -1:
      factor = acc
    else:
      factor = acc if inner < max_counts - remainder else remainder
    inner += 1
    out.append((factor, inner % acc == 0 or inner == max_counts))
  return out


def run_counting(acc, init, max_counts, calls):
  wrapper = jaxamp.OptimWrapper(optax.sgd(1.0), w_params(), accumulative_counts=acc)
  if max_counts != -1:
    ctx = pytest.warns(UserWarning, match="not divisible") if init % acc else contextlib.nullcontext()
    with ctx:
      wrapper.initialize_count_status(None, init, max_counts)
  out = []
  for _ in range(calls):
    factor = 1.0 / float(wrapper.scale_loss(jnp.float32(1.0)))
    before = np.asarray(wrapper.params["w"])
    wrapper.update_params(loss_fn, X)
    updated = not np.array_equal(before, np.asarray(wrapper.params["w"]))
    assert updated == wrapper.should_update()
    assert (wrapper.grads is None) == updated
    out.append((round(factor), updated))
  return wrapper, out


@pytest.mark.parametrize("acc,init,max_counts,factors,updates", [
    (3, 0, 10, [3] * 9 + [1], [3, 6, 9, 10]),
    (4, 0, 10, [4] * 8 + [2, 2], [4, 8, 10]),
    (3, 4, 10, [3, 3, 3, 3, 3, 1], [6, 9, 10]),
    (4, 0, 3, [3, 3, 3], [3]),
])
def test_reference_counting_table(acc, init, max_counts, factors, updates):
  wrapper, out = run_counting(acc, init, max_counts, max_counts - init)
  assert [f for f, _ in out] == factors
  assert [init + i + 1 for i, (_, u) in enumerate(out) if u] == updates
  assert wrapper.inner_count == max_counts


def test_window_gradients_are_the_mean():
  # acc 4, max 10: the last window has 2 calls, each divided by 2, so every step uses the mean.
  wrapper, _ = run_counting(4, 0, 10, 10)
  np.testing.assert_allclose(wrapper.params["w"], 1.0 - 3 * np.asarray(X), rtol=1e-6)


def test_past_max_counts_is_a_clear_error():
  wrapper = jaxamp.OptimWrapper(optax.sgd(1.0), w_params(), accumulative_counts=3)
  wrapper.initialize_count_status(None, 0, 9)
  for _ in range(9):
    wrapper.update_params(loss_fn, X)
  params, count = wrapper.params, wrapper.inner_count
  with pytest.raises(AssertionError, match="past max_counts"):
    wrapper.update_params(loss_fn, X)
  with pytest.raises(RuntimeError, match="max_counts=9"):
    wrapper.scale_loss(jnp.float32(1.0))
  assert wrapper.params is params and wrapper.inner_count == count


@settings(max_examples=12, deadline=None, derandomize=True)
@given(acc=st.integers(1, 4), init=st.integers(0, 6), extra=st.integers(0, 7))
def test_counting_matches_model(acc, init, extra):
  max_counts = init + extra
  _, out = run_counting(acc, init, max_counts, extra)
  assert out == mmengine_counting(acc, init, max_counts, extra)


def test_counting_without_initialize():
  _, out = run_counting(3, 0, -1, 7)
  assert out == mmengine_counting(3, 0, -1, 7)


def test_should_sync_and_optim_context_no_sync():
  class Model:
    def __init__(self):
      self.entered = 0

    @contextlib.contextmanager
    def no_sync(self):
      self.entered += 1
      yield

  wrapper = jaxamp.OptimWrapper(optax.sgd(0.1), w_params(), accumulative_counts=2)
  model = Model()
  syncs = []
  for _ in range(4):
    syncs.append(wrapper.should_sync())
    with wrapper.optim_context(model) as cast:
      assert cast(X) is X
    wrapper.update_params(loss_fn, X)
  assert syncs == [False, True, False, True]
  assert model.entered == 2
  with wrapper.optim_context() as cast:  # model may be None
    pass


def test_batchnorm_warning():
  wrapper = jaxamp.OptimWrapper(optax.sgd(0.1), w_params(), accumulative_counts=2)
  model = {"BatchNorm_0": {"scale": jnp.ones(2)}}
  with pytest.warns(UserWarning, match="BatchNorm"):
    wrapper.initialize_count_status(model, 0, 4)


def _nnx_model_with_batch_norm():
  from flax import nnx

  class Model(nnx.Module):

    def __init__(self):
      self.bn = nnx.BatchNorm(2, rngs=nnx.Rngs(0))  # named 'bn': found by its type

  return Model()


def _equinox_model_with_batch_norm():
  import equinox as eqx
  return eqx.nn.Sequential([eqx.nn.Linear(2, 2, key=jax.random.key(0)),
                            eqx.nn.BatchNorm(2, axis_name="batch", mode="batch")])


class BatchNorm2d:
  """A BatchNorm layer that is no pytree (a framework jax does not know)."""


# How each library's models show their BatchNorm layers: by type (nnx, equinox, an unknown
# object), Flax linen's 'batch_stats' collection (layer named 'bn'), Haiku's 'batch_norm'
# module names, and linen's default 'BatchNorm_0' names.
BATCH_NORM_MODELS = {
    "nnx": _nnx_model_with_batch_norm,
    "equinox": _equinox_model_with_batch_norm,
    "object": lambda: [BatchNorm2d()],
    "linen_batch_stats": lambda: {"params": {"bn": {"scale": jnp.ones(2)}},
                                  "batch_stats": {"bn": {"mean": jnp.zeros(2)}}},
    "haiku": lambda: {"mlp/~/batch_norm": {"scale": jnp.ones(2)}},
    "linen_params": lambda: {"BatchNorm_0": {"scale": jnp.ones(2)}},
}


@pytest.mark.parametrize("name", sorted(BATCH_NORM_MODELS))
def test_batchnorm_warning_finds_the_layers_of_each_library_and_only_when_accumulating(name):
  model = BATCH_NORM_MODELS[name]()
  wrapper = jaxamp.OptimWrapper(optax.sgd(0.1), w_params(), accumulative_counts=2)
  with pytest.warns(UserWarning, match="Gradient accumulative may slightly decrease performance"):
    wrapper.initialize_count_status(model, 0, 4)
  # As mmengine: without accumulation there is nothing to warn about (filterwarnings=error).
  jaxamp.OptimWrapper(optax.sgd(0.1), w_params()).initialize_count_status(model, 0, 4)


def test_no_batchnorm_warning_for_models_without_batch_norm_or_that_jax_cannot_flatten():
  wrapper = jaxamp.OptimWrapper(optax.sgd(0.1), w_params(), accumulative_counts=2)
  models = [None, {"backbone": {"norm": {"scale": jnp.ones(2)}}, "batch": jnp.ones(2)},
            {"w": jnp.ones(2), 0: jnp.ones(2)}]  # mixed keys: jax cannot sort them
  for model in models:  # no warning (filterwarnings=error), and the counts are set
    wrapper.initialize_count_status(model, 0, 5)
    assert wrapper._max_counts == 5 and wrapper.inner_count == 0  # mmengine's attribute


def test_bad_accumulative_counts():
  with pytest.raises(AssertionError, match="at least greater than or equal to 1"):
    jaxamp.OptimWrapper(optax.sgd(0.1), w_params(), accumulative_counts=0)
  with pytest.raises(TypeError):
    jaxamp.OptimWrapper(optax.sgd(0.1), w_params(), accumulative_counts=1.5)
  with pytest.raises(TypeError, match="optax"):
    jaxamp.OptimWrapper(object(), w_params())
  with pytest.raises(TypeError, match="floating"):
    jaxamp.OptimWrapper(optax.sgd(0.1), {"w": jnp.ones(2, jnp.int32)})


# -------------------------------------------------------------------------------------------------
# backward: the loss function as a pytree, no retracing, no host sync.
# -------------------------------------------------------------------------------------------------


class ScaledFn:
  """A pytree callable whose child is an array (like GradScaler.scale(fn))."""

  def __init__(self, fn, scale):
    self.fn, self.scale = fn, scale

  def __call__(self, *args, **kwargs):
    return self.fn(*args, **kwargs) * self.scale

  def __eq__(self, other):
    return type(other) is ScaledFn and self.fn is other.fn

  def __hash__(self):
    return hash(self.fn)


jax.tree_util.register_pytree_node(ScaledFn, lambda f: ((f.scale,), f.fn),
                                   lambda fn, ch: ScaledFn(fn, ch[0]))


def test_backward_traces_once_for_pytree_callables_and_static_leaves():
  calls = []

  def counted(params, x, *, power):
    calls.append(power)
    return jnp.sum(params["w"] * x) ** power

  wrapper = jaxamp.OptimWrapper(optax.sgd(0.1), w_params())
  for i in range(5):
    loss = wrapper.backward(ScaledFn(counted, jnp.float32(i)), X + i, power=1)
    assert isinstance(loss, jax.Array)
    assert float(loss) == pytest.approx(i * float(jnp.sum(X + i)))
  assert len(calls) == 2  # one trace without a buffer ("grad"), one with ("grad_acc")
  np.testing.assert_allclose(wrapper.grads["w"], sum(i * (np.asarray(X) + i) for i in range(5)))
  assert wrapper.inner_count == 5
  wrapper.backward(ScaledFn(counted, jnp.float32(1.0)), X, power=2)  # a new static value
  assert len(calls) == 3


def test_backward_has_aux_and_kwargs():
  def with_aux(params, x, scale=1.0):
    y = params["w"] * x
    return jnp.sum(y) * scale, {"y": y}

  wrapper = jaxamp.OptimWrapper(optax.sgd(0.1), w_params())
  loss, aux = wrapper.backward(with_aux, X, has_aux=True, scale=2.0)
  assert float(loss) == 14.0
  np.testing.assert_array_equal(aux["y"], X)
  np.testing.assert_array_equal(wrapper.grads["w"], 2 * X)
  loss, aux = wrapper.update_params(with_aux, X, has_aux=True)
  assert float(loss) == 7.0 and wrapper.grads is None


def test_has_aux_needs_a_loss_function_returning_a_pair():
  wrapper = jaxamp.OptimWrapper(optax.sgd(0.1), w_params())
  triple = lambda p, x: (jnp.sum(p["w"] * x), x, x)  # noqa: E731
  for bad, match in [(triple, r"must return a pair \(loss, aux\), got tuple"),
                     (loss_fn, r"must return a pair \(loss, aux\)")]:
    with pytest.raises(TypeError, match=match):
      wrapper.backward(bad, X, has_aux=True)
    with pytest.raises(TypeError, match=match):
      wrapper.update_params(bad, X, has_aux=True)
    assert wrapper.grads is None and wrapper.inner_count == 0
    np.testing.assert_array_equal(wrapper.params["w"], [1.0, 1.0])


def test_update_params_loop_compiles_once_and_never_syncs():
  calls = []

  def counted(params, x):
    calls.append(1)
    return jnp.sum(params["w"] * x)

  wrapper = jaxamp.OptimWrapper(optax.sgd(1e-3, momentum=0.9), w_params(),
                                accumulative_counts=3, clip_grad=dict(max_norm=1.0))
  wrapper.initialize_count_status(None, 0, 100)
  for _ in range(3):  # the first window compiles; the loss factors are cached
    wrapper.update_params(counted, X)
  with jax.transfer_guard("disallow_explicit"):  # not even an explicit transfer
    for _ in range(97):
      wrapper.update_params(counted, X)
  traces = dict(trace_counts(wrapper))
  # grad, grad_acc and fused_acc for the windows of 3; fused for the last call (100 = 33 * 3 + 1).
  assert traces == {"grad": 1, "grad_acc": 1, "fused_acc": 1, "fused": 1}
  assert len(calls) == 4
  assert wrapper.inner_count == 100 and wrapper.grads is None


class StepLoggingWrapper(jaxamp.OptimWrapper):
  """A subclass outside jaxamp overriding step, as mmengine users write them."""

  def step(self, closure=None, **kwargs):
    self.steps.append(kwargs)
    super().step(closure)


def test_update_params_calls_a_subclass_step_with_step_kwargs():
  wrapper = StepLoggingWrapper(optax.sgd(0.5), w_params())
  wrapper.steps = []
  wrapper.update_params(loss_fn, X)
  wrapper.update_params(loss_fn, X, step_kwargs=dict(tag="ema"))
  assert wrapper.steps == [{}, {"tag": "ema"}]  # as mmengine: self.step(**step_kwargs)
  np.testing.assert_allclose(wrapper.params["w"], 1.0 - 2 * 0.5 * np.asarray(X))


@pytest.mark.parametrize("acc", [1, 2])
def test_step_or_zero_kwargs_they_do_not_take_are_refused_before_anything_changes(acc):
  wrapper = jaxamp.OptimWrapper(optax.sgd(0.5), w_params(), accumulative_counts=acc)
  wrapper.backward(loss_fn, X)  # gradients under way (X, not divided by the window)
  params, grads = wrapper.params, wrapper.grads
  for kwargs, match in [(dict(step_kwargs=dict(lr=0.1)), r"step_kwargs=\{'lr': 0.1\} do not fit"),
                        (dict(zero_kwargs=dict(set_to_None=True)),
                         r"zero_kwargs=\{'set_to_None': True\} do not fit .*zero_grad\(\)")]:
    with pytest.raises(TypeError, match=match):
      wrapper.update_params(loss_fn, X, **kwargs)
    assert wrapper.params is params and wrapper.grads is grads and wrapper.inner_count == 1
  wrapper.update_params(loss_fn, X, zero_kwargs=dict(set_to_none=True))  # the wrapper carries on
  assert wrapper.inner_count == 2 and wrapper.grads is None
  np.testing.assert_allclose(wrapper.params["w"], 1.0 - 0.5 * (1 + 1 / acc) * np.asarray(X))


def loss_with_aux(params, x, scale=1.0):
  y = params["w"] * x
  return jnp.sum(y) * scale, {"y": y}


def test_update_params_passes_has_aux_and_kwargs_in_every_call_of_a_window():
  # The first call of the window only adds gradients, the second steps: as optax with the mean.
  wrapper = jaxamp.OptimWrapper(optax.sgd(0.1), w_params(), accumulative_counts=2)
  for scale in (2.0, 4.0):
    loss, aux = wrapper.update_params(loss_with_aux, X, has_aux=True, scale=scale)
    assert float(loss) == 7.0 * scale
    np.testing.assert_array_equal(aux["y"], X)
  opt = optax.sgd(0.1)
  updates, _ = opt.update({"w": 3.0 * X}, opt.init(w_params()))
  np.testing.assert_allclose(wrapper.params["w"], optax.apply_updates(w_params(), updates)["w"],
                             rtol=1e-6)


def test_fused_and_unfused_paths_agree():
  grads_list = [jnp.array([1.0, -2.0]), jnp.array([0.5, 0.25]), jnp.array([-1.0, 3.0])]

  def run(fuse):
    wrapper = jaxamp.OptimWrapper(optax.sgd(0.1, momentum=0.9), w_params(),
                                  accumulative_counts=2, clip_grad=dict(max_norm=1.5))
    if not fuse:
      wrapper._can_fuse = lambda: False
    for g in grads_list * 2:
      wrapper.update_params(loss_fn, g)
    return wrapper

  a, b = run(True), run(False)
  assert "fused_acc" in trace_counts(a) and "fused_acc" not in trace_counts(b)
  np.testing.assert_array_equal(a.params["w"], b.params["w"])
  np.testing.assert_array_equal(a.last_grad_norm, b.last_grad_norm)
  chex_equal = jax.tree.map(np.testing.assert_array_equal, a.opt_state, b.opt_state)
  del chex_equal


# -------------------------------------------------------------------------------------------------
# grads / params assignment, apply_gradients and skip.
# -------------------------------------------------------------------------------------------------


def test_grads_setter_validates_and_keeps_state():
  wrapper = jaxamp.OptimWrapper(optax.sgd(0.5), w_params())
  wrapper.backward(loss_fn, X)
  before = wrapper.grads
  for bad, err in [({"v": jnp.ones(2)}, ValueError), ({"w": jnp.ones(3)}, ValueError),
                   ({"w": jnp.ones(2, jnp.float16)}, ValueError), ({"w": "x"}, TypeError),
                   (jnp.ones(2), ValueError)]:
    with pytest.raises(err, match="grads"):
      wrapper.grads = bad
    assert wrapper.grads is before
  params = wrapper.params
  with pytest.raises(ValueError, match=r"^grads leaf \['w'\] must have shape \(2,\)"):
    wrapper.apply_gradients({"w": jnp.ones(3)})  # the holder protocol's step
  assert wrapper.params is params and wrapper.grads is before
  wrapper.grads = {"w": np.array([2.0, 4.0], np.float32)}
  assert isinstance(wrapper.grads["w"], jax.Array)
  wrapper.step()
  np.testing.assert_allclose(wrapper.params["w"], [0.0, -1.0])
  wrapper.grads = None
  assert wrapper.grads is None
  wrapper.step()  # nothing to apply: a no-op, as a torch step without .grad
  np.testing.assert_allclose(wrapper.params["w"], [0.0, -1.0])
  with pytest.raises(ValueError, match="params"):
    wrapper.params = {"w": jnp.ones(4)}
  wrapper.params = w_params((5.0, 5.0))
  np.testing.assert_array_equal(wrapper.params["w"], [5.0, 5.0])


def test_apply_gradients_skip_is_bit_identical_and_on_device():
  wrapper = jaxamp.OptimWrapper(optax.sgd(0.1, momentum=0.9), {"w": jnp.array([-0.0, 1.0])},
                                clip_grad=dict(max_norm=1.0))
  wrapper.apply_gradients({"w": jnp.array([3.0, 4.0])})
  params, opt_state = wrapper.params, wrapper.opt_state
  with jax.transfer_guard_device_to_host("disallow"):
    wrapper.apply_gradients({"w": jnp.array([30.0, 40.0])}, skip=jnp.array(True))
  assert jax.tree.all(jax.tree.map(lambda a, b: np.asarray(a).tobytes() == np.asarray(b).tobytes(),
                                   (params, opt_state), (wrapper.params, wrapper.opt_state)))
  assert float(wrapper.last_grad_norm) == 50.0  # the norm is recorded even on a skipped step
  wrapper.apply_gradients({"w": jnp.array([30.0, 40.0])}, skip=jnp.array(False))
  assert not np.array_equal(params["w"], wrapper.params["w"])
  with pytest.raises(ValueError, match="boolean scalar"):
    wrapper.apply_gradients({"w": jnp.ones(2)}, skip=jnp.ones(2, bool))
  assert trace_counts(wrapper)["apply"] == 1 and trace_counts(wrapper)["apply_skip"] == 1


def test_non_finite_grads_are_applied_as_pytorch_does():
  wrapper = jaxamp.OptimWrapper(optax.sgd(1.0), w_params())
  wrapper.apply_gradients({"w": jnp.array([jnp.inf, 1.0])})
  np.testing.assert_array_equal(wrapper.params["w"], [-np.inf, 0.0])
  # With norm clipping, PyTorch's coefficient max_norm / (inf + 1e-6) = 0 turns inf * 0 into nan.
  wrapper = jaxamp.OptimWrapper(optax.sgd(1.0), w_params(), clip_grad=dict(max_norm=1.0))
  wrapper.apply_gradients({"w": jnp.array([jnp.inf, 1.0])})
  assert np.isnan(wrapper.params["w"][0]) and wrapper.params["w"][1] == 1.0
  assert np.isinf(wrapper.last_grad_norm)


# -------------------------------------------------------------------------------------------------
# clip_grad: validation as mmengine, arithmetic as torch.
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("clip_grad,err,match", [
    ({}, AssertionError, "should be a `dict`"),
    ([1.0], AssertionError, "should be a `dict`"),
    (dict(type="value"), AssertionError, "besides `type`"),
    (dict(type="l2", max_norm=1.0), ValueError, 'should be "norm" or "value" but got l2'),
    (dict(max_norm=1.0, foo=2), TypeError, "unexpected keyword argument 'foo'"),
    (dict(norm_type=2.0), TypeError, "missing 1 required positional argument: 'max_norm'"),
    (dict(type="value", max_norm=1.0), TypeError, "clip_grad_value_"),
    (dict(max_norm="big"), TypeError, "max_norm"),
    (dict(max_norm=1.0, norm_type="l1"), ValueError, "norm_type"),
])
def test_clip_grad_validation(clip_grad, err, match):
  with pytest.raises(err, match=match):
    jaxamp.OptimWrapper(optax.sgd(0.1), w_params(), clip_grad=clip_grad)


def test_clip_grad_dict_not_mutated():
  cfg = dict(type="norm", max_norm=1.0)
  wrapper = jaxamp.OptimWrapper(optax.sgd(0.1), w_params(), clip_grad=cfg)
  assert cfg == dict(type="norm", max_norm=1.0)
  # mmengine's clip_grad_kwargs: the arguments without 'type' (what its clipping is called with).
  assert wrapper.clip_grad_kwargs == dict(max_norm=1.0)
  by_value = jaxamp.OptimWrapper(optax.sgd(0.1), w_params(),
                                 clip_grad=dict(type="value", clip_value=0.5))
  assert by_value.clip_grad_kwargs == dict(clip_value=0.5)
  assert jaxamp.OptimWrapper(optax.sgd(0.1), w_params()).clip_grad_kwargs is None


def torch_clip_norm(grads, max_norm, norm_type):
  leaves = [np.asarray(g, np.float32).ravel() for g in grads]
  if norm_type == math.inf:
    total = np.float32(max(np.max(np.abs(g)) for g in leaves))
  else:
    norms = np.array([np.sum(np.abs(g) ** norm_type) ** (1 / norm_type) for g in leaves])
    total = np.float32(np.sum(norms ** norm_type) ** (1 / norm_type))
  coef = np.minimum(np.float32(max_norm) / (total + np.float32(1e-6)), np.float32(1.0))
  return [np.asarray(g, np.float32) * coef for g in grads], total


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf, "inf"])
def test_clip_grad_norm_arithmetic(norm_type):
  rng = np.random.default_rng(0)
  grads = {"a": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32),
           "b": jnp.asarray(rng.normal(size=5), jnp.float32)}
  tx = jaxamp.clip_grad_norm(0.5, norm_type)
  clipped, state = jax.jit(tx.update)(grads, tx.init(grads))
  order = math.inf if norm_type == "inf" else norm_type
  expected, total = torch_clip_norm([grads["a"], grads["b"]], 0.5, order)
  np.testing.assert_allclose(state.total_norm, total, rtol=1e-6)
  np.testing.assert_allclose(clipped["a"], expected[0], rtol=1e-6)
  np.testing.assert_allclose(clipped["b"], expected[1], rtol=1e-6)
  # Below the threshold the gradients are multiplied by exactly 1.0.
  tx = jaxamp.clip_grad_norm(1e6, norm_type)
  same, _ = tx.update(grads, tx.init(grads))
  np.testing.assert_array_equal(same["a"], grads["a"])


def test_clip_grad_value_and_wrapper_norm():
  wrapper = jaxamp.OptimWrapper(optax.sgd(1.0), w_params(),
                                clip_grad=dict(type="value", clip_value=1.5))
  wrapper.update_params(lambda p, x: jnp.sum(p["w"] * x), jnp.array([3.0, -0.5]))
  np.testing.assert_array_equal(wrapper.params["w"], [-0.5, 1.5])
  assert wrapper.last_grad_norm is None
  wrapper = jaxamp.OptimWrapper(optax.sgd(1.0), w_params(), clip_grad=dict(max_norm=1.0))
  assert wrapper.last_grad_norm is None
  wrapper.update_params(loss_fn, X)
  assert float(wrapper.last_grad_norm) == 5.0
  np.testing.assert_allclose(wrapper.params["w"], [0.4, 0.2], rtol=1e-6)


def test_error_if_nonfinite_raises_and_keeps_state():
  wrapper = jaxamp.OptimWrapper(optax.sgd(1.0), w_params(),
                                clip_grad=dict(max_norm=1.0, error_if_nonfinite=True))
  wrapper.update_params(bad_loss, X, jnp.array(False))
  params = wrapper.params
  with pytest.raises(RuntimeError, match=r"The total norm of order 2.0 for gradients from "
                     r"`parameters` is non-finite, so it cannot be clipped"):
    wrapper.update_params(bad_loss, X, jnp.array(True))
  assert wrapper.params is params
  assert wrapper.inner_count == 2 and wrapper.grads is not None  # as mmengine: backward ran
  # PyTorch names the order it was asked for.
  l1 = jaxamp.OptimWrapper(optax.sgd(1.0), w_params(),
                           clip_grad=dict(max_norm=1.0, norm_type=1.0, error_if_nonfinite=True))
  with pytest.raises(RuntimeError, match=r"The total norm of order 1.0 for gradients"):
    l1.update_params(bad_loss, X, jnp.array(True))


# -------------------------------------------------------------------------------------------------
# Hyperparameters and state dicts.
# -------------------------------------------------------------------------------------------------


def test_get_lr_needs_injected_hyperparameters():
  wrapper = jaxamp.OptimWrapper(optax.sgd(0.1), w_params())
  with pytest.raises(ValueError, match="Cannot read the learning rate .*inject_hyperparams"):
    wrapper.get_lr()
  with pytest.raises(ValueError, match="Cannot read the momentum .*inject_hyperparams"):
    wrapper.get_momentum()
  assert [dict(g) for g in wrapper.param_groups] == [{"params": ["w"]}]
  assert wrapper.defaults == {}


def test_injected_hyperparameters_are_read_and_set_without_recompiling():
  adam = jaxamp.OptimWrapper(optax.inject_hyperparams(optax.adam)(learning_rate=0.1, b1=0.8),
                             w_params())
  assert adam.get_momentum() == {"momentum": [pytest.approx(0.8)]}
  assert adam.param_groups[0]["betas"] == (pytest.approx(0.8), pytest.approx(0.999))
  opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.8)
  wrapper = jaxamp.OptimWrapper(opt, w_params())
  assert wrapper.get_lr() == {"lr": [pytest.approx(0.1)]}
  assert wrapper.get_momentum() == {"momentum": [pytest.approx(0.8)]}
  assert wrapper.defaults["lr"] == pytest.approx(0.1)
  wrapper.update_params(loss_fn, X)
  group = wrapper.param_groups[0]
  group["lr"] = 0.25
  group.setdefault("initial_lr", 0.1)  # what mmengine's schedulers do
  assert wrapper.get_lr() == {"lr": [0.25]}
  assert wrapper.param_groups[0]["initial_lr"] == 0.1
  wrapper.update_params(loss_fn, X)
  assert trace_counts(wrapper)["fused"] == 1
  np.testing.assert_allclose(wrapper.opt_state.hyperparams["learning_rate"], 0.25)


def test_a_hyperparameter_the_state_does_not_hold_is_refused_not_ignored():
  plain = jaxamp.OptimWrapper(optax.sgd(0.1), w_params())
  sgd = jaxamp.OptimWrapper(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), w_params())
  for wrapper, key in ((plain, "lr"), (plain, "weight_decay"), (sgd, "momentum")):
    with pytest.raises(ValueError, match=f"holds no injected '{key}'.*inject_hyperparams"):
      wrapper.param_groups[0][key] = 0.01
    saved = wrapper.state_dict()
    saved["param_groups"][0][key] = 0.01
    with pytest.raises(ValueError, match=f"holds no injected '{key}'"):
      wrapper.load_state_dict(saved)
    assert key not in wrapper.param_groups[0]
  plain.param_groups[0]["initial_lr"] = 0.1  # a scheduler's own entry is kept
  assert plain.param_groups[0]["initial_lr"] == 0.1
  sgd.optimizer.param_groups[0]["lr"] = 0.01  # through mmengine's optimizer view
  sgd.update_params(loss_fn, X)
  np.testing.assert_allclose(sgd.params["w"], 1.0 - 0.01 * np.asarray(X))


def test_get_momentum_is_zero_for_an_optimizer_without_momentum():
  # As mmengine for torch's Adagrad, whose groups hold neither 'momentum' nor 'betas'.
  wrapper = jaxamp.build_optim_wrapper(w_params(), dict(optimizer=dict(type="Adagrad", lr=0.1)))
  assert wrapper.get_momentum() == {"momentum": [0]}
  sgd = jaxamp.OptimWrapper(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), w_params())
  assert sgd.get_momentum() == {"momentum": [0]}


def test_repr_is_mmengine_s():
  opt = optax.sgd(0.1)
  wrapper = jaxamp.OptimWrapper(opt, w_params(), accumulative_counts=2)
  # mmengine: the type, the accumulation, then repr(optim_wrapper.optimizer).
  assert repr(wrapper.optimizer) == repr(opt)
  assert repr(wrapper) == ("Type: OptimWrapper\n_accumulative_counts: 2\noptimizer: \n"
                           f"{wrapper.optimizer!r}\n")


def test_optimizer_state_dict_round_trip():
  # What mmengine's checkpoint hooks call on optim_wrapper.optimizer.
  opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
  wrapper = jaxamp.OptimWrapper(opt, w_params())
  wrapper.update_params(loss_fn, X)
  saved = copy.deepcopy(wrapper.optimizer.state_dict())
  assert set(saved) == {"state", "param_groups"}
  snapshot = wrapper.opt_state
  wrapper.update_params(loss_fn, X)
  wrapper.param_groups[0]["lr"] = 0.5
  wrapper.optimizer.load_state_dict(saved)
  jax.tree.map(np.testing.assert_array_equal, wrapper.opt_state, snapshot)
  assert wrapper.get_lr() == {"lr": [0.1]}
  with pytest.raises(ValueError, match="unexpected \\['base_param_settings'\\]"):
    wrapper.optimizer.load_state_dict(dict(saved, base_param_settings={"params": []}))
  jax.tree.map(np.testing.assert_array_equal, wrapper.opt_state, snapshot)


def test_state_dict_round_trip():
  opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
  wrapper = jaxamp.OptimWrapper(opt, w_params(), clip_grad=dict(max_norm=1.0))
  wrapper.update_params(loss_fn, X)
  saved = copy.deepcopy(wrapper.state_dict())
  assert set(saved) == {"state", "param_groups"}
  assert saved["param_groups"][0]["params"] == ["w"]
  snapshot = wrapper.opt_state
  wrapper.update_params(loss_fn, X)
  wrapper.param_groups[0]["lr"] = 0.5
  wrapper.load_state_dict(saved)
  jax.tree.map(np.testing.assert_array_equal, wrapper.opt_state, snapshot)
  assert wrapper.get_lr() == {"lr": [0.1]}
  # Hyperparameters in param_groups win, as in torch.
  edited = copy.deepcopy(saved)
  edited["param_groups"][0]["lr"] = 0.3
  wrapper.load_state_dict(edited)
  assert wrapper.get_lr() == {"lr": [0.3]}
  # Numpy leaves (a checkpoint read from disk) load too.
  wrapper.load_state_dict({"state": jax.tree.map(np.asarray, snapshot),
                           "param_groups": saved["param_groups"]})
  jax.tree.map(np.testing.assert_array_equal, wrapper.opt_state, snapshot)


def test_bad_state_dicts_change_nothing():
  opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
  wrapper = jaxamp.OptimWrapper(opt, w_params())
  wrapper.update_params(loss_fn, X)
  good = wrapper.state_dict()
  state = wrapper.opt_state
  sgd_state = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1).init(w_params())  # no trace
  bad_shape = jax.tree.map(lambda x: jnp.zeros((3,) + x.shape[1:], x.dtype) if x.ndim else x,
                           good["state"])
  bad_dtype = jax.tree.map(lambda x: x.astype(jnp.float16) if x.dtype == jnp.float32 else x,
                           good["state"])
  nan_trace = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan) if x.ndim else x, good["state"])
  cases = [
      ({"state": good["state"]}, ValueError, "missing \\['param_groups'\\]"),
      (dict(good, extra=1), ValueError, "unexpected \\['extra'\\]"),
      ({"state": sgd_state, "param_groups": good["param_groups"]}, ValueError,
       "different optimizer"),
      ({"state": bad_shape, "param_groups": good["param_groups"]}, ValueError,
       r"state_dict\['state'\] leaf .*trace\['w'\] must have shape \(2,\)"),
      ({"state": bad_dtype, "param_groups": good["param_groups"]}, ValueError, "dtype"),
      ({"state": good["state"], "param_groups": good["param_groups"] * 2}, ValueError,
       "different number of parameter groups"),
      ({"state": good["state"], "param_groups": [{"params": ["v"], "lr": 0.5}]}, ValueError,
       "doesn't match"),
      ([1, 2], TypeError, "dict"),
      # Values a run cannot go on from (a diverged run's checkpoint, a corrupted one).
      ({"state": nan_trace, "param_groups": good["param_groups"]}, ValueError,
       r"inf or nan at .*trace\['w'\]"),
      ({"state": good["state"]._replace(count=jnp.int32(-1)), "param_groups":
        good["param_groups"]}, ValueError, "count must be an int >= 0, got -1"),
  ]
  for sd, err, match in cases:
    with pytest.raises(err, match=match):
      wrapper.load_state_dict(sd)
    assert wrapper.opt_state is state
    assert wrapper.get_lr() == {"lr": [0.1]}


# -------------------------------------------------------------------------------------------------
# OptimWrapperDict
# -------------------------------------------------------------------------------------------------


def make_dict():
  gen = jaxamp.OptimWrapper(optax.inject_hyperparams(optax.sgd)(learning_rate=0.5, momentum=0.9),
                            w_params())
  disc = jaxamp.OptimWrapper(optax.inject_hyperparams(optax.sgd)(learning_rate=0.25,
                                                                 momentum=0.5),
                             {"v": jnp.zeros(3)})
  return jaxamp.OptimWrapperDict(gen=gen, disc=disc), gen, disc


def test_optim_wrapper_dict_mapping_and_getters():
  wrappers, gen, disc = make_dict()
  assert isinstance(wrappers, jaxamp.OptimWrapper)
  assert wrappers["gen"] is gen and "disc" in wrappers and "x" not in wrappers
  assert len(wrappers) == 2 and list(wrappers.keys()) == ["gen", "disc"]
  assert list(wrappers.values()) == [gen, disc] and dict(wrappers.items())["disc"] is disc
  assert list(wrappers) == ["gen", "disc"]
  assert wrappers.get_lr() == {"gen.lr": [0.5], "disc.lr": [0.25]}
  assert wrappers.get_momentum() == {"gen.momentum": [pytest.approx(0.9)],
                                     "disc.momentum": [0.5]}
  assert set(wrappers.param_groups) == {"gen", "disc"}
  with pytest.raises(KeyError, match="Cannot find x in OptimWrapperDict"):
    wrappers["x"]
  with pytest.raises(AssertionError):
    wrappers["x"]
  wrappers.initialize_count_status(None, 0, 10)  # a no-op
  assert gen._max_counts == -1


def test_optim_wrapper_dict_not_implemented_and_zero_grad():
  wrappers, gen, disc = make_dict()
  for call, name in [(lambda: wrappers.update_params(loss_fn, X), "update_params"),
                     (lambda: wrappers.backward(loss_fn, X), "backward"),
                     (lambda: wrappers.step(), "step")]:
    with pytest.raises(NotImplementedError, match=f"`{name}` should be called by each optimizer"):
      call()
  with pytest.raises(NotImplementedError, match="`optim_context` should be called by each"):
    with wrappers.optim_context(None):
      pass
  gen.backward(loss_fn, X)
  disc.backward(lambda p: jnp.sum(p["v"]))
  wrappers.zero_grad()
  assert gen.grads is None and disc.grads is None
  with pytest.raises(AssertionError, match="only accept OptimWrapper instance"):
    jaxamp.OptimWrapperDict(a=gen, b=optax.sgd(0.1))


def test_optim_wrapper_dict_state_dict_is_all_or_nothing():
  wrappers, gen, disc = make_dict()
  gen.update_params(loss_fn, X)
  disc.update_params(lambda p: jnp.sum(p["v"] ** 2 - p["v"]))
  saved = wrappers.state_dict()
  assert set(saved) == {"gen", "disc"}
  gen_state, disc_state = gen.opt_state, disc.opt_state
  gen.update_params(loss_fn, X)
  bad = {"gen": saved["gen"], "disc": {"state": saved["gen"]["state"],
                                       "param_groups": saved["disc"]["param_groups"]}}
  moved = gen.opt_state
  with pytest.raises(ValueError):
    wrappers.load_state_dict(bad)
  assert gen.opt_state is moved  # nothing was loaded
  with pytest.raises(AssertionError, match="Mismatched `state_dict`! cannot found x"):
    wrappers.load_state_dict({"x": saved["gen"]})
  wrappers.load_state_dict(saved)
  jax.tree.map(np.testing.assert_array_equal, gen.opt_state, gen_state)
  jax.tree.map(np.testing.assert_array_equal, disc.opt_state, disc_state)


def test_scale_loss_of_a_function_and_zero_grad_to_zeros():
  wrapper = jaxamp.OptimWrapper(optax.sgd(1.0), w_params(), accumulative_counts=4)
  np.testing.assert_allclose(wrapper.scale_loss(jnp.float32(2.0)), 0.5)
  divided = wrapper.scale_loss(loss_fn)
  assert float(divided(w_params(), X)) == 7.0 / 4
  for _ in range(3):
    wrapper.backward(wrapper.scale_loss(loss_fn), X)
  assert trace_counts(wrapper) == {"grad": 1, "grad_acc": 1}  # the factor is a traced child
  np.testing.assert_allclose(wrapper.grads["w"], 3 * np.asarray(X) / 4)
  wrapper.zero_grad(set_to_none=False)
  np.testing.assert_array_equal(wrapper.grads["w"], [0.0, 0.0])
  wrapper.update_params(loss_fn, X, zero_kwargs=dict(set_to_none=False))
  assert wrapper.inner_count == 4
  np.testing.assert_array_equal(wrapper.grads["w"], [0.0, 0.0])
  np.testing.assert_allclose(wrapper.params["w"], 1 - np.asarray(X) / 4)


def test_scale_loss_of_an_array_divides_as_torch():
  # torch's true division: a floating loss keeps its dtype, a bool or integer one (an error count,
  # say) is divided in float32, and a Python number is divided too.
  wrapper = jaxamp.OptimWrapper(optax.sgd(1.0), w_params(), accumulative_counts=4)
  cases = [(2.0, [0.5], jnp.float32), (np.float32(2.0), [0.5], jnp.float32),
           (jnp.asarray(2.0, jnp.float16), [0.5], jnp.float16),
           (jnp.asarray(2.0, jnp.bfloat16), [0.5], jnp.bfloat16),
           (jnp.asarray([True, False]), [0.25, 0.0], jnp.float32),
           (jnp.asarray([2, 6], jnp.int8), [0.5, 1.5], jnp.float32)]
  for loss, expected, dtype in cases:
    scaled = wrapper.scale_loss(loss)
    assert scaled.dtype == dtype
    np.testing.assert_array_equal(np.asarray(scaled, np.float32).reshape(-1), expected)
  # A window longer than the loss dtype's range.
  long = jaxamp.OptimWrapper(optax.sgd(1.0), w_params(), accumulative_counts=300)
  np.testing.assert_allclose(long.scale_loss(jnp.asarray([120], jnp.int8)), [0.4], rtol=1e-7)


@pytest.mark.parametrize("clip", [None, dict(max_norm=1.0), dict(type="value", clip_value=0.5)])
def test_external_skip_by_cond_is_bit_identical_to_the_select(clip):
  params = {"w": jnp.asarray([1.0, -0.0, 0.5], jnp.float32)}
  wrapper = jaxamp.OptimWrapper(optax.sgd(0.1, momentum=0.9), params, clip_grad=clip)
  select = jax.jit(wrapper._update)
  grads_seq = ([0.5, 2.0, -1.0], [jnp.inf, 1.0, 1.0], [0.25, -3.0, 1.0], [jnp.nan, 0.0, 1.0])
  for values, skip in zip(grads_seq, (False, True, False, True)):
    grads = {"w": jnp.asarray(values, jnp.float32)}
    expected = select(wrapper.params, wrapper._state, grads, jnp.asarray(skip))
    wrapper.apply_gradients(grads, skip=jnp.asarray(skip))
    got = (wrapper.params, wrapper._state, wrapper.last_grad_norm)
    assert ([np.asarray(x).tobytes() for x in jax.tree.leaves(got)]
            == [np.asarray(x).tobytes() for x in jax.tree.leaves(expected)])


def test_apply_scaled_gradients_takes_any_number_as_the_scale_and_compiles_once():
  # The scalers' step: unscale, check and step in one call, the norm before clipping recorded.
  wrapper = jaxamp.OptimWrapper(optax.sgd(0.5), w_params(), clip_grad=dict(max_norm=10.0))
  for scale in (1024.0, jnp.float32(1024.0), np.float64(1024.0), 1024):
    wrapper.grads = {"w": 1024.0 * X}
    assert not wrapper.apply_scaled_gradients(scale)
    np.testing.assert_array_equal(wrapper.grads["w"], X)  # read unscaled
    assert float(wrapper.last_grad_norm) == 5.0
  np.testing.assert_allclose(wrapper.params["w"], 1.0 - 4 * 0.5 * np.asarray(X))
  assert trace_counts(wrapper) == {"apply_scaled": 1}


def test_a_loss_function_without_array_arguments_written_in_the_loop_warns_it_recompiles():
  wrapper = jaxamp.OptimWrapper(optax.sgd(0.5), w_params())
  with pytest.warns(RuntimeWarning, match="compiled '<lambda>' again"):
    for _ in range(2):
      wrapper.backward(lambda p: jnp.sum(p["w"] ** 2))
      wrapper.step()
      wrapper.zero_grad()


@pytest.mark.parametrize("donate", [False, True])
def test_backward_and_apply_gradients_donate_only_with_donate(donate):
  # donate=True: the gradients backward adds to and the params and state a step replaces are
  # updated in place (the arrays read before are deleted); donate=False: all stay readable.
  wrapper = jaxamp.OptimWrapper(optax.sgd(0.5, momentum=0.9), w_params(), donate=donate)
  wrapper.backward(loss_fn, X)
  grads = wrapper.grads
  wrapper.backward(loss_fn, X)
  params, state = wrapper.params, wrapper.opt_state
  wrapper.apply_gradients()
  held = [grads["w"], params["w"], jax.tree.leaves(state)[-1]]
  assert [a.is_deleted() for a in held] == [donate] * 3
  np.testing.assert_allclose(wrapper.params["w"], 1.0 - 0.5 * 2 * np.asarray(X))


@pytest.mark.parametrize("donate", [False, True])
def test_the_one_call_scaled_step_compiles_without_a_buffer_for_the_unscaled_gradients(donate):
  if donate and jax.__version_info__ < (0, 10):
    pytest.skip("XLA:CPU's buffer assignment before jaxlib 0.10 keeps a copy of donated gradients "
                "that another kernel reads (a temporary of 16,544 bytes on jax 0.7.1)")
  # Donating, the unscaled gradients are written into the scaled ones' buffer; otherwise they
  # are not kept (read unscaled later): either way no temporary holds them for the step.
  params = {"w": jnp.ones((64, 64), jnp.float32)}
  wrapper = jaxamp.OptimWrapper(optax.sgd(0.1, momentum=0.9), params, donate=donate)
  grads = {"w": jnp.ones((64, 64), jnp.float32)}
  compiled = wrapper._apply_scaled_step.lower(wrapper.params, wrapper._state, grads,
                                              jnp.float32(2.0)).compile()
  assert compiled.memory_analysis().temp_size_in_bytes < grads["w"].nbytes


def test_a_skippable_step_gives_the_optimizer_the_params():
  # Weight decay reads the params: with an external skip flag too, the step is optax's.
  params = w_params((1.0, -2.0))
  opt = optax.chain(optax.add_decayed_weights(0.5), optax.sgd(0.1))
  updates, _ = opt.update({"w": X}, opt.init(params), params)
  for skip in (None, jnp.asarray(False)):
    wrapper = jaxamp.OptimWrapper(opt, params)
    wrapper.apply_gradients({"w": X}, skip=skip)
    np.testing.assert_allclose(wrapper.params["w"], optax.apply_updates(params, updates)["w"],
                               rtol=1e-6)
