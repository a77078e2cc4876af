"""PyTorch's AMP recipes, ported as written, with jaxamp.GradScaler and jaxamp.OptimWrapper."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

W0 = {"w": jnp.array([[0.5, -1.0], [2.0, 0.25]]), "b": jnp.array([0.1, -0.2])}
X = jnp.array([[1.0, 2.0], [-0.5, 0.3], [0.7, -1.2]])


def loss_fn(params, x):
  return jnp.mean(jnp.tanh(x @ params["w"] + params["b"][None, :]) ** 2)


def penalized_loss(scaler):
  """PyTorch's gradient-penalty recipe: the penalty of the gradients of the *scaled* loss."""

  def loss(params, x):
    scaled_grads = jax.grad(lambda p: scaler.scale(loss_fn(p, x)))(params)  # scaler.scale(loss)
    inv_scale = 1.0 / scaler.get_scale()
    grads = jax.tree.map(lambda g: g * inv_scale, scaled_grads)
    grad_norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
    return loss_fn(params, x) + grad_norm

  return loss


def _reference_penalty(params, x):
  grads = jax.grad(loss_fn)(params, x)
  return loss_fn(params, x) + jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))


def test_gradient_penalty_follows_the_scale_from_step_to_step():
  opt = jaxamp.OptimWrapper(optax.sgd(0.1), W0)
  scaler = jaxamp.GradScaler(init_scale=2.0**16, growth_interval=1)
  ref = jaxamp.OptimWrapper(optax.sgd(0.1), W0)
  loss = penalized_loss(scaler)
  for step in range(6):
    opt.zero_grad()
    opt.backward(scaler.scale(loss), X)
    scaler.step(opt)
    scaler.update()
    ref.zero_grad()
    ref.backward(_reference_penalty, X)
    ref.step()
    for a, b in zip(jax.tree.leaves(opt.params), jax.tree.leaves(ref.params)):
      np.testing.assert_allclose(a, b, rtol=1e-5, err_msg=f"step {step}")
  assert scaler.get_scale() == 2.0**22  # grew every step: nothing was frozen or skipped


def test_the_scale_read_inside_ones_own_jit_is_refused_with_the_fix():
  scaler = jaxamp.GradScaler()

  @jax.jit
  def frozen(x):
    return scaler.scale(x) * (1.0 / scaler.get_scale())

  with pytest.raises(RuntimeError, match=r"would be frozen.*scaler.state.scale"):
    frozen(jnp.float32(1.0))

  @jax.jit
  def passed(x, scale):  # the fix the message names
    return x * scale

  assert float(passed(jnp.float32(1.0), scaler.state.scale)) == 2.0**16


def test_unscale_clip_step_ports_line_by_line():
  """PyTorch's gradient-clipping recipe: unscale_, clip_grad_norm_ on the grads, step."""
  opt = jaxamp.OptimWrapper(optax.sgd(0.1), W0)
  scaler = jaxamp.GradScaler(init_scale=1024.0)
  opt.backward(scaler.scale(loss_fn), X)
  scaler.unscale_(opt)
  norm = jaxamp.clip_grad_norm_(opt, 0.01)
  scaler.step(opt)
  scaler.update()
  grads = jax.grad(loss_fn)(W0, X)
  want_norm = jaxamp.total_grad_norm(grads)
  np.testing.assert_allclose(norm, want_norm, rtol=1e-6)
  clipped, _ = jaxamp.clip_grad_norm(0.01).update(grads, jaxamp.clip_grad_norm(0.01).init(grads))
  for p, w, g in zip(jax.tree.leaves(opt.params), jax.tree.leaves(W0), jax.tree.leaves(clipped)):
    np.testing.assert_allclose(p, w - 0.1 * g, rtol=1e-5)
  with pytest.raises(TypeError, match="use the jaxamp.clip_grad_norm transformation"):
    jaxamp.clip_grad_norm_(grads, 1.0)


