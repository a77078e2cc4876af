"""mmengine's ``OptimWrapper`` for optax: accumulation, clipping, one call per iteration.

The wrapper holds a pytree (parameters, the optax state, accumulated gradients) and Python
counters (:mod:`.counting`), and steps them through jitted functions built from the functional
core; its other rooms are the modules beside this one.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxamp._src import state as state_lib
from jaxamp._src import finite
from jaxamp._src import fp8
from jaxamp._src import selective_update
from jaxamp._src import clipping
from jaxamp._src import outside
from jaxamp._src import validation
from jaxamp._src.facade.errors import AssertionTypeError
from jaxamp._src.facade import hyperparam_codecs as hc
from jaxamp._src.facade.mmengine import param_groups as pg
from jaxamp._src.facade.mmengine import sharding_pins
from jaxamp._src.facade.mmengine import trees
from jaxamp._src.facade.mmengine.clip import parse_clip_grad
from jaxamp._src.facade.mmengine.counting import AccumulationCounter
from jaxamp._src.facade.mmengine.jit_args import CallSpec
from jaxamp._src.facade.mmengine.jit_args import RetraceWatch
from jaxamp._src.facade.mmengine.jit_args import merge_call
from jaxamp._src.facade.mmengine.jit_args import split_call
from jaxamp._src.facade.scaled_loss import ScaledLoss
from jaxamp._src.facade.scaled_loss import DividedLoss
from jaxamp._src.facade.scaled_loss import divide

_unscale = jax.jit(fp8.unscale)  # Flax's fp8 values are not unscaled


class OptimizerState(NamedTuple):
  """The state of the wrapped optimizer, marked so the wrapper finds it by type in its state."""

  state: Any


def _marked(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
  """``optimizer`` with its state held in an :class:`OptimizerState`."""

  def init_fn(params):
    return OptimizerState(optimizer.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    updates, inner = optimizer.update(updates, state.state, params, **extra_args)
    return updates, OptimizerState(inner)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def loss_scale_of(state: Any) -> Optional[state_lib.LossScaleState]:
  """The wrapper's own loss-scale state: the root of its state, when it scales."""
  return state if isinstance(state, state_lib.LossScaleState) else None


# The methods update_params calls, in mmengine's order. It fuses them into one jitted call only
# while none is overridden (by a subclass outside jaxamp or on the instance).
_ITERATION_METHODS = ("scale_loss", "backward", "step", "zero_grad")


def overrides_iteration(wrapper: Any) -> bool:
  """Whether ``wrapper`` overrides a method that ``update_params`` calls (then it calls them)."""
  for name in _ITERATION_METHODS:
    if name in vars(wrapper):
      return True
    owner = next(c for c in type(wrapper).__mro__ if name in vars(c))
    if not owner.__module__.startswith("jaxamp."):
      return True
  return False


def check_call_kwargs(method: Callable, kwargs: dict, what: str) -> None:
  """Raises the ``TypeError`` that ``method(**kwargs)`` would raise, naming ``what``, without a call."""
  if kwargs:
    try:
      inspect.signature(method).bind(**kwargs)
    except TypeError as e:
      raise TypeError(f"{what}={kwargs!r} do not fit {method.__qualname__}(): {e}") from None


def check_optimizer(optimizer: Any) -> optax.GradientTransformation:
  """``optimizer`` when it is an optax transformation, else mmengine's assertion (a ``TypeError``)."""
  if not validation.is_gradient_transformation(optimizer):
    raise AssertionTypeError(
        "optimizer must be an optax `GradientTransformation` (with init and update), but got "
        f"{type(optimizer)}")
  return optimizer


def has_batch_norm(model: Any) -> bool:
  """Whether ``model`` (any pytree or object) seems to hold BatchNorm layers (mmengine warns)."""
  if model is None:
    return False
  is_norm = lambda x: "batchnorm" in type(x).__name__.lower()  # noqa: E731
  try:
    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_norm)[0]
  except Exception:  # noqa: BLE001 (a model that is no pytree has no BatchNorm we can see)
    return False
  names = [part.lower() for path, _ in leaves for part in trees.path_parts(path)]
  return (any(is_norm(leaf) for _, leaf in leaves)
          or any("batchnorm" in n or "batch_norm" in n or n == "batch_stats" for n in names))


