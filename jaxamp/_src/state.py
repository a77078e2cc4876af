"""Optimizer-state types and the queries that find them anywhere in a nested optax state.

The loss-scaling and accumulation transformations keep their state in the two
``NamedTuple`` types here; everything else (the Flax integrations, the
facades, the diagnostics) reads them through the functions of this module,
which work through ``optax.chain``, ``optax.inject_hyperparams`` and any other
nesting.

A transformation that skips non-finite steps itself declares its state type
with :func:`declare_skipping_state`; :func:`skips_nonfinite_steps` is how an
outer transformation (gradient accumulation) learns that an inner one checks
the gradients, without knowing its type.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp._src import outside
from jaxamp._src import validation

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
    skip_streak: int32, consecutive skipped updates up to the last one (0
      after an applied update).
    stalled: bool, whether the run is stuck on skipped steps: the last
      update was skipped and either ``skip_streak`` reached the
      transformation's ``stall_after``, or the scale could not back off any
      more (it was at ``min_scale``).
    nonfinite_leaves: bool vector with one entry per floating gradient leaf
      (in tree order): whether the last step's unscaled gradients held an
      inf or a nan there (all False after a finite step). See
      :func:`skip_report`.
    inner_state: the state of the wrapped transformation.
  """

  scale: jax.Array
  growth_tracker: jax.Array
  overflow_count: jax.Array
  skipped: jax.Array
  skipped_steps: jax.Array
  skip_streak: jax.Array
  stalled: jax.Array
  nonfinite_leaves: jax.Array
  inner_state: optax.OptState


class ClipGradNormState(NamedTuple):
  """State of :func:`clip_grad_norm`.

  Attributes:
    total_norm: float32 scalar, the total norm of the last gradients seen,
      measured before clipping (``nan``/``inf`` when they were not finite).
  """

  total_norm: jax.Array


class AccumulationState(NamedTuple):
  """State of :func:`accumulate_gradients`.

  Every counter is an int32 scalar that saturates instead of wrapping.

  Attributes:
    mini_step: micro-steps already accumulated in the open window (0 right
      after a window closed).
    gradient_step: windows closed so far, i.e. the optimizer steps emitted
      (a window dropped for non-finite gradients counts as closed).
    micro_step: micro-steps seen in total (mmengine's ``inner_count``); a value
      above ``total_steps`` records a call past the end.
    updated: bool, whether the last call closed a window (a window dropped
      for non-finite gradients included; :func:`update_applied` says whether
      the parameters changed).
    skipped_windows: windows dropped by the wrapper because their
      accumulated gradients held an inf or a nan (0 when the inner
      transformation is a loss scaler, which then does the skipping and
      counts it in its own state).
    acc_grads: the accumulated gradients (a pytree like the parameters, in
      the accumulator dtype); an empty ``optax.EmptyState()`` when
      ``every_k == 1``.
    inner_state: the state of the wrapped transformation.
  """

  mini_step: jax.Array
  gradient_step: jax.Array
  micro_step: jax.Array
  updated: jax.Array
  skipped_windows: jax.Array
  acc_grads: Any
  inner_state: optax.OptState


class LowPrecisionState(NamedTuple):
  """State of :func:`jaxamp.low_precision_params`.

  Attributes:
    key: uint32 ``[2]``, the raw threefry key of stochastic rounding; split
      once per applied step (unused by the other roundings, which keep the
      seed's key unchanged).
    compensation: a list with one int16 array per bfloat16 parameter leaf
      (in tree order), shaped like it, for ``rounding="kahan"``: what the
      parameter could not hold after the last step, in units of float32's
      spacing at the parameter's binade (:func:`jaxamp.decode_compensation`
      gives it as float32). An empty list otherwise.
    stale_fraction: float32 vector with one entry per bfloat16 parameter
      leaf (in tree order): in the last step, the fraction of the leaf's
      elements whose update ``u`` was not zero but would have been lost
      entirely by round-to-nearest (``bfloat16(p + u) == p``), whatever the
      rounding in use. See :func:`stale_report`.
    inner_state: the state of the wrapped transformation; its moments for
      bfloat16 leaves are stored in ``state_dtype``.
  """

  key: jax.Array
  compensation: list
  stale_fraction: jax.Array
  inner_state: optax.OptState


def find_states(opt_state: optax.OptState, cls: type) -> list[Any]:
  """Every node of type ``cls`` inside ``opt_state``, outermost first."""
  return [n for n in jax.tree.leaves(opt_state, is_leaf=lambda n: isinstance(n, cls))
          if isinstance(n, cls)]


def replace_states(opt_state: optax.OptState, cls: type, fn: Callable[[Any], Any]
                   ) -> optax.OptState:
  """``opt_state`` with each outermost node of type ``cls`` replaced by ``fn(node)``."""
  return jax.tree.map(lambda n: fn(n) if isinstance(n, cls) else n, opt_state,
                      is_leaf=lambda n: isinstance(n, cls))