def test_wrappers_built_in_every_iteration_compile_once():
  """``with torch.autocast():`` ported inside the loop: a new wrapper each time, one compile."""
  from tests._tracing import trace_counts
  opt = jaxamp.OptimWrapper(optax.sgd(0.1), W0)
  scaler = jaxamp.GradScaler()
  for _ in range(5):
    for wrap in (lambda f: jaxamp.mixed_precision(f, "c=bf16"),
                 lambda f: jaxamp.autocast(f, jnp.bfloat16)):
      opt.zero_grad()
      opt.backward(scaler.scale(wrap(loss_fn)), X)
      scaler.step(opt)
      scaler.update()
  assert trace_counts(opt)["grad"] == 2  # once per kind of wrapper, not once per iteration


def test_a_loss_written_inside_the_loop_warns_that_every_iteration_compiles():
  """``opt.backward(scaler.scale(lambda p: loss_fn(p, batch)))`` in the loop: one warning."""
  opt = jaxamp.OptimWrapper(optax.sgd(0.1), W0)
  scaler = jaxamp.GradScaler()
  with pytest.warns(RuntimeWarning, match="every iteration compiles") as caught:
    for step in range(3):
      batch = X * (1.0 + step)
      opt.zero_grad()
      opt.backward(scaler.scale(lambda p: loss_fn(p, batch)))
      scaler.step(opt)
      scaler.update()
  assert len(caught) == 1


def test_a_loss_defined_once_or_run_eagerly_does_not_warn():
  opt = jaxamp.OptimWrapper(optax.sgd(0.1), W0)
  scaler = jaxamp.GradScaler()
  for step in range(3):  # filterwarnings = error: a warning fails the test
    opt.zero_grad()
    opt.backward(scaler.scale(loss_fn), X * (1.0 + step))
    with jax.disable_jit():
      opt.backward(scaler.scale(lambda p, x: loss_fn(p, x)), X)
    scaler.step(opt)
    scaler.update()


def test_backward_of_a_scaled_loss_returns_the_loss_itself():
  """What a PyTorch loop logs is the loss before ``scaler.scale``."""
  opt = jaxamp.OptimWrapper(optax.sgd(0.1), W0)
  scaler = jaxamp.GradScaler(init_scale=2.0**16)
  loss = opt.backward(scaler.scale(loss_fn), X)
  np.testing.assert_allclose(loss, loss_fn(W0, X), rtol=1e-6)
  np.testing.assert_allclose(opt.grads["w"], 2.0**16 * jax.grad(loss_fn)(W0, X)["w"], rtol=1e-5)


# PyTorch's "multiple models, losses and optimizers": two losses over two models, one scaler.
PA = {"w": jnp.array([[0.5, -0.3], [0.2, 0.8]])}
PB = {"v": jnp.array([0.7, -1.1])}


def _out0(pa, pb, x):
  return jnp.tanh(x @ pa["w"]) @ pb["v"]


def loss0(ps, x):
  return jnp.mean(_out0(ps["a"], ps["b"], x) ** 2)


def loss1(ps, x):
  return jnp.mean((_out0(ps["a"], ps["b"], x) - 1.0) ** 2) + jnp.sum(ps["b"]["v"] ** 2)


def test_multiple_models_losses_and_optimizers_with_one_backward_per_loss():
  from jaxamp._src.facade.mmengine import optim_wrapper_dict
  compiled = optim_wrapper_dict._value_and_grads._cache_size()
  wrappers = jaxamp.OptimWrapperDict(a=jaxamp.OptimWrapper(optax.sgd(0.1), PA),
                                     b=jaxamp.OptimWrapper(optax.sgd(0.1, momentum=0.9), PB))
  scaler = jaxamp.GradScaler(init_scale=2.0**10, growth_interval=2)
  ref = {"a": jaxamp.OptimWrapper(optax.sgd(0.1), PA),
         "b": jaxamp.OptimWrapper(optax.sgd(0.1, momentum=0.9), PB)}
  # The reference: each wrapper differentiates each loss with respect to its own params.
  ref_losses = {(name, loss): (lambda p, x, q, loss=loss, name=name, other=other:
                               loss({name: p, other: q}, x))
                for name, other in (("a", "b"), ("b", "a")) for loss in (loss0, loss1)}
  for step in range(4):
    x = X * (1.0 + step)
    wrappers.zero_grad()
    out = wrappers.backward_all(scaler.scale(loss0), x)   # scaler.scale(loss0).backward()
    wrappers.backward_all(scaler.scale(loss1), x)          # scaler.scale(loss1).backward()
    scaler.unscale_(wrappers["a"])                         # optional, as in PyTorch
    scaler.step(wrappers["a"])
    scaler.step(wrappers["b"])
    scaler.update()
    np.testing.assert_allclose(out, loss0({"a": ref["a"].params, "b": ref["b"].params}, x),
                               rtol=1e-6)  # the loss itself, not the scaled one
    for name, other in (("a", "b"), ("b", "a")):
      ref[name].zero_grad()
      for loss in (loss0, loss1):
        ref[name].backward(ref_losses[name, loss], x, ref[other].params)
    for name in ("a", "b"):
      ref[name].step()
      for got, want in zip(jax.tree.leaves(wrappers[name].params),
                           jax.tree.leaves(ref[name].params)):
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"{name}, step {step}")
  assert scaler.get_scale() == 2.0**12  # two growths, nothing skipped
  assert optim_wrapper_dict._value_and_grads._cache_size() - compiled == 2  # per loss, not step


