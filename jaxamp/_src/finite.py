"""Unscaling and the finite check: whether a step's gradients may be applied.

The check must agree with the values the update reads, whatever XLA does to
the program. XLA may fuse the code that produces a gradient into every kernel
that reads it (computing it again there), contract a multiply and the add that
reads it into one fused multiply-add (the product is then never rounded, so a
product that overflows in the stored gradient can be finite inside the FMA),
keep bfloat16/float16 intermediates in float32 (excess precision), and reorder
reductions. A check that sums the gradients is defeated by the second: the
sum's additions absorb the gradient's last multiply. So every check here obeys
three rules:

1. **Nothing adds a gradient element before rounding it.** The first operation
   applied to an element is a bitcast, an ``abs`` or a multiplication, never an
   addition, a subtraction, a negation or a reduction, so no FMA can skip the
   rounding of the value the update reads (an FMA fuses a multiply into an add
   that reads its product; an ``abs``, a bitcast or a second multiply in between
   leaves no such pattern).
2. **Half-precision leaves are judged on their bits.** A bitcast to an integer
   needs the value rounded to its own dtype, so excess precision cannot show
   the check a finite float32 value where the stored bfloat16 is inf. (Where
   excess precision lets the update read the float32 value, that value is
   finite whenever the rounded one is: the safe direction.)
3. **Reductions are order-free.** A floating leaf of 32 bits or more is
   checked by summing ``|x| - |x|``, which is exactly +0 for a finite
   element and nan for inf or nan: a sum of such terms is nan in any order
   exactly when one of them is, and it cannot overflow. Other leaves sum nan
   where the booleans read from their bits are set and +0 elsewhere, which is
   as exact, and the data-parallel reduction adds integers. A maximum is not
   used: XLA:CPU's vectorized library (YNNPACK) drops a nan from a maximum
   reduction of 4096 elements or more (jax 0.10.2).

One more property keeps the check and the update on the same values: each
loss-scaling transformation passes the raw gradients through
``lax.optimization_barrier``, so where XLA honours barriers through fusion
(GPU and TPU) every kernel reads the one stored gradient. XLA:CPU removes
barriers before fusion; there the soundness rests on a producer that is fused
into several kernels computing the same rounded value in each (the same
elemental code), which the compiled-versus-eager tests exercise.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._src import sharding
from jaxamp._src import validation

AxisName = sharding.AxisName

_TWO_64 = 2.0**64
# Scales at or above this have a reciprocal below the smallest normal float32.
DENORMAL_RECIPROCAL = 2.0**126
_UINT = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def float_leaves(tree: Any) -> list:
  """The floating leaves of ``tree``, as arrays (a leaf that is one already is returned as is)."""
  return [jnp.asarray(x) for x in jax.tree.leaves(tree) if validation.is_inexact(x)]


def _ieee_bits(x: jax.Array) -> Optional[tuple[jax.Array, Any, Any]]:
  """``(bits, exponent mask, mantissa mask)`` of an IEEE float array, or None for other formats."""
  info = jnp.finfo(x.dtype)
  uint = _UINT.get(x.dtype.itemsize)
  if uint is None or info.bits != 8 * x.dtype.itemsize or x.dtype.name.startswith("float8"):
    return None
  exponent = np.array(((1 << info.nexp) - 1) << info.nmant, uint)
  return lax.bitcast_convert_type(x, uint), exponent, np.array((1 << info.nmant) - 1, uint)


def inf_nan_masks(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Elementwise ``(is inf, is nan)`` of ``x``, read from its bits in its own dtype.

  For the IEEE formats (float16, bfloat16, float32, float64) the exponent field
  is all ones exactly for inf (mantissa zero) and nan (mantissa not zero).
  Other floating formats (float8) use ``isinf``/``isnan``.
  """
  x = jnp.asarray(x)
  ieee = _ieee_bits(x)
  if ieee is None:
    return jnp.isinf(x), jnp.isnan(x)
  bits, exponent, mantissa = ieee
  top = (bits & exponent) == exponent
  empty = (bits & mantissa) == 0
  return top & empty, top & ~empty


def nonfinite_mask(x: jax.Array) -> jax.Array:
  """Elementwise: whether ``x`` is inf or nan, read from its bits: the exponent field all ones.

  Complex leaves check both parts.
  """
  x = jnp.asarray(x)
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    return nonfinite_mask(x.real) | nonfinite_mask(x.imag)
  ieee = _ieee_bits(x)
  if ieee is None:
    return jnp.logical_not(jnp.isfinite(x))
  bits, exponent, _ = ieee
  return (bits & exponent) == exponent


