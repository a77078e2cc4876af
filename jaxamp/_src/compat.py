"""The JAX releases jaxamp supports: where they differ, one spelling for all of them.

jaxamp runs on jax 0.7.1 and every later release (``.ci/oldest`` tests the
oldest, ``.ci/run`` the newest). Where the public API changed within that
range, this module picks what the installed JAX offers, once, at import:

=============================  ==========================  ===========================
what                           jax 0.7.1 (the floor)       jax 0.10.2 to 0.12.0.1
=============================  ==========================  ===========================
:func:`full` with a sharding   ``jnp.full``, then          ``jnp.full(...,
                               ``jax.sharding.reshard``    out_sharding=...)``
:func:`pcast_varying`          ``lax.pvary``               ``lax.pcast(..., to="varying")``
:data:`DropVar`                ``jax.core.DropVar``        ``jax.extend.core.DropVar``
:func:`bind_params`            ``get_bind_params`` gives   ``get_bind_params`` gives
                               ``(subfuns, params)``       ``params``
:func:`jaxprs_in_params`       found here                  ``jax.extend.core.
                                                           jaxprs_in_params``
=============================  ==========================  ===========================

Each entry is chosen by feature, not by version number, so a release in
between takes whichever spelling it has: jax 0.8.3, say, takes the floor's
column except for ``lax.pcast``, which it has. The parameter that names a
``shard_map``'s manual axes (``manual_axes`` up to 0.8.x, ``newly_manual_axes``
later) is read in :mod:`jaxamp._src.jaxpr_interp`, with the other parameter
names it reads (the custom rules', ``shard_map``'s); ``cond``, ``while``,
``scan`` and the calls are interpreted there without reading any. The rest is
the same on every supported release and needs nothing here: ``jax.shard_map``
with ``check_vma``, ``jax.typeof(x).vma``, ``jax.sharding.AxisType``, and the
other internals that
:mod:`jaxamp._src.jaxpr_interp` reads (the equation's ``ctx`` and
``source_info``, ``jax.extend.source_info_util``). One more difference is no
name: older releases keep some jaxpr literals as Python scalars, so autocast
reads a value's dtype with ``jax.typeof`` rather than ``.dtype``.

Which path runs: on every release from 0.7.1 to 0.12.0.1 the fused selection
(:func:`jaxamp._src.selective_update.select_update`) and
:func:`jaxamp.autocast` interpret the jaxpr (the fast path). On a release that
moves what binding an equation again needs,
:func:`jaxamp._src.jaxpr_interp.check` raises ``InterpretError``: the fused
selection then warns once and takes the plain selection (every update
computed, then selected with ``where``; no internals, sound on every release),
and ``autocast`` warns and runs the function at its traced dtypes. A family of
primitives that ``check`` finds moved runs at its traced dtypes, with a
warning naming it. This module only picks a name or
normalises a return value; :mod:`jaxamp._src.jaxpr_interp` stays the one
module that reads JAX's internals, and takes :data:`DropVar`,
:func:`bind_params` and :func:`jaxprs_in_params` from here.
"""

from __future__ import annotations

import inspect
from typing import Any, Iterator, Optional

import jax
import jax.core
import jax.extend.core as jex_core
import jax.numpy as jnp
from jax import lax

# ``jax.extend.core.DropVar`` where JAX exports it there; the same class in ``jax.core`` before.
DropVar: Any = getattr(jex_core, "DropVar", None)
if DropVar is None:  # pragma: no cover -- the oldest releases
  DropVar = getattr(jax.core, "DropVar")  # noqa: B009 -- absent from newer jax.core


def _takes(fn: Any, name: str) -> bool:
  try:
    return name in inspect.signature(fn).parameters
  except (TypeError, ValueError):  # pragma: no cover -- a builtin without a signature
    return False


FULL_TAKES_OUT_SHARDING = _takes(jnp.full, "out_sharding")


def full(shape: Any, value: Any, dtype: Any, sharding: Optional[Any] = None) -> jax.Array:
  """``jnp.full(shape, value, dtype)``, sharded as ``sharding`` (an ``Explicit`` mesh's)."""
  if FULL_TAKES_OUT_SHARDING:
    full_with_sharding: Any = jnp.full  # typed without out_sharding on the oldest releases
    return full_with_sharding(shape, value, dtype, out_sharding=sharding)
  out = jnp.full(shape, value, dtype)
  return out if sharding is None else jax.sharding.reshard(out, sharding)


def pcast_varying(x: jax.Array, axes: tuple) -> jax.Array:
  """Types ``x`` as varying over the manual mesh ``axes`` too (no data moves)."""
  pcast = getattr(lax, "pcast", None)
  if pcast is not None:
    return pcast(x, axes, to="varying")
  return getattr(lax, "pvary")(x, axes)  # noqa: B009 -- the oldest releases; not in newer lax


def bind_params(primitive: Any, params: dict) -> tuple:
  """``(subfuns, params)`` to bind ``primitive`` with: ``primitive.bind(*subfuns, *args, **params)``.

  ``Primitive.get_bind_params`` returns the pair on older releases and the
  parameters alone on newer ones (where no primitive binds with functions).
  """
  out = primitive.get_bind_params(params)
  if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):  # the oldest releases
    return tuple(out[0]), out[1]
  return (), out


def jaxprs_in_params(params: dict) -> Iterator[Any]:
  """The (open) jaxprs among an equation's parameters, directly or in a tuple."""
  found = getattr(jex_core, "jaxprs_in_params", None)
  if found is not None:
    yield from found(params)
    return
  for value in params.values():  # the oldest releases do not export it
    for v in value if isinstance(value, tuple) else (value,):
      if isinstance(v, jex_core.ClosedJaxpr):
        yield v.jaxpr
      elif isinstance(v, jex_core.Jaxpr):
        yield v

