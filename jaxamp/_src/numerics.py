"""Small numerical building blocks shared by the loss-scaling and accumulation transforms."""

from __future__ import annotations

import math
from typing import Any, Callable, Hashable, NamedTuple, Optional, Sequence, Union

import jax
import jax.extend.core as jex_core
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
  ok = _local_all_finite(tree)
  axes = sharding.finite_reduction_axes(tree, axis_name)
  if axes:
    # psum of the failures: one integer all-reduce, the same answer everywhere.
    bad = lax.psum(jnp.logical_not(ok).astype(jnp.int32), axes)
    ok = bad == 0
  return ok


def _is_float(x: Any) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def float_leaves(tree: Any) -> list:
  """The floating leaves of ``tree``, as arrays (a leaf that is one already is returned as is)."""
  return [jnp.asarray(x) for x in jax.tree.leaves(tree) if _is_float(x)]


def _exactly_finite(leaves: list) -> jax.Array:
  """Whether every element of ``leaves`` is finite, by an exact (if slower) check."""
  checks = []
  for x in leaves:
    if x.dtype.itemsize < 4:
      # Half precision: XLA:CPU would sum it in float32 and write the conversion out.
      checks.append(jnp.all(jnp.isfinite(x)))
    else:
      # x * 0 is 0 where x is finite and nan elsewhere: a float sum of it never
      # overflows, and reduces faster than a boolean ``all``.
      checks.append(jnp.isfinite(jnp.sum(x * 0)))
  return jnp.stack(checks).all() if checks else jnp.array(True)


def _probably_finite(leaves: list) -> jax.Array:
  """A check that is never wrong when it says True: each leaf's plain sum is finite.

  Any inf or nan makes the sum inf or nan; a sum of finite values can overflow,
  which gives a false False that the exact check then corrects. The plain sum
  (in float32 at least, so that half-precision sums do not overflow) is the
  cheapest reduction there is: nothing is computed before it, so XLA reads
  each leaf once without writing anything out.
  """
  checks = [jnp.isfinite(jnp.sum(x, dtype=x.dtype if x.dtype.itemsize >= 4 else jnp.float32))
            for x in leaves]
  return jnp.stack(checks).all() if checks else jnp.array(True)


def _quick_answer(quick: jax.Array, *args: Any) -> jax.Array:
  # The quick answer (True where it is taken) rather than a constant: inside
  # ``shard_map`` it varies over the mesh axes as the exact one does.
  del args
  return quick


def _exact_answer(quick: jax.Array, leaves: list) -> jax.Array:
  del quick
  return _exactly_finite(leaves)


def _local_all_finite(tree: Any) -> jax.Array:
  """Whether every floating element of ``tree`` is finite, on this device only.

  The quick check decides, and the exact one runs (in a ``lax.cond``) only
  when the quick one fails. The answer comes out of the conditional, so XLA
  computes it once rather than in every elementwise kernel that selects with it.
  """
  leaves = float_leaves(tree)
  quick = _probably_finite(leaves)
  return lax.cond(quick, _quick_answer, _exact_answer, quick, leaves)


