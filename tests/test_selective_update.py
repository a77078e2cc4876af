"""The fused selection of an optimizer update (select_update)."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp._src import finite
from jaxamp._src import selective_update
from tests._floats import bits


# -------------------------------------------------------------------------------- select_update


@pytest.fixture(scope="module")
def adam_setup():
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))
  params = {"w": jnp.array([1.0, -0.0, -2.0]), "b": jnp.zeros(2)}
  with jax.numpy_dtype_promotion("standard"):
    state = tx.init(params)
    grads = {"w": jnp.array([0.5, -1.0, 2.0]), "b": jnp.ones(2)}
    # One step so that the state is not all zeros.
    _, state = tx.update(grads, state, params)
  return tx, params, state, grads


def _naive(pred, tx, grads, state, params):
  updates, new_state = tx.update(grads, state, params)
  updates = jax.tree.map(lambda u: jnp.where(pred, u, -0.0 * jnp.ones_like(u)), updates)
  return updates, optax.tree.where(pred, new_state, state)


@pytest.mark.parametrize("pred", [True, False])
@pytest.mark.parametrize("fallback", [False, True])
def test_select_update_equals_the_naive_selection(adam_setup, monkeypatch, pred, fallback):
  tx, params, state, grads = adam_setup
  if fallback:  # the plain path, taken when the tracing cannot be used

    def broken(*args, **kwargs):
      raise RuntimeError("unusable jaxpr")

    monkeypatch.setattr(selective_update, "_eval_selecting", broken)

  @jax.jit
  def both(pred):
    with jax.numpy_dtype_promotion("standard"):
      got = selective_update.select_update(pred, lambda: tx.update(grads, state, params), state)
      return got, _naive(pred, tx, grads, state, params)

  if fallback:
    monkeypatch.setattr(selective_update, "_warned", set())
    with pytest.warns(RuntimeWarning, match="unusable jaxpr"):  # loud, naming the reason
      got, want = both(jnp.array(pred))
  else:
    got, want = both(jnp.array(pred))
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == w.dtype
    if pred:
      # XLA fuses the two programs differently, so the last bit may differ.
      np.testing.assert_allclose(g, w, rtol=1e-6)
    else:
      np.testing.assert_array_equal(np.atleast_1d(g).view(np.uint8),
                                    np.atleast_1d(w).view(np.uint8))
  if not pred:
    for g, s in zip(jax.tree.leaves(got[1]), jax.tree.leaves(state)):
      np.testing.assert_array_equal(g, s)
    new_params = optax.apply_updates(params, got[0])
    np.testing.assert_array_equal(bits(new_params["w"]), bits(params["w"]))  # -0.0 stays -0.0


@pytest.mark.parametrize("value", [1e30, np.nan, np.inf])
def test_a_clipped_step_decides_on_the_gradients_not_their_norm(value):
  """Squares that overflow in the clip's norm are not an overflow; nan and inf are."""
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
  tx = jaxamp.dynamic_loss_scale(inner, init_scale=1.0)
  params = {"w": jnp.array([1.0, 2.0]), "b": jnp.array([0.5])}
  grads = {"w": jnp.array([value, 1.0]), "b": jnp.array([1.0])}
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  finite = bool(np.isfinite(value))
  assert bool(state.skipped) is (not finite)
  if finite:  # the norm is inf: the clipped step is what the inner alone gives
    want, _ = inner.update(grads, inner.init(params), params)
    for u, w in zip(jax.tree.leaves(updates), jax.tree.leaves(want)):
      np.testing.assert_array_equal(bits(u), bits(w))


