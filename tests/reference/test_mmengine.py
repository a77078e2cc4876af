"""jaxamp's mmengine facade against mmengine 0.10.7 (OptimWrapper, AmpOptimWrapper), call by call."""

import functools
from unittest import mock

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import jaxamp
from tests.reference._refs import import_reference

torch = import_reference("torch")
mmengine_optim = import_reference("mmengine.optim")
amp_module = import_reference("mmengine.optim.optimizer.amp_optimizer_wrapper")

X = np.array([3.0, 4.0], np.float32)


def _torch_wrapper(amp, lr, acc, clip, loss_scale):
  clip = None if clip is None else dict(clip)  # mmengine pops 'type' from the caller's dict
  w = torch.nn.Parameter(torch.tensor([1.0, 1.0]))
  opt = torch.optim.SGD([w], lr=lr)
  if not amp:
    return w, mmengine_optim.OptimWrapper(opt, accumulative_counts=acc, clip_grad=clip)
  # mmengine builds its scaler for CUDA devices; the same code runs on CPU with torch.amp's.
  with mock.patch.object(amp_module, "is_cuda_available", lambda: True), \
       mock.patch.object(amp_module, "GradScaler", functools.partial(torch.amp.GradScaler, "cpu")):
    wrapper = mmengine_optim.AmpOptimWrapper(loss_scale=loss_scale, optimizer=opt,
                                             accumulative_counts=acc, clip_grad=clip)
  return w, wrapper


def _run_torch(bad, amp, lr=0.1, acc=1, clip=None, loss_scale="dynamic", counts=None):
  w, wrapper = _torch_wrapper(amp, lr, acc, clip, loss_scale)
  if counts is not None:
    wrapper.initialize_count_status(torch.nn.Linear(1, 1), *counts)
  out = []
  for b in bad:
    loss = (w * torch.tensor(X)).sum() * (float("inf") if b else 1.0)
    wrapper.update_params(loss)
    scale = wrapper.loss_scaler.get_scale() if amp else 1.0
    out.append((w.detach().numpy().copy(), scale))
  return out


def _loss(params, x, bad):
  return jnp.sum(params["w"] * x) * jnp.where(bad, jnp.float32(jnp.inf), jnp.float32(1.0))


def _run_jax(bad, amp, lr=0.1, acc=1, clip=None, loss_scale="dynamic", counts=None):
  params = {"w": jnp.ones(2, jnp.float32)}
  if amp:
    wrapper = jaxamp.AmpOptimWrapper(optax.sgd(lr), params, loss_scale=loss_scale,
                                     accumulative_counts=acc, clip_grad=clip)
  else:
    wrapper = jaxamp.OptimWrapper(optax.sgd(lr), params, accumulative_counts=acc, clip_grad=clip)
  if counts is not None:
    wrapper.initialize_count_status(None, *counts)
  out = []
  for b in bad:
    wrapper.update_params(_loss, jnp.asarray(X), jnp.asarray(b))
    out.append((np.asarray(wrapper.params["w"]), wrapper.get_scale() if amp else 1.0))
  return out


def _compare(torch_out, jax_out, rtol=1e-6):
  for (tw, ts), (jw, js) in zip(torch_out, jax_out):
    np.testing.assert_allclose(jw, tw, rtol=rtol, atol=1e-7)
    assert ts == js


def test_reference_amp_example():
  bad = [False, False, True, False, False, False]
  kw = dict(amp=True, clip=dict(max_norm=1.0), loss_scale=dict(init_scale=4, growth_interval=2))
  _compare(_run_torch(bad, **kw), _run_jax(bad, **kw))


@pytest.mark.parametrize("acc,counts", [(3, (0, 10)), (4, (0, 10)), (3, (4, 10)), (4, (0, 3))])
def test_counting_table(acc, counts):
  n = counts[1] - counts[0]
  bad = [False] * n
  t = _run_torch(bad, amp=False, acc=acc, counts=counts)  # mmengine logs its resume warning
  with pytest.warns(UserWarning) if counts[0] % acc else _nothing():
    j = _run_jax(bad, amp=False, acc=acc, counts=counts)
  _compare(t, j)


class _nothing:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


@settings(max_examples=15, deadline=None, derandomize=True)
@given(bad=st.lists(st.booleans(), min_size=1, max_size=12), acc=st.integers(1, 3),
       clip=st.sampled_from([None, dict(max_norm=1.0), dict(max_norm=0.5, norm_type=1.0),
                             dict(type="value", clip_value=0.7)]),
       interval=st.integers(1, 3))
def test_amp_random_patterns(bad, acc, clip, interval):
  kw = dict(amp=True, acc=acc, clip=clip, loss_scale=dict(init_scale=8.0, growth_interval=interval))
  _compare(_run_torch(bad, **kw), _run_jax(bad, **kw))
