"""jaxamp.dynamic_loss_scale against torch.amp.GradScaler("cpu"), step by step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import jaxamp
from tests.reference._refs import import_reference

torch = import_reference("torch")

KINDS = st.sampled_from(["ok", "ok", "ok", "inf", "nan", "big"])


def _torch_run(grads_seq, lr, **scaler_kw):
  param = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=torch.float32))
  opt = torch.optim.SGD([param], lr=lr)
  scaler = torch.amp.GradScaler("cpu", **scaler_kw)
  scaler.scale(torch.ones(()))  # creates the scale tensor
  out = []
  for g in grads_seq:
    opt.zero_grad()
    param.grad = torch.tensor(g, dtype=torch.float32)
    scaler.step(opt)
    scaler.update()
    out.append((scaler.get_scale(), scaler._get_growth_tracker(), param.detach().numpy().copy()))
  return out


def _jax_run(grads_seq, lr, **kw):
  tx = jaxamp.dynamic_loss_scale(optax.sgd(lr), **kw)
  params = jnp.array([1.0, -2.0, 0.5], jnp.float32)
  state = tx.init(params)

  @jax.jit
  def step(params, state, g):
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  out = []
  for g in grads_seq:
    params, state = step(params, state, jnp.asarray(g, jnp.float32))
    out.append((float(state.scale), int(state.growth_tracker), np.asarray(params)))
  return out


def _grads(kinds, scale_hint):
  rng = np.random.default_rng(len(kinds))
  seq = []
  for kind in kinds:
    g = rng.standard_normal(3).astype(np.float32) * np.float32(scale_hint)
    if kind == "inf":
      g[1] = np.inf
    elif kind == "nan":
      g[0] = np.nan
    elif kind == "big":  # finite scaled grads that overflow nothing
      g = g * np.float32(1e3)
    seq.append(g)
  return seq


@settings(max_examples=25, deadline=None, derandomize=True)
@given(kinds=st.lists(KINDS, min_size=1, max_size=25), interval=st.integers(1, 4),
       init_exp=st.integers(-3, 20))
def test_power_of_two_trajectory_is_bit_identical(kinds, interval, init_exp):
  kw = dict(init_scale=2.0**init_exp, growth_factor=2.0, backoff_factor=0.5, growth_interval=interval)
  seq = _grads(kinds, 2.0**init_exp)
  for (ts, tt, tp), (js, jt, jp) in zip(_torch_run(seq, 0.5, **kw), _jax_run(seq, 0.5, **kw)):
    assert ts == js and tt == jt
    np.testing.assert_array_equal(tp, jp)


@pytest.mark.parametrize("growth,backoff", [(1.5, 0.3), (3.0, 0.25), (1.1, 0.9)])
def test_other_factors_within_one_ulp(growth, backoff):
  kinds = ["ok", "inf", "ok", "ok", "nan", "ok", "ok", "ok", "inf", "inf", "ok", "ok"] * 3
  kw = dict(init_scale=1000.0, growth_factor=growth, backoff_factor=backoff, growth_interval=1)
  seq = _grads(kinds, 1.0)
  for (ts, tt, _), (js, jt, _) in zip(_torch_run(seq, 0.5, **kw), _jax_run(seq, 0.5, **kw)):
    assert tt == jt
    assert abs(np.float32(ts) - np.float32(js)) <= np.spacing(np.float32(ts))


def test_top_of_range_matches_torch():
  # 2^127 grows no further; its reciprocal is a denormal, which must not zero the grads.
  kw = dict(init_scale=2.0**125, growth_interval=1)
  seq = [np.array([2.0**126, -2.0**125, 2.0**124], np.float32)] * 4
  for (ts, tt, tp), (js, jt, jp) in zip(_torch_run(seq, 0.5, **kw), _jax_run(seq, 0.5, **kw)):
    assert ts == js and tt == jt
    np.testing.assert_array_equal(tp, jp)