class OptimWrapper:
  """mmengine's ``OptimWrapper`` for optax: accumulation, clipping, one call per iteration.

  The wrapper owns the parameters (PyTorch keeps them in the model), the optax
  state and the accumulated gradients, and steps them through jitted
  functions. A typical loop::

    wrapper = jaxamp.OptimWrapper(optax.sgd(0.1), params, accumulative_counts=4,
                                  clip_grad=dict(max_norm=1.0))
    wrapper.initialize_count_status(None, 0, len(loader))
    for batch in loader:
      loss = wrapper.update_params(loss_fn, batch)   # loss_fn(params, batch) -> scalar

  **The loss is a function.** JAX has no ``loss.backward()``: where mmengine
  takes a loss tensor, the wrapper takes ``loss_fn`` and its arguments and
  differentiates ``loss_fn(params, *args, **kwargs)`` with respect to the
  params. ``loss_fn`` and the arguments are flattened as one pytree: array
  leaves are traced, everything else (the function itself, Python numbers,
  strings) is static and hashed, exactly like ``jax.jit``'s static
  arguments. Pass the batch as an argument, not through a new ``lambda``
  per iteration (a new function object means a new compilation). A pytree
  callable whose children are arrays (e.g. ``jaxamp.GradScaler.scale(fn)``,
  which carries the current scale) does not retrace either.

  **Counting** is mmengine's: ``update_params`` divides the loss by the
  accumulation factor (:meth:`scale_loss`), adds the gradients into
  :attr:`grads` and steps when :meth:`should_update` says so, including the
  remainder window after :meth:`initialize_count_status`. Calling past
  ``max_counts`` raises a clear error (mmengine divides by zero there).

  **The optimizer-holder protocol** that :class:`jaxamp.GradScaler` and
  ``jaxamp.paddle.GradScaler`` step (:mod:`jaxamp._src.facade.holder`):
  :attr:`params`, :attr:`opt_state`, :attr:`grads`, :meth:`backward`,
  :meth:`apply_gradients` (with a device ``skip`` flag) and
  :meth:`apply_scaled_gradients`.

  **Learning rates.** ``get_lr()``, ``get_momentum()`` and ``param_groups``
  read the hyperparameters from ``optax.inject_hyperparams`` states found
  anywhere in the optimizer state (one parameter group per such state), and
  writing ``param_groups[i]['lr']`` writes them there. Optimizers built by
  :func:`jaxamp.build_optim_wrapper` are always built that way. For an optax
  transformation without injected hyperparameters ``get_lr()`` and
  ``get_momentum()`` raise a ``ValueError`` saying how to build it, and
  ``param_groups`` holds one group with only ``'params'``.

  What differs from mmengine, and why, is listed in the porting guide
  (``docs/porting.md``, "From mmengine"); ``last_grad_norm`` holds the norm
  before clipping (mmengine logs it as ``train/grad_norm``).

  Args:
    optimizer: an optax ``GradientTransformation``.
    params: the parameters, a pytree of floating-point arrays (numpy leaves
      are moved to the device; shardings of jax arrays are kept).
    accumulative_counts: the number of ``update_params`` calls whose
      gradients are summed into one step.
    clip_grad: ``None``, ``dict(max_norm=..., norm_type=2.0,
      error_if_nonfinite=False)`` (``type='norm'``, the default) or
      ``dict(type='value', clip_value=...)``. Not mutated.
    donate: opt-in buffer donation (see **Donation** below). ``False`` (the
      default) never invalidates an array the user holds.

  **Donation** (``donate=True``). The jitted step donates the wrapper's own
  parameters and optimizer state, and ``backward`` donates the accumulated
  gradients it adds to, so XLA updates them in place (as PyTorch's
  ``optimizer.step()`` updates tensors in place) instead of allocating fresh
  buffers each step. The numerics are identical to ``donate=False`` bit for
  bit. **Arrays previously read from the wrapper are invalidated**:
  ``params``, ``opt_state`` and ``loss_scaler`` by the next step, ``grads``
  by the next ``backward`` that adds to them or a scaler's ``unscale_`` or
  ``step``, which unscale them in place (and
  the arrays passed to the constructor or assigned to ``params``/``grads``,
  which the wrapper then owns, likewise); reading them raises JAX's "Array
  has been deleted" ``RuntimeError``. Copy
  what must outlive a step (``jax.tree.map(jnp.copy, wrapper.params)``).
  :meth:`state_dict` returns on-device copies then, so checkpoints stay valid.
  Donation saves memory (one copy of params and state instead of two during
  a step) and the allocation of fresh buffers, which measured faster on CPU
  too (``benchmarks/bench_grad_scaler.py``); it is off by default because it
  invalidates arrays the user holds. An external ``skip`` (the GradScaler
  protocol) is selected where the optimizer computes its new state, so a
  skippable step costs no copy of the state.

  Raises:
    AssertionError: (also a ``ValueError``/``TypeError``) where mmengine
      asserts: a non-positive ``accumulative_counts``, a ``clip_grad`` that is
      not a non-empty dict, an optimizer that is not an optax transformation.
    ValueError: an unknown clip ``type`` (mmengine's message).
    TypeError: unknown clip arguments, non-floating parameters.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> loss_fn = lambda p, x: jnp.sum(p['w'] * x)
    >>> wrapper = jaxamp.OptimWrapper(optax.sgd(0.1), {'w': jnp.ones(2)},
    ...                               accumulative_counts=2)
    >>> x = jnp.array([1.0, 2.0])
    >>> loss = wrapper.update_params(loss_fn, x)   # gradient x / 2, buffered
    >>> wrapper.inner_count, wrapper.grads['w']
    (1, Array([0.5, 1. ], dtype=float32))
    >>> loss = wrapper.update_params(loss_fn, x)   # steps with the sum
    >>> wrapper.params['w'], wrapper.grads
    (Array([0.9, 0.8], dtype=float32), None)
  """

  def __init__(self, optimizer: optax.GradientTransformation, params: Any, *,
               accumulative_counts: int = 1, clip_grad: Optional[dict] = None,
               donate: bool = False):
    if not isinstance(donate, bool):
      raise TypeError(f"donate must be a bool, got {donate!r}")
    self._donate = donate
    self._counter = AccumulationCounter(accumulative_counts)
    self._optimizer = check_optimizer(optimizer)
    self._clip = parse_clip_grad(clip_grad)
    # mmengine keeps the clip_grad arguments without 'type'.
    self.clip_grad_kwargs: Optional[dict] = (
        None if clip_grad is None else {k: v for k, v in clip_grad.items() if k != "type"})
    self._params = trees.check_params(params)
    self._shardings = sharding_pins.param_shardings(self._params)
    self._tx = self._build_transformation()
    self._state = self._init_state(self._params)
    self._grads: Optional[Any] = None
    # Set by apply_scaled_gradients: ``_grads`` holds the scaled gradients, and
    # ``grads`` reads them divided by this (unscaled on first read).
    self._grads_scale: Optional[jax.Array] = None
    self._last_grad_norm: Optional[jax.Array] = None
    self._build_steps()
    self._factors: Dict[float, jax.Array] = {}
    self._specs: Optional[List[pg.GroupSpec]] = None
    self._defaults: Optional[dict] = None
    self._base_param_settings: Any = _UNSET
    self.optimizer = WrappedOptimizer(self)

  # -- the transformation and its state ---------------------------------------------------------

  def _init_state(self, params: Any) -> Any:
    # Flax's fp8 state is overwritten by the step, never given to the optimizer (fp8.py).
    state = self._tx.init(fp8.split(params)[0])
    state_lib.check_compositions(state)
    return sharding_pins.replicate_scalars(state, params)

  def _build_transformation(self) -> optax.GradientTransformation:
    """``chain(clip, optimizer)`` (or ``optimizer``), the optimizer's state marked by type."""
    if self._clip is None:
      return _marked(self._optimizer)
    return optax.chain(self._clip.transformation(), _marked(self._optimizer))

  def _with_opt(self, state: Any, opt_state: Any) -> Any:
    """``state`` with the optimizer's state replaced by ``opt_state``."""
    return state_lib.replace_states(state, OptimizerState, lambda _: OptimizerState(opt_state))

  def _compute_in_dtype(self, loss_fn: Callable) -> Callable:
    """``loss_fn`` as it runs in the compute dtype (as written, here)."""
    return loss_fn

  # -- jitted functions -------------------------------------------------------------------------

  @property
  def donate(self) -> bool:
    """Whether the jitted steps donate the wrapper's buffers (see the class notes)."""
    return self._donate

  def _build_steps(self) -> None:
    """(Re)builds the jitted steps from ``self._tx``: the next calls compile anew.

    Only buffers that an output of the same shape can reuse are donated (XLA
    warns about the others): params and state into the new params and
    state, the accumulated gradients into the new sum, and the scaled
    gradients into the unscaled ones.
    """
    both: Tuple[int, ...] = (0, 1) if self._donate else ()
    self._grad_step = jax.jit(self._grad_impl, static_argnums=(5,),
                              donate_argnums=(1,) if self._donate else ())
    self._fused_step = jax.jit(self._fused_impl, static_argnums=(5,), donate_argnums=both)
    self._apply_step = jax.jit(self._apply_impl, donate_argnums=both)
    # Donating, the scaled gradients' buffer takes the unscaled ones (see apply_scaled_gradients).
    self._apply_scaled_step = jax.jit(self._apply_scaled_impl,
                                      donate_argnums=(0, 1, 2) if self._donate else ())
    self._retraces = RetraceWatch()

  def _objective(self, spec: CallSpec, dynamic: Sequence[Any], factor: jax.Array,
                 scale: Optional[jax.Array]) -> Callable:
    loss_fn, args, kwargs = merge_call(spec, dynamic)
    if isinstance(loss_fn, ScaledLoss):
      # scaler.scale(loss_fn): differentiate the scaled loss, return the loss itself (what a
      # PyTorch loop logs, the loss before scaler.scale).
      scale = loss_fn.scale if scale is None else state_lib.multiply_by_scale(loss_fn.scale, scale)
      loss_fn = loss_fn.unscaled
    divisor = None
    if isinstance(loss_fn, DividedLoss):
      # scale_loss(loss_fn): differentiate the divided loss, return the loss itself (what
      # update_params returns).
      divisor, loss_fn = loss_fn.factor, loss_fn.fn
    loss_fn = self._compute_in_dtype(loss_fn)

    def objective(params):
      out = loss_fn(params, *args, **kwargs)
      if spec.has_aux:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
          raise TypeError("With has_aux=True, loss_fn must return a pair (loss, aux), got "
                          f"{type(out).__name__}")
        loss, aux = out
      else:
        loss, aux = out, None
      loss = jnp.asarray(loss)
      if loss.shape != ():
        raise TypeError(f"loss_fn must return a scalar loss, got shape {loss.shape}")
      value = divide(loss, factor)
      if divisor is not None:
        value = divide(value, divisor)
      if scale is not None:
        value = state_lib.multiply_by_scale(value, scale)
      return value, (loss, aux)

    return objective

  def _grads_and_loss(self, params, buffer, dynamic, factor, scale, spec):
    """Traced: the loss and the gradients, added to ``buffer`` when there is one."""
    objective = self._objective(spec, dynamic, factor, scale)
    grads, (loss, aux) = jax.grad(objective, has_aux=True)(params)
    if buffer is not None:
      grads = fp8.accumulate(buffer, grads, finite.add_stored)
    return ((loss, aux) if spec.has_aux else loss), grads

  # The traced implementations of the jitted steps.

  def _grad_impl(self, params, buffer, dynamic, factor, scale, spec):
    self._retraces.traced(("backward", buffer is None), spec, dynamic, params)
    out, grads = self._grads_and_loss(params, buffer, dynamic, factor, scale, spec)
    return out, sharding_pins.constrain(grads, self._shardings)

  def _update(self, params, state, grads, skip):
    """Traced: one optimizer step. Returns ``(params, state, grad_norm)``.

    The only update path: ``self._tx`` (with :class:`AmpOptimWrapper` the
    core's loss scaling, which skips a non-finite step by selection), and,
    with an external ``skip``, the core's selection around it (no copy of
    the state).
    """
    grads = sharding_pins.constrain(grads, self._shardings)
    (params, old_fp8), (grads, new_fp8) = fp8.split(params), fp8.split(grads)
    # A non-finite fp8 value (a saturated overflow) skips the step where the step can skip.
    grads = fp8.flag_overflow(grads, new_fp8, state)
    if skip is None:
      updates, new_state = self._tx.update(grads, state, params)
    else:
      updates, new_state = selective_update.select_update(
          jnp.logical_not(skip), lambda: self._tx.update(grads, state, params), state)
    new_params = optax.apply_updates(params, updates)
    applied = state_lib.update_applied(state, new_state)
    if skip is not None:
      applied = jnp.logical_and(applied, jnp.logical_not(skip))
    new_params = fp8.overwrite(new_params, old_fp8, new_fp8, applied)
    norm = self._grad_norm(state, new_state, grads, skip)
    return sharding_pins.constrain(new_params, self._shardings), new_state, norm

  def _grad_norm(self, state, new_state, grads, skip) -> Optional[jax.Array]:
    """Traced: the total norm before clipping (``None`` without norm clipping).

    The clipping state records it when the step is applied; a skipped step
    (an external ``skip``, or a non-finite step the loss scaling skipped)
    keeps the old state, so the norm of its (unscaled) gradients is measured.
    """
    clip = self._clip
    if clip is None or clip.kind != "norm":
      return None
    recorded = state_lib.find_states(new_state, state_lib.ClipGradNormState)[0].total_norm
    scaling, new_scaling = loss_scale_of(state), loss_scale_of(new_state)
    flags = [f for f in (skip, None if new_scaling is None else new_scaling.skipped)
             if f is not None]
    if not flags:
      return recorded
    unscaled = grads if scaling is None else finite.unscale(grads, scaling.scale)
    return lax.cond(functools.reduce(jnp.logical_or, flags),
                    lambda: clipping.total_grad_norm(unscaled, clip.norm_type),
                    lambda: recorded)

  def _apply_impl(self, params, state, grads, skip=None):
    return self._update(params, state, grads, skip)

  def _apply_scaled_impl(self, params, state, grads, scale):
    unscaled, found_inf = fp8.unscale_and_check(grads, scale)
    params, state, norm = self._update(params, state, unscaled, found_inf)
    if not self._donate:
      return params, state, norm, found_inf, None
    return params, state, norm, found_inf, sharding_pins.constrain(unscaled, self._shardings)

  def _fused_impl(self, params, state, buffer, dynamic, factor, spec):
    self._retraces.traced(("update_params", buffer is None), spec, dynamic, params)
    scaling = loss_scale_of(state)
    scale = None if scaling is None else scaling.scale
    out, grads = self._grads_and_loss(params, buffer, dynamic, factor, scale, spec)
    new_params, new_state, norm = self._update(params, state, grads, None)
    return out, new_params, new_state, norm

  def _factor(self, factor: float) -> jax.Array:
    array = self._factors.get(factor)
    if array is None:
      array = self._factors[factor] = jax.device_put(np.float32(factor))
    return array

  # -- properties ------------------------------------------------------------------------------

  @property
  def params(self) -> Any:
    """The current parameters (settable with a pytree of the same structure, shapes, dtypes)."""
    return self._params

  @params.setter
  def params(self, value: Any) -> None:
    self._params = self._validated_like_params(value, "params")
    self._shardings = sharding_pins.param_shardings(self._params)

  @property
  def opt_state(self) -> Any:
    """The optax state of ``optimizer`` (without the clipping or loss-scale state)."""
    return state_lib.find_states(self._state, OptimizerState)[0].state

  @property
  def grads(self) -> Optional[Any]:
    """The accumulated gradients, ``None`` after :meth:`zero_grad`.

    Assigning a pytree with the params' structure, shapes and dtypes
    replaces them (as PyTorch users overwrite ``.grad``); ``None`` clears them.
    """
    if self._grads_scale is not None:
      self._grads = _unscale(self._grads, self._grads_scale)
      self._grads_scale = None
    return self._grads

  @grads.setter
  def grads(self, value: Optional[Any]) -> None:
    self._grads = None if value is None else self._validated_like_params(value, "grads")
    self._grads_scale = None

  @property
  def inner_count(self) -> int:
    """The number of ``backward`` calls counted so far (mmengine's ``_inner_count``)."""
    return self._counter.inner_count

  @property
  def last_grad_norm(self) -> Optional[jax.Array]:
    """The total gradient norm before clipping at the last step (a float32 device scalar).

    ``None`` before the first step and without ``clip_grad`` of type
    ``'norm'`` (mmengine logs no ``grad_norm`` then either).
    """
    return self._last_grad_norm

  def _validated_like_params(self, value: Any, what: str) -> Any:
    return trees.validated_like_params(value, self._params, what)

  # -- counting (mmengine) ----------------------------------------------------------------------

  # mmengine's attribute names, which ported hooks and tests read.
  _accumulative_counts = property(lambda self: self._counter.accumulative_counts)

  @property
  def _inner_count(self) -> int:
    return self._counter.inner_count

  @_inner_count.setter
  def _inner_count(self, value: int) -> None:
    self._counter.inner_count = value
  _max_counts = property(lambda self: self._counter.max_counts)
  _remainder_counts = property(lambda self: self._counter.remainder_counts)

  def initialize_count_status(self, model: Any, init_counts: int, max_counts: int) -> None:
    """Sets the counters for a run of ``max_counts`` calls starting at ``init_counts``.

    As mmengine: warns when resuming at a count that is not a multiple of
    ``accumulative_counts`` (the gradients of a partial window are lost), and
    when ``model`` (any pytree or object; may be ``None``) has BatchNorm
    layers and gradients are accumulated.
    """
    self._counter.initialize(init_counts, max_counts,
                             self._counter.accumulative_counts > 1 and has_batch_norm(model))

  def should_update(self) -> bool:
    """Whether the current call (after ``backward``) should step (mmengine's rule)."""
    return self._counter.should_update()

  def should_sync(self) -> bool:
    """Whether the next ``backward`` ends a window (so gradients should be synchronized)."""
    return self._counter.should_sync()

  def scale_loss(self, loss: Any) -> Any:
    """Divides ``loss`` by mmengine's accumulation factor for the current call.

    ``loss`` is an array (returns ``loss / factor``) or a loss function
    (returns a function whose loss is divided; with ``has_aux`` outputs only
    the loss is divided). The factor is ``accumulative_counts``, or the size of
    the last window after :meth:`initialize_count_status`. As torch's
    division, a floating loss keeps its dtype; a bool or integer one is
    divided in float32.

    Raises:
      AssertionError: (also a ``RuntimeError``) past ``max_counts``.
    """
    factor = self._counter.loss_factor()
    if callable(loss) and not trees.is_array(loss):
      return DividedLoss(loss, self._factor(float(factor)))
    loss = jnp.asarray(loss)
    if not jnp.issubdtype(loss.dtype, jnp.inexact):
      # As torch's true division: an integer or bool loss is divided in float32.
      loss = jnp.asarray(loss, jnp.float32)
    return loss / factor  # a Python int: the loss keeps its floating dtype

  # -- backward / step ------------------------------------------------------------------------

  def backward(self, loss_fn: Callable[..., Any], *args: Any, has_aux: bool = False,
               **kwargs: Any) -> Any:
    """Adds the gradients of ``loss_fn(params, *args, **kwargs)`` to :attr:`grads`.

    Increments :attr:`inner_count`. Returns the loss (and, with
    ``has_aux=True``, ``(loss, aux)``) as device arrays: nothing waits for
    the device. Array leaves of ``loss_fn``/``args``/``kwargs`` are traced,
    other leaves are static (see the class notes), so repeated calls compile
    once. In :class:`AmpOptimWrapper` the loss is computed in the compute
    ``dtype`` and multiplied by the current scale before differentiating; the
    returned loss is the unscaled one (float32 when a ``dtype`` is set).
    """
    dynamic, spec = split_call(loss_fn, args, kwargs, has_aux)
    scaling = loss_scale_of(self._state)
    scale = None if scaling is None else scaling.scale
    out, self._grads = self._grad_step(self._params, self.grads, dynamic, self._factor(1.0),
                                       scale, spec)
    self._counter.inner_count += 1
    return out

  def apply_gradients(self, grads: Optional[Any] = None, *, skip: Optional[Any] = None) -> None:
    """Clips, runs the optimizer and applies the updates, in one jitted call.

    Args:
      grads: the gradients; ``None`` means :attr:`grads`. With neither there
        is nothing to apply and nothing changes (as a PyTorch step whose
        parameters have no ``.grad``).
      skip: ``None``, or a boolean scalar (on the device: no host sync); where
        true, :attr:`params` and :attr:`opt_state` stay bit-identical. The norm
        before clipping is recorded either way.

    Raises:
      RuntimeError: with ``error_if_nonfinite=True`` and a non-finite norm
        (PyTorch's message); nothing is changed then.
    """
    if grads is None:
      grads = self.grads
    else:
      grads = self._validated_like_params(grads, "grads")
    if grads is None:
      return
    if skip is None:
      result = self._apply_step(self._params, self._state, grads)
    else:
      skip = jnp.asarray(skip)
      if skip.shape != () or skip.dtype != jnp.bool_:
        raise ValueError(f"skip must be a boolean scalar, got dtype {skip.dtype} and shape "
                         f"{skip.shape}")
      result = self._apply_step(self._params, self._state, grads, skip)
    self._commit_step(*result)

  def apply_scaled_gradients(self, scale: Any) -> Optional[jax.Array]:
    """Unscales :attr:`grads` by ``scale``, checks them and applies them unless one is inf/nan.

    :meth:`GradScaler.unscale_ <jaxamp.GradScaler.unscale_>` and
    :meth:`apply_gradients` in one jitted call, so that the unscaled gradients
    are not written out and read back: the scalers' ``step`` uses it when
    nothing has to see the gradients unscaled in between. Afterwards
    :attr:`grads` reads the unscaled gradients: with ``donate=True`` the call
    writes them into the scaled gradients' buffer (which it donates, as
    ``unscale_`` does), otherwise they are computed on the first read.

    Args:
      scale: the loss scale, a float32 scalar (no host sync).

    Returns:
      ``found_inf``, a device boolean: whether a gradient was inf or nan (the
      step was skipped); ``None`` when there are no gradients (nothing changes).
    """
    grads = self.grads
    if grads is None:
      return None
    if not (isinstance(scale, jax.Array) and scale.dtype == jnp.float32):  # a scaler's: as it is
      scale = jnp.asarray(scale, jnp.float32)
    params, state, norm, found_inf, unscaled = self._apply_scaled_step(
        self._params, self._state, grads, scale)
    if unscaled is None:
      self._grads_scale = scale
    else:
      self._grads = unscaled
    self._commit_step(params, state, norm)
    return found_inf

  def _commit_step(self, params: Any, state: Any, norm: Optional[jax.Array]) -> None:
    if self._clip is not None and self._clip.error_if_nonfinite and norm is not None:
      clipping.check_total_norm(norm, self._clip.norm_type)
    self._params, self._state, self._last_grad_norm = params, state, norm

  def step(self, closure: Optional[Callable] = None) -> None:
    """Applies :attr:`grads` (clipping first, per ``clip_grad``); see :meth:`apply_gradients`."""
    if closure is not None:
      raise TypeError("step(closure=...) is not supported: the loss is recomputed by "
                      "backward(loss_fn, ...), not by a closure.")
    self.apply_gradients()

  def zero_grad(self, set_to_none: bool = True) -> None:
    """Clears :attr:`grads`: ``None``, or zeros like the params with ``set_to_none=False``."""
    self._grads = None if set_to_none else jax.tree.map(jnp.zeros_like, self._params)
    self._grads_scale = None

  def _can_fuse(self) -> bool:
    return (not overrides_iteration(self)
            and not (self._clip is not None and self._clip.error_if_nonfinite))

  def update_params(self, loss_fn: Callable[..., Any], *args: Any,
                    step_kwargs: Optional[dict] = None, zero_kwargs: Optional[dict] = None,
                    has_aux: bool = False, **kwargs: Any) -> Any:
    """One training iteration: :meth:`scale_loss`, :meth:`backward`, and step when due.

    As mmengine: ``self.backward(self.scale_loss(loss_fn), ...)``, then,
    when :meth:`should_update` is true, ``self.step()`` and
    ``self.zero_grad()``, so a subclass (or an instance) overriding any of
    them sees its override called (``has_aux`` is passed on to ``backward``
    only when true, so that an override written for mmengine's
    ``backward(loss)`` works). When none is overridden, the three run as one
    jitted call.

    Args:
      loss_fn: ``loss_fn(params, *args, **kwargs)`` returns a scalar loss
        (or ``(loss, aux)`` with ``has_aux=True``).
      *args: passed to ``loss_fn``.
      step_kwargs: keyword arguments of :meth:`step`.
      zero_kwargs: keyword arguments of :meth:`zero_grad`.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      **kwargs: passed to ``loss_fn``.

    Returns:
      The loss as ``loss_fn`` returned it (before the accumulation factor),
      and the aux output with ``has_aux=True``: device arrays.

    Raises:
      TypeError: ``step_kwargs`` or ``zero_kwargs`` that :meth:`step` or
        :meth:`zero_grad` does not take, before anything changes.
    """
    step_kwargs = {} if step_kwargs is None else dict(step_kwargs)
    zero_kwargs = {} if zero_kwargs is None else dict(zero_kwargs)
    # Refused before anything changes (mmengine raises from step or zero_grad, after backward).
    check_call_kwargs(self.step, step_kwargs, "step_kwargs")
    check_call_kwargs(self.zero_grad, zero_kwargs, "zero_kwargs")
    factor = float(self._counter.loss_factor())
    if self.should_sync() and self._can_fuse() and not step_kwargs:
      dynamic, spec = split_call(loss_fn, args, kwargs, has_aux)
      out, params, state, norm = self._fused_step(
          self._params, self._state, self.grads, dynamic, self._factor(factor), spec)
      self._counter.inner_count += 1
      self._commit_step(params, state, norm)
      self.zero_grad(**zero_kwargs)
      return out
    if has_aux:  # only when set: mmengine calls backward(loss), and overrides take no more
      kwargs = dict(kwargs, has_aux=True)
    out = self.backward(self.scale_loss(loss_fn), *args, **kwargs)
    if self.should_update():
      self.step(**step_kwargs)
      self.zero_grad(**zero_kwargs)
    return out

  @contextlib.contextmanager
  def optim_context(self, model: Any = None):
    """A context for one iteration, as mmengine's.

    Inside it, a ``model`` with a ``no_sync()`` method is kept from
    synchronizing gradients while the window is not complete
    (``should_sync()`` false). Yields a function casting the floating leaves
    of a pytree to the compute dtype: the identity here; the ``dtype`` of
    :class:`AmpOptimWrapper`. JAX has no global autocast: ``backward`` and
    ``update_params`` run the loss in the compute dtype themselves; inside the
    context, user code casts what it computes itself::

      with wrapper.optim_context() as cast:
        logits = model.apply(cast(params), cast(x))
    """
    cast = self._cast_fn()
    if not self.should_sync() and hasattr(model, "no_sync"):
      with model.no_sync():
        yield cast
    else:
      yield cast

  def _cast_fn(self) -> Callable[[Any], Any]:
    return lambda tree: tree

  # -- hyperparameters --------------------------------------------------------------------------

  def _group_specs(self) -> List[pg.GroupSpec]:
    if self._specs is None:
      nodes = hc.inject_nodes(self.opt_state)
      names = trees.param_names(self._params)
      if not nodes:
        self._specs = [pg.GroupSpec(names=names, codecs={})]
      else:
        self._specs = [pg.GroupSpec(names=names if len(nodes) == 1 else None,
                                    codecs=hc.generic_codecs(node.hyperparams)) for node in nodes]
    return self._specs

  def _read_hyperparam(self, index: int, key: str) -> Any:
    return pg.read_hyperparam(self._group_specs()[index], hc.inject_nodes(self.opt_state)[index],
                              key)

  def _write_hyperparams(self, index: int, values: Dict[str, Any]) -> None:
    spec = self._group_specs()[index]
    opt_state = pg.with_values(self.opt_state, index, spec, values, f"param_groups[{index}]")
    self._state = self._with_opt(self._state, opt_state)
    spec.mirror.update(values)

  def _optimizer_groups(self) -> List[pg.ParamGroup]:
    return [pg.ParamGroup(self, i) for i in range(len(self._group_specs()))]

  @property
  def base_param_settings(self) -> Optional[dict]:
    """mmengine's base group: ``None`` with one parameter group, else the defaults.

    With several parameter groups mmengine appends ``{'params': ..., **defaults}``
    to :attr:`param_groups`, so that schedulers scale it like the others and
    ``get_lr()`` reports it as ``'base_lr'``. Its ``'params'`` is ``[]``.
    """
    if self._base_param_settings is _UNSET:
      if len(self._group_specs()) > 1:
        self._base_param_settings = {"params": [], **self.defaults}
      else:
        self._base_param_settings = None
    return self._base_param_settings

  @base_param_settings.setter
  def base_param_settings(self, value: Optional[dict]) -> None:
    self._base_param_settings = value

  @property
  def param_groups(self) -> List[Any]:
    """``optimizer.param_groups``, plus :attr:`base_param_settings` when there are several.

    The groups are live views of the hyperparameters (see :class:`ParamGroup`).
    """
    groups: List[Any] = self._optimizer_groups()
    base = self.base_param_settings
    return groups if base is None else groups + [base]

  @property
  def defaults(self) -> dict:
    """The optimizer's default hyperparameters (PyTorch names), as ``Optimizer.defaults``.

    For a wrapper built by :func:`build_optim_wrapper`: the optimizer config
    with PyTorch's defaults filled in. Otherwise the first group's injected
    hyperparameters when first asked for, or ``{}`` when nothing is injected.
    """
    if self._defaults is None:
      group = self._optimizer_groups()[0]
      self._defaults = {k: group[k] for k in group if k != "params"}
    return dict(self._defaults)

  def _readable_groups(self, what: str) -> List[Any]:
    """The parameter groups, or a clear error when no hyperparameter was injected."""
    if not any(spec.codecs for spec in self._group_specs()):
      raise ValueError(
          f"Cannot read the {what} of this optimizer: its state holds no "
          "optax.inject_hyperparams state. Build it as, e.g., "
          "optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), or with "
          "jaxamp.build_optim_wrapper, to make the hyperparameters readable and settable.")
    return self._optimizer_groups()

  def get_lr(self) -> Dict[str, List[float]]:
    """``{'lr': [learning rate of each parameter group]}`` (Python floats).

    As mmengine, with several parameter groups ``'base_lr'`` holds the
    learning rate of :attr:`base_param_settings` too.

    Raises:
      ValueError: when the optimizer has no injected hyperparameters.
    """
    lrs = []
    for group in self._readable_groups("learning rate"):
      if "lr" not in group:
        raise ValueError(f"A parameter group has no injected learning rate: {dict(group)!r}")
      lrs.append(group["lr"])
    base = self.base_param_settings
    if base is not None:
      return dict(base_lr=[base["lr"]], lr=lrs)
    return dict(lr=lrs)

  def get_momentum(self) -> Dict[str, List[float]]:
    """``{'momentum': [...]}``: SGD/RMSprop momentum, Adam's first beta, else 0 per group.

    Raises:
      ValueError: when the optimizer has no injected hyperparameters.
    """
    momentum = []
    for group in self._readable_groups("momentum"):
      if "momentum" in group:
        momentum.append(group["momentum"])
      elif "betas" in group:
        momentum.append(group["betas"][0])
      else:
        momentum.append(0)
    return dict(momentum=momentum)

  # -- state dict -------------------------------------------------------------------------------

  def _optimizer_state_dict(self) -> dict:
    groups = []
    for group in self._optimizer_groups():
      groups.append({k: group[k] for k in group})
    state = self.opt_state
    if self._donate:
      state = jax.tree.map(jnp.copy, state)
    return {"state": state, "param_groups": groups}

  def state_dict(self) -> dict:
    """``{'state': <optax state of optimizer>, 'param_groups': [...]}``.

    ``state`` holds device arrays (no copy, shardings kept; with
    ``donate=True`` on-device copies, so that the next step, which donates
    the wrapper's buffers, leaves them valid); ``param_groups`` the groups'
    names and hyperparameters as Python values. As mmengine, with several
    parameter groups ``'base_param_settings'`` is added.
    """
    out = self._optimizer_state_dict()
    base = self.base_param_settings
    if base is not None:
      out["base_param_settings"] = dict(base)
    return out

  def _prepare_load(self, state_dict: Any) -> Callable[[], None]:
    """Validates ``state_dict`` fully; returns the function that installs it."""
    if not isinstance(state_dict, Mapping):
      raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    state_dict = dict(state_dict)
    base = state_dict.pop("base_param_settings", None)
    if base is not None and not isinstance(base, Mapping):
      raise TypeError(f"state_dict['base_param_settings'] must be a dict, got "
                      f"{type(base).__name__}")
    commit_optimizer = self._prepare_optimizer_load(state_dict)

    def commit():
      commit_optimizer()
      if base is not None:
        self.base_param_settings = dict(base)

    return commit

  def _prepare_optimizer_load(self, state_dict: Any) -> Callable[[], None]:
    """Validates an ``optimizer.state_dict()``; returns the function that installs it."""
    if not isinstance(state_dict, Mapping):
      raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    expected = {"state", "param_groups"}
    missing = sorted(expected - set(state_dict))
    extra = sorted(set(state_dict) - expected)
    if missing or extra:
      raise ValueError(f"state_dict must have exactly the keys {sorted(expected)}: missing "
                       f"{missing}, unexpected {extra}")
    opt_state = trees.validated_like(state_dict["state"], self.opt_state, "state_dict['state']")
    outside.validate_opt_state(opt_state)
    opt_state, commit_groups = pg.load_groups(state_dict["param_groups"], self._group_specs(),
                                              opt_state)

    def commit():
      self._state = self._with_opt(self._state, opt_state)
      commit_groups()

    return commit

  def load_state_dict(self, state_dict: dict) -> None:
    """Loads a :meth:`state_dict`; validates everything before changing anything.

    :class:`AmpOptimWrapper` also loads ``'loss_scaler'`` (PyTorch's
    GradScaler format) when present; without it the optimizer only.

    Raises:
      ValueError: missing or unexpected keys, another tree structure (a
        different optimizer or parameters), other shapes or dtypes, other
        parameter groups, other scaler keys.
      TypeError: a non-dict, or leaves that are not arrays.
      RuntimeError: an empty ``'loss_scaler'`` (PyTorch's message).
    """
    self._prepare_load(state_dict)()

  def __repr__(self) -> str:
    return (f"Type: {type(self).__name__}\n_accumulative_counts: "
            f"{self._counter.accumulative_counts}\n"
            f"optimizer: \n{self._optimizer!r}\n")



