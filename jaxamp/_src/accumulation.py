"""Gradient accumulation over micro-steps as an optax transformation.

The inner transformation runs only when a window of micro-batches closes;
the other micro-steps add their gradients into one accumulator and cost about
one read-add-write of the gradients. Windows follow mmengine's counting
(including the shorter last window of ``total_steps``), a non-finite window
is dropped as a whole, and the accumulator is reset by selection, so a NaN
never leaks from one window into the next.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxamp._src import finite
from jaxamp._src import fp8
from jaxamp._src import selective_update
from jaxamp._src import sharding
from jaxamp._src import state as state_lib
from jaxamp._src import validation
from jaxamp._src.state import AccumulationState

_HALF = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def _past_end(flag: np.ndarray, micro_step: np.ndarray, total_steps: int) -> None:
  # Runs on the host, only in the branch taken past the end (under vmap both
  # branches run, hence the check of the flag).
  if np.any(flag):
    seen = int(np.max(micro_step)) + 1
    raise RuntimeError(
        f"accumulate_gradients: micro-step {seen} is past total_steps={total_steps}. "
        "The last window closed at micro-step total_steps; this call returned zero updates "
        "and left the accumulator and the inner state unchanged. Build the transformation "
        "with a larger total_steps (or None) to train longer.")


def accumulate_gradients(
    inner: optax.GradientTransformation,
    every_k: int,
    *,
    average: bool = True,
    total_steps: Optional[int] = None,
    accumulator_dtype: Any = None,
    axis_name: finite.AxisName = None,
    raise_past_end: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """Accumulates gradients over ``every_k`` micro-steps before each inner update.

  Call ``update`` once per micro-batch, with that micro-batch's gradients.
  Micro-steps 1 to ``k - 1`` of a window add the gradients into one
  accumulator and return zero updates; the ``k``-th adds its own, feeds the
  accumulated gradients (their mean when ``average``, their sum otherwise)
  to ``inner`` and returns its updates. ``inner`` runs only on that closing
  micro-step (under ``lax.cond``), so its state (step counts, schedules of
  ``optax.inject_hyperparams``) advances once per optimizer step, and the
  other micro-steps cost one read-add-write of the gradients plus the zero
  updates. ``optax.MultiSteps``, by contrast, runs ``inner`` on every
  micro-step and throws the result away.

  **Windows and** ``total_steps`` (mmengine's ``accumulative_counts`` with
  ``initialize_count_status(0, total_steps)``): windows close after
  micro-steps ``k, 2k, ...`` and, when ``total_steps`` is given, after
  micro-step ``total_steps``. If ``total_steps`` is not a multiple of ``k``
  the last window holds the remaining ``total_steps % k`` micro-batches and
  its mean divides by that remainder, so no micro-batch is lost and none is
  over-weighted (``k=4, total_steps=10``: windows of 4, 4 and 2). A call
  past ``total_steps`` returns zero updates, leaves the accumulator and the
  inner state unchanged, records itself in ``micro_step`` (which then
  exceeds ``total_steps``) and raises a ``RuntimeError`` from a host
  callback that only runs in that case (under ``jit`` it surfaces as a
  ``jax.errors.JaxRuntimeError`` carrying the message, when the result is
  awaited). It never divides by zero. The callback, although never run
  before the end, makes the compiled step effectful: JAX then dispatches
  each call through Python instead of its C++ fast path (about 2 ms more
  per call for a 30-leaf model on CPU, several times the step of a small
  model; a few percent of a 4M-parameter adam step), and ``jax.export``
  cannot serialize it. ``raise_past_end=False`` leaves it out: a call past
  the end is then only recorded in ``micro_step``. A resumed run continues
  mmengine's counting when ``micro_step`` is set to the number of
  micro-steps done and ``mini_step`` to ``micro_step % k``.

  **Non-finite windows.** When the accumulated gradients of a window hold an
  inf or a nan, the whole window is dropped: zero updates, inner state
  untouched, ``skipped_windows`` incremented; the accumulator restarts from
  zeros (selected, never multiplied by 0), so the next window is unaffected.
  The check reads the accumulator once, on the closing micro-step only. When
  ``inner`` holds a loss scaler (:func:`dynamic_loss_scale`,
  :func:`static_loss_scale`) the window is handed to it instead, so that it
  can skip the step and back off the scale itself.

  **With loss scaling**, ``accumulate_gradients(dynamic_loss_scale(inner), k)``
  is PyTorch's recipe: the scale (found by :func:`loss_scale` and
  :func:`scale_loss` through this wrapper) stays constant within a window,
  every micro-batch's loss is multiplied by it, and the accumulated
  gradients are unscaled and checked once per window; an inf or nan in any
  micro-batch skips the whole window and backs the scale off once;
  ``growth_interval`` counts optimizer steps. The other nesting,
  ``dynamic_loss_scale(accumulate_gradients(inner, k))``, unscales, checks
  and adjusts the scale on every micro-step, drops a bad micro-batch from
  its window (the window then waits for one more, drifting away from
  ``total_steps``) and counts ``growth_interval`` in micro-steps; it warns
  at ``init``. PyTorch divides each micro-batch's loss by ``k`` before
  scaling; in float16 use ``average=False`` on ``scale_loss(loss / k)``
  gradients to reproduce its intermediate magnitudes exactly.

  **Data parallelism** (``axis_name``; the counterpart of DDP's ``no_sync``):
  inside ``shard_map``/``pmap``, each device accumulates its own partial
  gradients and the accumulated gradients are all-reduced (mean over the
  axis, in the accumulator dtype) only on the closing micro-step, so
  gradient communication drops ``k``-fold. ``inner`` then sees identical,
  globally reduced gradients on every device (an inner loss scaler needs no
  ``axis_name`` of its own). The accumulator differs between devices: keep
  it per device (e.g. a leading device axis in the ``shard_map`` specs, or
  the whole loop inside the mapped function).

  **Flax's fp8 layers**: ``init`` refuses parameters holding their
  collection ``'_overwrite_with_gradient'``. Wrap the whole transformation
  in :func:`overwrite_with_gradient` (or use :class:`TrainState`,
  ``jaxamp.nnx.Optimizer``), which combines the window's fp8 values by
  their maximum and writes them when the window's step is applied.

  Choose this transformation when micro-batches arrive over separate calls
  (a data loader yielding micro-batches, ported PyTorch/mmengine loops,
  ``total_steps`` remainders). When the whole large batch is at hand in one
  step, :func:`microbatch_value_and_grad` computes its gradient in one call
  with no accumulator in the optimizer state.

  Args:
    inner: the optax transformation applied to the accumulated gradients,
      e.g. ``optax.adamw(1e-3)`` or ``jaxamp.dynamic_loss_scale(...)``.
    every_k: micro-steps per window (mmengine's ``accumulative_counts``),
      an int >= 1.
    average: feed ``inner`` the mean of the window's gradients (True) or
      their sum (False).
    total_steps: the run's total number of micro-steps, for the shorter last
      window; ``None`` for an open-ended run (every window has ``k``).
    accumulator_dtype: dtype of the accumulator; ``None`` means float32 for
      float16/bfloat16 leaves and the leaf's own dtype otherwise. Given, it
      makes a complex leaf's accumulator complex128 if it is float64, else
      complex64. ``inner`` receives, and the updates come back in, the
      gradients' own dtypes.
    axis_name: mapped axis name (or tuple of names) to all-reduce the
      accumulated gradients over, once per window; ``()`` inside ``shard_map``
      lets each shard keep its own window and decide on its own whether it is
      finite.
    raise_past_end: with ``total_steps``, raise an error from the host on a
      call past the end (True), or only record it in ``micro_step`` and keep
      the step free of host callbacks (False).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is an
    :class:`AccumulationState`. Extra keyword arguments of ``update`` are
    passed to ``inner`` on the closing micro-step.

  Raises:
    TypeError: for arguments of the wrong type.
    ValueError: for out-of-range arguments.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> tx = jaxamp.accumulate_gradients(optax.sgd(1.0), 2)
    >>> params = {'w': jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({'w': jnp.array([1.0, 2.0])}, state)
    >>> updates['w']  # -0.0: p + (-0.0) is p, bit for bit
    Array([-0., -0.], dtype=float32)
    >>> updates, state = tx.update({'w': jnp.array([3.0, 2.0])}, state)
    >>> updates['w'], state.gradient_step
    (Array([-2., -2.], dtype=float32), Array(1, dtype=int32))

    The shorter last window of ``total_steps`` divides by its own length:

    >>> tx = jaxamp.accumulate_gradients(optax.sgd(1.0), 4, total_steps=6)
    >>> state = tx.init(params)
    >>> for g in [1.0, 1.0, 1.0, 1.0, 4.0, 2.0]:
    ...   updates, state = tx.update({'w': jnp.full(2, g)}, state)
    >>> updates['w']
    Array([-3., -3.], dtype=float32)
  """
  inner = validation.check_gradient_transformation(inner, "inner")
  k = validation.check_count("every_k", every_k)
  if not isinstance(average, (bool, np.bool_)):
    raise TypeError(f"average must be a bool, got {average!r} of type {type(average).__name__}")
  average = bool(average)
  if total_steps is not None:
    total_steps = validation.check_count("total_steps", total_steps)
  acc_dtype = validation.check_float_dtype("accumulator_dtype", accumulator_dtype, allow_none=True)
  if not isinstance(raise_past_end, (bool, np.bool_)):
    raise TypeError(f"raise_past_end must be a bool, got {raise_past_end!r} of type "
                    f"{type(raise_past_end).__name__}")
  accumulates = k > 1

  def leaf_acc_dtype(x) -> jnp.dtype:
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.inexact):
      return dtype
    if acc_dtype is not None:
      if jnp.issubdtype(dtype, jnp.complexfloating):
        # Complex, with parts of accumulator_dtype where such a complex dtype exists.
        return jnp.dtype(jnp.complex128 if acc_dtype == jnp.float64 else jnp.complex64)
      return acc_dtype
    return jnp.dtype(jnp.float32) if dtype in _HALF else dtype

  def init_fn(params):
    fp8.refuse(params, "accumulate_gradients")
    if accumulates:
      # zeros_like: the accumulator is sharded like the parameters.
      acc = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=leaf_acc_dtype(p)), params)
    else:
      acc = optax.EmptyState()
    inner_state = inner.init(params)
    state_lib.check_compositions(inner_state)
    return AccumulationState(
        mini_step=jnp.zeros([], jnp.int32),
        gradient_step=jnp.zeros([], jnp.int32),
        micro_step=jnp.zeros([], jnp.int32),
        updated=jnp.zeros([], jnp.bool_),
        skipped_windows=jnp.zeros([], jnp.int32),
        acc_grads=acc,
        inner_state=inner_state,
    )

  def update_fn(updates: optax.Updates, state: Any, params: Optional[optax.Params] = None,
                **extra_args: Any) -> tuple[optax.Updates, Any]:
    grads = updates  # the (scaled) gradients
    if accumulates:
      validation.check_shapes_like("the gradients", grads, "the accumulated gradients",
                                   state.acc_grads)
    grads = finite.stored_once(grads)  # one stored copy, as in the loss scalers
    # Static: a loss scaler inside does its own finite check and skipping.
    scaler_inside = state_lib.skips_nonfinite_steps(state.inner_state)

    # Inside shard_map, the axes the updates vary over: those of everything they
    # are computed from, except axis_name, over which the gradients are reduced.
    reduced = frozenset(sharding.axis_tuple(axis_name))
    array_args = [x for x in jax.tree.leaves(extra_args) if isinstance(x, jax.Array)]
    update_axes = ((sharding.tree_varying_axes((grads, state.acc_grads)) - reduced)
                   | sharding.tree_varying_axes((params, state._replace(acc_grads=()),
                                                 array_args)))

    def zeros_like_grads():
      return jax.tree.map(lambda g: selective_update.neg_zeros_like(g, update_axes), grads)

    def divisor(dtype):
      if total_steps is None or total_steps % k == 0:
        return jnp.asarray(k, dtype)
      remainder = total_steps % k
      full = state.micro_step < total_steps - remainder
      return jnp.where(full, k, remainder).astype(dtype)

    window_full = state.mini_step + 1 >= k
    if total_steps is None:
      beyond = None
      emit = window_full
    else:
      beyond = state.micro_step >= total_steps
      emit = jnp.logical_and(jnp.logical_or(window_full, state.micro_step + 1 >= total_steps),
                             jnp.logical_not(beyond))

    def window_sum(acc, grads):
      if not accumulates:
        return grads
      return jax.tree.map(finite.add_stored, acc, grads)

    def window_mean(acc, grads):
      total = window_sum(acc, grads)
      if axis_name is not None:
        total = lax.pmean(total, axis_name)
      if average and k > 1:
        total = jax.tree.map(
            lambda t: t / divisor(t.dtype) if jnp.issubdtype(t.dtype, jnp.inexact) else t, total)
      return jax.tree.map(lambda t, g: t.astype(jnp.result_type(g)), total, grads)

    def close(acc, grads, inner_state, params):
      if axis_name is None:
        # The mean is formed where it is used (by the finite check, then by the
        # inner update), fused into their loops rather than written out.
        source = (acc, grads)
        form = window_mean
      else:
        # All-reduced once, then used as it is.
        source = (window_mean(acc, grads), None)
        form = lambda mean, _: mean  # noqa: E731

      def step(source, inner_state, params):
        updates, new_inner = inner.update(form(*source), inner_state, params, **extra_args)
        updates = jax.tree.map(
            lambda u, g: sharding.mark_varying(u.astype(jnp.result_type(g)), update_axes),
            updates, grads)
        new_inner = jax.tree.map(lambda n, o: jnp.asarray(n).astype(jnp.result_type(o)),
                                 new_inner, inner_state)
        return updates, new_inner, jnp.zeros([], jnp.bool_)

      def drop(source, inner_state, params):
        del source, params
        return zeros_like_grads(), inner_state, jnp.ones([], jnp.bool_)

      if scaler_inside:
        out = step(source, inner_state, params)
      else:
        # The mean is already the same on every device, unless axis_name=() asked each shard
        # to decide on its own.
        per_shard = axis_name is not None and not sharding.axis_tuple(axis_name)
        window_finite = finite.all_finite(form(*source), axis_name=() if per_shard else None)
        out = lax.cond(window_finite, step, drop, source, inner_state, params)
      return out + (jnp.ones([], jnp.bool_),)

    def keep(acc, grads, inner_state, params):
      del acc, grads, params
      return zeros_like_grads(), inner_state, jnp.zeros([], jnp.bool_), jnp.zeros([], jnp.bool_)

    operands = (state.acc_grads, grads, state.inner_state, params)
    if accumulates or total_steps is not None:
      updates, inner_state, dropped, closed = lax.cond(emit, close, keep, *operands)
    else:
      updates, inner_state, dropped, closed = close(*operands)
    if beyond is not None and raise_past_end:
      # Past the end: zero updates from `keep` above, and an error raised from
      # the host, in a branch that only runs in that case.
      def report(beyond, micro_step):
        jax.debug.callback(functools.partial(_past_end, total_steps=total_steps), beyond,
                           micro_step)

      lax.cond(beyond, report, lambda *_: None, beyond, state.micro_step)

    # The accumulator is updated after the branches, by selection: one fused
    # read-add-write, in place in the donated buffer. A closed window restarts
    # from zeros (never a multiplication by 0, which would keep a nan); past
    # the end nothing is added. Selecting on `closed`, an output of the
    # branches, orders their read of the accumulator before this write, so
    # XLA needs no defensive copy of it.
    if accumulates:
      summed = window_sum(state.acc_grads, grads)
      acc = jax.tree.map(lambda s: jnp.where(closed, jnp.zeros_like(s), s), summed)
      if beyond is not None:
        acc = jax.tree.map(lambda n, o: jnp.where(beyond, o, n), acc, state.acc_grads)
    else:
      acc = optax.EmptyState()

    mini_step = jnp.where(emit, 0, state.mini_step + 1)
    if beyond is not None:
      mini_step = jnp.where(beyond, state.mini_step, mini_step)
    new_state = AccumulationState(
        mini_step=mini_step.astype(jnp.int32),
        gradient_step=jnp.where(emit, optax.safe_increment(state.gradient_step),
                                state.gradient_step).astype(jnp.int32),
        micro_step=jnp.asarray(optax.safe_increment(state.micro_step), jnp.int32),
        updated=jnp.asarray(emit, jnp.bool_),
        skipped_windows=jnp.where(dropped, optax.safe_increment(state.skipped_windows),
                                  state.skipped_windows).astype(jnp.int32),
        acc_grads=acc,
        inner_state=inner_state,
    )
    return updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