def leaf_witness(x: jax.Array) -> jax.Array:
  """A float32 scalar that is nan if the array ``x`` holds an inf or a nan, +0 otherwise.

  One reduction: a real leaf of 32 bits or more sums ``|x| - |x|``, which is
  +0 for a finite element and nan otherwise (see the module docstring); other
  leaves (half precision, complex, float8) sum nan where :func:`nonfinite_mask`
  is set and +0 elsewhere. Either sum is exact in any order. :func:`check`
  tests all the leaves' witnesses with one ``isnan``, so that no leaf needs a
  kernel of its own for its flag.
  """
  x = jnp.asarray(x)
  if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize >= 4:
    magnitude = jnp.abs(x)
    return jnp.sum(magnitude - magnitude).astype(jnp.float32)
  return jnp.sum(jnp.where(nonfinite_mask(x), jnp.float32(jnp.nan), jnp.float32(0.0)))


class Check(NamedTuple):
  """The outcome of :func:`check`.

  Attributes:
    finite: bool scalar, whether every element of every floating leaf is finite.
    nonfinite_leaves: bool vector, for each floating leaf (in tree order)
      whether it holds an inf or a nan.
  """

  finite: jax.Array
  nonfinite_leaves: jax.Array


def check(tree: Any, axis_name: AxisName = None) -> Check:
  """Whether every floating leaf of ``tree`` is finite, and which are not.

  Each leaf is read once, by :func:`leaf_witness`. With ``axis_name`` the
  flags are combined across that mapped axis (or tuple of axes), so every
  device holds the same flags and takes the same decision; see
  :func:`all_finite`.

  Args:
    tree: a pytree of arrays.
    axis_name: as in :func:`all_finite`.

  Returns:
    A :class:`Check`.

  Raises:
    ValueError: as :func:`all_finite`.
  """
  axes = sharding.finite_reduction_axes(tree, axis_name)
  leaves = float_leaves(tree)
  flags = (jnp.isnan(jnp.stack([leaf_witness(x) for x in leaves])) if leaves
           else jnp.zeros([0], jnp.bool_))
  if axes:
    # One integer all-reduce: the same flags, and so the same decision, everywhere.
    flags = lax.psum(flags.astype(jnp.int32), axes) > 0
  return Check(jnp.logical_not(jnp.any(flags)), flags)