_SKIPPING_STATES: set[type] = {LossScaleState}


def declare_skipping_state(cls: type) -> type:
  """Declares that a transformation whose state has type ``cls`` skips non-finite steps itself."""
  _SKIPPING_STATES.add(cls)
  return cls


def _declares_skipping(node: Any) -> bool:
  return type(node) in _SKIPPING_STATES


def skips_nonfinite_steps(opt_state: optax.OptState) -> bool:
  """Whether a transformation inside ``opt_state`` checks its gradients and skips non-finite steps.

  True when a node's type was declared with :func:`declare_skipping_state`,
  as :class:`LossScaleState` is. A static (trace-time) answer.
  """
  return any(_declares_skipping(n) for n in jax.tree.leaves(opt_state, is_leaf=_declares_skipping))


def promotion_for_updates(opt_state: optax.OptState) -> Any:
  """A context for ``optax.apply_updates``: standard dtype promotion where the updates need it.

  :func:`jaxamp.low_precision_params` returns float32 updates for bfloat16
  parameters, which ``optax.apply_updates`` adds under standard promotion
  (strict promotion refuses the sum); without a :class:`LowPrecisionState`
  in ``opt_state`` the configured promotion is kept.
  """
  if find_states(opt_state, LowPrecisionState):
    return jax.numpy_dtype_promotion("standard")
  return contextlib.nullcontext()


def _child(node: Any, key: Any) -> Any:
  """The child of pytree ``node`` at one key of a ``jax.tree_util`` key path."""
  if isinstance(key, jax.tree_util.GetAttrKey):
    return getattr(node, key.name)
  if isinstance(key, jax.tree_util.SequenceKey):
    return node[key.idx]
  if isinstance(key, jax.tree_util.DictKey):
    return node[key.key]
  children = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)[0]
  return children[key.key]


#: Wrappers whose own state may sit around a loss scaler: it does not advance wrongly on a skipped
#: step (see :func:`declare_state_around_scaler`).
_AROUND_SCALER: set[type] = {AccumulationState, LowPrecisionState, optax.InjectHyperparamsState,
                             optax.InjectStatefulHyperparamsState}


def declare_state_around_scaler(cls: type) -> type:
  """Declares that a wrapper whose state has type ``cls`` may hold a loss scaler inside.

  Its own state must not go wrong on the steps the scaler skips: jaxamp's
  accumulation counts them knowingly, the fp8 overwrite writes only the
  applied steps, the low-precision rounding of a skipped step's zero updates
  leaves the parameters and the compensation as they were, and
  ``optax.inject_hyperparams``'s count drives only the schedules of the
  injected values.
  """
  _AROUND_SCALER.add(cls)
  return cls


def _stateful_siblings(node: Any, key: Any) -> list:
  """The entries of the container ``node`` other than ``key`` that hold state."""
  if isinstance(key, jax.tree_util.SequenceKey):
    return [i for i, sibling in enumerate(node) if i != key.idx and jax.tree.leaves(sibling)]
  return [k for k, sibling in node.items() if k != key.key and jax.tree.leaves(sibling)]


def _is_optax_wrapper(node: Any) -> bool:
  """Whether ``node`` is the state of an optax transformation (a wrapper, when it holds another).

  A user's own ``NamedTuple`` may hold two models' states side by side, as a
  list may: only optax's types are taken for wrappers.
  """
  return (isinstance(node, tuple) and hasattr(node, "_fields")
          and type(node).__module__.split(".")[0] == "optax")


