"""Loss scaling as an optax transformation: dynamic (PyTorch's rule with Paddle's hysteresis) and static."""

from __future__ import annotations

import dataclasses
import numbers
import warnings
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxamp._src import finite
from jaxamp._src import numerics
from jaxamp._src import selective_update

#: Default floor of the dynamic scale: the smallest normal float32. Far below any
#: scale a real run reaches, it only stops the degenerate slide to 0.0.
DEFAULT_MIN_SCALE = float(np.finfo(np.float32).tiny)
#: Default ceiling: the largest finite float32. A growth that would overflow is
#: refused, exactly as PyTorch refuses to grow to inf.
DEFAULT_MAX_SCALE = float(np.finfo(np.float32).max)


class LossScaleState(NamedTuple):
  """State of :func:`dynamic_loss_scale` and :func:`static_loss_scale`.

  Every field is an array with a fixed dtype, so the state can be logged,
  checkpointed and carried through ``lax.scan`` without a host sync.

  Attributes:
    scale: float32 scalar, the factor the loss is multiplied by.
    growth_tracker: int32, consecutive finite steps since the scale last
      changed (PyTorch's ``_growth_tracker``, Paddle's ``incr_count``).
    overflow_count: int32, consecutive non-finite steps not yet acted on
      (Paddle's ``decr_count``; always 0 with ``hysteresis=1``).
    skipped: bool, whether the last update was skipped for non-finite grads.
    skipped_steps: int32, how many updates were skipped in total (saturates).
    inner_state: the state of the wrapped transformation.
  """

  scale: jax.Array
  growth_tracker: jax.Array
  overflow_count: jax.Array
  skipped: jax.Array
  skipped_steps: jax.Array
  inner_state: optax.OptState


@dataclasses.dataclass(frozen=True)
class ScaleRule:
  """The scale-adjustment rule: hyperparameters that select code, kept static."""

  growth_factor: float = 2.0
  backoff_factor: float = 0.5
  growth_interval: int = 2000
  hysteresis: int = 1
  min_scale: float = DEFAULT_MIN_SCALE
  max_scale: float = DEFAULT_MAX_SCALE
  dynamic: bool = True

  def adjust(self, scale, growth_tracker, overflow_count, found_inf):
    """Returns the next ``(scale, growth_tracker, overflow_count)``.

    ::

      if found_inf:
        growth_tracker = 0
        overflow_count += 1
        if overflow_count == hysteresis:
          scale = max(scale * backoff_factor, min_scale); overflow_count = 0
      else:
        overflow_count = 0
        growth_tracker += 1
        if growth_tracker == growth_interval:
          if scale * growth_factor is finite:
            scale = min(scale * growth_factor, max_scale)
          growth_tracker = 0

    Products are rounded as PyTorch's float64 arithmetic rounds them.
    """
    if not self.dynamic:
      return scale, growth_tracker, overflow_count
    zero = jnp.zeros_like(growth_tracker)
    # Bad step.
    overflows = overflow_count + 1
    back_off = overflows >= self.hysteresis
    shrunk = jnp.maximum(numerics.mul_like_float64(scale, self.backoff_factor),
                         jnp.float32(self.min_scale))
    bad_scale = jnp.where(back_off, shrunk, scale)
    bad_overflow = jnp.where(back_off, zero, overflows)
    # Good step.
    tracker = growth_tracker + 1
    grow = tracker >= self.growth_interval
    grown = numerics.mul_like_float64(scale, self.growth_factor)
    grown = jnp.where(jnp.isfinite(grown), jnp.minimum(grown, jnp.float32(self.max_scale)), scale)
    good_scale = jnp.where(grow, grown, scale)
    good_tracker = jnp.where(grow, zero, tracker)

    new_scale = jnp.where(found_inf, bad_scale, good_scale).astype(jnp.float32)
    new_tracker = jnp.where(found_inf, zero, good_tracker).astype(jnp.int32)
    new_overflow = jnp.where(found_inf, bad_overflow, zero).astype(jnp.int32)
    return new_scale, new_tracker, new_overflow


_INT32_MAX = int(np.iinfo(np.int32).max)