_UNSET = object()


class WrappedOptimizer:
  """``optim_wrapper.optimizer``: the optax transformation with ``torch.optim.Optimizer``'s books.

  mmengine's hooks, parameter schedulers and loops read and write
  ``optim_wrapper.optimizer.param_groups``; here they are live views of the
  hyperparameters in the wrapper's optax state (see
  :class:`~jaxamp._src.facade.mmengine.param_groups.ParamGroup`): writing
  ``param_groups[i]['lr']`` takes effect at the next step, without a
  recompilation. ``state_dict()``/``load_state_dict()`` are the
  optimizer's (without mmengine's ``base_param_settings``);
  :attr:`transformation` is the optax transformation itself.
  """

  def __init__(self, wrapper: OptimWrapper):
    self._wrapper = wrapper

  @property
  def transformation(self) -> optax.GradientTransformation:
    """The optax transformation the wrapper was built with."""
    return self._wrapper._optimizer  # noqa: SLF001

  @property
  def param_groups(self) -> List[pg.ParamGroup]:
    """One live view per parameter group (one per ``inject_hyperparams`` state)."""
    return self._wrapper._optimizer_groups()  # noqa: SLF001

  @property
  def defaults(self) -> dict:
    """The default hyperparameters (PyTorch names), as ``Optimizer.defaults``."""
    return self._wrapper.defaults

  def state_dict(self) -> dict:
    """``{'state': <optax state>, 'param_groups': [...]}``."""
    return self._wrapper._optimizer_state_dict()  # noqa: SLF001

  def load_state_dict(self, state_dict: dict) -> None:
    """Loads a :meth:`state_dict`; validates everything before changing anything."""
    self._wrapper._prepare_optimizer_load(state_dict)()  # noqa: SLF001

  def __repr__(self) -> str:
    return repr(self.transformation)


def install_group_specs(wrapper: OptimWrapper, specs: List[pg.GroupSpec], defaults: dict) -> None:
  """Gives ``wrapper`` the parameter groups :func:`jaxamp.build_optim_wrapper` built.

  ``specs`` holds one :class:`~.param_groups.GroupSpec` per injected state
  of the wrapper's optimizer (names, PyTorch codecs, fixed keys, extras),
  ``defaults`` the optimizer's defaults with PyTorch's names.
  """
  if len(specs) != len(hc.inject_nodes(wrapper.opt_state)):
    raise ValueError("one parameter group per inject_hyperparams state is expected")
  wrapper._specs = specs  # noqa: SLF001 (the wrapper's own module)
  wrapper._defaults = dict(defaults)  # noqa: SLF001


def describe_groups(wrapper: OptimWrapper, groups: Sequence[Tuple[List[str], dict]]) -> None:
  """Names the leaves of each parameter group and adds its extra keys (``lr_mult``...).

  For a wrapper around an injected optax factory, whose hyperparameters keep
  their optax names: ``groups`` holds ``(leaf names, extras)`` per group.
  """
  for spec, (names, extras) in zip(wrapper._group_specs(), groups):  # noqa: SLF001
    spec.names = names
    spec.extras.update(extras)

