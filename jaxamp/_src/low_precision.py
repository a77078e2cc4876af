"""Training bfloat16 parameters without a float32 master copy: stochastic and Kahan rounding.

:func:`low_precision_params` wraps an optax transformation so that it runs on
float32 views of bfloat16 parameters and returns float32 updates that
``optax.apply_updates`` turns into exactly the rounded new parameters.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxamp._src import state as state_lib
from jaxamp._src import validation
from jaxamp._src.state import LowPrecisionState

ROUNDINGS = ("stochastic", "kahan", "nearest")
STATE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_LOW = jnp.dtype(jnp.bfloat16)
_KEY_IMPL = "threefry2x32"


def check_rounding(rounding: Any) -> str:
  """``rounding`` when it names one of :data:`ROUNDINGS`."""
  if not isinstance(rounding, str) or rounding not in ROUNDINGS:
    raise ValueError(f"rounding must be one of {', '.join(map(repr, ROUNDINGS))}, "
                     f"got {rounding!r}")
  return rounding


def check_seed(seed: Any) -> int:
  """``seed`` when it is an int in ``[0, 2**32)``."""
  try:
    seed = validation.concrete_scalar(seed, "seeds")
  except TypeError as err:
    raise TypeError(f"seed must be an int: {err}") from None
  return validation.check_int("seed", seed, minimum=0, maximum=2**32 - 1)


def check_state_dtype(state_dtype: Any) -> jnp.dtype:
  """``state_dtype`` when it is float32 or bfloat16."""
  dtype = validation.check_float_dtype("state_dtype", state_dtype)
  if dtype not in STATE_DTYPES:
    raise ValueError(f"state_dtype must be float32 or bfloat16, got {dtype}")
  return jnp.dtype(dtype)


def _is_low(leaf: Any) -> bool:
  return jnp.result_type(leaf) == _LOW


def _check_leaves(tree: Any, what: str) -> None:
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    dtype = jnp.result_type(leaf)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4 and dtype != _LOW:
      where = jax.tree_util.keystr(path) or "<root>"
      raise ValueError(
          f"jaxamp.low_precision_params supports bfloat16 and float32 parameters; the {what} "
          f"leaf {where} is {dtype}. Float16 has too few exponent bits for updates to live in the "
          "parameters: keep float32 master parameters and cast them to float16 for the "
          "computation only (jaxamp.Policy), or store the parameters in bfloat16.")


# Every rounding here produces a float32 array holding bfloat16 values, and no value rounded here
# is read back from bfloat16: on a GPU, XLA removes ``convert(convert(x: f32) -> bf16) -> f32`` by
# default (excess precision), so a rounding written as that round trip would read the unrounded
# ``x``. ``lax.reduce_precision`` and bitcasts are kept whatever XLA does to conversions. The
# parameters are read as float32 from bfloat16; where the step that wrote them is in the same
# program (two steps in one jit), XLA may read them from the float32 sum of ``apply_updates``
# instead, which is the bfloat16 value itself (see :func:`exact_update`; to within a float32
# spacing in the rare case that function describes).
_LOW_INFO = jnp.finfo(_LOW)


def round_nearest(x: jax.Array) -> jax.Array:
  """float32 to the nearest bfloat16 value (ties to even), as a float32 array.

  ``lax.reduce_precision`` rounds as the conversion to bfloat16 does (overflow
  to inf, NaN kept) without leaving float32, so no rewrite of conversions can
  remove it.
  """
  return lax.reduce_precision(x, exponent_bits=_LOW_INFO.nexp, mantissa_bits=_LOW_INFO.nmant)


def _mix32(x: jax.Array) -> jax.Array:
  """The lowbias32 integer hash (xor-shift, multiply; a bijection of uint32)."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def random_bits16(key: jax.Array, shape: tuple) -> jax.Array:
  """uint32 array of ``shape`` with 16 random bits per element (the high bits of a keyed hash).

  Counter-based: element ``i`` (its row-major index) gets the high 16 bits of
  ``mix(mix(i ^ k0) + k1)``, with ``k0, k1`` the two words of the raw
  threefry ``key`` and ``mix`` the lowbias32 hash. The bits depend on the key
  and the index only: the same under any sharding and on every device. (A
  few integer operations per element, where threefry's random bits cost
  several times more.)
  """
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for dim in reversed(range(len(shape))):
    index = index + lax.broadcasted_iota(jnp.uint32, shape, dim) * jnp.uint32(stride % 2**32)
    stride *= shape[dim]
  return _mix32(_mix32(index ^ key[0]) + key[1]) >> 16


