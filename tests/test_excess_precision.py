"""Every rounding jaxamp relies on survives excess precision, as XLA's GPU pipeline applies it.

On a GPU, XLA removes every ``convert(convert(x: f32) -> bf16) -> f32`` by default (the pass
SimplifyFPConversions; see tests/_excess_precision.py). A rounding written as such a round trip
does nothing there: Kahan-compensated bfloat16 parameters, whose compensation was
``y - (bfloat16(p + y) - p)``, kept a compensation of 0 on an H200 and stalled like round-to-nearest.
XLA:CPU keeps the round trip, so these tests run each program as the GPU compiles it
(:func:`collapse_conversions`) and require what the CPU computes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jaxamp
from tests._excess_precision import collapse_conversions

BF16 = jnp.bfloat16
ROUNDINGS = ["stochastic", "kahan", "nearest"]


def _bits(tree):
  return [np.asarray(x).reshape(-1).view(np.uint8) for x in jax.tree.leaves(tree)]


def _assert_same_bits(got, want):
  for g, w in zip(_bits(got), _bits(want), strict=True):
    np.testing.assert_array_equal(g, w)


# --- the rewrite does what the pass does ------------------------------------------------------

def test_the_rewrite_collapses_conversion_chains_as_the_pass_does():
  x = jnp.array([1.001, -3.14159, 65519.0, 1e-30], jnp.float32)

  def chains(x):
    through_a_call = jax.jit(lambda y: y.astype(BF16))(x).astype(jnp.float32)
    return (x.astype(BF16).astype(jnp.float32),  # f32 -> bf16 -> f32: x itself
            x.astype(BF16).astype(jnp.float16),  # f32 -> bf16 -> f16: f32 -> f16, one rounding
            through_a_call)  # XLA inlines calls before the pass

  collapsed = collapse_conversions(chains)
  same, one_rounding, called = jax.jit(collapsed)(x)
  assert collapsed.collapsed == 3
  np.testing.assert_array_equal(same, x)
  np.testing.assert_array_equal(called, x)
  np.testing.assert_array_equal(one_rounding, x.astype(jnp.float16))
  assert float(one_rounding[2]) == 65504.0  # 65519 rounds to float16's largest directly...
  assert float(chains(x)[1][2]) == np.inf  # ...but to bfloat16's 65536 first, then to inf


def test_the_rewrite_keeps_reduce_precision_bitcasts_and_loop_boundaries():
  x = jnp.array([1.001, -3.14159], jnp.float32)

  def kept(x):
    nearest = lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
    truncated = lax.bitcast_convert_type(
        lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000), jnp.float32)
    # A loop's body is a computation of its own: its bfloat16 result leaves it rounded ...
    carried = lax.fori_loop(0, 2, lambda i, v: (v.astype(jnp.float32) * 1.001).astype(BF16),
                            x.astype(BF16))
    # ... while a round trip inside the body goes.
    inside = lax.fori_loop(0, 1, lambda i, v: v.astype(BF16).astype(jnp.float32), x)
    return nearest.astype(BF16).astype(jnp.float32), truncated, carried.astype(jnp.float32), inside

  collapsed = collapse_conversions(kept)
  got = jax.jit(collapsed)(x)
  want = jax.jit(kept)(x)
  for g, w in zip(got[:3], want[:3]):
    np.testing.assert_array_equal(g, w)
  np.testing.assert_array_equal(got[3], x)
  assert not np.array_equal(want[3], x)


# --- bfloat16 parameters -----------------------------------------------------------------------

def _add_steps(steps, unroll):
  """``steps`` Kahan SGD steps adding ``1e-4`` to a bfloat16 ``1.0``, compiled as a GPU would."""
  tx = jaxamp.low_precision_params(optax.sgd(1e-4), "kahan")
  params = {"w": jnp.ones(256, BF16)}
  grads = {"w": jnp.full(256, -1.0, BF16)}

  def run(params, state):
    def body(_, carry):
      p, s = carry
      updates, s = tx.update(grads, s, p)
      with jax.numpy_dtype_promotion("standard"):
        return optax.apply_updates(p, updates), s
    return lax.fori_loop(0, steps, body, (params, state), unroll=unroll)

  return jax.jit(collapse_conversions(run))(params, tx.init(params))


# In one loop, and unrolled: consecutive steps in one computation, where a step reads the
# parameters the previous one wrote through their float32 sum in apply_updates (XLA may unroll a
# short loop itself).
@pytest.mark.parametrize("steps, unroll", [(100, 1), (20, True)])
def test_kahan_keeps_the_sum_when_round_trips_are_removed(steps, unroll):
  params, state = _add_steps(steps, unroll)
  w = np.asarray(params["w"], np.float32)
  hidden = np.asarray(jaxamp.decode_compensation(state.compensation[0], params["w"]))
  # As on the CPU (the docstring's example): the float32 master's sum, held as the visible
  # bfloat16 weight plus the compensation, where a removed rounding left the weight at 1.0 and
  # the compensation at 0.
  master = np.float32(1.0)
  for _ in range(steps):
    master = np.float32(master + np.float32(1e-4))
  np.testing.assert_array_equal(w, master.astype(BF16).astype(np.float32))
  np.testing.assert_array_equal(w + hidden, master)
  assert float(state.stale_fraction[0]) == 1.0


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_each_rounding_is_bit_identical_when_round_trips_are_removed(rounding):
  rng = np.random.default_rng(0)
  # Parameters over many binades with both signs and zeros, and updates from far below half a
  # spacing of their parameter to many spacings, through the loss scaler (a power-of-two scale).
  # The inner transformation passes the updates through: an optimizer's own multiply-adds may be
  # contracted differently in a rewritten program, which says nothing about the rounding.
  w = rng.standard_normal(512) * np.exp2(rng.integers(-20, 20, 512))
  w[:8] = 0.0
  params = {"w": jnp.asarray(w, BF16), "f": jnp.linspace(-1.0, 1.0, 4)}
  tx = jaxamp.dynamic_loss_scale(
      jaxamp.low_precision_params(optax.identity(), rounding, seed=5), init_scale=2.0**8)

  def step(params, state, grads):
    with jax.numpy_dtype_promotion("standard"):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

  plain, collapsed = jax.jit(step), jax.jit(collapse_conversions(step))
  got = want = (params, tx.init(params))
  for _ in range(4):
    ratio = rng.choice([-1.0, 1.0], 512) * 10.0 ** rng.uniform(-6.0, 1.0, 512)
    grads = {"w": jnp.asarray((np.abs(w) + 1e-3) * ratio * 2.0**8, BF16),
             "f": jnp.asarray(rng.standard_normal(4) * 2.0**8, jnp.float32)}
    got, want = collapsed(*got, grads), plain(*want, grads)
    _assert_same_bits(got, want)
  assert not np.array_equal(np.asarray(got[0]["w"], np.float32), w.astype(BF16).astype(np.float32))


def test_convergence_with_kahan_when_round_trips_are_removed():
  # The regression of tests/test_low_precision.py on which Kahan stalled like nearest on an H200
  # (a loss of 112 against float32's 0.15).
  rng = np.random.default_rng(0)
  x = rng.standard_normal((256, 64)).astype(np.float32)
  w_star = rng.standard_normal(64).astype(np.float32)
  y = (x @ w_star + 0.4 * rng.standard_normal(256)).astype(np.float32)

  def loss(w):
    return jnp.mean((x @ w.astype(jnp.float32) - y) ** 2)

  def train(w, tx):
    def body(carry, _):
      w, s = carry
      updates, s = tx.update(jax.grad(loss)(w), s, w)
      with jax.numpy_dtype_promotion("standard"):
        return (optax.apply_updates(w, updates), s), None
    (w, _), _ = lax.scan(body, (w, tx.init(w)), None, length=2000)
    return loss(w)

  f32 = float(jax.jit(train, static_argnums=1)(jnp.asarray(w_star + 8.0), optax.sgd(3e-3)))
  tx = jaxamp.low_precision_params(optax.sgd(3e-3), "kahan")
  kahan = float(jax.jit(collapse_conversions(lambda w: train(w, tx)))(
      jnp.asarray(w_star + 8.0, BF16)))
  assert kahan <= 1.05 * f32


# --- the finite check --------------------------------------------------------------------------

def test_the_finite_check_reads_the_rounded_bfloat16_gradients():
  # Unscaling computes a bfloat16 leaf in float32 and casts it back; an optimizer that
  # reads it in float32 then reads the unrounded product where the round trip is removed, finite
  # where the stored bfloat16 value is inf. The check reads the rounded value's bits, so the step is
  # skipped: the safe direction.
  big = float(jnp.finfo(BF16).max)
  params = {"w": jnp.zeros(4, jnp.float32)}
  descend = optax.stateless(lambda g, p: jax.tree.map(lambda x: -x.astype(jnp.float32), g))
  tx = jaxamp.dynamic_loss_scale(descend, init_scale=0.5)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  grads = {"w": jnp.asarray([big, 1.0, -1.0, 0.5], BF16)}  # unscaled: 2 * max, inf in bfloat16
  state = tx.init(params)
  collapsed = collapse_conversions(step)
  for fn in (step, collapsed):
    new_params, new_state = jax.jit(fn)(params, state, grads)
    assert bool(new_state.skipped)
    _assert_same_bits(new_params, params)
  assert collapsed.collapsed > 0  # the optimizer did read the unrounded product


# --- the demo ----------------------------------------------------------------------------------

def test_the_demo_step_has_no_round_trip():
  # The demo's float16 model with float32 parameters, accumulation and loss scaling: nothing in its
  # step converts a value back to a dtype it came from, so the GPU computes what the CPU does.
  # (With bfloat16 parameters, low_precision_params reads the unscaled bfloat16 gradients in
  # float32, a round trip the GPU removes: exact for the loss scaler's power-of-two scales, and
  # relied on by nothing otherwise.)
  from jaxamp.demo import train as demo

  config = demo.DemoConfig(width=32, depth=2)
  model = demo.MLP(config.width, config.depth, config.num_classes)
  x = jax.random.normal(jax.random.key(0), (64, 2))
  y = jnp.arange(64, dtype=jnp.int32) % config.num_classes
  state = jaxamp.TrainState.create(apply_fn=model.apply, tx=demo.make_optimizer(config),
                                   params=model.init(jax.random.key(1), x[:1])["params"])

  def step(state):  # the demo's micro-step, on one batch (under JAX's default promotion)
    loss_fn = lambda p: state.scale_loss(demo.cross_entropy(state.apply_fn({"params": p}, x), y))
    with jax.numpy_dtype_promotion("standard"):
      return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))

  rewritten = collapse_conversions(step)
  collapsed, plain = jax.jit(rewritten), jax.jit(step)
  got = want = state
  for _ in range(8 * config.accumulate):  # from the overflowing initial scale to applied steps
    got, want = collapsed(got), plain(want)
  assert rewritten.collapsed == 0
  _assert_same_bits(got, want)
  assert int(want.step) > 0
