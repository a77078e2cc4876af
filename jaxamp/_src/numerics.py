"""Float64-rounded scale products in float32 arithmetic, as PyTorch updates its loss scale."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

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
  # With the third piece the three float32s hold all 53 bits of ``factor``.
  f_lo2 = np.float32(factor - float(f_hi) - float(f_lo))
  # Lift tiny inputs so that no partial product underflows; undone exactly below.
  lift = jnp.where(jnp.abs(x) < 2.0**-60, jnp.float32(2.0**64), jnp.float32(1.0))
  x = x * lift
  x_hi, x_lo = _split(x)
  fh_hi, fh_lo = _split(jnp.asarray(f_hi))
  # Four exact partial products (12-bit heads and tails) plus the tiny x*f_lo
  # and the tinier x*f_lo2.
  s, e1 = _two_sum(x_hi * fh_hi, x_hi * fh_lo)
  s, e2 = _two_sum(s, x_lo * fh_hi)
  exact = s + (e1 + e2 + x_lo * fh_lo + (x * f_lo + x * f_lo2))
  # Where p overflowed (inf) the correction is meaningless (inf - inf): keep p.
  p = x * f_hi
  return jnp.where(jnp.isfinite(p), exact, p) / lift