def _concrete_scalar(value: Any) -> Any:
  """Unwraps a concrete 0-d numpy/JAX array; refuses traced values."""
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
        f"got the traced value {value!r}; loss-scaling hyperparameters select code at "
        "construction and must be Python numbers (with optax.inject_hyperparams, list them "
        "in static_args)")
  if isinstance(value, (np.ndarray, np.generic, jax.Array)) and np.ndim(value) == 0:
    return np.asarray(value).item()
  return value


def _check_number(name: str, value: Any) -> float:
  try:
    value = _concrete_scalar(value)
  except TypeError as err:
    raise TypeError(f"{name} must be a real number: {err}") from None
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{name} must be a real number, got {value!r} of type {type(value).__name__}")
  value = float(value)
  if not np.isfinite(value):
    raise ValueError(f"{name} must be finite, got {value!r}")
  return value


def _check_int(name: str, value: Any) -> int:
  try:
    value = _concrete_scalar(value)
  except TypeError as err:
    raise TypeError(f"{name} must be an int: {err}") from None
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
  if not 1 <= value <= _INT32_MAX:
    raise ValueError(f"{name} must be an int in [1, {_INT32_MAX}] (its counter is an int32), "
                     f"got {value!r}")
  return int(value)


def _check_inner(inner: Any) -> optax.GradientTransformationExtraArgs:
  if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
    raise TypeError(
        f"inner must be an optax GradientTransformation (with init and update), got {inner!r}")
  return optax.with_extra_args_support(inner)


def make_rule(*, growth_factor: float = 2.0, backoff_factor: float = 0.5,
              growth_interval: int = 2000, hysteresis: int = 1,
              min_scale: Optional[float] = None, max_scale: Optional[float] = None) -> ScaleRule:
  """Validates the hyperparameters of the dynamic rule and returns it."""
  growth_factor = _check_number("growth_factor", growth_factor)
  if growth_factor <= 1.0:
    raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}")
  backoff_factor = _check_number("backoff_factor", backoff_factor)
  if not 0.0 < backoff_factor < 1.0:
    raise ValueError(f"backoff_factor must be in the open interval (0, 1), got {backoff_factor!r}")
  growth_interval = _check_int("growth_interval", growth_interval)
  hysteresis = _check_int("hysteresis", hysteresis)
  min_scale = DEFAULT_MIN_SCALE if min_scale is None else _check_number("min_scale", min_scale)
  max_scale = DEFAULT_MAX_SCALE if max_scale is None else _check_number("max_scale", max_scale)
  if min_scale < DEFAULT_MIN_SCALE:
    raise ValueError(
        f"min_scale must be a normal float32, at least {DEFAULT_MIN_SCALE!r} (smaller scales are "
        f"denormal, which XLA flushes to 0.0), got {min_scale!r}")
  if min_scale > max_scale:
    raise ValueError(f"min_scale must be <= max_scale, got min_scale={min_scale!r} > "
                     f"max_scale={max_scale!r}")
  if max_scale > DEFAULT_MAX_SCALE:
    raise ValueError(f"max_scale must be a finite float32, at most {DEFAULT_MAX_SCALE!r}, "
                     f"got {max_scale!r}")
  return ScaleRule(growth_factor, backoff_factor, growth_interval, hysteresis,
                   min_scale, max_scale, True)


def check_scale(name: str, value: Any, low: float = 0.0, high: float = DEFAULT_MAX_SCALE) -> float:
  """Validates a positive, finite loss scale within ``[low, high]``."""
  value = _check_number(name, value)
  if value <= 0.0:
    raise ValueError(f"{name} must be a positive, finite number, got {value!r}")
  if not low <= value <= high:
    raise ValueError(f"{name} must lie in [min_scale, max_scale] = [{low!r}, {high!r}], "
                     f"got {value!r}")
  return value