def _check_composition(opt_state: optax.OptState, path: Any) -> None:
  """Refuses the compositions around a loss scaler that cannot work (a trace-time check).

  ``path`` is the key path of the loss-scale state inside ``opt_state``. Raises
  when it sits inside ``optax.MultiSteps``, ``optax.apply_if_finite``,
  ``optax.contrib.schedule_free`` or any other optax wrapper with state of
  its own (which advances on the skipped steps), or in an ``optax.chain`` or
  ``optax.partition`` beside a transformation that holds state.
  """
  node = opt_state
  for i, key in enumerate(path):
    if isinstance(node, optax.MultiStepsState):
      raise ValueError(
          "optax.MultiSteps(jaxamp.dynamic_loss_scale(...)) cannot work: MultiSteps resets its "
          "accumulator by multiplying it by zero, and 0 * inf is nan, so one overflowing "
          "micro-batch leaves nan in the accumulator and every later step is skipped: the run "
          "stalls for good. Accumulate inside jaxamp instead: "
          "jaxamp.accumulate_gradients(jaxamp.dynamic_loss_scale(inner), k).")
    if isinstance(node, optax.ApplyIfFiniteState):
      raise ValueError(
          "optax.apply_if_finite(jaxamp.dynamic_loss_scale(...)) cannot work: it throws away "
          "the inner state of every non-finite step, and with it the loss scaler's back-off, so "
          "the scale never comes down from a value that overflows. The loss scaler already skips "
          "non-finite steps: use jaxamp.dynamic_loss_scale(inner) alone.")
    if type(node) is tuple and isinstance(key, jax.tree_util.SequenceKey):
      stateful = _stateful_siblings(node, key)
      if stateful:
        where = "before" if stateful[0] < key.idx else "after"
        raise ValueError(
            "a loss scaler sits in optax.chain(...) beside a transformation that holds state "
            f"(chain entry {stateful[0]}, {where} the scaler at entry {key.idx}): a "
            "transformation before the scaler sees the scaled, possibly infinite gradients "
            "(one inf poisons its state), one after it advances on the skipped steps. Put "
            "every stateful transformation inside the scaler: "
            "jaxamp.dynamic_loss_scale(optax.chain(...)).")
    if isinstance(node, optax.MultiTransformState) and i + 1 < len(path):
      stateful = _stateful_siblings(node.inner_states, path[i + 1])
      if stateful:
        raise ValueError(
            "a loss scaler sits in optax.partition(...) (or multi_transform) beside a "
            f"transformation that holds state (label {stateful[0]!r}): it sees the scaled "
            "gradients, never unscaled, and advances on the skipped steps. Put the scaler "
            "around the partition: jaxamp.dynamic_loss_scale(optax.partition(...)).")
    if (_is_optax_wrapper(node) and type(node) not in _AROUND_SCALER
        and isinstance(key, jax.tree_util.GetAttrKey)):
      wrapper: Any = node  # an optax NamedTuple state (_is_optax_wrapper)
      own = [f for f in wrapper._fields if f != key.name and jax.tree.leaves(getattr(node, f))]
      if own:
        kind = type(node).__name__
        if kind == "ScheduleFreeState":
          raise ValueError(
              "optax.contrib.schedule_free(jaxamp.dynamic_loss_scale(...)) cannot work: its "
              "step count, weights and averaged iterate advance on the steps the scaler skips. "
              "Put the scaler outside: jaxamp.dynamic_loss_scale(optax.contrib.schedule_free("
              "inner, ...)).")
        raise ValueError(
            f"a loss scaler sits inside a transformation whose state ({kind}) holds state of "
            f"its own ({', '.join(own)}): it advances on every update, the skipped ones "
            "included. Put the loss scaler around that transformation: "
            "jaxamp.dynamic_loss_scale(...) outermost.")
    node = _child(node, key)


def _scaler_paths(opt_state: optax.OptState) -> list[tuple[Any, LossScaleState]]:
  """``(key path, node)`` of every :class:`LossScaleState` in ``opt_state``, outermost first."""
  found = jax.tree_util.tree_flatten_with_path(
      opt_state, is_leaf=lambda n: isinstance(n, LossScaleState))[0]
  return [(path, node) for path, node in found if isinstance(node, LossScaleState)]


def check_compositions(opt_state: optax.OptState) -> None:
  """Refuses every loss scaler in ``opt_state`` that sits in a composition that cannot work.

  The check :func:`get_loss_scale_state` makes, for every loss scaler in the
  state. jaxamp runs it where a whole state is first built or first updated:
  ``TrainState.create`` and ``apply_gradients``, ``jaxamp.nnx.Optimizer``,
  the mmengine-style wrappers, the transformations that wrap another
  (:func:`accumulate_gradients`, :func:`overwrite_with_gradient`,
  :func:`low_precision_params`), :func:`update_applied`,
  :func:`skipped_steps`, :func:`keep_if_skipped` and
  :func:`validate_opt_state`. A Python check on the tree structure; nothing
  of it runs in the compiled step.

  Raises:
    ValueError: naming the composition and the one that works.
  """
  for path, _ in _scaler_paths(opt_state):
    _check_composition(opt_state, path)


def get_loss_scale_state(opt_state: optax.OptState) -> LossScaleState:
  """Finds the (outermost) :class:`LossScaleState` anywhere inside ``opt_state``.

  Every functional-core query of the scale goes through here (:func:`scale_loss`,
  :func:`loss_scale`, ``jaxamp.TrainState``, ``jaxamp.nnx.Optimizer``), so
  the compositions around the scaler that cannot work are refused here, at the
  first trace (and where a state is first built or updated, see
  :func:`check_compositions`): a scaler inside ``optax.MultiSteps``,
  ``optax.apply_if_finite``, ``optax.contrib.schedule_free`` or any other
  optax wrapper whose own state advances on the skipped steps, or beside a
  stateful transformation in an ``optax.chain`` or ``optax.partition``. A
  Python check on the tree structure; nothing of it runs in the compiled
  step.

  Raises:
    ValueError: when ``opt_state`` holds no loss-scale state, or holds it in
      one of the compositions above (the message names the one that works).
  """
  for path, node in _scaler_paths(opt_state):
    _check_composition(opt_state, path)
    return node
  raise ValueError(
      "No loss-scale state found in the optimizer state (of type "
      f"{type(opt_state).__name__}). Build the optimizer with jaxamp.dynamic_loss_scale(...) "
      "or jaxamp.static_loss_scale(...).")


