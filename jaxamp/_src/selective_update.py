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
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._src import finite
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


Pred = Union[jax.Array, Callable[[list], jax.Array]]

# Primitives whose result is non-finite wherever an operand is (for ``div``,
# the numerator; for ``integer_pow``, a positive power), so that a value
# computed from a gradient leaf through them is non-finite if the leaf is.
_STRUCTURAL = frozenset({"neg", "abs", "convert_element_type", "copy", "reshape", "squeeze",
                         "expand_dims", "transpose", "broadcast_in_dim", "reduce_sum"})
_PROPAGATING = _STRUCTURAL | {"add", "sub", "mul", "div", "sqrt", "square", "integer_pow"}
# Those that read their operand as a rounded value: an FMA contracts a multiply
# into the add that reads its product, never into an abs or another multiply.
_ROUNDING = frozenset({"abs", "mul", "div", "sqrt", "square", "integer_pow"})
# Those that an FMA could fuse with the multiply that produced their operand.
_ADDING = frozenset({"add", "sub", "reduce_sum"})


def select_update(pred: Pred, update: Callable[[], tuple[Any, Any]], old_state: Any,
                  watch: Sequence[jax.Array] = (),
                  unscaled_from: Optional[tuple[Sequence[jax.Array], jax.Array]] = None
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

  ``pred`` may also be a function of *witnesses*, one per array of ``watch``
  (arrays that ``update`` reads): a float scalar that ``update`` computes
  before it writes any state, from that array alone, and that is non-finite
  whenever that array has a non-finite element, or ``None`` where there is
  none. Only sums of squares, of absolute values and the like qualify: the
  first operation on the array's elements must round them (a multiply, a
  division, a square root or an ``abs``), because an addition that reads an
  element directly can be fused with the multiply that produced it into one
  FMA, which never rounds the product to inf. Arrays of less than 32 bits
  have no witness (XLA may compute their producers in float32). A finite
  check can then reuse a reduction that the update makes anyway (a
  global-norm clip's) instead of reading the arrays once more.

  With ``unscaled_from=(raw, scale)``, where ``watch[i]`` is
  ``unscale(raw[i], scale)``, a witness that scales with its array (a sum of
  squares: ``w(c * x) == c**2 * w(x)``) is computed from the raw array and
  multiplied back, whenever that is exact: a power-of-two scale of at least
  1, a finite raw witness and a normal result. Otherwise (an overflow, a
  scale of another kind) it is computed as written, in a ``lax.cond``. The
  reduction then reads the raw array as it is: XLA:CPU's reductions slow
  down by half when they multiply by a scalar computed at run time.
  Unscaled values below the smallest normal number, flushed to zero in the
  written computation, may count in the raw one.

  When the jaxpr cannot be interpreted, a ``RuntimeWarning`` names the reason
  (once per reason) and the plain selection runs; errors raised by
  ``update`` itself propagate. :func:`set_fused_selection` chooses the plain
  selection outright.

  Args:
    pred: a ``bool`` scalar, or a function of the list of witnesses
      returning one.
    update: a function of no arguments returning ``(updates, new_state)``,
      ``new_state`` with the structure of ``old_state``.
    old_state: the state to keep where ``pred`` is false.
    watch: the arrays whose witnesses ``pred`` is given.
    unscaled_from: ``(raw, scale)`` as above, or ``None``.

  Returns:
    ``(updates, state)``.
  """
  decide = pred if callable(pred) else lambda _: pred
  if not _fused:
    return _plain(decide, update(), old_state, len(watch))
  old_leaves, old_def = jax.tree.flatten(old_state)
  closed, shapes = jax.make_jaxpr(update, return_shape=True)()  # the update's own errors raise
  out_def = jax.tree.structure(shapes)
  num_updates = len(jax.tree.leaves(shapes[0]))
  new_def: Any = jax.tree.structure(shapes[1])
  try:
    interp.check()
    if new_def != old_def:
      raise ValueError(f"the new state's structure {new_def} is not the old state's {old_def}")
    outputs = _eval_selecting(closed, _own_errors(decide), watch, unscaled_from, num_updates,
                              old_leaves)
  except _PredicateError as err:
    raise err.original from None  # the predicate's own error (a sharding check's, say)
  except Exception as err:  # noqa: BLE001 -- any failure to interpret takes the plain path, loudly
    reason = f"{type(err).__name__}: {err}"
    if reason not in _warned:
      _warned.add(reason)
      warnings.warn(
          f"jaxamp's fused selection cannot interpret this optimizer update ({reason}); it "
          "takes the plain selection, which gives the same values at a higher cost. "
          "jaxamp.set_fused_selection(False) or JAXAMP_FUSED_SELECTION=0 chooses it "
          "outright.", RuntimeWarning, stacklevel=3)
    return _plain(decide, update(), old_state, len(watch))
  return jax.tree.unflatten(out_def, outputs)


class _PredicateError(Exception):
  """Carries an error raised by the predicate through the interpretation."""

  def __init__(self, original: Exception):
    super().__init__(str(original))
    self.original = original


def _own_errors(decide: Callable[[list], jax.Array]) -> Callable[[list], jax.Array]:
  def wrapped(witnesses: list) -> jax.Array:
    try:
      return decide(witnesses)
    except Exception as err:
      raise _PredicateError(err) from err
  return wrapped


def _plain(decide: Callable[[list], jax.Array], result: tuple[Any, Any], old_state: Any,
           num_watched: int) -> tuple[Any, Any]:
  updates, new_state = result
  ok = decide([None] * num_watched)
  updates = jax.tree.map(lambda u: jnp.where(ok, u, neg_zeros_like(u)), updates)
  return updates, jax.tree.map(lambda n, o: _keep(ok, n, o), new_state, old_state)


class _Witness(NamedTuple):
  var: Any  # the scalar
  source: Any  # the watched variable it is computed from
  eqns: tuple  # the equations that compute it from ``source`` (and zeros), in order
  chain: frozenset  # those of them whose results are used by nothing else
  degree: Optional[int]  # ``w(c * x) == c**degree * w(x)``; None: unknown, or not on its own


_ZERO = "zero"


def _degree(eqn: Any, degrees: list) -> Optional[int]:
  """The degree of homogeneity of ``eqn``'s result in the watched array, or None.

  ``degrees`` holds each operand's: an int, None, or ``_ZERO`` for a zero constant.
  """
  name = eqn.primitive.name
  if None in degrees:
    return None
  if name in _STRUCTURAL:
    return degrees[0]
  if name == "square":
    return 2 * degrees[0]
  if name == "integer_pow":
    return eqn.params["y"] * degrees[0]
  if name == "sqrt":
    return degrees[0] // 2 if degrees[0] % 2 == 0 else None
  if _ZERO in degrees and name in ("mul", "div"):
    return None
  if name == "mul":
    return sum(degrees)
  if name == "div":
    return degrees[0] - degrees[1]
  terms = {d for d in degrees if d != _ZERO}  # add, sub: a zero term changes nothing
  return terms.pop() if len(terms) == 1 else None


def _is_zero(v: Any, zeros: dict) -> bool:
  if isinstance(v, interp.Literal):
    return bool(np.all(np.asarray(v.val) == 0))
  return v in zeros


def _witnesses(closed: Any, watch: Sequence[jax.Array], stop: int) -> list:
  """For each array of ``watch``, the first scalar of ``closed`` among its first ``stop``
  equations that is computed from it alone through :data:`_PROPAGATING` primitives, with
  a rounding one before any adding one, as a :class:`_Witness`, or None."""
  jaxpr = closed.jaxpr
  watched = {v: i for v, c in zip(jaxpr.constvars, closed.consts)
             for i, w in enumerate(watch) if c is w and jnp.result_type(w).itemsize >= 4}
  consts = set(jaxpr.constvars)
  origin = dict(watched)
  rounded = {v: False for v in watched}  # whether a rounding primitive has read the elements
  degree: dict = {v: 1 for v in watched}
  zeros: dict = {}  # zero constants computed from literals -> their equation
  made_by: dict = {}
  found = [None] * len(watch)
  for v, i in watched.items():
    if v.aval.shape == ():  # a scalar is its own witness
      found[i] = v
  for k, eqn in enumerate(jaxpr.eqns[:stop]):
    name, out = eqn.primitive.name, eqn.outvars[0]
    if (name not in _PROPAGATING or (name == "integer_pow" and eqn.params["y"] <= 0)
        or not jnp.issubdtype(out.aval.dtype, jnp.inexact) or out.aval.size == 0):
      continue
    if name in _PROPAGATING - {"sub", "mul", "div"} and all(
        _is_zero(v, zeros) for v in eqn.invars):
      zeros[out] = k
      continue
    operands = eqn.invars[:1] if name == "div" else eqn.invars
    from_source = [v for v in operands if isinstance(v, interp.Var) and v in origin]
    sources = {origin[v] for v in from_source}
    if len(sources) != 1:
      continue
    if name in _ADDING and not all(rounded[v] for v in from_source):
      continue
    i = origin[out] = sources.pop()
    rounded[out] = name in _ROUNDING or all(rounded[v] for v in from_source)
    made_by[out] = k

    def operand_degree(v, i=i):
      if _is_zero(v, zeros):
        return _ZERO
      if isinstance(v, interp.Literal) or (v in consts and v not in watched):
        return 0
      return degree.get(v) if origin.get(v) == i else None  # computed elsewhere: not on its own

    degree[out] = _degree(eqn, [operand_degree(v) for v in eqn.invars])
    if found[i] is None and out.aval.shape == () and rounded[out]:
      found[i] = out
  readers: dict = {}
  for k, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if isinstance(v, interp.Var):
        readers.setdefault(v, set()).add(k)
  outvars = set(jaxpr.outvars)
  witnesses: list = [None] * len(watch)
  for i, w in enumerate(found):
    if w is None or w in watched:
      witnesses[i] = None if w is None else _Witness(w, w, (), frozenset(), None)
      continue
    eqns, pending = set(), [w]
    while pending:
      v = pending.pop()
      k = made_by.get(v, zeros.get(v))
      if k is not None and k not in eqns:
        eqns.add(k)
        pending.extend(x for x in jaxpr.eqns[k].invars if isinstance(x, interp.Var))
    chain = frozenset(k for k in eqns if jaxpr.eqns[k].outvars[0] in made_by)
    inner = {jaxpr.eqns[k].outvars[0] for k in chain} - {w}
    alone = all(readers.get(v, set()) <= chain and v not in outvars for v in inner)
    witnesses[i] = _Witness(w, next(v for v, j in watched.items() if j == i), tuple(sorted(eqns)),
                            chain, degree[w] if alone else None)
  return witnesses


def _bind(eqn: Any, read: Callable[[Any], Any]) -> list:
  return interp.bind(eqn, [read(v) for v in eqn.invars])


def _from_raw(closed: Any, witnesses: list, read: Callable[[Any], Any],
              raw: Sequence[jax.Array], scale: jax.Array) -> dict:
  """The values of the witnesses of degree 1 or more, computed from ``raw`` (see
  :func:`select_update`): ``{witness variable: value}``."""
  fast = [(i, w) for i, w in enumerate(witnesses) if w is not None and w.degree]
  if not fast:
    return {}
  scale = jnp.asarray(scale, jnp.float32)

  def run(w, leaf):
    env = {w.source: leaf}

    def local(v):
      return env[v] if isinstance(v, interp.Var) and v in env else read(v)

    for k in w.eqns:
      eqn = closed.jaxpr.eqns[k]
      env.update(zip(eqn.outvars, _bind(eqn, local)))
    return env[w.var]

  # Grouped by dtype and degree, so that XLA checks and scales one vector per group.
  groups: dict = {}
  for i, w in fast:
    groups.setdefault((w.var.aval.dtype, w.degree), []).append((i, w))
  grouped = list(groups.values())
  mantissa, _ = jnp.frexp(scale)
  ok = (mantissa == 0.5) & (scale >= 1.0) & (scale < finite.DENORMAL_RECIPROCAL)
  values = []
  for group in grouped:
    x = jnp.stack([run(w, raw[i]) for i, w in group])
    y = x
    for _ in range(group[0][1].degree):  # exact: a power of two, and the result is checked normal
      y = y * (1.0 / scale).astype(y.dtype)
    ok &= jnp.all(jnp.isfinite(x) & ((x == 0) | (jnp.abs(y) >= jnp.finfo(y.dtype).tiny)))
    values.append(y)

  def as_written(values, raw, scale):
    del values
    unscaling = finite.unscale_factors(scale)
    return [jnp.stack([run(w, finite.unscale_leaf(raw[i], unscaling)) for i, w in group])
            for group in grouped]

  values = lax.cond(ok, lambda values, *_: values, as_written, values, list(raw), scale)
  return {w.var: v[j] for group, v in zip(grouped, values) for j, (_, w) in enumerate(group)}


def _eval_selecting(closed: Any, decide: Callable[[list], jax.Array], watch: Sequence[jax.Array],
                    unscaled_from: Optional[tuple[Sequence[jax.Array], jax.Array]],
                    num_updates: int, old_leaves: list) -> list:
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
  # The predicate is needed from the first selection on.
  first = next((k for k, eqn in enumerate(jaxpr.eqns) if any(v in swap for v in eqn.outvars)),
               len(jaxpr.eqns))
  witnesses = _witnesses(closed, watch, first)
  env: dict = dict(zip(jaxpr.constvars, closed.consts))

  def read(v):
    return v.val if isinstance(v, interp.Literal) else env[v]

  skip: set = set()
  if unscaled_from is not None:
    env.update(_from_raw(closed, witnesses, read, *unscaled_from))
    skip = {k for w in witnesses if w is not None and w.var in env for k in w.chain}
  witness_vars = [None if w is None else w.var for w in witnesses]
  pred: Any = None
  for k, eqn in enumerate(jaxpr.eqns):
    if k == first:
      pred = decide([None if w is None else read(w) for w in witness_vars])
    if k in skip:
      continue
    for v, val in zip(eqn.outvars, _bind(eqn, read)):
      if v in swap:
        val = _keep(pred, val, old_leaves[swap[v]])
      env[v] = val
  if pred is None:
    pred = decide([None if w is None else read(w) for w in witness_vars])
  assert pred is not None

  outputs = [read(v) for v in jaxpr.outvars]
  updates = [jnp.where(pred, u, neg_zeros_like(u)) for u in outputs[:num_updates]]
  state = [val if swap.get(v) == i else _keep(pred, val, old)
           for i, (v, val, old) in enumerate(zip(state_vars, outputs[num_updates:], old_leaves))]
  return updates + state