def test_backward_all_refuses_accumulating_wrappers():
  wrappers = jaxamp.OptimWrapperDict(a=jaxamp.OptimWrapper(optax.sgd(0.1), PA,
                                                           accumulative_counts=2))
  with pytest.raises(ValueError, match="backward_all needs accumulative_counts=1"):
    wrappers.backward_all(lambda ps, x: jnp.sum(ps["a"]["w"]), X)


def _half_loss(params, x):
  """A loss computed in float16: a large scale overflows its gradients."""
  h = x.astype(jnp.float16) @ params["w"].astype(jnp.float16) + params["b"].astype(jnp.float16)[None, :]
  return jnp.mean(jnp.tanh(h).astype(jnp.float32) ** 2)


def _penalty_run(make_scaler, form, init_scale, steps=32):
  """The gradient-penalty recipe, its inner scaled gradients written in ``form``; per-step values."""
  opt = jaxamp.OptimWrapper(optax.sgd(0.1), W0)
  scaler = make_scaler(init_scale)

  def penalized(params, x):
    if form == "function":
      scaled_grads = jax.grad(scaler.scale(_half_loss))(params, x)
    else:
      scaled_grads = jax.grad(lambda p: scaler.scale(_half_loss(p, x)))(params)
    inv_scale = 1.0 / scaler.scale(jnp.float32(1.0))  # the scale, asked for as an array
    grads = jax.tree.map(lambda g: g * inv_scale, scaled_grads)
    return _half_loss(params, x) + jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))

  trace = []
  for _ in range(steps):
    opt.zero_grad()
    loss = opt.backward(scaler.scale(penalized), X)
    scaler.step(opt)
    scaler.update()
    trace.append((np.asarray(loss), np.asarray(scaler.state.scale),
                  [np.asarray(p) for p in jax.tree.leaves(opt.params)]))
  return trace


_SCALERS = {
    "torch": lambda s: jaxamp.GradScaler(init_scale=s, growth_interval=4),
    "paddle": lambda s: jaxamp.paddle.GradScaler(init_loss_scaling=s, incr_every_n_steps=4,
                                                 decr_every_n_nan_or_inf=1),
}


@pytest.mark.parametrize("init_scale", [2.0**40, 2.0**16])
@pytest.mark.parametrize("facade", sorted(_SCALERS))
def test_gradient_penalty_function_and_array_forms_give_the_same_run(facade, init_scale):
  """Inside a scaled loss, scale(fn) multiplies by the traced scale, as scale(array) does."""
  by_function = _penalty_run(_SCALERS[facade], "function", init_scale)
  by_array = _penalty_run(_SCALERS[facade], "array", init_scale)
  for step, (a, b) in enumerate(zip(by_function, by_array)):
    np.testing.assert_array_equal(a[0], b[0], err_msg=f"loss at step {step}")
    np.testing.assert_array_equal(a[1], b[1], err_msg=f"scale at step {step}")
    for pa, pb in zip(a[2], b[2]):
      np.testing.assert_array_equal(pa, pb, err_msg=f"params at step {step}")
  assert np.isfinite(by_function[-1][0])  # recovered from the overflowing start
  assert not np.array_equal(by_function[-1][2][0], np.asarray(W0["b"]))  # and trained
