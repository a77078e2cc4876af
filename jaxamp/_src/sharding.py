"""Sharding helpers: one decision on every device, state typed like the gradients.

Where the finite check must be reduced so that every device takes the same
decision (:func:`finite_reduction_axes`), and fresh values with the sharding
and ``shard_map`` type of the gradients (:func:`full_like_type`,
:func:`mark_varying`).

Inside ``shard_map`` (with ``check_vma=True``, the default) JAX records in each
value's type the manual mesh axes it varies over (``jax.typeof(x).vma``). If
the gradients vary over an axis, a finite check computed on them differs from
shard to shard: one shard skips the step and lowers its scale while the others
apply it, and the replicas silently diverge. :func:`finite_reduction_axes`
refuses that at trace time and, for the axes that do need it, returns the axes
the check has to be reduced over; axes over which the gradients are already
invariant (after a ``lax.pmean``, say) need no collective at all.

Under ``pmap``, under ``shard_map(..., check_vma=False)`` and over ``vmap``
axes JAX does not track variation: the check cannot see it there, so every
axis in ``axis_name`` is reduced, and a missing ``axis_name`` goes unnoticed.
"""

from __future__ import annotations

from typing import Any, Hashable, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType

from jaxamp._src import compat

AxisName = Union[Hashable, Sequence[Hashable], None]


def axis_tuple(axis_name: AxisName) -> Tuple[Hashable, ...]:
  """Returns ``axis_name`` as a tuple of names (``None`` gives ``()``).

  Examples:
    >>> axis_tuple("data"), axis_tuple(("data", "model")), axis_tuple(None)
    (('data',), ('data', 'model'), ())
  """
  if axis_name is None:
    return ()
  if isinstance(axis_name, (tuple, list)):
    return tuple(axis_name)
  return (axis_name,)


def _aval(x: Any) -> Any:
  return x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)


def varying_axes(x: Any) -> frozenset:
  """The manual mesh axes the value ``x`` varies over, as JAX's type system records them.

  ``x`` is an array, a tracer or a ``jax.ShapeDtypeStruct`` (from
  ``jax.eval_shape``). Empty outside ``shard_map``, and inside ``pmap`` or
  ``shard_map(..., check_vma=False)``, where JAX does not track variation.
  """
  aval = _aval(x)
  vma = getattr(aval, "vma", None)
  if vma is None:
    vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
  return frozenset(vma or ())


def tree_varying_axes(tree: Any) -> frozenset:
  """The union of :func:`varying_axes` over the leaves of ``tree`` (non-array leaves ignored)."""
  out: frozenset = frozenset()
  for x in jax.tree.leaves(tree):
    try:
      out |= varying_axes(x)
    except TypeError:  # a string or another non-array value: it varies over nothing
      pass
  return out


def mark_varying(x: jax.Array, axes: frozenset) -> jax.Array:
  """Types ``x`` as varying over ``axes`` too (a no-op cast; only the type changes).

  Used where two values must have the same type, e.g. the branches of a
  ``lax.cond`` or the carry of a ``lax.scan`` inside ``shard_map``.
  """
  missing = tuple(sorted(frozenset(axes) - varying_axes(x), key=str))
  if not missing:
    return x
  return compat.pcast_varying(x, missing)


def full_like_type(like: Any, value: Any, dtype: Any = None,
                   varying: Optional[frozenset] = None) -> jax.Array:
  """A new array filled with ``value``, with the shape and sharding of ``like``.

  ``like`` is an array, a tracer or a ``jax.ShapeDtypeStruct``. Unlike
  ``jnp.full_like`` the result depends on no data: it is typed as varying
  over ``varying`` (by default the axes ``like`` varies over), which may be
  fewer, so that, e.g., the zero updates of a skipped step have the type of
  the real updates computed from all-reduced gradients. Under an ``Explicit``
  mesh it carries ``like``'s sharding, so that the two are also sharded alike.
  """
  aval = _aval(like)
  dtype = aval.dtype if dtype is None else dtype
  out_sharding = None
  sharding = getattr(aval, "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is not None and AxisType.Explicit in tuple(getattr(mesh, "axis_types", ())):
    out_sharding = sharding
  out = compat.full(aval.shape, value, dtype, out_sharding)
  return mark_varying(out, varying_axes(like) if varying is None else varying)


def tracked_axes(axis_name: AxisName) -> tuple:
  """The axes of ``axis_name`` over which JAX tracks variation (``shard_map`` with check_vma)."""
  return tuple(a for a in axis_tuple(axis_name) if _tracks_variation(a))


def own_copies(tree: Any, axis_name: AxisName) -> Any:
  """``tree`` typed as varying over the axes of ``axis_name`` that JAX tracks (``shard_map``).

  Differentiating a replicated value inside ``shard_map`` gives gradients
  already summed over the devices (the transpose of its implicit broadcast is
  a ``psum``); differentiating each device's own copy gives that device's
  gradients, which the caller then averages once (``lax.pmean``). A no-op
  where variation is not tracked (``pmap``, ``vmap``, no ``axis_name``).
  """
  tracked = frozenset(tracked_axes(axis_name))
  if not tracked:
    return tree
  return jax.tree.map(lambda x: mark_varying(x, tracked), tree)


def _tracks_variation(name: Hashable) -> bool:
  """Whether JAX tracks variation over the bound axis ``name`` (shard_map with check_vma)."""
  # The device index varies over its axis by definition; its type says so only when
  # variation is tracked. The index itself is unused, so it costs nothing at run time.
  return name in varying_axes(lax.axis_index(name))


def _names(axes) -> str:
  return "(" + ", ".join(repr(a) for a in sorted(axes, key=str)) + (",)" if len(axes) == 1 else ")")


def finite_reduction_axes(tree: Any, axis_name: AxisName, what: str = "all_finite") -> tuple:
  """The axes over which a finite check on ``tree`` must be reduced.

  Args:
    tree: the pytree whose floating leaves are checked (the gradients).
    axis_name: the axis name or tuple of names the caller asked to reduce over;
      ``None`` for none; ``()`` to ask explicitly for a per-shard answer.
    what: the name of the calling function, for the error message.

  Returns:
    A tuple of axis names, possibly empty: the axes of ``axis_name`` over which
    the leaves may differ (all of them where JAX does not track variation).

  Raises:
    ValueError: inside ``shard_map`` with ``check_vma=True``, when the leaves
      vary over a manual mesh axis that ``axis_name`` does not name: a check
      computed per shard would let the devices take different decisions.
  """
  axes = axis_tuple(axis_name)
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  varying = frozenset().union(*(varying_axes(x) for x in leaves))
  missing = varying - frozenset(axes)
  if missing and not (isinstance(axis_name, (tuple, list)) and not axes):
    order = sorted(varying, key=str)
    raise ValueError(
        f"{what}: the gradients vary over the shard_map mesh axes {_names(missing)}, but "
        f"axis_name={axis_name!r} does not reduce over them, so each shard would decide on its "
        "own whether the step is finite, and the devices would disagree on skipping the step "
        f"and on the loss scale. Pass axis_name={tuple(order)!r} (to jaxamp.dynamic_loss_scale, "
        "jaxamp.static_loss_scale, jaxamp.all_finite or the accumulation transform), or reduce "
        "the gradients over those axes first (lax.pmean); pass axis_name=() only if each shard "
        "really is meant to decide on its own.")
  return tuple(a for a in axes if a in varying or not _tracks_variation(a))
