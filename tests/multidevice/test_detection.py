"""The finite check inside shard_map: missing axis names are refused, needless collectives avoided."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp
from tests._hlo import hlo_collectives


def _put(mesh, x, spec):
  return jax.device_put(x, NamedSharding(mesh, spec))


def _grads(mesh, spec=P("data")):
  return {"w": _put(mesh, jnp.ones((16, 4), jnp.float32), spec),
          "b": _put(mesh, jnp.ones((8,), jnp.float32), spec)}


@pytest.mark.parametrize("make", [
    lambda: jaxamp.dynamic_loss_scale(optax.sgd(0.1)),
    lambda: jaxamp.static_loss_scale(optax.sgd(0.1), 8.0),
], ids=["dynamic", "static"])
def test_sharded_grads_without_axis_name_are_refused(mesh, make):
  tx = make()
  grads = _grads(mesh)
  state = tx.init({"w": jnp.zeros((2, 4)), "b": jnp.zeros((1,))})

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P()), out_specs=P())
  def step(g, s):
    return tx.update(g, s)[1].scale

  with pytest.raises(ValueError, match=r"vary over the shard_map mesh axes \('data',\).*"
                     r"axis_name=None.*Pass axis_name=\('data',\)"):
    jax.jit(step).lower(grads, state)


def test_all_finite_without_axis_name_is_refused(mesh):
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=P())
  def check(g):
    return jaxamp.all_finite(g)

  with pytest.raises(ValueError, match="'data'"):
    jax.jit(check).lower(_grads(mesh))


def test_axis_name_missing_one_of_two_axes_is_refused(mesh2d):
  grads = _grads(mesh2d, P(("data", "model")))

  @functools.partial(jax.shard_map, mesh=mesh2d, in_specs=P(("data", "model")), out_specs=P())
  def check(g):
    return jaxamp.all_finite(g, axis_name="data")

  with pytest.raises(ValueError, match=r"axes \('model',\), but axis_name='data'"):
    jax.jit(check).lower(grads)


def test_empty_tuple_asks_for_a_per_shard_answer(mesh):
  w = np.ones((16,), np.float32)
  w[13] = np.inf  # in the 7th shard (rows 12..13)

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
  def check(g):
    return jaxamp.all_finite(g, axis_name=())[None]

  out = jax.jit(check)(_put(mesh, jnp.asarray(w), P("data")))
  np.testing.assert_array_equal(np.asarray(out), [True] * 6 + [False] + [True])


def _count(hlo, op="all-reduce"):
  return sum(1 for o, _, _ in hlo_collectives(hlo) if o == op)


def test_no_collective_when_grads_are_already_reduced(mesh):
  """After a pmean the grads are invariant: the finite check needs no all-reduce of its own."""
  params = {"w": _put(mesh, jnp.ones((4, 4)), P())}
  x = _put(mesh, jnp.ones((16, 4)), P("data"))
  plain = optax.sgd(0.1)
  scaled = jaxamp.dynamic_loss_scale(optax.sgd(0.1), axis_name="data")

  def make(tx):
    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P("data")),
                       out_specs=(P(), P()))
    def step(p, s, xb):
      g = jax.grad(lambda p: jnp.sum(jnp.tanh(xb @ p["w"])))(p)
      g = lax.pmean(g, "data")
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s
    return step

  hlo_plain = make(plain).lower(params, plain.init(params), x).compile().as_text()
  hlo_scaled = make(scaled).lower(params, scaled.init(params), x).compile().as_text()
  assert _count(hlo_plain) >= 1
  assert _count(hlo_scaled) == _count(hlo_plain)
  assert all(op == "all-reduce" for op, _, _ in hlo_collectives(hlo_scaled))


def test_sharded_grads_get_one_small_integer_all_reduce(mesh):
  """The per-leaf flags (2 leaves), from which every device decides alike."""
  grads = _grads(mesh)
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), axis_name="data")
  state = tx.init({"w": jnp.zeros((2, 4)), "b": jnp.zeros((1,))})

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P()), out_specs=P())
  def step(g, s):
    return tx.update(g, s)[1].scale

  found = hlo_collectives(step.lower(grads, state).compile().as_text())
  assert [(op, shape.split("{")[0]) for op, shape, _ in found] == [("all-reduce", "s32[2]")]


def test_untracked_variation_is_reduced_over_every_named_axis(mesh):
  """With check_vma=False JAX does not know what varies: every named axis is reduced.

  Without axis_name the shards then decide on their own, undetected: the
  documented limitation of pmap and check_vma=False.
  """
  w = np.ones((16,), np.float32)
  w[3] = np.inf  # shard 1 only

  def make(axis_name):
    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                       check_vma=False)
    def check(g):
      return jaxamp.all_finite(g, axis_name=axis_name)[None]
    return check

  arr = _put(mesh, jnp.asarray(w), P("data"))
  np.testing.assert_array_equal(np.asarray(make("data")(arr)), [False] * 8)
  np.testing.assert_array_equal(np.asarray(make(None)(arr)), [True, False] + [True] * 6)
  assert _count(make("data").lower(arr).compile().as_text()) == 1


@pytest.mark.parametrize("axis_name", [("data", "model"), ("model", "data")])
def test_tuple_of_axis_names_on_a_2d_mesh(mesh2d, axis_name):
  w = np.ones((8, 4), np.float32)
  w[5, 1] = np.nan  # one device of the 4 x 2 mesh
  arr = _put(mesh2d, jnp.asarray(w), P("data", "model"))
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0, axis_name=axis_name)
  state = tx.init(jnp.zeros((2, 2)))

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh2d, in_specs=(P("data", "model"), P()),
                     out_specs=(P(), P()))
  def step(g, s):
    s = tx.update(g, s)[1]
    return s.scale, s.skipped

  scale, skipped = step(arr, state)
  assert bool(skipped) and float(scale) == 4.0
