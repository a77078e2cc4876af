"""Small numerical building blocks shared by the loss-scaling and accumulation transforms."""

from __future__ import annotations

import math
from typing import Any, Hashable, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._src import sharding

AxisName = Union[Hashable, Sequence[Hashable], None]

_TWO_64 = 2.0**64
# Scales at or above this have a reciprocal below the smallest normal float32.
_DENORMAL_RECIPROCAL = 2.0**126


def all_finite(tree: Any, axis_name: AxisName = None) -> jax.Array:
  """Returns one boolean scalar: whether every element of every leaf is finite.

  Non-floating leaves (integers, booleans) are finite by definition. With
  ``axis_name`` the answer is reduced across that mapped axis (or tuple of
  axes) inside ``shard_map``/``pmap``, so every device takes the same decision.
  Inside ``shard_map`` (``check_vma=True``) axes over which the leaves are
  already invariant (e.g. after ``lax.pmean``) need and get no collective, and
  leaves that vary over an axis ``axis_name`` does not name are an error: the
  shards would decide differently. ``pmap`` does not track variation, so there
  every named axis is reduced and a missing ``axis_name`` cannot be detected.

  Args:
    tree: a pytree of arrays.
    axis_name: a mapped axis name or a tuple of them; ``None`` for no
      reduction; ``()`` for an explicitly per-shard answer.

  Returns:
    A ``bool`` scalar array.

  Raises:
    ValueError: inside ``shard_map`` when the leaves vary over a mesh axis
      that ``axis_name`` does not cover.

  Examples:
    >>> import jax.numpy as jnp
    >>> import jaxamp
    >>> jaxamp.all_finite({'w': jnp.ones(3), 'b': jnp.array([1.0, jnp.inf])})
    Array(False, dtype=bool)
  """
  leaves = [
      jnp.all(jnp.isfinite(x))
      for x in jax.tree.leaves(tree)
      if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
  ]
  ok = jnp.stack(leaves).all() if leaves else jnp.array(True)
  axes = sharding.finite_reduction_axes(tree, axis_name)
  if axes:
    # psum of the failures: one integer all-reduce, the same answer everywhere.
    bad = lax.psum(jnp.logical_not(ok).astype(jnp.int32), axes)
    ok = bad == 0
  return ok


def select_tree(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
  """Elementwise ``where(pred, a, b)`` over two pytrees of the same structure.

  The result keeps each leaf's dtype of ``on_false`` (the old value), so a
  state stays type-stable under ``lax.cond``/``lax.scan``. Selection, unlike a
  multiplication by 0/1, never lets a NaN of the unselected side through.
  """

  def pick(a, b):
    return jnp.where(pred, a, b).astype(jnp.result_type(b))

  return jax.tree.map(pick, on_true, on_false)


def safe_increment(count: jax.Array) -> jax.Array:
  """Adds one to an integer counter, saturating at its dtype's maximum."""
  top = jnp.iinfo(count.dtype).max
  return jnp.where(count < top, count + 1, count).astype(count.dtype)


def unscale(tree: Any, scale: jax.Array) -> Any:
  """Divides every floating leaf by ``scale``, bit for bit as PyTorch does.

  PyTorch multiplies by ``float32(1 / scale)``. When the scale is 2^126 or
  more, that reciprocal is a denormal, which XLA flushes to zero on CPU; then
  the multiplication is split into two normal factors (``2^-64`` and
  ``2^64 / scale``), so the result is the same as PyTorch's instead of zero.
  Each leaf is computed in float32 and cast back to its own dtype.
  """
  scale = jnp.asarray(scale, jnp.float32)
  huge = scale >= _DENORMAL_RECIPROCAL
  first = jnp.where(huge, jnp.float32(1.0 / _TWO_64), jnp.float32(1.0))
  second = jnp.where(huge, jnp.float32(_TWO_64) / scale, jnp.float32(1.0) / scale)

  def one(g):
    if not jnp.issubdtype(g.dtype, jnp.inexact):
      return g
    return (g.astype(jnp.float32) * first * second).astype(g.dtype)

  return jax.tree.map(one, tree)


def _split(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Splits a float32 into a 12-bit head and an exact tail (Dekker), overflow-free."""
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  head = lax.bitcast_convert_type(bits & jnp.uint32(0xFFFFF000), jnp.float32)
  return head, x - head


def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Knuth's error-free sum: ``a + b == s + e`` exactly."""
  s = a + b
  bb = s - a
  return s, (a - (s - bb)) + (b - bb)


def mul_like_float64(x: jax.Array, factor: float) -> jax.Array:
  """Returns ``float32(float64(x) * factor)`` using float32 arithmetic only.

  PyTorch updates its loss scale in float64 and rounds the product to float32
  (``1500 * 0.3`` gives ``450.0``, where a float32 multiplication gives
  ``450.00003``). With x64 disabled, the product is formed as an unevaluated
  float32 sum (exact partial products of 12-bit halves, added error-free)
  and rounded once: the correctly rounded result except in double-rounding
  ties, within one ulp always. Power-of-two factors take one exact multiply.
  """
  x = jnp.asarray(x, jnp.float32)
  f_hi = np.float32(factor)
  if math.frexp(factor)[0] == 0.5:
    return x * f_hi
  f_lo = np.float32(factor - float(f_hi))
  # Lift tiny inputs so that no partial product underflows; undone exactly below.
  lift = jnp.where(jnp.abs(x) < 2.0**-60, jnp.float32(2.0**64), jnp.float32(1.0))
  x = x * lift
  x_hi, x_lo = _split(x)
  fh_hi, fh_lo = _split(jnp.asarray(f_hi))
  # Four exact partial products (12-bit heads and tails) plus the tiny x*f_lo.
  s, e1 = _two_sum(x_hi * fh_hi, x_hi * fh_lo)
  s, e2 = _two_sum(s, x_lo * fh_hi)
  exact = s + (e1 + e2 + x_lo * fh_lo + x * f_lo)
  # Where p overflowed (inf) the correction is meaningless (inf - inf): keep p.
  p = x * f_hi
  return jnp.where(jnp.isfinite(p), exact, p) / lift