def loss_scale(opt_state: optax.OptState) -> jax.Array:
  """Returns the current loss scale (a float32 device scalar) found in ``opt_state``.

  Works through ``optax.chain``, ``optax.inject_hyperparams``,
  :func:`accumulate_gradients` and any other nesting of optax states. The
  same name as ``TrainState.loss_scale``, ``jaxamp.nnx.Optimizer.loss_scale``
  and the ``'loss_scale'`` entry of :func:`step_metrics` (which read 1.0
  without loss scaling, where this raises).

  Raises:
    ValueError: when ``opt_state`` holds no loss-scale state.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> tx = optax.chain(optax.identity(), jaxamp.dynamic_loss_scale(optax.adam(1e-3)))
    >>> jaxamp.loss_scale(tx.init({'w': jnp.zeros(3)}))
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
  return multiply_by_scale(loss, loss_scale(opt_state))


def loss_in_float32_at_least(loss: Any) -> jax.Array:
  """``loss`` as an array, an integer or half-precision one cast to float32 (explicitly, so
  that strict dtype promotion accepts it); float32, float64 and complex losses as they are."""
  loss = jnp.asarray(loss)
  if not (jnp.issubdtype(loss.dtype, jnp.inexact) and loss.dtype.itemsize >= 4):
    loss = loss.astype(jnp.float32)
  return loss


def multiply_by_scale(loss: Any, scale: Any) -> jax.Array:
  """``loss * scale``, with an integer or half-precision loss promoted to float32 first."""
  loss = loss_in_float32_at_least(loss)
  return loss * jnp.asarray(scale).astype(loss.dtype)


def set_loss_scale(opt_state: optax.OptState, scale: Any) -> optax.OptState:
  """Returns ``opt_state`` with every loss scale inside it set to ``scale``.

  The growth tracker and overflow count are left as they are (as PyTorch's
  ``update(new_scale)``). No recompilation: the scale is a state leaf, and
  ``scale`` may be a Python number or a concrete scalar array (checked to be
  finite and between the smallest normal float32 and the largest finite
  one, as every scale a state holds), or a traced scalar (which cannot be
  checked).

  Raises:
    TypeError: when ``scale`` is neither a real number nor a real scalar array.
    ValueError: when ``scale`` is not a scalar, not positive and finite, or
      ``opt_state`` holds no loss-scale state.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> tx = optax.chain(optax.identity(), jaxamp.dynamic_loss_scale(optax.sgd(0.1)))
    >>> state = jaxamp.set_loss_scale(tx.init({'w': jnp.zeros(2)}), 1024.0)
    >>> jaxamp.loss_scale(state)
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
    if np.ndim(scale) != 0:  # arrays, and lists and tuples as numpy reads them
      raise ValueError(f"scale must be a scalar, got an array of shape {np.shape(scale)}")
    value = jnp.asarray(outside.scale("scale", scale, DEFAULT_MIN_SCALE, DEFAULT_MAX_SCALE),
                        jnp.float32)

  def put(node):
    return node._replace(scale=value) if isinstance(node, LossScaleState) else node

  return jax.tree.map(put, opt_state, is_leaf=lambda n: isinstance(n, LossScaleState))


def get_accumulation_state(opt_state: optax.OptState) -> AccumulationState:
  """Finds the (outermost) :class:`AccumulationState` anywhere inside ``opt_state``.

  Raises:
    ValueError: when ``opt_state`` holds no accumulation state.
  """
  for node in find_states(opt_state, AccumulationState):
    return node
  raise ValueError(
      "No accumulation state found in the optimizer state (of type "
      f"{type(opt_state).__name__}). Build the optimizer with jaxamp.accumulate_gradients(...).")