def check_grad_dtypes(tree: Any, what: str) -> None:
  """Refuses float16 master weights/grads, warns about integer leaves (trace-time check)."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    dtype = jnp.result_type(leaf)
    where = jax.tree_util.keystr(path) or "<root>"
    if dtype == jnp.float16:
      raise ValueError(
          "Attempting to unscale FP16 gradients. "
          f"The {what} leaf {where} is float16; keep float32 master parameters and cast "
          "them to float16 for the computation only (see jaxamp.Policy).")
    if not jnp.issubdtype(dtype, jnp.inexact):
      warnings.warn(f"{what} leaf {where} has non-floating dtype {dtype}; it is neither "
                    "unscaled nor checked for overflow.", stacklevel=3)


def _scaling(inner: Any, init_scale: float, rule: ScaleRule,
             axis_name: finite.AxisName) -> optax.GradientTransformationExtraArgs:
  inner = _check_inner(inner)

  def init_fn(params):
    check_grad_dtypes(params, "params")
    inner_state = inner.init(params)
    # Deferred import: the accumulation module imports this one.
    from jaxamp._src import accumulation  # pylint: disable=import-outside-toplevel
    accumulation.warn_if_accumulation_inside(
        inner_state, "dynamic_loss_scale" if rule.dynamic else "static_loss_scale")
    return LossScaleState(
        scale=jnp.asarray(init_scale, jnp.float32),
        growth_tracker=jnp.zeros([], jnp.int32),
        overflow_count=jnp.zeros([], jnp.int32),
        skipped=jnp.zeros([], jnp.bool_),
        skipped_steps=jnp.zeros([], jnp.int32),
        inner_state=inner_state,
    )

  def update_fn(grads, state, params=None, **extra_args):
    check_grad_dtypes(grads, "gradient")
    # One stored copy of the gradients for the check and the update alike, where
    # XLA honours barriers through fusion (see jaxamp._src.finite).
    grads = finite.stored_once(grads)
    unscaled = finite.unscale(grads, state.scale)
    checked = {}

    def decide(witnesses):
      # The quick check reuses any sum of squares of the gradients that the
      # inner update makes anyway (a global-norm clip's), and reads the rest.
      checked["finite"] = finite.unscaled_all_finite(grads, state.scale, axis_name, witnesses)
      return checked["finite"]

    updates, inner_state = selective_update.select_update(
        decide, lambda: inner.update(unscaled, state.inner_state, params, **extra_args),
        state.inner_state, watch=finite.float_leaves(unscaled),
        unscaled_from=(finite.float_leaves(grads), state.scale))
    found_inf = jnp.logical_not(checked["finite"])
    scale, tracker, overflow = rule.adjust(state.scale, state.growth_tracker,
                                           state.overflow_count, found_inf)
    skipped_steps = jnp.where(found_inf, numerics.safe_increment(state.skipped_steps),
                              state.skipped_steps)
    return updates, LossScaleState(scale, tracker, overflow, found_inf, skipped_steps, inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def dynamic_loss_scale(
    inner: optax.GradientTransformation,
    *,
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    hysteresis: int = 1,
    min_scale: Optional[float] = None,
    max_scale: Optional[float] = None,
    axis_name: finite.AxisName = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` with dynamic loss scaling.

  ``update`` receives the gradients of the *scaled* loss (see
  :func:`scale_loss`). It unscales them, checks that every leaf is finite and
  then either runs ``inner.update`` on the unscaled gradients, or, when a
  value is inf or nan, returns zero updates and keeps the inner state as it
  was (its step count and schedules do not advance), so that
  ``optax.apply_updates`` leaves the parameters bit-identical (the zeros are
  ``-0.0``: ``p + 0.0`` would turn a ``-0.0`` parameter into ``+0.0``).
  Finally it adjusts the scale::

    if found_inf:
      growth_tracker = 0
      overflow_count += 1
      if overflow_count == hysteresis:      # Paddle's decr_every_n_nan_or_inf
        scale = max(scale * backoff_factor, min_scale)
        overflow_count = 0
    else:
      overflow_count = 0
      growth_tracker += 1
      if growth_tracker == growth_interval:  # PyTorch: the N-th good step grows
        if isfinite(scale * growth_factor):
          scale = min(scale * growth_factor, max_scale)
        growth_tracker = 0

  With ``hysteresis=1`` this is exactly ``torch.amp.GradScaler``, including
  its float64 rounding of the scale. Unlike PyTorch the scale never reaches
  0.0: it stops at ``min_scale``, by default the smallest normal float32
  (``1.1754944e-38``), far below any scale a real run reaches. ``max_scale``
  defaults to the largest finite float32, so growth stops exactly where
  PyTorch stops it (a growth to inf is refused). The gradients are unscaled
  as PyTorch unscales them (times ``float32(1 / scale)``), also for scales of
  2^126 and more, whose reciprocal is a denormal that XLA would flush to 0.

  The finite check holds whatever XLA does with the compiled step (fusion,
  FMA contraction, excess precision, reordered sums; see
  ``docs/concepts.md``). It reads the gradients once: a sum of ``|g|`` per
  float32 leaf, the bits of each half-precision one, and the exact check
  on the bits only when a sum is not finite. When the inner update reduces
  every gradient anyway, as ``optax.clip_by_global_norm`` does, its sums of
  squares are the check and the gradients are not read again. Those sums are taken of the raw
  gradients and scaled back where that gives the same bits (a power-of-two
  scale of at least 1, no overflow, a normal result), and of the unscaled
  ones otherwise; unscaled squares below the smallest normal float, which
  XLA flushes to zero, may count. The skip costs nothing more: the inner
  update is traced and its new state selected where it is computed, so that
  XLA fuses the selection into the inner update's own elementwise kernels
  (see ``benchmarks/bench_loss_scale.py``).

  Args:
    inner: the optax transformation fed with the unscaled gradients, e.g.
      ``optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))``.
    init_scale: the initial scale, positive and finite.
    growth_factor: multiplier applied after ``growth_interval`` consecutive
      finite steps; must be > 1.
    backoff_factor: multiplier applied on overflow; must be in (0, 1).
    growth_interval: number of consecutive finite steps before growing; >= 1.
    hysteresis: number of consecutive non-finite steps before backing off;
      >= 1 (1 is PyTorch, Paddle's default is 2). Every non-finite step is
      skipped regardless.
    min_scale: floor of the scale, at least the smallest normal float32
      (``DEFAULT_MIN_SCALE``, also the default when ``None``).
    max_scale: ceiling of the scale; ``None`` for the largest float32.
    axis_name: mapped axis name (or tuple of names) over which the finite
      check is reduced inside ``shard_map``/``pmap``, so that every device
      takes the same decision. Needed whenever the gradients inside the
      mapped function are sharded or differ per device.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`LossScaleState`.

  Raises:
    TypeError: for arguments of the wrong type.
    ValueError: for out-of-range hyperparameters, or (at ``init``/trace time)
      float16 parameters or gradients.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import jaxamp
    >>> tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0, growth_interval=2)
    >>> params = {'w': jnp.ones(2)}
    >>> state = tx.init(params)
    >>> grads = {'w': jnp.array([8.0, jnp.inf])}  # an overflow: skipped
    >>> updates, state = tx.update(grads, state, params)
    >>> updates['w'], state.scale, state.skipped
    (Array([-0., -0.], dtype=float32), Array(4., dtype=float32), Array(True, dtype=bool))
  """
  init_scale_ = check_scale("init_scale", init_scale)
  rule = make_rule(growth_factor=growth_factor, backoff_factor=backoff_factor,
                   growth_interval=growth_interval, hysteresis=hysteresis,
                   min_scale=min_scale, max_scale=max_scale)
  check_scale("init_scale", init_scale_, rule.min_scale, rule.max_scale)
  return _scaling(inner, init_scale_, rule, axis_name)


