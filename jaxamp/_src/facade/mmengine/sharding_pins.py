"""Sharding pins: the wrappers' outputs keep the shardings of the parameters they update.

A jitted step left to itself may return gradients or parameters with
another sharding than it received (gradients of a contraction over a sharded
batch come back replicated, say); the next step would then see new input
shardings and compile again. The wrappers pin every params-shaped output
to the parameter's sharding (:func:`constrain`), and put the scalars of a
fresh optimizer state on the parameters' mesh (:func:`replicate_scalars`),
where the jitted steps return them.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import jax
from jax import lax


def replicate_scalars(state: Any, params: Any) -> Any:
  """Puts the single-device scalars of ``state`` on the params' mesh, replicated.

  That is where the jitted steps return them; a state fresh from ``init``
  would otherwise bring other shardings to the second step, and compile again.
  """
  mesh = next((p.sharding.mesh for p in jax.tree.leaves(params)
               if isinstance(getattr(p, "sharding", None), jax.sharding.NamedSharding)), None)
  if mesh is None:
    return state
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def put(x):
    if (isinstance(x, jax.Array) and x.ndim == 0
        and isinstance(x.sharding, jax.sharding.SingleDeviceSharding)):
      return jax.device_put(x, replicated)
    return x

  return jax.tree.map(put, state)


def param_shardings(params: Any) -> Optional[Tuple[Any, ...]]:
  """Per params leaf, the sharding outputs must be pinned to (None: nothing to pin)."""
  shardings = tuple(None if isinstance(s, jax.sharding.SingleDeviceSharding) else s
                    for s in (getattr(p, "sharding", None) for p in jax.tree.leaves(params)))
  return shardings if any(s is not None for s in shardings) else None


def pin(x: jax.Array, sharding: Any) -> jax.Array:
  """Traced: ``x`` constrained (or, on explicit axes, resharded) to ``sharding``."""
  if sharding is None:
    return x
  axis_types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
  if any(t == jax.sharding.AxisType.Explicit for t in axis_types):
    # Explicit axes: the sharding is part of the type (gradients of a contraction over a
    # sharded batch come back replicated, say); move it back to the parameter's.
    return jax.sharding.reshard(x, sharding)
  return lax.with_sharding_constraint(x, sharding)


def constrain(tree: Any, shardings: Optional[Tuple[Any, ...]]) -> Any:
  """Pins the leaves of ``tree`` (traced, params-shaped) to the params' shardings."""
  if shardings is None:
    return tree
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, [pin(x, s) for x, s in zip(leaves, shardings)])