def skipped_steps(opt_state: optax.OptState) -> jax.Array:
  """The number of optimizer steps skipped so far for non-finite gradients.

  Counts the steps skipped by :func:`dynamic_loss_scale` and
  :func:`static_loss_scale` (``LossScaleState.skipped_steps``) plus the
  windows dropped by :func:`accumulate_gradients` when it holds no loss scaler
  (``AccumulationState.skipped_windows``), wherever they sit in ``opt_state``.

  Args:
    opt_state: an optax state.

  Returns:
    An int32 scalar array (0 when ``opt_state`` can skip nothing).

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> tx = jaxamp.accumulate_gradients(jaxamp.dynamic_loss_scale(optax.sgd(0.1)), 2)
    >>> state = tx.init({'w': jnp.zeros(2)})
    >>> for g in [1.0, jnp.nan, 1.0, 1.0]:
    ...   _, state = tx.update({'w': jnp.full(2, g)}, state)
    >>> jaxamp.skipped_steps(state)
    Array(1, dtype=int32)
  """
  check_compositions(opt_state)
  total = jnp.zeros([], jnp.int32)
  for node in find_states(opt_state, LossScaleState):
    total = total + jnp.asarray(node.skipped_steps, jnp.int32)
  for node in find_states(opt_state, AccumulationState):
    total = total + jnp.asarray(node.skipped_windows, jnp.int32)
  return total


def update_applied(before: optax.OptState, after: optax.OptState) -> jax.Array:
  """Whether the ``tx.update`` that turned ``before`` into ``after`` updated the parameters.

  False for a step skipped because the gradients were not finite (see
  :func:`skipped_steps`) and for a micro-step of :func:`accumulate_gradients`
  that did not close its window; True otherwise. This is what a step counter
  should count (:class:`TrainState` and ``jaxamp.nnx.Optimizer`` do), in a
  hand-written loop as well::

    updates, new_state = tx.update(grads, opt_state, params)
    step = jnp.where(jaxamp.update_applied(opt_state, new_state), step + 1, step)

  Args:
    before: the optimizer state passed to ``tx.update``.
    after: the optimizer state it returned.

  Returns:
    A ``bool`` scalar array (no host sync).

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))
    >>> state = tx.init({'w': jnp.zeros(2)})
    >>> _, new_state = tx.update({'w': jnp.array([1.0, jnp.nan])}, state)
    >>> jaxamp.update_applied(state, new_state)
    Array(False, dtype=bool)
  """
  not_skipped = skipped_steps(after) == skipped_steps(before)
  return jnp.logical_and(window_closed(after), not_skipped)


def window_closed(after: optax.OptState) -> jax.Array:
  """Whether the update that returned ``after`` closed its accumulation window (True without one).

  Reads the outermost :class:`AccumulationState`'s ``updated`` flag.
  """
  accumulators = find_states(after, AccumulationState)
  return jnp.asarray(accumulators[0].updated, jnp.bool_) if accumulators else jnp.array(True)


def keep_if_skipped(new: Any, old: Any, before: optax.OptState, after: optax.OptState) -> Any:
  """``old`` where the step was skipped or ``new`` holds an inf or a nan; ``new`` otherwise.

  For what a train step writes besides the parameters and the optimizer
  state: BatchNorm running statistics (Flax ``batch_stats``, NNX
  ``nnx.BatchStat``, Equinox ``eqx.nn.State``), EMA copies, counters. The
  forward pass of a skipped step computed them from the batch whose
  gradients were dropped: they are kept at their previous values, as the
  parameters are, so one bad batch cannot leave NaN statistics behind (a
  running mean that holds a NaN holds it for good, and evaluation returns
  NaN while the training loss looks fine). On a step that was not skipped
  (an applied one, or a micro-step of :func:`accumulate_gradients` that only
  accumulates) they are kept too when any of their floating leaves is not
  finite. The choice is one for the whole tree, so the statistics always come
  from one step. :class:`TrainState` applies it to the fields passed to
  ``apply_gradients``.

  Args:
    new: the values the step computed (a pytree).
    old: the values before the step (a pytree of the same structure).
    before: the optimizer state passed to ``tx.update``.
    after: the optimizer state it returned.

  Returns:
    ``new`` or ``old``, leaf by leaf in ``old``'s dtypes (no host sync).

  Raises:
    ValueError: ``new`` and ``old`` of other tree structures or leaf shapes
      (the kept statistics would change shape), or a loss scaler in a
      composition that cannot work (see :func:`check_compositions`).

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))
    >>> state = tx.init({'w': jnp.zeros(2)})
    >>> _, new_state = tx.update({'w': jnp.array([1.0, jnp.nan])}, state)
    >>> stats, new_stats = {'mean': jnp.zeros(2)}, {'mean': jnp.array([0.5, jnp.nan])}
    >>> jaxamp.keep_if_skipped(new_stats, stats, state, new_state)
    {'mean': Array([0., 0.], dtype=float32)}
  """
  validation.check_shapes_like("new", new, "old", old)
  skipped = skipped_steps(after) != skipped_steps(before)
  finite = jnp.array(True)
  for leaf in jax.tree.leaves(new):
    if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
      finite = jnp.logical_and(finite, jnp.all(jnp.isfinite(leaf)))
  keep = jnp.logical_or(skipped, jnp.logical_not(finite))

  def select(n: Any, o: Any) -> Any:
    o, n = jnp.asarray(o), jnp.asarray(n)
    if n.dtype != o.dtype:  # typed PRNG keys have no astype
      n = n.astype(o.dtype)
    return jnp.where(keep, o, n)

  return jax.tree.map(select, new, old)