def all_finite(tree: Any, axis_name: AxisName = None) -> jax.Array:
  """Returns one boolean scalar: whether every element of every leaf is finite.

  Non-floating leaves (integers, booleans) are finite by definition. The
  answer holds for the values as stored in each leaf's dtype, under any
  rewrite XLA makes of the program that computes them (see
  :mod:`jaxamp._src.finite`). With ``axis_name`` the answer is reduced across
  that mapped axis (or tuple of axes) inside ``shard_map``/``pmap``, so every
  device takes the same decision. Inside ``shard_map`` (``check_vma=True``)
  axes over which the leaves are already invariant (e.g. after ``lax.pmean``)
  need and get no collective, and leaves that vary over an axis
  ``axis_name`` does not name are an error: the shards would decide
  differently. ``pmap`` does not track variation, so there every named axis
  is reduced and a missing ``axis_name`` cannot be detected.

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
  return check(tree, axis_name).finite


def as_stored(x: jax.Array) -> jax.Array:
  """``x``, with every element that is inf or nan in ``x``'s dtype made exactly that.

  An accumulator that adds ``x`` to a running sum may otherwise receive it
  unrounded: XLA can contract ``x``'s last multiply and the addition into one
  FMA, so a product that overflows in ``x`` is finite in the sum. Reading
  ``x`` through its bits first rounds it, and the selection that follows is
  not a multiply that an addition could absorb.
  """
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    return x
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    return lax.complex(as_stored(x.real), as_stored(x.imag))
  inf, nan = inf_nan_masks(x)
  # The sign of an element that rounds to inf is that of its unrounded value (a comparison, as
  # copysign does not take float8).
  signed_inf = jnp.where(x < 0, jnp.full_like(x, -jnp.inf), jnp.full_like(x, jnp.inf))
  return jnp.where(nan, jnp.full_like(x, jnp.nan), jnp.where(inf, signed_inf, x))


def add_stored(acc: jax.Array, x: jax.Array) -> jax.Array:
  """``acc + x`` in ``acc``'s dtype, ``x`` rounded first (:func:`as_stored`): how accumulators add.

  Every accumulator of gradients (``accumulate_gradients``,
  ``microbatch_value_and_grad``, the mmengine wrappers' buffers) adds with
  this, so that no FMA absorbs an overflow of ``x``.
  """
  return acc + as_stored(x).astype(acc.dtype)


def stored_once(tree: Any) -> Any:
  """``tree`` through ``lax.optimization_barrier``, leaf by leaf.

  Where XLA honours barriers through fusion (GPU, TPU), every kernel that reads
  a leaf then reads its one stored value instead of computing it again. Leaf
  by leaf, so that inside ``shard_map`` a replicated leaf stays replicated.
  """
  return jax.tree.map(lax.optimization_barrier, tree)


def _huge_factors(scale: jax.Array) -> tuple[jax.Array, ...]:
  return (jnp.float32(1.0) / scale, jnp.ones([], jnp.bool_), jnp.float32(1.0 / _TWO_64),
          jnp.float32(_TWO_64) / scale)


def _normal_factors(scale: jax.Array) -> tuple[jax.Array, ...]:
  return (jnp.float32(1.0) / scale, jnp.zeros([], jnp.bool_), jnp.float32(1.0),
          jnp.float32(1.0) / scale)


class Unscaling(NamedTuple):
  """How :func:`unscale` multiplies by ``float32(1 / scale)``, computed once per step.

  Attributes:
    reciprocal: ``float32(1 / scale)``.
    huge: whether the scale is 2^126 or more, where that reciprocal is a
      denormal that XLA flushes to zero on CPU.
    first: a normal float32 factor; ``first * second == float32(1 / scale)``.
    second: the other factor.
  """

  reciprocal: jax.Array
  huge: jax.Array
  first: jax.Array
  second: jax.Array


def unscale_factors(scale: jax.Array) -> Unscaling:
  """The :class:`Unscaling` of ``scale``.

  Every field comes out of a ``lax.cond``, not a ``where``: XLA:CPU fuses
  scalar code into each elementwise kernel that uses it and re-runs it there
  for every element; a conditional's results are computed once.
  """
  scale = jnp.asarray(scale, jnp.float32)
  return Unscaling(*lax.cond(scale >= DENORMAL_RECIPROCAL, _huge_factors, _normal_factors, scale))


def unscale(tree: Any, scale: jax.Array) -> Any:
  """Divides every floating leaf by ``scale``, bit for bit as PyTorch does.

  PyTorch multiplies by ``float32(1 / scale)``, and so does jaxamp. When the
  scale is 2^126 or more, that reciprocal is a denormal, which XLA flushes to
  zero on CPU; then the multiplication is split into two normal factors
  (``2^-64`` and ``2^64 / scale``), so the result is the same as PyTorch's
  instead of zero. The product reaches the optimizer through a selection,
  which XLA cannot fuse with the optimizer's next addition into an FMA: the
  optimizer then rounds as it would on the unscaled gradients themselves, so
  that for a power-of-two scale (where the product is exact) an applied step
  of sgd with momentum is bit-identical to plain optax's. Each leaf is
  computed in float32 and cast back to its own dtype.
  """
  unscaling = unscale_factors(scale)
  return jax.tree.map(lambda g: unscale_leaf(g, unscaling), tree)


def unscale_leaf(g: Any, unscaling: Unscaling) -> Any:
  """One leaf of :func:`unscale`, given :func:`unscale_factors`."""
  g = jnp.asarray(g)
  if not jnp.issubdtype(g.dtype, jnp.inexact):
    return g
  if jnp.issubdtype(g.dtype, jnp.complexfloating):
    return lax.complex(unscale_leaf(g.real, unscaling), unscale_leaf(g.imag, unscaling))
  # Half precision is computed in float32, float64 (with x64) in float64.
  compute = g.dtype if g.dtype.itemsize >= 4 else jnp.dtype(jnp.float32)
  x = g.astype(compute)
  split = x * unscaling.first.astype(compute) * unscaling.second.astype(compute)
  # A selection, also where both give the same value: it leaves no multiply for XLA to fuse
  # with the optimizer's next addition into an FMA, so that the optimizer rounds as it would
  # on the unscaled gradients themselves (bit-identical to plain optax for power-of-two scales).
  return jnp.where(unscaling.huge, split, x * unscaling.reciprocal.astype(compute)).astype(g.dtype)


def unscale_and_check(grads: Any, scale: jax.Array, axis_name: AxisName = None
                      ) -> tuple[Any, Check]:
  """``unscale(grads, scale)`` and the :func:`check` of it: what a loss-scaled step reads.

  The check reads the unscaled gradients, the values the optimizer reads,
  so it holds for every scale: below 1, where unscaling can overflow a
  finite gradient, and for a nan scale, which makes every element nan.

  Args:
    grads: a pytree of (scaled) gradients.
    scale: the loss scale they are divided by, a float32 scalar.
    axis_name: as in :func:`all_finite`.

  Returns:
    ``(unscaled, check)``.

  Raises:
    ValueError: as :func:`all_finite`.
  """
  unscaled = unscale(grads, scale)
  return unscaled, check(unscaled, axis_name)


def unscaled_check(grads: Any, scale: jax.Array, axis_name: AxisName = None) -> Check:
  """:func:`check` of ``unscale(grads, scale)``: whether the unscaled gradients are finite."""
  return unscale_and_check(grads, scale, axis_name)[1]


def unscaled_all_finite(grads: Any, scale: jax.Array, axis_name: AxisName = None) -> jax.Array:
  """Returns ``all_finite(unscale(grads, scale), axis_name)``."""
  return unscaled_check(grads, scale, axis_name).finite