def round_stochastic(x: jax.Array, key: jax.Array) -> jax.Array:
  """float32 to bfloat16 values, stochastically: adds 16 random bits below the kept ones, truncates.

  The float32 bit pattern ``b`` (sign, 8 exponent bits, 23 mantissa bits) gets
  a uniform integer ``r`` in ``[0, 2**16)`` (:func:`random_bits16` of the raw
  ``key``) added to it as an unsigned integer, and the low 16 bits of the sum
  are cleared; the result is a bfloat16 value, as a float32 array (read from
  the bits, so no rewrite of conversions can remove the rounding). The magnitude therefore rounds
  away from zero with probability ``(b mod 2**16) / 2**16``, its distance to
  the lower neighbour in units of the bfloat16 spacing, and toward zero
  otherwise: the expectation is ``x`` (unbiased), across binades and
  subnormals alike (the carry walks into the exponent). Infinities stay
  infinities; a value whose rounding away from zero passes the largest
  bfloat16 becomes ``inf`` with that probability; NaN stays NaN.
  """
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  kept = (bits + random_bits16(key, x.shape)) & jnp.uint32(0xFFFF0000)
  return jnp.where(jnp.isnan(x), x, lax.bitcast_convert_type(kept, jnp.float32))


def _unit_exponent(p: jax.Array) -> jax.Array:
  """int32 ``e``: the compensation of ``p`` counts in units of ``2**(e - 23)`` (float32's spacing).

  ``e`` is ``p``'s binary exponent, at least -126 (zeros and subnormals) and
  at most 126; ``p`` is a bfloat16 parameter or a float32 array of bfloat16
  values (the exponent fields agree).
  """
  if p.dtype == _LOW:
    bits = lax.bitcast_convert_type(p, jnp.uint16).astype(jnp.int32) << 16
  else:
    bits = lax.bitcast_convert_type(p, jnp.int32)
  return jnp.clip(((bits >> 23) & 0xFF) - 127, -126, 126)


def _pow2(e: jax.Array) -> jax.Array:
  """float32 ``2**e`` for int32 ``e`` in ``[-126, 127]``, from the bits."""
  return lax.bitcast_convert_type(((e + 127) << 23).astype(jnp.int32), jnp.float32)


def decode_compensation(c: jax.Array, p: jax.Array) -> jax.Array:
  """The float32 value of the int16 compensation ``c`` of the bfloat16 parameter ``p``."""
  return (c.astype(jnp.float32) * jnp.float32(2.0**-23)) * _pow2(_unit_exponent(p))


def encode_compensation(residual: jax.Array, p: jax.Array) -> jax.Array:
  """``residual`` (float32, at most half a bfloat16 spacing of ``p``) as ``p``'s int16 compensation.

  Rounded to the nearest multiple of ``2**(e - 23)`` (float32's spacing at
  ``p``'s exponent ``e``); a non-finite residual (``p`` inf or nan) gives 0.
  """
  units = jnp.round(residual * _pow2(-_unit_exponent(p)) * jnp.float32(2.0**23))
  units = jnp.where(jnp.isfinite(units), units, 0.0)
  return jnp.clip(units, -32767, 32767).astype(jnp.int16)


def exact_update(p32: jax.Array, new32: jax.Array) -> jax.Array:
  """The float32 ``u`` with ``bfloat16(p + u) == new`` (value-exact), ``-0.0`` where nothing changes."""
  return jnp.where(new32 == p32, jnp.float32(-0.0), new32 - p32)