@pytest.mark.parametrize("scale,grad", [
    (2.0**10, 3.0),
    (1000.0, 3.0),  # not a power of two
    (0.25, 3.0),  # below 1
    (2.0**127, 3.0 * 2.0**120),  # no normal reciprocal
    (2.0**10, 1e20),  # the raw squares overflow, the unscaled ones do not
    (2.0**10, 1e-17),  # the unscaled squares are subnormal, the raw ones are not
    (2.0**10, np.inf),
])
def test_a_clipped_step_is_the_clipped_step_of_the_unscaled_gradients(scale, grad):
  inner = optax.chain(optax.clip_by_global_norm(1e-30), optax.sgd(1.0))
  tx = jaxamp.dynamic_loss_scale(inner, init_scale=scale, max_scale=2.0**127)
  params = {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4)}
  grads = {"w": jnp.full((3, 4), grad, jnp.float32), "b": jnp.arange(4.0) * grad}
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  unscaled = finite.unscale(grads, scale)
  want, _ = jax.jit(inner.update)(unscaled, inner.init(params), params)
  assert bool(state.skipped) is (not np.isfinite(grad))
  if np.isfinite(grad):
    for u, w in zip(jax.tree.leaves(updates), jax.tree.leaves(want)):
      np.testing.assert_allclose(u, w, rtol=1e-6)


def test_select_update_reruns_a_broken_update_to_raise_its_own_error():
  def broken():
    raise KeyError("from the inner update")

  with pytest.raises(KeyError, match="from the inner update"):
    selective_update.select_update(jnp.array(True), broken, ())


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="reads XLA:CPU's compiled HLO")
def test_select_update_fuses_the_selection_into_the_inner_update():
  """No copy of a donated optimizer-state buffer, as the naive selection causes."""
  tx = optax.adam(1e-3)
  params = {f"p{i}": jnp.ones(4096) for i in range(3)}
  with jax.numpy_dtype_promotion("standard"):
    state = tx.init(params)

  def step(params, state, grads, pred, fused):
    with jax.numpy_dtype_promotion("standard"):
      if fused:
        updates, state = selective_update.select_update(pred, lambda: tx.update(grads, state, params), state)
      else:
        updates, state = _naive(pred, tx, grads, state, params)
    return optax.apply_updates(params, updates), state

  def copies(fused):
    lowered = jax.jit(step, donate_argnums=(0, 1), static_argnums=4).lower(
        params, state, params, jnp.array(True), fused)
    text = lowered.compile().as_text()
    entry = text[text.index("\nENTRY"):]
    return sum(" copy(" in line and "f32[4096]" in line for line in entry.splitlines())

  assert copies(True) == 0


# ------------------------------------------------------------------------------------ optax zoo


def _zoo():
  lr = 1e-2
  return {
      "sgd": optax.sgd(lr),
      "momentum": optax.sgd(lr, momentum=0.9, nesterov=True),
      "adam": optax.adam(lr),
      "adamw": optax.adamw(lr, weight_decay=1e-2),
      "lion": optax.lion(lr),
      "adafactor": optax.adafactor(lr),
      "lamb": optax.lamb(lr),
      "schedule_free": optax.contrib.schedule_free_adamw(lr),
      "inject_hyperparams": optax.inject_hyperparams(optax.adam)(learning_rate=lr),
      "multi_transform": optax.multi_transform(
          {"a": optax.adam(lr), "s": optax.sgd(lr)}, {"w": "a", "b": "s", "m": "a"}),
      "multi_steps": optax.MultiSteps(optax.adam(lr), every_k_schedule=2),
      "clip_chain": optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr)),
  }


# The largest difference, in units in the last place, between the fused and the
# plain selection on an applied step: none, except where XLA fuses the two
# programs differently and contracts another multiply-add into an FMA (measured
# on XLA:CPU; the selection itself is exact). jaxlib 0.12's XLA:CPU does so in
# adamw's too.
ZOO_ULPS = {"clip_chain": 1, "schedule_free": 1, "adamw": 1}


def _ulps(a, b):
  a, b = np.asarray(a), np.asarray(b)
  if not np.issubdtype(a.dtype, np.floating):
    return 0 if np.array_equal(a, b) else np.inf
  ia = a.astype(np.float32).view(np.int32).astype(np.int64)
  ib = b.astype(np.float32).view(np.int32).astype(np.int64)
  ia = np.where(ia < 0, np.int64(-2**31) - ia, ia)
  ib = np.where(ib < 0, np.int64(-2**31) - ib, ib)
  return int(np.max(np.abs(ia - ib), initial=0))