def loss_scale_or_one(opt_state: optax.OptState) -> jax.Array:
  """The loss scale inside ``opt_state`` (float32), or 1.0 when it holds none."""
  if not find_states(opt_state, LossScaleState):
    return jnp.ones([], jnp.float32)
  return jnp.asarray(get_loss_scale_state(opt_state).scale, jnp.float32)


def stalled(opt_state: optax.OptState) -> jax.Array:
  """Whether the run is stuck on skipped steps (a bool device scalar; see :class:`LossScaleState`).

  Raises:
    ValueError: when ``opt_state`` holds no loss-scale state.
  """
  return get_loss_scale_state(opt_state).stalled


def _float_paths(params: Any) -> list[str]:
  return [jax.tree_util.keystr(path) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
          if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)]


def skip_report(opt_state: optax.OptState, params: Any) -> list[str]:
  """The gradient leaves that held an inf or a nan in the last step, by path.

  Paths are written as ``jax.tree_util.keystr`` writes them (``"['dec']['w']"``)
  for the floating leaves of ``params``, in tree order; ``[]`` when the last
  step was finite. The flags behind it are computed inside the step by the
  finite check itself, one reduction per leaf, so a good step pays nothing
  more for them. (They say which leaves, not how many elements.)
  Through :func:`accumulate_gradients` the loss scaler checks a window's
  accumulated gradients, so the report names the leaves of every non-finite
  micro-step of the window. Reading the report is a host
  sync: call it where the loop already reads values, not on every step.

  Args:
    opt_state: an optax state holding a loss-scale state (found as
      :func:`get_loss_scale_state` finds it).
    params: the parameters (or anything with their tree structure), for the
      paths.

  Returns:
    A list of paths.

  Raises:
    ValueError: when ``opt_state`` holds no loss-scale state, or ``params``
      has not as many floating leaves as the gradients it was built for.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> params = {'dec': {'w': jnp.ones(2)}, 'enc': jnp.ones(3)}
    >>> tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))
    >>> state = tx.init(params)
    >>> grads = {'dec': {'w': jnp.array([1.0, jnp.nan])}, 'enc': jnp.array([jnp.inf, 2, 3])}
    >>> _, state = tx.update(grads, state, params)
    >>> jaxamp.skip_report(state, params)
    ["['dec']['w']", "['enc']"]
  """
  node = get_loss_scale_state(opt_state)
  paths = _float_paths(params)
  flags = jax.device_get(node.nonfinite_leaves)
  if len(paths) != len(flags):
    raise ValueError(f"params has {len(paths)} floating leaves, but the loss-scale state counts "
                     f"{len(flags)}: pass the params the optimizer was initialised with")
  _check_params_like_state(node.inner_state, params)
  return [p for p, bad in zip(paths, flags) if bad]


def _check_params_like_state(inner_state: Any, params: Any) -> None:
  """Refuses ``params`` of another structure than a params-like tree in ``inner_state``.

  Optimizer states hold trees shaped like the parameters (momenta, moments);
  one with the same leaf shapes, in order, floating where the parameters are
  (a tree of step counts is no moment), but another tree structure means
  that ``params`` is not the tree the optimizer was initialised with, and its
  paths would name the wrong leaves. (A state holding no such tree, as plain
  SGD's, cannot tell; the leaf count is checked always.)
  """
  treedef: Any = jax.tree.structure(params)
  shapes = [jnp.shape(x) for x in jax.tree.leaves(params)]
  if not shapes:
    return
  floating = [jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in jax.tree.leaves(params)]

  found = []

  def same_structure(x: Any) -> bool:
    if jax.tree.structure(x) == treedef:
      found.append(x)
      return True
    return False

  jax.tree.leaves(inner_state, is_leaf=same_structure)
  if found:
    return
  for sub in _subtrees(inner_state):
    leaves = jax.tree.leaves(sub)
    # A moment of a floating parameter is floating: a tree of step counts is not params-like.
    if [jnp.shape(x) for x in leaves] == shapes and all(
        jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x, f in zip(leaves, floating) if f):
      raise ValueError(
          "params has another tree structure than the parameters the optimizer state was "
          f"initialised with ({jax.tree.structure(params)} against {jax.tree.structure(sub)}): "
          "the paths would name the wrong leaves; pass the params the optimizer was "
          "initialised with")