def _leaves_like(treedef: Any, tree: Any, what: str) -> list:
  """The leaves of ``tree``, which must have the structure ``treedef`` (the parameters')."""
  leaves, structure = jax.tree.flatten(tree)
  if structure != treedef:
    raise ValueError(f"{what} must have the structure of the parameters: got {structure}, "
                     f"expected {treedef}")
  return leaves


def _check_compensation(params: Any, compensation: list) -> None:
  """Refuses a bfloat16 leaf of another shape than its compensation buffer (a moved leaf)."""
  low = [(path, p) for path, p in jax.tree_util.tree_leaves_with_path(params) if _is_low(p)]
  for j, ((path, p), c) in enumerate(zip(low, compensation)):
    if jnp.shape(c) != jnp.shape(p):
      raise ValueError(
          f"the bfloat16 parameter {jax.tree_util.keystr(path) or '<root>'} has shape "
          f"{jnp.shape(p)}, but the state's Kahan compensation of bfloat16 leaf {j} has shape "
          f"{jnp.shape(c)}: pass the params the state was initialised with, with the same "
          "leaves in bfloat16")


def _upcast(tree: Any) -> Any:
  return jax.tree.map(lambda x: x.astype(jnp.float32) if _is_low(x) else x, tree)


def _like(new: Any, old: Any) -> Any:
  return jax.tree.map(lambda n, o: jnp.asarray(n).astype(jnp.result_type(o)), new, old)


