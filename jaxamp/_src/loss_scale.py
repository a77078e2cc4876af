"""Loss scaling as an optax transformation: dynamic (PyTorch's rule with Paddle's hysteresis) and static."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxamp._src import finite
from jaxamp._src import fp8
from jaxamp._src import numerics
from jaxamp._src import selective_update
from jaxamp._src import state as state_lib
from jaxamp._src import validation
from jaxamp._src.state import DEFAULT_MAX_SCALE, DEFAULT_MIN_SCALE, LossScaleState


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


def initial_state(scale: Any, growth_tracker: Any = 0, overflow_count: Any = 0, *,
                  num_leaves: int = 0, inner_state: optax.OptState = ()) -> LossScaleState:
  """A loss scaler's state before its first step, every leaf with its dtype (nothing skipped yet).

  Args:
    scale: the loss scale (checked by the caller).
    growth_tracker: consecutive finite steps so far (a loaded scaler's).
    overflow_count: consecutive non-finite steps not acted on yet.
    num_leaves: the number of floating gradient leaves (the length of
      ``nonfinite_leaves``); 0 for the facades' scalers, which keep no flags.
    inner_state: the wrapped transformation's state.
  """
  return LossScaleState(
      scale=jnp.asarray(scale, jnp.float32),
      growth_tracker=jnp.asarray(growth_tracker, jnp.int32),
      overflow_count=jnp.asarray(overflow_count, jnp.int32),
      skipped=jnp.zeros([], jnp.bool_),
      skipped_steps=jnp.zeros([], jnp.int32),
      skip_streak=jnp.zeros([], jnp.int32),
      stalled=jnp.zeros([], jnp.bool_),
      nonfinite_leaves=jnp.zeros([num_leaves], jnp.bool_),
      inner_state=inner_state)


def advance(rule: ScaleRule, state: LossScaleState, found_inf: jax.Array,
            stall_after: int) -> LossScaleState:
  """The loss-scale state after one step: the scale, its counters, the skip counters and the stall.

  The one copy of the rule: :func:`dynamic_loss_scale`, :func:`static_loss_scale`
  and both facades' ``GradScaler`` (one call per iteration) advance their
  state with it::

    scale, growth_tracker, overflow_count = rule.adjust(...)
    skipped = found_inf
    if found_inf:
      skipped_steps += 1                      # both counters saturate
      skip_streak += 1
    else:
      skip_streak = 0
    stalled = found_inf and (skip_streak >= stall_after or scale was at min_scale)

  A static rule (``rule.dynamic`` false) keeps the scale and never stalls at
  ``min_scale``. ``nonfinite_leaves`` and ``inner_state`` are returned as
  given, and reporting a stall is left to the caller.

  Args:
    rule: the scale-adjustment rule.
    state: the state before the step.
    found_inf: bool scalar, whether the step's unscaled gradients held an inf
      or a nan (the step was skipped).
    stall_after: consecutive skipped steps that make a stall.

  Returns:
    The state after the step.
  """
  scale, tracker, overflow = rule.adjust(state.scale, state.growth_tracker,
                                         state.overflow_count, found_inf)
  streak = jnp.where(found_inf, optax.safe_increment(state.skip_streak), 0).astype(jnp.int32)
  at_floor = rule.dynamic and state.scale <= jnp.float32(rule.min_scale)
  return state._replace(
      scale=scale, growth_tracker=tracker, overflow_count=overflow, skipped=found_inf,
      skipped_steps=jnp.where(found_inf, optax.safe_increment(state.skipped_steps),
                              state.skipped_steps),
      skip_streak=streak, stalled=found_inf & ((streak >= stall_after) | at_floor))


def make_rule(*, growth_factor: float = 2.0, backoff_factor: float = 0.5,
              growth_interval: int = 2000, hysteresis: int = 1,
              min_scale: Optional[float] = None, max_scale: Optional[float] = None) -> ScaleRule:
  """Validates the hyperparameters of the dynamic rule and returns it."""
  growth_factor = validation.check_finite("growth_factor", growth_factor)
  if growth_factor <= 1.0:
    raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}")
  backoff_factor = validation.check_finite("backoff_factor", backoff_factor)
  if not 0.0 < backoff_factor < 1.0:
    raise ValueError(f"backoff_factor must be in the open interval (0, 1), got {backoff_factor!r}")
  growth_interval = validation.check_count("growth_interval", growth_interval)
  hysteresis = validation.check_count("hysteresis", hysteresis)
  min_scale = DEFAULT_MIN_SCALE if min_scale is None else validation.check_finite("min_scale", min_scale)
  max_scale = DEFAULT_MAX_SCALE if max_scale is None else validation.check_finite("max_scale", max_scale)
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


def warn_if_accumulation_inside(inner_state: optax.OptState, outer: str) -> None:
  """Warns when a loss scaler wraps an accumulator (the per-micro-step nesting).

  Called by the loss-scaling transformations at ``init``.
  """
  if state_lib.find_states(inner_state, state_lib.AccumulationState):
    warnings.warn(
        f"jaxamp.{outer}(...) wraps jaxamp.accumulate_gradients(...): the scale is then "
        "checked and adjusted on every micro-step, a non-finite micro-batch is dropped from "
        "its window (which waits for one more micro-batch, so windows drift away from "
        "total_steps), and growth_interval counts micro-steps. For PyTorch's recipe (one scale "
        "per window, a non-finite micro-batch skips the whole window) nest them the other "
        f"way: jaxamp.accumulate_gradients(jaxamp.{outer}(inner), every_k).",
        UserWarning, stacklevel=3)


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


class StallWarning(RuntimeWarning):
  """A loss-scaled run has skipped every step for a while: its gradients never become finite."""


#: What a loss scaler does when its run stalls (``on_stall``): ``"record"`` (the default) keeps the
#: stall in the state only; ``"warn"`` also warns from inside the step, through a host callback;
#: ``"ignore"`` is the earlier name of ``"record"``.
ON_STALL = ("record", "warn", "ignore")


def _check_on_stall(on_stall: Any) -> str:
  if not isinstance(on_stall, str) or on_stall not in ON_STALL:
    raise ValueError(f"on_stall must be one of {ON_STALL}, got {on_stall!r}")
  return on_stall


def _warn_stalled(flipped: Any, stalled: Any, streak: Any, scale: Any, *, name: str) -> np.ndarray:
  """Host side of the stall warning; returns ``stalled``, which becomes the state's flag.

  Called from inside the step by ``jax.pure_callback`` (see :func:`_report_stall`).
  ``flipped`` is checked again here: under ``vmap`` with a batched flag the
  branch that calls this runs for every element, the flag says which stalled.
  """
  if bool(flipped):
    warnings.warn(
        f"jaxamp.{name}: {int(streak)} consecutive steps were skipped because the gradients held "
        f"inf or nan, and the loss scale ({float(scale):g}) has not made them finite: the run is "
        "stalled. Look for the operation that overflows (jaxamp.skip_report(opt_state, params) "
        f"names the gradient leaves) or for bad inputs. Pass {name}(..., on_stall='record') to "
        "read LossScaleState.stalled yourself instead.", StallWarning, stacklevel=2)
  return np.asarray(stalled, np.bool_)


def _report_stall(name: str, flipped: jax.Array, stalled: jax.Array, streak: jax.Array,
                  scale: jax.Array) -> jax.Array:
  """``stalled``, through a host callback that warns, in a branch taken only when ``flipped``.

  The callback is a ``jax.pure_callback`` whose result is the state's ``stalled``
  flag, so that it can be neither dropped nor moved out of the branch. A callback
  with an effect (``jax.debug.callback``) would make JAX dispatch every call of
  the jitted step through its Python path instead of its C++ one, which costs
  time per argument on every step: an update-bound adam step at 100 leaves of
  128 x 128 took 4.2 times plain optax's time that way, 1.85 times this way
  (XLA:CPU; see docs/benchmarks.md).
  """

  def report(flipped, stalled, streak, scale):
    return jax.pure_callback(functools.partial(_warn_stalled, name=name),
                             jax.ShapeDtypeStruct((), jnp.bool_), flipped, stalled, streak,
                             scale, vmap_method="sequential")

  return lax.cond(flipped, report, lambda flipped, stalled, *_: stalled, flipped, stalled,
                  streak, scale)


#: Default ``stall_after``: consecutive skipped steps after which a run counts as stalled. With the
#: default back-off (0.5 per skip) that is a scale 2^50 times smaller, far past any calibration.
DEFAULT_STALL_AFTER = 50


def _scaling(inner: Any, init_scale: float, rule: ScaleRule, axis_name: finite.AxisName,
             stall_after: int, on_stall: str) -> optax.GradientTransformationExtraArgs:
  inner = validation.check_gradient_transformation(inner, "inner")
  name = "dynamic_loss_scale" if rule.dynamic else "static_loss_scale"

  def init_fn(params):
    fp8.refuse(params, "dynamic_loss_scale" if rule.dynamic else "static_loss_scale")
    check_grad_dtypes(params, "params")
    inner_state = inner.init(params)
    if state_lib.find_states(inner_state, LossScaleState):
      raise ValueError(
          "a loss-scaling transformation wraps another one: the gradients would be unscaled "
          "twice and each scale would back off on the other's overflows. Use one, outermost "
          "(inside jaxamp.accumulate_gradients if you accumulate): "
          "jaxamp.dynamic_loss_scale(optax.chain(...)).")
    warn_if_accumulation_inside(
        inner_state, "dynamic_loss_scale" if rule.dynamic else "static_loss_scale")
    return initial_state(init_scale, num_leaves=len(finite.float_leaves(params)),
                         inner_state=inner_state)

  def update_fn(updates: optax.Updates, state: Any, params: Optional[optax.Params] = None,
                **extra_args: Any) -> tuple[optax.Updates, Any]:
    grads = updates  # the (scaled) gradients
    check_grad_dtypes(grads, "gradient")
    if params is not None:  # leading: per-example gradients, for a transformation inside
      validation.check_shapes_like("the gradients", grads, "the parameters", params, leading=True)
    # One stored copy of the gradients for the check and the update alike, where
    # XLA honours barriers through fusion (see jaxamp._src.finite).
    grads = finite.stored_once(grads)
    if len(finite.float_leaves(grads)) != state.nonfinite_leaves.shape[0]:
      raise ValueError(f"the gradients have {len(finite.float_leaves(grads))} floating leaves, the "
                       f"params the state was initialised with {state.nonfinite_leaves.shape[0]}")
    # The check reads the unscaled gradients, the values the update reads.
    unscaled, check = finite.unscale_and_check(grads, state.scale, axis_name)
    updates, inner_state = selective_update.select_update(
        check.finite, lambda: inner.update(unscaled, state.inner_state, params, **extra_args),
        state.inner_state)
    if params is not None:
      validation.check_shapes_like("the updates", updates, "the parameters", params)
    new_state = advance(rule, state, jnp.logical_not(check.finite), stall_after)._replace(
        nonfinite_leaves=check.nonfinite_leaves, inner_state=inner_state)
    if on_stall == "warn":
      # A host callback in a branch taken only on the step where the run
      # becomes stalled: a good step pays one scalar compare.
      stalled = new_state.stalled
      new_state = new_state._replace(stalled=_report_stall(
          name, stalled & jnp.logical_not(state.stalled), stalled, new_state.skip_streak,
          state.scale))
    return updates, new_state

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
    stall_after: int = DEFAULT_STALL_AFTER,
    on_stall: str = "record",
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
  ``docs/concepts.md``). It reads each unscaled gradient once, one
  reduction per leaf: a sum of ``|g| - |g|`` for leaves of 32 bits or more
  (+0 for a finite element, nan otherwise, in any order), the bits of the
  others. The skip costs nothing more: the inner
  update is traced and its new state selected where it is computed, so that
  XLA fuses the selection into the inner update's own elementwise kernels
  (see ``benchmarks/bench_update_sweep.py``).

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
    stall_after: consecutive skipped steps after which the state reports the
      run as stalled (``LossScaleState.stalled``, :func:`jaxamp.stalled`);
      a skip at ``min_scale``, where the scale cannot back off any more,
      counts as a stall at once.
    on_stall: how a stall is reported. ``"record"`` (the default): in the
      state only (``LossScaleState.stalled``, :func:`jaxamp.stalled`,
      :func:`jaxamp.step_metrics`), which the facades read every few steps
      and warn about, and which a training loop reads where it logs (see
      ``docs/diagnostics.md``); the step holds no host callback.
      ``"warn"``: the step also emits a :class:`jaxamp.StallWarning` itself,
      through a host callback, on the step where the run becomes stalled
      (once per stall: ``stalled`` must turn False, on an applied step,
      before it warns again). The callback sits in a branch taken only on
      that step, but a program that holds a host callback runs synchronously
      on XLA:CPU (the next step's dispatch cannot overlap this one): an
      update-bound adam step of 100 leaves of 128 x 128 took 1.45 times as
      long as with ``"record"``, and the update-bound LM of
      ``docs/benchmarks.md`` 1.07 times. On GPU the cost is unmeasured.
      ``"ignore"`` is the earlier name of ``"record"``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`LossScaleState`.

  Raises:
    TypeError: for arguments of the wrong type.
    ValueError: for out-of-range hyperparameters or an unknown ``on_stall``, or (at ``init``/trace time)
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
  init_scale_ = validation.check_scale("init_scale", init_scale)
  rule = make_rule(growth_factor=growth_factor, backoff_factor=backoff_factor,
                   growth_interval=growth_interval, hysteresis=hysteresis,
                   min_scale=min_scale, max_scale=max_scale)
  validation.check_scale("init_scale", init_scale_, rule.min_scale, rule.max_scale)
  return _scaling(inner, init_scale_, rule, axis_name,
                  validation.check_count("stall_after", stall_after), _check_on_stall(on_stall))


def static_loss_scale(inner: optax.GradientTransformation, scale: float, *,
                      axis_name: finite.AxisName = None,
                      stall_after: int = DEFAULT_STALL_AFTER, on_stall: str = "record"
                      ) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` with a fixed loss scale; non-finite steps are still skipped.

  This is mmengine's ``AmpOptimWrapper(loss_scale=<float>)``. The scale is a
  state leaf (:class:`LossScaleState` as for :func:`dynamic_loss_scale`), so
  :func:`set_loss_scale` changes it without a recompilation.

  Args:
    inner: the optax transformation fed with the unscaled gradients.
    scale: the loss scale, positive and finite.
    axis_name: as in :func:`dynamic_loss_scale`.
    stall_after: consecutive skipped steps after which the state reports the
      run as stalled, as in :func:`dynamic_loss_scale`.
    on_stall: ``"record"`` (the default) or ``"warn"``, as in
      :func:`dynamic_loss_scale`.

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
  scale_ = validation.check_scale("scale", scale, DEFAULT_MIN_SCALE, DEFAULT_MAX_SCALE)
  return _scaling(inner, scale_, ScaleRule(dynamic=False), axis_name,
                  validation.check_count("stall_after", stall_after), _check_on_stall(on_stall))