def static_loss_scale(inner: optax.GradientTransformation, scale: float, *,
                      axis_name: finite.AxisName = None) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` with a fixed loss scale; non-finite steps are still skipped.

  This is mmengine's ``AmpOptimWrapper(loss_scale=<float>)``. The scale is a
  state leaf (:class:`LossScaleState` as for :func:`dynamic_loss_scale`), so
  :func:`set_loss_scale` changes it without a recompilation.

  Args:
    inner: the optax transformation fed with the unscaled gradients.
    scale: the loss scale, positive and finite.
    axis_name: as in :func:`dynamic_loss_scale`.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> tx = jaxamp.static_loss_scale(optax.sgd(1.0), 128.0)
    >>> state = tx.init({'w': jnp.zeros(2)})
    >>> updates, state = tx.update({'w': jnp.array([128.0, -256.0])}, state)
    >>> updates['w']
    Array([-1.,  2.], dtype=float32)
  """
  scale_ = check_scale("scale", scale)
  return _scaling(inner, scale_, ScaleRule(dynamic=False), axis_name)


def _is_scale_state(node: Any) -> bool:
  return isinstance(node, LossScaleState)


def get_loss_scale_state(opt_state: optax.OptState) -> LossScaleState:
  """Finds the (outermost) :class:`LossScaleState` anywhere inside ``opt_state``.

  Raises:
    ValueError: when ``opt_state`` holds no loss-scale state.
  """
  for node in jax.tree.leaves(opt_state, is_leaf=_is_scale_state):
    if _is_scale_state(node):
      return node
  raise ValueError(
      "No loss-scale state found in the optimizer state (of type "
      f"{type(opt_state).__name__}). Build the optimizer with jaxamp.dynamic_loss_scale(...) "
      "or jaxamp.static_loss_scale(...).")


def get_loss_scale(opt_state: optax.OptState) -> jax.Array:
  """Returns the current loss scale (a float32 device scalar) found in ``opt_state``.

  Works through ``optax.chain``, ``optax.inject_hyperparams``,
  :func:`accumulate_gradients` and any other nesting of optax states.

  Raises:
    ValueError: when ``opt_state`` holds no loss-scale state.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> tx = optax.chain(optax.identity(), jaxamp.dynamic_loss_scale(optax.adam(1e-3)))
    >>> jaxamp.get_loss_scale(tx.init({'w': jnp.zeros(3)}))
    Array(65536., dtype=float32)
  """
  return get_loss_scale_state(opt_state).scale


def scale_loss(loss: jax.Array, opt_state: optax.OptState) -> jax.Array:
  """Multiplies ``loss`` by the loss scale held in ``opt_state``.

  Half-precision losses are promoted to float32 first (65536 is not a finite
  float16), so compute the final reduction of your loss in float32 or let
  this do it.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> state = jaxamp.static_loss_scale(optax.sgd(0.1), 4.0).init({'w': jnp.zeros(1)})
    >>> jaxamp.scale_loss(jnp.float32(0.5), state)
    Array(2., dtype=float32)
  """
  scale = get_loss_scale(opt_state)
  loss = jnp.asarray(loss)
  if not (jnp.issubdtype(loss.dtype, jnp.inexact) and loss.dtype.itemsize >= 4):
    loss = loss.astype(jnp.float32)  # integers and half precision
  return loss * scale.astype(loss.dtype)


def set_loss_scale(opt_state: optax.OptState, scale: Any) -> optax.OptState:
  """Returns ``opt_state`` with every loss scale inside it set to ``scale``.

  The growth tracker and overflow count are left as they are (as PyTorch's
  ``update(new_scale)``). No recompilation: the scale is a state leaf, and
  ``scale`` may be a Python number (checked to be positive and finite) or a
  scalar array (a traced one too, which cannot be checked).

  Raises:
    TypeError: when ``scale`` is neither a real number nor a real scalar array.
    ValueError: when ``scale`` is not a scalar, not positive and finite, or
      ``opt_state`` holds no loss-scale state.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> tx = optax.chain(optax.identity(), jaxamp.dynamic_loss_scale(optax.sgd(0.1)))
    >>> state = jaxamp.set_loss_scale(tx.init({'w': jnp.zeros(2)}), 1024.0)
    >>> jaxamp.get_loss_scale(state)
    Array(1024., dtype=float32)
  """
  get_loss_scale_state(opt_state)  # a clear error when there is none
  if isinstance(scale, jax.core.Tracer):
    if scale.shape != () or not (jnp.issubdtype(scale.dtype, jnp.floating)
                                 or jnp.issubdtype(scale.dtype, jnp.integer)):
      raise TypeError(f"scale must be a real scalar, got a traced {scale.dtype} array of "
                      f"shape {scale.shape}")
    value = scale.astype(jnp.float32)
  else:
    if isinstance(scale, (np.ndarray, jax.Array)) and np.ndim(scale) != 0:
      raise ValueError(f"scale must be a scalar, got an array of shape {np.shape(scale)}")
    value = jnp.asarray(check_scale("scale", scale), jnp.float32)

  def put(node):
    return node._replace(scale=value) if _is_scale_state(node) else node

  return jax.tree.map(put, opt_state, is_leaf=_is_scale_state)