def low_precision_params(
    inner: optax.GradientTransformation,
    rounding: str = "stochastic",
    *,
    seed: int = 0,
    state_dtype: Any = jnp.float32,
) -> optax.GradientTransformationExtraArgs:
  """Trains bfloat16 parameters in place, without a float32 master copy.

  ``inner`` (an Adam, an SGD, a chain with a clip) runs on float32 views of
  the bfloat16 parameters and gradients, so its arithmetic is float32 and its
  moments are stored in ``state_dtype`` (``optax.adam`` on bare bfloat16
  parameters would keep bfloat16 moments). Its update ``u`` is then added to
  each bfloat16 parameter ``p`` in float32 and the sum rounded back to
  bfloat16 by the chosen rule ``R``:

  - ``"nearest"``: round-to-nearest-even, ``new = bfloat16(p + u)``. Every
    ``|u|`` below half a bfloat16 spacing of ``p`` (``2**-9 |p|`` or less) is
    lost: the baseline, and what plain bfloat16 training does.
  - ``"stochastic"``: the float32 bits of ``p + u`` get 16 uniform random
    bits added below the 16 that bfloat16 keeps, and are then truncated, so
    ``new`` is the upper or the lower neighbour with probabilities that make
    it unbiased, ``E[new] = p + u``. The key in the state is split once per
    step and folded with each leaf's index, so the same ``seed`` gives the
    same bits on any number of devices and under any sharding. The random
    bits are a keyed integer hash of each element's index (lowbias32).
  - ``"kahan"``: a 16-bit compensation buffer ``c`` per leaf keeps what
    rounding dropped and adds it back at the next step::

      y = u + c                     # float32
      new = bfloat16(p + y)         # round-to-nearest
      c = y - (new - p)             # what new could not hold (new - p is exact)

    ``c`` is stored as an int16 in units of float32's spacing at ``new``'s
    binade (``2**(e - 23)`` for ``new`` in ``[2**e, 2**(e+1))``, ``e`` at
    least -126), so ``new + c`` is the float32 sum of the updates to
    float32 precision: the bfloat16 parameter holds the high 8 significand
    bits and ``c`` the next 16, as a float32 master would. (A bfloat16
    buffer, 2 bytes as well, holds 8 bits of the residual only: adding
    ``1e-4`` to ``1.0`` 100 times, ``p + c`` ends at 1.0103 instead of
    1.01.) The visible weight is the nearest bfloat16 to that sum.
    :func:`decode_compensation` gives ``c`` as float32.

  The returned updates are float32, ``new - p`` where the parameter changes
  and ``-0.0`` where it does not, so that ``optax.apply_updates`` (which adds
  in float32 and casts to the parameter's dtype) gives exactly ``new``:
  ``new - p`` is exact when ``new`` and ``p`` are within ``2**16`` of each
  other in magnitude, and otherwise off by less than a float32 spacing,
  which the cast back to bfloat16 removes. A zero result carries ``p``'s sign
  where ``p`` is zero (a float32 addition cannot turn ``+0.0`` into
  ``-0.0``). Apply them with standard dtype promotion: under
  ``jax_numpy_dtype_promotion="strict"``, ``optax.apply_updates`` refuses a
  bfloat16 parameter plus a float32 update; ``jaxamp.TrainState`` and
  ``jaxamp.nnx.Optimizer`` apply them under standard promotion.

  float32 (and wider) parameters pass through untouched: ``inner`` sees them
  as they are and their updates are returned as ``inner`` made them. Float16
  parameters are refused. Put the transformation inside
  :func:`dynamic_loss_scale` or :func:`accumulate_gradients`: a skipped or
  accumulating step does not run it, so its key and buffers stay
  bit-identical.

  ``update`` takes the parameters the state was initialised with: the
  gradients must have their structure and shapes, and the state knows how
  many leaves are bfloat16 and, with Kahan rounding, their shapes, so a
  different count or a bfloat16 leaf of another shape than its compensation
  buffer is refused. Which leaves they are is not recorded: a bfloat16 leaf
  swapped with a float32 leaf of the same shape would take over the other's
  compensation (less than half a bfloat16 spacing of it).

  Args:
    inner: the optax transformation, e.g. ``optax.adamw(3e-4)``.
    rounding: ``"stochastic"``, ``"kahan"`` or ``"nearest"``.
    seed: an int in ``[0, 2**32)``, the seed of stochastic rounding.
    state_dtype: ``jnp.float32`` or ``jnp.bfloat16``, the dtype in which the
      inner state (Adam's moments) of bfloat16 leaves is stored; it computes
      in float32 either way.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`LowPrecisionState`. ``update`` needs ``params``.

  Raises:
    TypeError: when ``inner`` is not an optax transformation, ``seed`` not
      an int, or ``state_dtype`` not a dtype.
    ValueError: for an unknown ``rounding``, a ``seed`` out of range, a
      ``state_dtype`` other than float32 and bfloat16, and (at ``init`` and
      trace time) float16 parameters, a missing ``params``, gradients of
      another shape than the parameters or a moved bfloat16 leaf (named by
      its path).

  Examples:
    Adding ``1e-4`` to a bfloat16 ``1.0`` 100 times: nearest rounding loses
    every step, Kahan keeps the sum.

    >>> import jax, jax.numpy as jnp, optax, jaxamp
    >>> def run(rounding):
    ...   tx = jaxamp.low_precision_params(optax.sgd(1e-4), rounding)
    ...   params = {'w': jnp.ones(4, jnp.bfloat16)}
    ...   state = tx.init(params)
    ...   grads = {'w': jnp.full(4, -1.0, jnp.bfloat16)}
    ...   for _ in range(100):
    ...     updates, state = tx.update(grads, state, params)
    ...     with jax.numpy_dtype_promotion("standard"):  # jax's default
    ...       params = optax.apply_updates(params, updates)
    ...   return params['w'], state
    >>> run("nearest")[0]
    Array([1, 1, 1, 1], dtype=bfloat16)
    >>> w, state = run("kahan")
    >>> w
    Array([1.00781, 1.00781, 1.00781, 1.00781], dtype=bfloat16)
    >>> w.astype(jnp.float32) + jaxamp.decode_compensation(state.compensation[0], w)
    Array([1.0100017, 1.0100017, 1.0100017, 1.0100017], dtype=float32)
    >>> state.stale_fraction  # round-to-nearest would have lost every element
    Array([1.], dtype=float32)
  """
  inner = validation.check_gradient_transformation(inner, "inner")
  rounding = check_rounding(rounding)
  seed = check_seed(seed)
  state_dtype = check_state_dtype(state_dtype)
  store_low = state_dtype == _LOW

  def init_fn(params: optax.Params) -> LowPrecisionState:
    _check_leaves(params, "params")
    leaves = jax.tree.leaves(params)
    low = [jnp.asarray(x) for x in leaves if _is_low(x)]
    views = jax.tree.map(lambda x: jnp.asarray(x).astype(state_dtype) if _is_low(x) else x,
                         params)
    key = jax.random.key_data(jax.random.key(seed, impl=_KEY_IMPL)).astype(jnp.uint32)
    compensation = ([jnp.zeros_like(x, dtype=jnp.int16) for x in low] if rounding == "kahan"
                    else [])
    inner_state = inner.init(views)
    state_lib.check_compositions(inner_state)
    return LowPrecisionState(key=key, compensation=compensation,
                             stale_fraction=jnp.zeros([len(low)], jnp.float32),
                             inner_state=inner_state)

  def update_fn(updates: optax.Updates, state: Any,
                params: Optional[optax.Params] = None, **extra_args: Any
                ) -> tuple[optax.Updates, LowPrecisionState]:
    if params is None:
      raise ValueError("jaxamp.low_precision_params needs the parameters: call "
                       "tx.update(grads, state, params)")
    _check_leaves(params, "params")
    p_leaves, treedef = jax.tree.flatten(params)
    g_leaves = _leaves_like(treedef, updates, "the gradients")
    validation.check_shapes_like("the gradients", updates, "the parameters", params)
    is_low = [_is_low(p) for p in p_leaves]
    if sum(is_low) != state.stale_fraction.shape[0]:
      raise ValueError(f"params have {sum(is_low)} bfloat16 leaves, the params the state was "
                       f"initialised with {state.stale_fraction.shape[0]}")
    _check_compensation(params, state.compensation)
    p_views = [jnp.asarray(p).astype(jnp.float32) if low else p
               for p, low in zip(p_leaves, is_low)]
    g_views = [jnp.asarray(g).astype(jnp.float32) if low else g
               for g, low in zip(g_leaves, is_low)]
    inner_state = _upcast(state.inner_state) if store_low else state.inner_state
    inner_updates, new_inner = inner.update(jax.tree.unflatten(treedef, g_views), inner_state,
                                            jax.tree.unflatten(treedef, p_views), **extra_args)
    new_inner = _like(new_inner, state.inner_state)
    u_leaves = _leaves_like(treedef, inner_updates, "the inner updates")

    key = state.key
    if rounding == "stochastic":
      keys = jax.random.split(jax.random.wrap_key_data(state.key, impl=_KEY_IMPL))
      key, step_key = jax.random.key_data(keys[0]), keys[1]
    out, stale, compensation = [], [], []
    j = 0
    for p, p32, u, low in zip(p_leaves, p_views, u_leaves, is_low):
      if not low:
        out.append(u)
        continue
      u32 = jnp.asarray(u).astype(jnp.float32)
      total = p32 + u32
      nearest = round_nearest(total)  # float32 arrays of bfloat16 values from here on
      lost = (nearest == p32) & (u32 != 0)
      stale.append(jnp.sum(lost, dtype=jnp.float32) / jnp.float32(max(lost.size, 1)))
      if rounding == "nearest":
        new = nearest
      elif rounding == "stochastic":
        new = round_stochastic(total, jax.random.key_data(jax.random.fold_in(step_key, j)))
      else:
        y = u32 + decode_compensation(state.compensation[j], p)
        new = round_nearest(p32 + y)
        compensation.append(encode_compensation(y - (new - p32), new))
      out.append(exact_update(p32, new))
      j += 1
    stale_fraction = (jnp.stack(stale) if stale else jnp.zeros([0], jnp.float32))
    return jax.tree.unflatten(treedef, out), LowPrecisionState(
        key=key.astype(jnp.uint32), compensation=compensation,
        stale_fraction=stale_fraction.astype(jnp.float32), inner_state=new_inner)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
