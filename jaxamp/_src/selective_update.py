"""The fused selection: an optax update whose result counts only where a predicate holds.

:func:`select_update` interprets the jaxpr of the inner update and selects each
new state leaf where it is computed, so that XLA fuses the selection into the
inner update's own kernels. It binds each equation again through
:mod:`jaxamp._src.jaxpr_interp`, which holds every internal of JAX that the
interpretation needs, so a JAX release may change them. When the
interpretation fails, a warning names the reason and the
plain selection runs instead; :func:`set_fused_selection` (or the environment
variable ``JAXAMP_FUSED_SELECTION=0``) chooses the plain selection outright.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from jaxamp._src import jaxpr_interp as interp
from jaxamp._src import sharding

_fused = os.environ.get("JAXAMP_FUSED_SELECTION", "1").strip().lower() not in ("0", "false", "no")
_warned: set = set()


def set_fused_selection(enabled: bool) -> bool:
  """Chooses between the fused selection (the default) and the plain one; returns the old choice.

  The choice is read when a step is traced: it applies to functions jitted
  after the call. The plain selection computes ``where(pred, new, old)`` after
  the inner update, which XLA cannot fuse into it (about 1.6x the cost of a
  bare Adam update on CPU). The environment variable
  ``JAXAMP_FUSED_SELECTION=0`` sets the initial choice.

  Examples:
    >>> import jaxamp
    >>> previous = jaxamp.set_fused_selection(False)
    >>> jaxamp.set_fused_selection(previous)
    False
  """
  global _fused
  if not isinstance(enabled, bool):
    raise TypeError(f"enabled must be a bool, got {enabled!r}")
  previous, _fused = _fused, enabled
  return previous


def neg_zeros_like(x: jax.Array, varying: Optional[frozenset] = None) -> jax.Array:
  """Zero updates shaped and sharded like ``x``: ``-0.0`` for floats, as ``p + (-0.0)`` is ``p``.

  Inside ``shard_map`` they vary over ``varying`` (by default the axes ``x``
  varies over; see :func:`jaxamp._src.sharding.full_like_type`).
  """
  x = jnp.asarray(x)
  value = -0.0 if jnp.issubdtype(x.dtype, jnp.inexact) else 0
  return sharding.full_like_type(x, value, varying=varying)


def _keep(pred: jax.Array, new: Any, old: jax.Array) -> jax.Array:
  dtype = jnp.result_type(old)
  return jnp.where(pred, jnp.asarray(new).astype(dtype), old).astype(dtype)


def select_update(pred: jax.Array, update: Callable[[], tuple[Any, Any]], old_state: Any
                  ) -> tuple[Any, Any]:
  """Runs an optax-style ``update()`` whose result counts only where ``pred``.

  Returns ``(updates, new_state)`` from ``update()`` when ``pred`` is true,
  and ``(zeros, old_state)`` otherwise: the zeros are ``-0.0``, so that
  ``optax.apply_updates`` leaves every parameter bit-identical (``p + 0.0``
  would turn a ``-0.0`` parameter into ``+0.0``), and the state keeps each
  leaf's dtype.

  The plain ``where(pred, updates, 0)``, ``where(pred, new_state, old_state)``
  forces XLA to compute the updates from the *old* optimizer state (the new
  one is only materialised after the selection), so each donated state buffer
  is copied and the gradients are read once more: about 1.6x the cost of the
  bare Adam update. Here ``update`` is traced once to a jaxpr and evaluated
  with each new state leaf replaced, where it is computed, by its selected
  value, so that the updates are computed from the selected state. Where
  ``pred`` is false the result is bit for bit that of the plain selection
  (zeros and the old state); where it is true the values are the same
  computation, which XLA may round differently in the last bit, because it
  fuses (and contracts into FMAs) another program.

  When the jaxpr cannot be interpreted, a ``RuntimeWarning`` names the reason
  (once per reason) and the plain selection runs; errors raised by
  ``update`` itself propagate. :func:`set_fused_selection` chooses the plain
  selection outright.

  Args:
    pred: a ``bool`` scalar.
    update: a function of no arguments returning ``(updates, new_state)``,
      ``new_state`` with the structure of ``old_state``.
    old_state: the state to keep where ``pred`` is false.

  Returns:
    ``(updates, state)``.
  """
  if not _fused:
    return _plain(pred, update(), old_state)
  old_leaves, old_def = jax.tree.flatten(old_state)
  closed, shapes = jax.make_jaxpr(update, return_shape=True)()  # the update's own errors raise
  out_def = jax.tree.structure(shapes)
  num_updates = len(jax.tree.leaves(shapes[0]))
  new_def: Any = jax.tree.structure(shapes[1])
  try:
    interp.check()
    if new_def != old_def:
      raise ValueError(f"the new state's structure {new_def} is not the old state's {old_def}")
    outputs = _eval_selecting(closed, pred, num_updates, old_leaves)
  except Exception as err:  # noqa: BLE001 -- any failure to interpret takes the plain path, loudly
    reason = f"{type(err).__name__}: {err}"
    if reason not in _warned:
      _warned.add(reason)
      warnings.warn(
          f"jaxamp's fused selection cannot interpret this optimizer update ({reason}); it "
          "takes the plain selection, which gives the same values at a higher cost. "
          "jaxamp.set_fused_selection(False) or JAXAMP_FUSED_SELECTION=0 chooses it "
          "outright.", RuntimeWarning, stacklevel=3)
    return _plain(pred, update(), old_state)
  return jax.tree.unflatten(out_def, outputs)


def _plain(pred: jax.Array, result: tuple[Any, Any], old_state: Any) -> tuple[Any, Any]:
  updates, new_state = result
  updates = jax.tree.map(lambda u: jnp.where(pred, u, neg_zeros_like(u)), updates)
  return updates, jax.tree.map(lambda n, o: _keep(pred, n, o), new_state, old_state)


def _bind(eqn: Any, read: Callable[[Any], Any]) -> list:
  return interp.bind(eqn, [read(v) for v in eqn.invars])


def _eval_selecting(closed: Any, pred: jax.Array, num_updates: int, old_leaves: list) -> list:
  """Evaluates ``closed`` (a jaxpr of ``update``), selecting the state where it is made."""
  jaxpr = closed.jaxpr
  state_vars = jaxpr.outvars[num_updates:]
  if len(state_vars) != len(old_leaves):
    raise ValueError(f"the update returns {len(state_vars)} state leaves for {len(old_leaves)}")
  # Each state output defined by an equation is selected right there (by the old
  # value of its own position); later uses, the updates among them, see that value.
  defined = {v for eqn in jaxpr.eqns for v in eqn.outvars}
  swap: dict = {}
  for i, (v, old) in enumerate(zip(state_vars, old_leaves)):
    old = jnp.asarray(old)
    aval: Any = v.aval
    if (isinstance(v, interp.Var) and v in defined and v not in swap
        and aval.shape == old.shape and aval.dtype == old.dtype):
      swap[v] = i
  env: dict = dict(zip(jaxpr.constvars, closed.consts))

  def read(v):
    return v.val if isinstance(v, interp.Literal) else env[v]

  for eqn in jaxpr.eqns:
    for v, val in zip(eqn.outvars, _bind(eqn, read)):
      if v in swap:
        val = _keep(pred, val, old_leaves[swap[v]])
      env[v] = val

  outputs = [read(v) for v in jaxpr.outvars]
  updates = [jnp.where(pred, u, neg_zeros_like(u)) for u in outputs[:num_updates]]
  state = [val if swap.get(v) == i else _keep(pred, val, old)
           for i, (v, val, old) in enumerate(zip(state_vars, outputs[num_updates:], old_leaves))]
  return updates + state
