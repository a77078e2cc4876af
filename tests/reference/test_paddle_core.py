"""jaxamp.dynamic_loss_scale(hysteresis=n) against paddle.amp.GradScaler, step by step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import jaxamp
from tests.reference._refs import import_reference, paddle_scaler_on_cpu

paddle = import_reference("paddle")

# Paddle converts one-element arrays to floats in a way NumPy deprecates.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _paddle_run(grads_seq, **kw):
  param = paddle.create_parameter([3], "float32",
                                  default_initializer=paddle.nn.initializer.Assign(
                                      np.array([1.0, -2.0, 0.5], np.float32)))
  opt = paddle.optimizer.SGD(learning_rate=0.5, parameters=[param])
  scaler = paddle_scaler_on_cpu(**kw)
  out = []
  for g in grads_seq:
    loss = (param * paddle.to_tensor(g)).sum()
    loss.backward()
    scaler.minimize(opt, loss)
    opt.clear_grad()
    out.append((float(scaler._scale.numpy().reshape(())), param.numpy().copy()))
  return out


def _jax_run(grads_seq, *, init_loss_scaling, incr_ratio, decr_ratio, incr_every_n_steps,
             decr_every_n_nan_or_inf):
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.5), init_scale=init_loss_scaling,
                                 growth_factor=incr_ratio, backoff_factor=decr_ratio,
                                 growth_interval=incr_every_n_steps,
                                 hysteresis=decr_every_n_nan_or_inf)
  params = jnp.array([1.0, -2.0, 0.5], jnp.float32)
  state = tx.init(params)
  step = jax.jit(lambda p, s, g: (lambda u_s: (optax.apply_updates(p, u_s[0]), u_s[1]))(
      tx.update(g, s, p)))
  out = []
  for g in grads_seq:
    params, state = step(params, state, jnp.asarray(g))
    out.append((float(state.scale), np.asarray(params)))
  return out


@settings(max_examples=20, deadline=None, derandomize=True)
@given(bad=st.lists(st.booleans(), min_size=1, max_size=20), incr=st.integers(1, 4),
       decr=st.integers(1, 3), init_exp=st.integers(0, 12))
def test_hysteresis_trajectory_matches_paddle(bad, incr, decr, init_exp):
  kw = dict(init_loss_scaling=2.0**init_exp, incr_ratio=2.0, decr_ratio=0.5,
            incr_every_n_steps=incr, decr_every_n_nan_or_inf=decr)
  rng = np.random.default_rng(len(bad))
  seq = []
  for b in bad:
    g = (rng.standard_normal(3) * 2.0**init_exp).astype(np.float32)
    if b:
      g[2] = np.inf
    seq.append(g)
  for (ps, pp), (js, jp) in zip(_paddle_run(seq, **kw), _jax_run(seq, **kw)):
    assert ps == js
    np.testing.assert_array_equal(pp, jp)
