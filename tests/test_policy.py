"""Tests of the precision policy: parsing, casting and the mixed-precision loss wrapper."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from tests._problems import classification

F16, BF16, F32 = jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)


def dtypes(policy):
  return policy.param_dtype, policy.compute_dtype, policy.output_dtype


@pytest.mark.parametrize("spec, expected", [
    ("params=float32,compute=float16,output=float32", (F32, F16, F32)),
    ("params=float32,compute=bfloat16,output=bfloat16", (F32, BF16, BF16)),
    ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
    ("P = F32 , C = FP16 , O = F32", (F32, F16, F32)),
    ("param=float32,c=half", (F32, F16, F32)),
    ("compute=bf16", (F32, BF16, F32)),
    ("o=f16,p=f32,c=f16", (F32, F16, F16)),
    ("c=half", (F32, F16, F32)),
    ("p=f32", (F32, F32, F32)),
    ("params=float16,compute=float16,output=float16", (F16, F16, F16)),
])
def test_get_policy_parses_long_and_short_forms(spec, expected):
  assert dtypes(jaxamp.get_policy(spec)) == expected


@pytest.mark.parametrize("spec, name", [
    ("half", "float16"), ("F16", "float16"), ("bf16", "bfloat16"), ("float32", "float32"),
    (jnp.bfloat16, "bfloat16"), (np.dtype(np.float16), "float16"),
])
def test_a_single_dtype_is_refused_naming_both_readings(spec, name):
  with pytest.raises(ValueError) as info:
    jaxamp.get_policy(spec)
  message = str(info.value)
  assert f"params={name},compute={name},output={name}" in message  # jmp's reading
  assert f"params=float32,compute={name},output=float32" in message  # the mixed one
  assert "jaxamp.autocast" in message and "ambiguous" in message
  with pytest.raises(ValueError, match="ambiguous"):
    jaxamp.mixed_precision(jnp.sin, spec)


def test_get_policy_returns_a_policy_unchanged():
  policy = jaxamp.Policy("f32", "f16", "f16")
  assert jaxamp.get_policy(policy) is policy


def test_str_round_trips():
  for spec in ("c=half", "p=f32,c=bf16,o=bf16", "p=f32"):
    policy = jaxamp.get_policy(spec)
    assert jaxamp.get_policy(str(policy)) == policy
  assert str(jaxamp.get_policy("c=half")) == "params=float32,compute=float16,output=float32"


@pytest.mark.parametrize("spec", [
    "quarter", "params=float32,compute=float8", "p=f32,x=f16", "p=f32,p=f16", "p=f32,",
    "p=f32;c=f16", "", "params float32",
])
def test_bad_strings_list_the_accepted_forms(spec):
  with pytest.raises(ValueError) as info:
    jaxamp.get_policy(spec)
  message = str(info.value)
  assert repr(spec) in message
  for form in ("params=float32,compute=float16,output=float32", "params|p", "compute|c",
               "output|o", "'c=f16'", "bfloat16"):
    assert form in message


@pytest.mark.parametrize("spec", [3, None, jnp.int32])
def test_bad_types_are_type_or_value_errors(spec):
  with pytest.raises((TypeError, ValueError), match="policy"):
    jaxamp.get_policy(spec)


def test_policy_constructor_validates_each_field():
  with pytest.raises(ValueError, match="compute_dtype must be a floating-point dtype, got int32"):
    jaxamp.Policy(jnp.float32, jnp.int32, jnp.float32)
  with pytest.raises(ValueError, match="output_dtype must be one of"):
    jaxamp.Policy("f32", "f16", "tiny")
  with pytest.raises(TypeError, match=r"param_dtype must be a floating-point dtype \(a dtype or"):
    jaxamp.Policy(object(), "f16", "f32")


def test_casts_touch_only_floating_array_leaves():
  policy = jaxamp.get_policy("p=f32,c=bf16,o=f16")
  tree = {
      "w": jnp.ones((2, 3), jnp.float32),
      "h": np.ones(2, np.float16),
      "labels": jnp.arange(3, dtype=jnp.int32),
      "mask": jnp.array([True, False]),
      "z": jnp.ones(2, jnp.complex64),
      "lr": 0.5,
      "name": "layer",
      "nothing": None,
  }
  for cast, dtype in ((policy.cast_to_compute, BF16), (policy.cast_to_output, F16),
                      (policy.cast_to_param, F32)):
    out = cast(tree)
    assert out["w"].dtype == dtype and out["h"].dtype == dtype
    assert out["labels"].dtype == jnp.int32 and out["mask"].dtype == jnp.bool_
    assert out["z"].dtype == jnp.complex64
    assert out["lr"] == 0.5 and out["name"] == "layer" and out["nothing"] is None
    assert jax.tree.structure(out) == jax.tree.structure(tree)


def test_casts_work_under_jit_on_tracers():
  policy = jaxamp.get_policy("c=f16")
  out = jax.jit(policy.cast_to_compute)({"w": jnp.ones(2), "i": jnp.ones(2, jnp.int32)})
  assert out["w"].dtype == F16 and out["i"].dtype == jnp.int32


def _mlp_loss(params, x, labels):
  h = jnp.tanh(x @ params["w1"] + params["b1"][None])
  logits = h @ params["w2"]
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


@pytest.mark.parametrize("spec, compute", [("c=half", F16), ("p=f32,c=bf16,o=f32", BF16)])
def test_mixed_precision_computes_in_half_and_returns_float32_grads(spec, compute):
  params, x, labels = classification()
  loss_fn = jaxamp.mixed_precision(_mlp_loss, spec)
  loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, x, labels)
  assert loss.dtype == F32
  assert all(g.dtype == F32 for g in jax.tree.leaves(grads))
  # Every matrix product, forward and backward, runs in the compute dtype.
  jaxpr = jax.make_jaxpr(jax.value_and_grad(loss_fn))(params, x, labels)
  dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
  assert len(dots) == 2 + 3  # 2 forward, 3 backward (the input needs no gradient)
  for eqn in dots:
    assert [v.aval.dtype for v in eqn.invars] == [compute, compute]
  # Integer labels are not cast.
  assert labels.dtype == jnp.int32
  # Close to the float32 values, within half-precision tolerance.
  ref_loss, ref_grads = jax.value_and_grad(_mlp_loss)(params, x, labels)
  tol = 1e-2 if compute == F16 else 5e-2
  np.testing.assert_allclose(loss, ref_loss, rtol=tol)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, r, rtol=tol, atol=tol * float(jnp.max(jnp.abs(r))))


def test_mixed_precision_checked_inside_with_a_debug_callback():
  seen = []

  def loss_fn(params, x):
    jax.debug.callback(lambda d: seen.append(d.dtype), params["w"])
    return jnp.sum(params["w"] * x)

  f = jaxamp.mixed_precision(loss_fn, "c=f16")
  grads = jax.grad(f)({"w": jnp.ones(3)}, jnp.ones(3))
  assert seen == [F16] and grads["w"].dtype == F32


def test_mixed_precision_casts_outputs_and_aux_and_keeps_kwargs():
  def loss_fn(params, x, *, bias):
    pred = params["w"] * x + bias
    return jnp.sum(pred), {"pred": pred, "count": jnp.int32(3)}

  f = jaxamp.mixed_precision(loss_fn, "p=f32,c=f16,o=f32")
  (loss, aux), grads = jax.value_and_grad(f, has_aux=True)(
      {"w": jnp.ones(3)}, jnp.ones(3), bias=jnp.ones(3))
  assert loss.dtype == F32 and aux["pred"].dtype == F32 and aux["count"].dtype == jnp.int32
  assert grads["w"].dtype == F32
  assert f.__name__ == "loss_fn"


def test_mixed_precision_with_loss_scaling_end_to_end():
  import optax

  params, x, labels = classification()
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.5), init_scale=2.0**10)
  opt_state = tx.init(params)
  loss_fn = jaxamp.mixed_precision(_mlp_loss, "c=f16")

  @jax.jit
  def step(params, opt_state):
    scaled = lambda p: jaxamp.scale_loss(loss_fn(p, x, labels), opt_state)
    grads = jax.grad(scaled)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  first = _mlp_loss(params, x, labels)
  for _ in range(10):
    params, opt_state = step(params, opt_state)
  assert all(p.dtype == F32 for p in jax.tree.leaves(params))
  assert _mlp_loss(params, x, labels) < 0.8 * first
