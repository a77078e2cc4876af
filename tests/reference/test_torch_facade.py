"""jaxamp.GradScaler + jaxamp.OptimWrapper against torch.amp.GradScaler("cpu") + torch.optim.SGD."""

import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import given, settings, strategies as st

import jaxamp
from tests.reference._refs import import_reference

torch = import_reference("torch")

X = np.array([3.0, -4.0, 0.5], np.float32)
W0 = np.array([1.0, 2.0, -1.0], np.float32)


def _loss(params, x, factor):
  return jnp.sum(params["w"] * x) * factor


def _factor(kind, k=1):
  return {"ok": 1.0, "inf": float("inf"), "nan": float("nan")}[kind] / k


class TorchLoop:
  def __init__(self, n_opt, clip, **kw):
    self.ws = [torch.nn.Parameter(torch.tensor(W0)) for _ in range(n_opt)]
    self.opts = [torch.optim.SGD([w], lr=0.25) for w in self.ws]
    self.scaler = torch.amp.GradScaler("cpu", **kw)
    self.clip = clip

  def micro(self, kinds, k=1):
    for w, kind in zip(self.ws, kinds):
      loss = (w * torch.tensor(X)).sum() * _factor(kind, k)
      self.scaler.scale(loss).backward()

  def step(self):
    for w, opt in zip(self.ws, self.opts):
      if self.clip:
        self.scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_([w], self.clip)
      self.scaler.step(opt)
    self.scaler.update()
    for opt in self.opts:
      opt.zero_grad()
    return [w.detach().numpy().copy() for w in self.ws], self.scaler.get_scale()


class JaxLoop:
  def __init__(self, n_opt, clip, **kw):
    clip_grad = dict(max_norm=clip) if clip else None
    self.opts = [jaxamp.OptimWrapper(optax.sgd(0.25), {"w": jnp.asarray(W0)}, clip_grad=clip_grad)
                 for _ in range(n_opt)]
    self.scaler = jaxamp.GradScaler("cpu", **kw)
    self.clip = clip

  def micro(self, kinds, k=1):
    for opt, kind in zip(self.opts, kinds):
      opt.backward(self.scaler.scale(_loss), jnp.asarray(X), jnp.float32(_factor(kind, k)))

  def step(self):
    for opt in self.opts:
      if self.clip:
        self.scaler.unscale_(opt)
      self.scaler.step(opt)
    self.scaler.update()
    for opt in self.opts:
      opt.zero_grad()
    return [np.asarray(o.params["w"]) for o in self.opts], self.scaler.get_scale()


def _check(t, j):
  (tw, ts), (jw, js) = t, j
  assert ts == js
  for a, b in zip(tw, jw):
    np.testing.assert_allclose(b, a, rtol=2e-6, atol=1e-6)


KIND = st.sampled_from(["ok", "ok", "ok", "inf", "nan"])


@settings(max_examples=12, deadline=None, derandomize=True)
@given(pattern=st.lists(st.tuples(KIND, KIND), min_size=1, max_size=10), n_opt=st.integers(1, 2),
       clip=st.sampled_from([None, 1.0]), interval=st.integers(1, 3))
def test_loops_match(pattern, n_opt, clip, interval):
  kw = dict(init_scale=2.0**10, growth_interval=interval)
  t, j = TorchLoop(n_opt, clip, **kw), JaxLoop(n_opt, clip, **kw)
  for kinds in pattern:
    t.micro(kinds)
    j.micro(kinds)
    _check(t.step(), j.step())


@settings(max_examples=8, deadline=None, derandomize=True)
@given(pattern=st.lists(KIND, min_size=2, max_size=12), k=st.integers(2, 3))
def test_accumulation_recipe_matches(pattern, k):
  kw = dict(init_scale=2.0**8, growth_interval=2)
  t, j = TorchLoop(1, None, **kw), JaxLoop(1, None, **kw)
  for i, kind in enumerate(pattern):
    t.micro([kind], k)
    j.micro([kind], k)
    if (i + 1) % k == 0:
      _check(t.step(), j.step())


def test_state_dict_round_trip_both_ways():
  kw = dict(init_scale=2.0**6, growth_interval=2, growth_factor=4.0, backoff_factor=0.25)
  t, j = TorchLoop(1, None, **kw), JaxLoop(1, None, **kw)
  for kind in ["ok", "inf", "ok"]:
    t.micro([kind])
    j.micro([kind])
    _check(t.step(), j.step())
  # torch -> jaxamp, and jaxamp -> torch: both continue the same trajectory.
  j2 = JaxLoop(1, None)
  j2.opts = j.opts
  j2.scaler.load_state_dict(t.scaler.state_dict())
  t2 = TorchLoop(1, None)
  t2.ws, t2.opts = t.ws, t.opts
  t2.scaler.load_state_dict(j.scaler.state_dict())
  assert t.scaler.state_dict() == j.scaler.state_dict()
  for kind in ["ok", "ok", "nan", "ok", "ok", "ok"]:
    t2.micro([kind])
    j2.micro([kind])
    _check(t2.step(), j2.step())
    assert t2.scaler.state_dict() == j2.scaler.state_dict()