_INJECT_STATES = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def _subtrees(tree: Any) -> list:
  """Every container node of ``tree`` (dicts, lists, non-empty tuples), outermost first.

  The injected hyperparameters of ``optax.inject_hyperparams`` (scalars, no
  moments) are left out.
  """
  out = []
  stack = [tree]
  while stack:
    node = stack.pop()
    children = None
    if isinstance(node, _INJECT_STATES):
      children = [node.inner_state]
    elif isinstance(node, dict):
      children = list(node.values())
    elif isinstance(node, (list, tuple)):
      children = list(node)
    if children is None:
      continue
    if not (isinstance(node, tuple) and hasattr(node, "_fields")):
      out.append(node)
    stack.extend(children)
  return out


def step_metrics(source: Any) -> dict[str, jax.Array]:
  """What a training loop logs about loss scaling, as device scalars (no host sync).

  ``source`` is an optax state, or anything with a ``step_metrics()`` method:
  ``jaxamp.TrainState``, ``jaxamp.nnx.Optimizer``, ``jaxamp.GradScaler``,
  ``jaxamp.paddle.GradScaler`` and ``jaxamp.AmpOptimWrapper`` have one.

  ``loss_scale``, ``skipped`` (the last update), ``skipped_steps`` (as
  :func:`skipped_steps` counts them), ``skip_streak``, ``stalled`` and, when a
  :func:`clip_grad_norm` inside recorded one, ``grad_norm`` (before clipping).
  With :func:`jaxamp.low_precision_params` inside, also ``stale_fraction``
  (the mean over bfloat16 leaves of the fraction of elements whose last
  update round-to-nearest would have lost, see :func:`stale_report`) and
  ``stale_fraction_per_leaf`` (one entry per bfloat16 leaf, in tree order);
  the loss-scaling entries are then present only when a loss scaler is.
  Hand the dict to a logger after one ``jax.device_get`` (the values are then
  numpy scalars), for example ``wandb.log(jax.device_get(m), step=step)`` or
  ``for k, v in jax.device_get(m).items(): writer.add_scalar(k, v, step)``.

  Raises:
    ValueError: when ``source`` holds neither a loss-scale state nor a
      low-precision state.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0)
    >>> state = tx.init({'w': jnp.ones(2)})
    >>> sorted(jaxamp.step_metrics(state))
    ['loss_scale', 'skip_streak', 'skipped', 'skipped_steps', 'stalled']
  """
  method = getattr(source, "step_metrics", None)
  if callable(method):
    return method()
  opt_state = source
  lows = find_states(opt_state, LowPrecisionState)
  metrics: dict[str, jax.Array] = {}
  if not lows or find_states(opt_state, LossScaleState):
    node = get_loss_scale_state(opt_state)
    metrics.update({"loss_scale": node.scale, "skipped": node.skipped,
                    "skipped_steps": skipped_steps(opt_state), "skip_streak": node.skip_streak,
                    "stalled": node.stalled})
  clips = find_states(opt_state, ClipGradNormState)
  if clips:
    metrics["grad_norm"] = clips[0].total_norm
  if lows:
    per_leaf = jnp.asarray(lows[0].stale_fraction, jnp.float32)
    metrics["stale_fraction"] = (jnp.mean(per_leaf) if per_leaf.size
                                 else jnp.zeros([], jnp.float32))
    metrics["stale_fraction_per_leaf"] = per_leaf
  return metrics


def stale_report(opt_state: optax.OptState, params: Any) -> dict[str, float]:
  """Per bfloat16 leaf, the fraction of the last update that round-to-nearest would have lost.

  Reads the :class:`LowPrecisionState` of :func:`jaxamp.low_precision_params`
  (the outermost one in ``opt_state``): for each bfloat16 leaf of ``params``,
  by path as ``jax.tree_util.keystr`` writes it, the fraction of its elements
  whose update was not zero but smaller than what bfloat16 can add to the
  parameter (``bfloat16(p + u) == p``). Near 0 everywhere, plain bfloat16
  training would do; a large fraction says the updates of that leaf stall
  without stochastic or Kahan rounding. A host sync.

  Raises:
    ValueError: when ``opt_state`` holds no low-precision state, or
      ``params`` has not as many bfloat16 leaves as it was built for.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> params = {'big': jnp.ones(2, jnp.bfloat16), 'f32': jnp.ones(2)}
    >>> tx = jaxamp.low_precision_params(optax.sgd(1e-3), "kahan")
    >>> state = tx.init(params)
    >>> _, state = tx.update({'big': jnp.ones(2, jnp.bfloat16), 'f32': jnp.ones(2)}, state, params)
    >>> jaxamp.stale_report(state, params)
    {"['big']": 1.0}
  """
  lows = find_states(opt_state, LowPrecisionState)
  if not lows:
    raise ValueError(
        "No low-precision state found in the optimizer state (of type "
        f"{type(opt_state).__name__}). Build the optimizer with jaxamp.low_precision_params(...).")
  paths = [jax.tree_util.keystr(path) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
           if jnp.result_type(leaf) == jnp.bfloat16]
  fractions = jax.device_get(lows[0].stale_fraction)
  if len(paths) != len(fractions):
    raise ValueError(f"params has {len(paths)} bfloat16 leaves, but the low-precision state "
                     f"counts {len(fractions)}: pass the params the optimizer was initialised with")
  return {p: float(f) for p, f in zip(paths, fractions)}