@pytest.mark.parametrize("name", sorted(_zoo()))
def test_the_fused_selection_takes_its_path_and_matches_the_plain_one(name, monkeypatch):
  tx = _zoo()[name]
  params = {"w": jnp.linspace(-1.0, 1.0, 24).reshape(4, 6), "b": jnp.array([0.5, -0.0, 2.0]),
            "m": jnp.linspace(0.1, 0.9, 12).reshape(3, 4)}
  grads = [jax.tree.map(lambda p, k=k: jnp.sin(p * (k + 3.0)) + 0.1 * k, params) for k in range(3)]
  interpreted = []
  real_eval = selective_update._eval_selecting

  def counting(*args, **kwargs):
    out = real_eval(*args, **kwargs)
    interpreted.append(True)
    return out

  monkeypatch.setattr(selective_update, "_eval_selecting", counting)

  @functools.partial(jax.jit, static_argnums=4)
  def step(params, state, grads, pred, fused):
    previous = selective_update.set_fused_selection(fused)
    try:
      with jax.numpy_dtype_promotion("standard"):
        updates, state = selective_update.select_update(
            pred, lambda: tx.update(grads, state, params), state)
    finally:
      selective_update.set_fused_selection(previous)
    return optax.apply_updates(params, updates), state

  with jax.numpy_dtype_promotion("standard"):
    state = tx.init(params)
  fused_run, plain_run = (params, state), (params, state)
  for k, (g, pred) in enumerate(zip(grads, [True, False, True])):
    before = fused_run
    fused_run = step(*fused_run, g, jnp.array(pred), True)
    plain_run = step(*plain_run, g, jnp.array(pred), False)
    if not pred:  # skipped: params and state bit-identical
      for a, b in zip(jax.tree.leaves(fused_run), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.atleast_1d(a).view(np.uint8),
                                      np.atleast_1d(b).view(np.uint8))
    for f, p in zip(jax.tree.leaves(fused_run), jax.tree.leaves(plain_run)):
      assert f.dtype == p.dtype
      assert _ulps(f, p) <= ZOO_ULPS.get(name, 0), (name, k, _ulps(f, p))
  assert interpreted, "the fused path was not taken"


def test_set_fused_selection_chooses_the_plain_path(adam_setup, monkeypatch):
  tx, params, state, grads = adam_setup

  def unused(*args, **kwargs):
    raise AssertionError("the fused path was taken")

  monkeypatch.setattr(selective_update, "_eval_selecting", unused)
  previous = selective_update.set_fused_selection(False)
  try:
    with jax.numpy_dtype_promotion("standard"):
      updates, new_state = selective_update.select_update(
          jnp.array(False), lambda: tx.update(grads, state, params), state)
  finally:
    selective_update.set_fused_selection(previous)
  assert previous is True
  for n, o in zip(jax.tree.leaves(new_state), jax.tree.leaves(state)):
    np.testing.assert_array_equal(n, o)
  with pytest.raises(TypeError, match="enabled must be a bool"):
    selective_update.set_fused_selection("no")


def test_the_fallback_warns_once_per_reason(adam_setup, monkeypatch):
  tx, params, state, grads = adam_setup

  def broken(*args, **kwargs):
    raise NotImplementedError("a primitive it cannot bind")

  monkeypatch.setattr(selective_update, "_eval_selecting", broken)
  monkeypatch.setattr(selective_update, "_warned", set())
  run = lambda: selective_update.select_update(  # noqa: E731
      jnp.array(True), lambda: tx.update(grads, state, params), state)
  with jax.numpy_dtype_promotion("standard"):
    with pytest.warns(RuntimeWarning, match="NotImplementedError: a primitive it cannot bind"):
      run()
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      run()  # the same reason: no second warning