def select_tree(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
  """Elementwise ``where(pred, a, b)`` over two pytrees of the same structure.

  The result keeps each leaf's dtype of ``on_false`` (the old value), so a
  state stays type-stable under ``lax.cond``/``lax.scan``. Selection, unlike a
  multiplication by 0/1, never lets a NaN of the unselected side through.
  """

  def pick(a, b):
    dtype = jnp.result_type(b)
    return jnp.where(pred, jnp.asarray(a).astype(dtype), b).astype(dtype)

  return jax.tree.map(pick, on_true, on_false)


def _neg_zeros_like(x: jax.Array) -> jax.Array:
  # -0.0, not 0.0: p + (-0.0) is p bit for bit for every p, -0.0 included.
  x = jnp.asarray(x)
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.full_like(x, -0.0)  # full_like: sharded (and shard_map-typed) as x is
  return jnp.zeros_like(x)


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

  The naive ``where(pred, updates, 0)``, ``where(pred, new_state, old_state)``
  forces XLA to compute the updates from the *old* optimizer state (the new
  one is only materialised after the selection), so each donated state buffer
  is copied and the gradients are read once more: about 1.6x the cost of the
  bare Adam update. Here ``update`` is traced once to a jaxpr and evaluated
  with each new state leaf replaced, where it is computed, by its selected
  value, so that the updates are computed from the selected state. Where
  ``pred`` is true both are the same values; where it is false the updates
  are zeroed and the state is the old one either way: the result is exactly
  that of the naive selection, at the cost of the plain inner update.

  ``pred`` may also be a function of *witnesses*, one per array of ``watch``
  (arrays that ``update`` reads): a float scalar that ``update`` computes
  before it writes any state and that is non-finite whenever that array has
  a non-finite element (the sum of squares inside a global-norm clip), or
  ``None`` where there is none. A finite check can then reuse a reduction
  the update makes anyway instead of reading the arrays once more.

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
  old_leaves, old_def = jax.tree.flatten(old_state)
  try:
    closed, shapes = jax.make_jaxpr(update, return_shape=True)()
    out_def = jax.tree.structure(shapes)
    updates_def = jax.tree.structure(shapes[0])
    if jax.tree.structure(shapes[1]) != old_def:
      raise ValueError("the new state has not the structure of the old one")
    outputs = _eval_selecting(closed, decide, watch, unscaled_from, updates_def.num_leaves,
                              old_leaves)
  except Exception:  # pylint: disable=broad-except
    # Anything the tracing cannot handle takes the plain path (which also
    # raises the genuine error of a broken ``update``).
    updates, new_state = update()
    ok = decide([None] * len(watch))
    updates = jax.tree.map(lambda u: jnp.where(ok, u, _neg_zeros_like(u)), updates)
    return updates, jax.tree.map(lambda n, o: _keep(ok, n, o), new_state, old_state)
  return jax.tree.unflatten(out_def, outputs)


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
  if isinstance(v, jex_core.Literal):
    return bool(np.all(np.asarray(v.val) == 0))
  return v in zeros


def _witnesses(closed: Any, watch: Sequence[jax.Array], stop: int) -> list:
  """For each array of ``watch``, the first scalar of ``closed`` among its first ``stop``
  equations that is computed from it alone through :data:`_PROPAGATING` primitives, as a
  :class:`_Witness`, or None."""
  jaxpr = closed.jaxpr
  watched = {v: i for v, c in zip(jaxpr.constvars, closed.consts)
             for i, w in enumerate(watch) if c is w}
  consts = set(jaxpr.constvars)
  origin = dict(watched)
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
    sources = {origin[v] for v in operands if isinstance(v, jex_core.Var) and v in origin}
    if len(sources) != 1:
      continue
    i = origin[out] = sources.pop()
    made_by[out] = k

    def operand_degree(v):
      if _is_zero(v, zeros):
        return _ZERO
      if isinstance(v, jex_core.Literal) or (v in consts and v not in watched):
        return 0
      return degree.get(v) if origin.get(v) == i else None  # computed elsewhere: not on its own

    degree[out] = _degree(eqn, [operand_degree(v) for v in eqn.invars])
    if found[i] is None and out.aval.shape == ():
      found[i] = out
  readers: dict = {}
  for k, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if isinstance(v, jex_core.Var):
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
        pending.extend(x for x in jaxpr.eqns[k].invars if isinstance(x, jex_core.Var))
    chain = frozenset(k for k in eqns if jaxpr.eqns[k].outvars[0] in made_by)
    inner = {jaxpr.eqns[k].outvars[0] for k in chain} - {w}
    alone = all(readers.get(v, set()) <= chain and v not in outvars for v in inner)
    witnesses[i] = _Witness(w, next(v for v, j in watched.items() if j == i), tuple(sorted(eqns)),
                            chain, degree[w] if alone else None)
  return witnesses


def _bind(eqn: Any, read: Callable[[Any], Any]) -> list:
  params = eqn.primitive.get_bind_params(eqn.params)
  with eqn.ctx.manager:
    ans = eqn.primitive.bind(*[read(v) for v in eqn.invars], **params)
  return ans if eqn.primitive.multiple_results else [ans]


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
      return env[v] if isinstance(v, jex_core.Var) and v in env else read(v)

    for k in w.eqns:
      eqn = closed.jaxpr.eqns[k]
      env.update(zip(eqn.outvars, _bind(eqn, local)))
    return env[w.var]

  # Grouped by dtype and degree, so that XLA checks and scales one vector per group.
  groups: dict = {}
  for i, w in fast:
    groups.setdefault((w.var.aval.dtype, w.degree), []).append((i, w))
  groups = list(groups.values())
  mantissa, _ = jnp.frexp(scale)
  ok = (mantissa == 0.5) & (scale >= 1.0) & (scale < _DENORMAL_RECIPROCAL)
  values = []
  for group in groups:
    x = jnp.stack([run(w, raw[i]) for i, w in group])
    y = x
    for _ in range(group[0][1].degree):  # exact: a power of two, and the result is checked normal
      y = y * (1.0 / scale).astype(y.dtype)
    ok &= jnp.all(jnp.isfinite(x) & ((x == 0) | (jnp.abs(y) >= jnp.finfo(y.dtype).tiny)))
    values.append(y)

  def as_written(values, raw, scale):
    del values
    factors = _unscale_factors(scale)
    return [jnp.stack([run(w, _unscale_leaf(raw[i], *factors)) for i, w in group])
            for group in groups]

  values = lax.cond(ok, lambda values, *_: values, as_written, values, list(raw), scale)
  return {w.var: v[j] for group, v in zip(groups, values) for j, (_, w) in enumerate(group)}


def _eval_selecting(closed: Any, decide: Callable[[list], jax.Array], watch: Sequence[jax.Array],
                    unscaled_from: Optional[tuple[Sequence[jax.Array], jax.Array]],
                    num_updates: int, old_leaves: list) -> list:
  """Evaluates ``closed`` (a jaxpr of ``update``), selecting the state where it is made."""
  jaxpr = closed.jaxpr
  state_vars = jaxpr.outvars[num_updates:]
  if len(state_vars) != len(old_leaves):
    raise ValueError("state leaves do not match")
  # Each state output defined by an equation is selected right there (by the old
  # value of its own position); later uses, the updates among them, see that value.
  defined = {v for eqn in jaxpr.eqns for v in eqn.outvars}
  swap: dict = {}
  for i, (v, old) in enumerate(zip(state_vars, old_leaves)):
    old = jnp.asarray(old)
    if (isinstance(v, jex_core.Var) and v in defined and v not in swap
        and v.aval.shape == old.shape and v.aval.dtype == old.dtype):
      swap[v] = i
  # The predicate is needed from the first selection on.
  first = next((k for k, eqn in enumerate(jaxpr.eqns) if any(v in swap for v in eqn.outvars)),
               len(jaxpr.eqns))
  witnesses = _witnesses(closed, watch, first)
  env: dict = dict(zip(jaxpr.constvars, closed.consts))

  def read(v):
    return v.val if isinstance(v, jex_core.Literal) else env[v]

  skip: set = set()
  if unscaled_from is not None:
    env.update(_from_raw(closed, witnesses, read, *unscaled_from))
    skip = {k for w in witnesses if w is not None and w.var in env for k in w.chain}
  witness_vars = [None if w is None else w.var for w in witnesses]
  pred = None
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

  outputs = [read(v) for v in jaxpr.outvars]
  updates = [jnp.where(pred, u, _neg_zeros_like(u)) for u in outputs[:num_updates]]
  state = [val if swap.get(v) == i else _keep(pred, val, old)
           for i, (v, val, old) in enumerate(zip(state_vars, outputs[num_updates:], old_leaves))]
  return updates + state


def safe_increment(count: jax.Array) -> jax.Array:
  """Adds one to an integer counter, saturating at its dtype's maximum."""
  top = jnp.iinfo(count.dtype).max
  return jnp.where(count < top, count + 1, count).astype(count.dtype)


def _huge_factors(scale: jax.Array) -> tuple[jax.Array, jax.Array]:
  return jnp.float32(1.0 / _TWO_64), jnp.float32(_TWO_64) / scale


def _normal_factors(scale: jax.Array) -> tuple[jax.Array, jax.Array]:
  return jnp.float32(1.0), jnp.float32(1.0) / scale


def _unscale_factors(scale: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Two normal float32 factors whose product is ``float32(1 / scale)``, as XLA buffers.

  A ``lax.cond``, not a ``where``: XLA:CPU fuses scalar code into each
  elementwise kernel that uses it and re-runs it there for every element; a
  conditional's results are computed once.
  """
  return lax.cond(scale >= _DENORMAL_RECIPROCAL, _huge_factors, _normal_factors, scale)


def unscale(tree: Any, scale: jax.Array) -> Any:
  """Divides every floating leaf by ``scale``, bit for bit as PyTorch does.

  PyTorch multiplies by ``float32(1 / scale)``. When the scale is 2^126 or
  more, that reciprocal is a denormal, which XLA flushes to zero on CPU; then
  the multiplication is split into two normal factors (``2^-64`` and
  ``2^64 / scale``), so the result is the same as PyTorch's instead of zero.
  Each leaf is computed in float32 and cast back to its own dtype.
  """
  factors = _unscale_factors(jnp.asarray(scale, jnp.float32))
  return jax.tree.map(lambda g: _unscale_leaf(g, *factors), tree)


def _unscale_leaf(g: Any, first: jax.Array, second: jax.Array) -> Any:
  g = jnp.asarray(g)
  if not jnp.issubdtype(g.dtype, jnp.inexact):
    return g
  if jnp.issubdtype(g.dtype, jnp.complexfloating):
    return lax.complex(_unscale_leaf(g.real, first, second), _unscale_leaf(g.imag, first, second))
  # Half precision is computed in float32, float64 (with x64) in float64.
  compute = g.dtype if g.dtype.itemsize >= 4 else jnp.dtype(jnp.float32)
  return (g.astype(compute) * first.astype(compute) * second.astype(compute)).astype(g.dtype)


def _unscaled_exactly_finite(quick: jax.Array, grads: Any, scale: jax.Array) -> jax.Array:
  del quick
  return _exactly_finite(float_leaves(unscale(grads, scale)))


def unscaled_all_finite(grads: Any, scale: jax.Array, axis_name: AxisName = None,
                        witnesses: Optional[Sequence[Optional[jax.Array]]] = None) -> jax.Array:
  """Returns ``all_finite(unscale(grads, scale), axis_name)``, reading the gradients once.

  The quick check sums each raw (scaled) gradient leaf, which a jitted step
  already holds in memory: checking the unscaled ones would make XLA write
  them out first. Finite sums prove the unscaled gradients finite whenever
  ``scale >= 1``, as unscaling then only shrinks values. Otherwise (a sum
  that overflowed, a genuine inf or nan, a scale below 1) the unscaled
  gradients are checked exactly, inside a ``lax.cond`` that is skipped on a
  good step. The answer comes out of that conditional, so that XLA computes
  it once rather than in every elementwise kernel that selects with it.

  Args:
    grads: a pytree of (scaled) gradients.
    scale: the loss scale they are divided by, as :func:`unscale` does.
    axis_name: as in :func:`all_finite`.
    witnesses: one entry per floating leaf of ``grads``: a scalar computed
      from the *unscaled* leaf that is non-finite whenever the leaf has a
      non-finite element (see :func:`select_update`), used by the quick check
      instead of the leaf's own sum; or ``None``.

  Returns:
    A ``bool`` scalar array.

  Raises:
    ValueError: as :func:`all_finite`.
  """
  scale = jnp.asarray(scale, jnp.float32)
  axes = sharding.finite_reduction_axes(grads, axis_name)
  leaves = float_leaves(grads)
  witnesses = [None] * len(leaves) if witnesses is None else witnesses
  checks = [jnp.isfinite(w) for w in witnesses if w is not None]
  raw = [x for x, w in zip(leaves, witnesses) if w is None]
  if raw:
    # A NaN scale fails ``scale >= 1`` and takes the exact path.
    checks.append(jnp.logical_and(_probably_finite(raw), scale >= 1.0))
  quick = jnp.stack(checks).all() if checks else jnp.array(True)
  ok = lax.cond(quick, _quick_answer, _unscaled_exactly_finite, quick, grads, scale)
  if axes:
    # psum of the failures, as in all_finite.
    ok = lax.psum(jnp.logical_not(ok).astype(jnp.int32), axes) == 0
  return ok


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