def upgrade_opt_state(restored: Any, template: optax.OptState) -> optax.OptState:
  """Rebuilds an optimizer state restored without a target, filling fields it lacks from ``template``.

  A checkpoint written by an earlier jaxamp holds a :class:`LossScaleState`
  without the fields added since (``skip_streak``, ``stalled``,
  ``nonfinite_leaves``); restoring it into a new state as target
  fails with a list of the missing fields. Restore it without a target
  instead (orbax gives nested dicts keyed by field name, and lists for
  tuples) and pass the result here with ``tx.init(params)`` as ``template``:
  every value found in ``restored`` is kept (cast to the template's dtype),
  every field missing is the template's. What it builds is checked with
  :func:`jaxamp.validate_opt_state`: a negative, zero, nan or overflowing
  scale, a negative or fractional counter, a non-finite moment or an
  unexpected key is refused, not restored.

  Raises:
    ValueError: when ``restored`` does not have the template's shape at a
      node (a different optimizer, or other parameters), holds keys the
      template has not, or a value that the cast would change or that is
      out of range; the message names the field.
    TypeError: a value of the wrong kind (a string for a number).

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> template = jaxamp.dynamic_loss_scale(optax.sgd(0.1)).init({'w': jnp.zeros(2)})
    >>> old = {'scale': 1024.0, 'growth_tracker': 5, 'overflow_count': 0, 'skipped': False,
    ...        'skipped_steps': 3, 'inner_state': [{}, {}]}
    >>> state = jaxamp.upgrade_opt_state(old, template)
    >>> state.scale, state.skipped_steps, state.skip_streak
    (Array(1024., dtype=float32), Array(3, dtype=int32), Array(0, dtype=int32))
  """

  def fail(where: str, what: str) -> ValueError:
    return ValueError(f"{where or 'the state'}: {what}")

  def build(raw: Any, node: Any, where: str) -> Any:
    if isinstance(raw, tuple) and hasattr(raw, "_fields"):
      raw = dict(zip(raw._fields, raw))
    if isinstance(node, tuple) and hasattr(node, "_fields"):
      if not node._fields:  # optax.EmptyState() and the like
        if raw is not None and jax.tree.leaves(raw):
          raise fail(where, f"expected an empty {type(node).__name__}, got {raw!r}")
        return node
      if not isinstance(raw, dict):
        raise fail(where, f"expected the fields of {type(node).__name__}, got "
                   f"{type(raw).__name__}")
      extra = sorted(str(k) for k in raw if k not in node._fields)
      if extra:
        raise fail(where, f"unexpected fields {extra} for {type(node).__name__} (accepted: "
                   f"{list(node._fields)})")
      return type(node)(*[build(raw[f], getattr(node, f), f"{where}.{f}") if f in raw
                          else getattr(node, f) for f in node._fields])
    if isinstance(node, (list, tuple)):
      if raw is None and not jax.tree.leaves(node):
        return node
      if isinstance(raw, dict):
        items = list(raw.values())
      elif isinstance(raw, (list, tuple)):
        items = list(raw)
      else:
        raise fail(where, f"expected a sequence of {len(node)} entries, got {type(raw).__name__}")
      if len(items) != len(node):
        raise fail(where, f"expected {len(node)} entries, got {len(items)}")
      return type(node)(build(r, n, f"{where}[{i}]") for i, (r, n) in enumerate(zip(items, node)))
    if isinstance(node, dict):
      if raw is None and not jax.tree.leaves(node):
        return node
      if not isinstance(raw, dict):
        raise fail(where, f"expected a dict with keys {sorted(node)}, got {type(raw).__name__}")
      extra = sorted(str(k) for k in raw if k not in node)
      if extra:
        raise fail(where, f"unexpected keys {extra} (accepted: {sorted(node)})")
      # type(node): an OrderedDict of parameters stays one.
      return type(node)((k, build(raw[k], v, f"{where}[{k!r}]") if k in raw else v)
                        for k, v in node.items())
    if node is None or not jax.tree.leaves(node):
      if raw is not None and jax.tree.leaves(raw):
        raise fail(where, f"expected nothing, got {raw!r}")
      return node
    value = outside.fits(where or "the state", raw, jnp.result_type(node))
    if value.size != int(np.prod(jnp.shape(node))):
      raise fail(where, f"expected shape {jnp.shape(node)}, got {value.shape}")
    return jnp.asarray(value.reshape(jnp.shape(node)))

  upgraded = build(restored, template, "state")
  return outside.validate_opt_state(upgraded, template)

