"""``jaxamp.GradScaler``: PyTorch's ``torch.amp.GradScaler`` for JAX training loops.

The scaler holds a small pytree of device arrays (:class:`ScalerState`) and
drives it with jitted functions of the functional core
(:meth:`jaxamp._src.loss_scale.ScaleRule.adjust`, :func:`jaxamp._src.numerics.unscale`,
:func:`jaxamp.all_finite`). It steps an *optimizer holder*: ``jaxamp.OptimWrapper``
or any object with the same protocol,

* ``params``, ``opt_state``: the parameters and optax state (read only here);
* ``grads``: the accumulated gradients, readable and settable (``None`` or a
  pytree shaped like ``params``);
* ``backward(loss_fn, *args, has_aux=False, **kwargs)``: adds the gradients
  of ``loss_fn(params, *args, **kwargs)`` into ``grads``. ``loss_fn`` is
  passed to ``jit`` as a pytree, so a pytree callable such as the one
  :meth:`GradScaler.scale` returns does not retrace when only its array leaves
  (the scale) change;
* ``apply_gradients(grads=None, *, skip=None)``: one jitted call that clips (per
  the holder's configuration), runs the optax update and applies it. When
  ``skip`` (a device boolean scalar) is true, ``params`` and ``opt_state`` stay
  bit-identical, without a host sync;
* optionally ``apply_scaled_gradients(scale)``: unscale, check and apply in one
  jitted call, returning ``found_inf``; ``step`` uses it when ``unscale_`` was
  not called (see :func:`fused_step`).

PyTorch's ``scaler.scale(loss).backward()`` is spelled
``opt.backward(scaler.scale(loss_fn), batch)``.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import numbers
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._src import loss_scale
from jaxamp._src import numerics


class ScalerState(NamedTuple):
  """The device state of a scaler facade.

  Attributes:
    scale: float32 scalar, the loss scale.
    growth_tracker: int32, consecutive finite iterations since the scale last
      changed (PyTorch's ``_growth_tracker``, Paddle's ``incr_count``).
    overflow_count: int32, consecutive non-finite iterations not yet acted on
      (Paddle's ``decr_count``; always 0 for PyTorch's rule).
  """

  scale: jax.Array
  growth_tracker: jax.Array
  overflow_count: jax.Array


def make_state(scale: Any, growth_tracker: Any = 0, overflow_count: Any = 0) -> ScalerState:
  """Builds a :class:`ScalerState` with explicit dtypes."""
  return ScalerState(jnp.asarray(scale, jnp.float32), jnp.asarray(growth_tracker, jnp.int32),
                     jnp.asarray(overflow_count, jnp.int32))


class OptState(enum.Enum):
  """Per-optimizer stage within one iteration (PyTorch's names)."""

  READY = 0
  UNSCALED = 1
  STEPPED = 2


@dataclasses.dataclass
class OptimizerRecord:
  """What the scaler knows about one optimizer since the last ``update()``."""

  stage: OptState = OptState.READY
  found_inf: Optional[jax.Array] = None


class MimicError(ValueError, AssertionError):
  """A bad argument, raised where PyTorch/Paddle raise ``AssertionError``.

  Catchable both as ``ValueError`` (the usual Python type for a bad value) and
  as ``AssertionError`` (what the original raises), with the original's message.
  """


class NewScaleError(TypeError, AttributeError, AssertionError):
  """A ``new_scale`` of a type :meth:`GradScaler.update` does not accept.

  PyTorch fails on such a value with ``AssertionError`` (a tensor of the wrong
  size) or ``AttributeError`` (not a tensor); this is both, and a ``TypeError``.
  """


_NEW_SCALE_REASON = ("new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                     "torch.FloatTensor with requires_grad=False.")


# ---------------------------------------------------------------------------------------------
# Jitted building blocks, shared with the Paddle facade.


@jax.jit
def _unscale_and_check(grads: Any, scale: jax.Array) -> tuple[Any, jax.Array]:
  unscaled = numerics.unscale(grads, scale)
  return unscaled, jnp.logical_not(numerics.all_finite(unscaled))


_unscale_and_check_donated = jax.jit(_unscale_and_check.__wrapped__, donate_argnums=(0,))


def unscale_and_check(grads: Any, scale: jax.Array, *,
                      donate: bool = False) -> tuple[Any, jax.Array]:
  """Returns ``(grads / scale, found_inf)`` from one jitted call (no host sync).

  ``found_inf`` is checked on the unscaled gradients: an inf or nan stays
  one, and a finite value that the division overflows (possible only with a
  scale below 1) is caught too, where PyTorch would step on it. With
  ``donate=True`` the buffers of ``grads`` are donated (unscaled in place;
  ``grads`` is deleted).
  """
  if donate:
    return _unscale_and_check_donated(grads, scale)
  return _unscale_and_check(grads, scale)


def fused_step(optimizer: Any, scale: jax.Array, *, allow_float16: bool) -> Optional[jax.Array]:
  """Unscales, checks and applies ``optimizer.grads`` in one call, where the holder can.

  A holder with ``apply_scaled_gradients(scale)`` (``jaxamp.OptimWrapper``)
  does it in one jitted call.

  Returns:
    ``found_inf``, or ``None`` when the caller must unscale and apply in two
    calls (no such method, or no gradients).

  Raises:
    ValueError: ``"Attempting to unscale FP16 gradients."`` for float16
      gradients unless ``allow_float16``.
  """
  apply_scaled = getattr(optimizer, "apply_scaled_gradients", None)
  if apply_scaled is None:
    return None
  grads = optimizer.grads
  if grads is None or not jax.tree.leaves(grads):
    return None
  if not allow_float16 and has_float16_leaf(grads):
    raise ValueError("Attempting to unscale FP16 gradients.")
  return apply_scaled(scale)


def holder_donates(optimizer: Any) -> bool:
  """Whether ``optimizer`` owns its buffers and donates them (``donate=True``).

  Its gradients are then unscaled in place: the scaled ones, which only the
  holder references, are donated to the unscaled result.
  """
  return getattr(optimizer, "donate", False) is True


@functools.lru_cache(maxsize=64)
def update_fn(rule: loss_scale.ScaleRule) -> Callable[[ScalerState, Sequence[jax.Array]],
                                                      tuple[ScalerState, jax.Array]]:
  """The jitted scale update for one (static, hashable) rule, built once per rule.

  The returned function maps ``(state, found_infs)`` (a tuple of boolean
  scalars, one per optimizer checked this iteration) to ``(new_state,
  found_inf)``, where ``found_inf`` is their OR.
  """

  @jax.jit
  def update(state: ScalerState, found_infs: Sequence[jax.Array]) -> tuple[ScalerState, jax.Array]:
    found = jnp.stack([jnp.asarray(f, jnp.bool_) for f in found_infs]).any()
    scale, tracker, overflow = rule.adjust(state.scale, state.growth_tracker,
                                           state.overflow_count, found)
    return ScalerState(scale, tracker, overflow), found

  return update


def times_scale(x: Any, scale: jax.Array) -> jax.Array:
  """``x * scale``, computed in float32 at least (half-precision inputs are promoted)."""
  x = jnp.asarray(x)
  wide = jnp.issubdtype(x.dtype, jnp.inexact) and jnp.finfo(x.dtype).bits >= 32
  dtype = x.dtype if wide else jnp.dtype(jnp.float32)
  return x.astype(dtype) * scale.astype(dtype)


def is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def has_float16_leaf(tree: Any) -> bool:
  return any(jnp.result_type(leaf) == jnp.float16 for leaf in jax.tree.leaves(tree))


class ScaledLoss:
  """A loss function whose output is multiplied by a scaler's current scale.

  Returned by ``scaler.scale(loss_fn)``. It is a pytree: its only child is
  the scale (a float32 scalar, read from the scaler when the pytree is
  flattened), its static part is ``(fn, scaler, has_aux)``. Passed to a jitted
  function, it therefore brings the current scale in as a traced argument and
  compares equal across iterations: a loop compiles once.

  Called outside a trace it reads the scaler's scale at call time. With
  ``has_aux=True`` the function returns ``(loss, aux)`` and only ``loss`` is
  scaled. Losses in float16/bfloat16 are promoted to float32 first.
  """

  __slots__ = ("fn", "scaler", "has_aux", "_scale")

  def __init__(self, fn: Callable[..., Any], scaler: Any, has_aux: bool = False,
               scale: Optional[jax.Array] = None):
    self.fn = fn
    self.scaler = scaler
    self.has_aux = has_aux
    self._scale = scale

  @property
  def scale(self) -> jax.Array:
    """The scale this function multiplies by (the scaler's, unless unflattened)."""
    return self.scaler._scale_array() if self._scale is None else self._scale

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    out = self.fn(*args, **kwargs)
    scale = self.scale
    if self.has_aux:
      loss, aux = out
      return times_scale(loss, scale), aux
    return times_scale(out, scale)

  def __eq__(self, other: Any) -> bool:
    return (type(other) is ScaledLoss and self.fn == other.fn and self.scaler is other.scaler
            and self.has_aux == other.has_aux)

  def __hash__(self) -> int:
    return hash((self.fn, id(self.scaler), self.has_aux))

  def __repr__(self) -> str:
    return f"ScaledLoss({self.fn!r}, has_aux={self.has_aux})"


def _flatten_scaled_loss(f: ScaledLoss):
  return (f.scale,), (f.fn, f.scaler, f.has_aux)


def _unflatten_scaled_loss(aux, children) -> ScaledLoss:
  fn, scaler, has_aux = aux
  return ScaledLoss(fn, scaler, has_aux, children[0])


jax.tree_util.register_pytree_node(ScaledLoss, _flatten_scaled_loss, _unflatten_scaled_loss)


def as_float(name: str, value: Any) -> float:
  """A Python float from a real number or a one-element array (host value)."""
  if is_array(value) and np.size(value) == 1:
    value = np.asarray(value).reshape(()).item()
  return loss_scale._check_number(name, value)


def as_count(name: str, value: Any) -> int:
  """A non-negative Python int from an int or a one-element integer array."""
  if is_array(value) and np.size(value) == 1:
    value = np.asarray(value).reshape(()).item()
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
  if value < 0:
    raise ValueError(f"{name} must be an int >= 0, got {value!r}")
  return int(value)


def check_factor_types(**values: Any) -> None:
  for name, value in values.items():
    loss_scale._check_number(name, value)


# ---------------------------------------------------------------------------------------------


_NOT_SCALED_FIX = ("This may indicate your script did not use scaler.scale(loss or outputs) "
                   "earlier in the iteration.")


class GradScaler:
  """Dynamic loss scaling with PyTorch's ``torch.amp.GradScaler`` API and behaviour.

  ``scale`` multiplies the loss, ``step(opt)`` unscales the gradients of an
  optimizer holder and applies them unless one is inf/nan, ``update()``
  adjusts the scale::

    scaler = jaxamp.GradScaler()
    for batch in data:
      opt.zero_grad()
      opt.backward(scaler.scale(loss_fn), batch)  # scaler.scale(loss).backward()
      scaler.step(opt)                            # skipped on inf/nan, no host sync
      scaler.update()

  ``opt`` is a :class:`jaxamp.OptimWrapper` or any object with its protocol:
  ``params``, ``opt_state``, settable ``grads``, ``backward(loss_fn, *args,
  has_aux=False, **kwargs)`` (adds the gradients of ``loss_fn(params, *args)``
  into ``grads``, taking ``loss_fn`` as a jit pytree argument) and
  ``apply_gradients(grads=None, *, skip=None)`` (one jitted clip + optax
  update + apply, leaving everything bit-identical when the device boolean
  ``skip`` is true). A holder that also has ``apply_scaled_gradients(scale)``
  (unscale, check and apply in one call, returning ``found_inf``), as
  :class:`jaxamp.OptimWrapper` has, is stepped with it when :meth:`unscale_`
  was not called: the unscaled gradients are then never written out, and
  ``opt.grads`` reads them unscaled afterwards, as PyTorch's ``.grad``.

  The update rule is PyTorch's, with the scale arithmetic done as PyTorch
  does it (in float64, rounded to float32)::

    found_inf = OR over the optimizers checked this iteration
    if found_inf:
      scale = scale * backoff_factor; growth_tracker = 0
    else:
      growth_tracker += 1
      if growth_tracker == growth_interval:
        if scale * growth_factor is finite: scale = scale * growth_factor
        growth_tracker = 0

  Per optimizer (keyed by identity, as PyTorch does) the scaler moves through
  READY -> UNSCALED (``unscale_``) -> STEPPED (``step``); ``update()`` resets
  every optimizer to READY. Misuse raises PyTorch's exceptions with its
  messages: ``unscale_`` twice or after ``step``, ``step`` twice, ``step``
  with ``closure=``, ``update()`` with nothing checked, ``unscale_``/``step``/
  ``update`` before the first ``scale`` (the state is created by the first
  ``scale`` call, as in PyTorch), float16 gradients, an empty state dict.

  Differences from PyTorch:

  * ``step`` always returns ``None``: finding out whether it skipped would
    need a host sync (PyTorch's optimizers also return ``None`` without a
    closure). Read ``get_scale()`` or the holder's own state to log skips.
  * The scale never falls below :data:`jaxamp.DEFAULT_MIN_SCALE` (the
    smallest normal float32, far below any scale a real run reaches), where
    PyTorch's slides to 0.0 and corrupts every later step.
  * Overflow is checked on the unscaled gradients, so a finite gradient
    that the division by a scale below 1 turns into inf skips the step.
  * A tracker above ``growth_interval`` (after ``set_growth_interval`` or a
    loaded state) grows at the next finite step; PyTorch's equality test
    never grows again.
  * The setters validate their value (PyTorch's do not) and build a new
    static rule, so the first ``update()`` after a setter compiles the update
    function once more (cached per rule: returning to earlier values costs
    nothing).
  * ``scale`` promotes float16/bfloat16 losses to float32 before scaling
    (65536 is not a finite float16). Scaling an array inside your own jitted
    function would freeze the scale at trace time: pass the loss function
    instead (``scaler.scale(loss_fn)``), whose scale is a traced argument.
  * ``device`` is accepted for signature compatibility; the state lives on
    JAX's default device and ``'cuda'`` does not disable the scaler.

  Args:
    device: a device-type string, accepted and ignored (see above).
    init_scale: the initial scale, positive and finite.
    growth_factor: multiplier after ``growth_interval`` finite iterations; > 1.
    backoff_factor: multiplier after an iteration with inf/nan; in (0, 1).
    growth_interval: consecutive finite iterations before growing; >= 1.
    enabled: ``False`` makes ``scale`` the identity, ``step`` an
      unconditional ``apply_gradients()``, the other methods no-ops,
      ``get_scale()`` 1.0 and ``state_dict()`` ``{}``.

  Raises:
    ValueError: also an ``AssertionError``, with PyTorch's messages, for
      ``growth_factor <= 1`` or ``backoff_factor >= 1``; a plain ``ValueError``
      for other out-of-range values.
    TypeError: for arguments of the wrong type.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> opt = jaxamp.OptimWrapper(optax.sgd(0.5), {'w': jnp.ones(2)})
    >>> scaler = jaxamp.GradScaler(init_scale=8.0, growth_interval=1)
    >>> loss_fn = lambda params, x: jnp.sum(params['w'] * x)
    >>> for x in (jnp.array([1.0, 2.0]), jnp.array([jnp.inf, 1.0])):  # the second overflows
    ...   opt.zero_grad()
    ...   loss = opt.backward(scaler.scale(loss_fn), x)  # scaled gradients
    ...   scaler.step(opt)                               # unscaled, applied or skipped
    ...   scaler.update()
    >>> opt.params['w'], scaler.get_scale()
    (Array([0.5, 0. ], dtype=float32), 8.0)
    >>> scaler.state_dict()
    {'scale': 8.0, 'growth_factor': 2.0, 'backoff_factor': 0.5, 'growth_interval': 1, '_growth_tracker': 0}
    >>> scaler.scale(jnp.float32(0.5))
    Array(4., dtype=float32)
  """

  def __init__(self, device: str = "cpu", init_scale: float = 2.0**16,
               growth_factor: float = 2.0, backoff_factor: float = 0.5,
               growth_interval: int = 2000, enabled: bool = True) -> None:
    if not isinstance(device, str):
      raise TypeError(f"device must be a device-type string such as 'cpu' or 'cuda', "
                      f"got {device!r}")
    if not isinstance(enabled, (bool, np.bool_)):
      raise TypeError(f"enabled must be a bool, got {enabled!r}")
    self._device = device
    self._enabled = bool(enabled)
    self._init_scale = float(init_scale) if isinstance(init_scale, numbers.Real) else init_scale
    self._growth_factor = growth_factor
    self._backoff_factor = backoff_factor
    self._growth_interval = growth_interval
    self._init_growth_tracker = 0
    self._state: Optional[ScalerState] = None
    self._per_optimizer_states: collections.defaultdict[int, OptimizerRecord] = (
        collections.defaultdict(OptimizerRecord))
    if self._enabled:
      check_factor_types(growth_factor=growth_factor, backoff_factor=backoff_factor)
      if growth_factor <= 1.0:
        raise MimicError("The growth factor must be > 1.0.")
      if backoff_factor >= 1.0:
        raise MimicError("The backoff factor must be < 1.0.")
      self._rule = self._make_rule(growth_factor, backoff_factor, growth_interval)
      self._init_scale = loss_scale.check_scale("init_scale", init_scale, self._rule.min_scale,
                                                self._rule.max_scale)

  @staticmethod
  def _make_rule(growth_factor: Any, backoff_factor: Any, growth_interval: Any
                 ) -> loss_scale.ScaleRule:
    return loss_scale.make_rule(growth_factor=growth_factor, backoff_factor=backoff_factor,
                                growth_interval=growth_interval)

  def __repr__(self) -> str:
    if not self._enabled:
      return "GradScaler(enabled=False)"
    return (f"GradScaler(growth_factor={self._growth_factor!r}, "
            f"backoff_factor={self._backoff_factor!r}, "
            f"growth_interval={self._growth_interval!r})")

  # -- state ------------------------------------------------------------------------------------

  def _lazy_init_scale_growth_tracker(self) -> ScalerState:
    if self._state is None:
      self._state = make_state(self._init_scale, self._init_growth_tracker)
    return self._state

  def _check_scale_growth_tracker(self, funcname: str) -> ScalerState:
    if self._state is None:
      raise AssertionError(f"Attempted {funcname} but _scale is None.  " + _NOT_SCALED_FIX)
    return self._state

  def _scale_array(self) -> jax.Array:
    """The current scale as a device scalar (creating the state if needed)."""
    return self._lazy_init_scale_growth_tracker().scale

  @property
  def state(self) -> Optional[ScalerState]:
    """The device state (``None`` before the first :meth:`scale`, or when disabled)."""
    return self._state

  # -- scaling ----------------------------------------------------------------------------------

  def scale(self, outputs: Any, *, has_aux: bool = False) -> Any:
    """Multiplies an array (or arrays, or a loss function's output) by the scale.

    Args:
      outputs: an array: returns ``outputs * scale`` (float32 at least); a
        (nested) list or tuple of arrays: the same structure, each scaled;
        another iterable: a lazy iterator over the scaled items (as
        PyTorch); a callable ``loss_fn``: a :class:`ScaledLoss`, the same
        function with its output multiplied by the scale current when it is
        called (or flattened into a jitted call), so that
        ``opt.backward(scaler.scale(loss_fn), batch)`` computes scaled
        gradients and a training loop compiles once.
      has_aux: for a callable returning ``(loss, aux)``: scale only ``loss``.

    Returns:
      The scaled outputs; ``outputs`` itself when the scaler is disabled.

    Raises:
      ValueError: ``"outputs must be a Tensor or an iterable of Tensors"`` for
        anything else (e.g. a Python float).
    """
    if not self._enabled:
      return outputs
    if is_array(outputs):
      return times_scale(outputs, self._scale_array())
    if callable(outputs) and not isinstance(outputs, (list, tuple)):
      self._lazy_init_scale_growth_tracker()
      return ScaledLoss(outputs, self, bool(has_aux))

    def apply_scale(val: Any) -> Any:
      if is_array(val):
        return times_scale(val, self._scale_array())
      if isinstance(val, (list, tuple)):
        items = [apply_scale(v) for v in val]
        if isinstance(val, tuple) and hasattr(val, "_fields"):
          return type(val)(*items)
        return type(val)(items)
      if hasattr(val, "__iter__") and not isinstance(val, (str, bytes)):
        return map(apply_scale, val)
      raise ValueError("outputs must be a Tensor or an iterable of Tensors")

    return apply_scale(outputs)

  # -- unscale / step / update ------------------------------------------------------------------

  def unscale_(self, optimizer: Any) -> None:
    """Divides ``optimizer.grads`` by the scale and records whether any is inf/nan.

    Call it between ``backward`` and ``step`` when the gradients must be
    read or changed unscaled (clipping, logging); ``step`` calls it
    otherwise. One jitted call, no host sync. ``optimizer.grads`` is
    replaced by the unscaled gradients (PyTorch unscales in place); with no
    gradients (``None``), nothing is checked, and ``step`` then raises as
    PyTorch does.

    Raises:
      RuntimeError: when called twice for ``optimizer`` since the last
        ``update()``, or after ``step(optimizer)`` (PyTorch's messages).
      ValueError: ``"Attempting to unscale FP16 gradients."`` for float16
        gradients (keep float32 master parameters, see :class:`jaxamp.Policy`).
      AssertionError: before the first :meth:`scale`.
    """
    if not self._enabled:
      return
    state = self._check_scale_growth_tracker("unscale_")
    record = self._per_optimizer_states[id(optimizer)]
    if record.stage is OptState.UNSCALED:
      raise RuntimeError(
          "unscale_() has already been called on this optimizer since the last update().")
    if record.stage is OptState.STEPPED:
      raise RuntimeError("unscale_() is being called after step().")
    grads = optimizer.grads
    if grads is not None and jax.tree.leaves(grads):
      if has_float16_leaf(grads):
        raise ValueError("Attempting to unscale FP16 gradients.")
      unscaled, found_inf = unscale_and_check(grads, state.scale,
                                              donate=holder_donates(optimizer))
      optimizer.grads = unscaled
      record.found_inf = found_inf
    record.stage = OptState.UNSCALED

  def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
    """Unscales (unless :meth:`unscale_` did) and applies the gradients unless one is inf/nan.

    Calls ``optimizer.apply_gradients(*args, skip=found_inf, **kwargs)``: the
    decision to skip stays on the device, so nothing waits for the step.
    Extra arguments are forwarded to ``apply_gradients``.

    Returns:
      ``None``, always (see the class notes).

    Raises:
      RuntimeError: for ``closure=`` or a second ``step`` since ``update()``.
      AssertionError: when ``optimizer`` has no gradients to check, or before
        the first :meth:`scale`.
    """
    if not self._enabled:
      optimizer.apply_gradients(*args, **kwargs)
      return None
    if "closure" in kwargs:
      raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
    state = self._check_scale_growth_tracker("step")
    record = self._per_optimizer_states[id(optimizer)]
    if record.stage is OptState.STEPPED:
      raise RuntimeError("step() has already been called since the last update().")
    if record.stage is OptState.READY and not args and not kwargs:
      found_inf = fused_step(optimizer, state.scale, allow_float16=False)
      if found_inf is not None:
        record.found_inf, record.stage = found_inf, OptState.STEPPED
        return None
    if record.stage is OptState.READY:
      self.unscale_(optimizer)
    if record.found_inf is None:
      raise AssertionError("No inf checks were recorded for this optimizer.")
    optimizer.apply_gradients(*args, skip=record.found_inf, **kwargs)
    record.stage = OptState.STEPPED
    return None

  def update(self, new_scale: Any = None) -> None:
    """Adjusts the scale for the next iteration (or sets it) and resets every optimizer's stage.

    Without ``new_scale``: backs off once if any optimizer checked since the
    last update found inf/nan (each optimizer skipped on its own finding),
    grows after ``growth_interval`` consecutive finite iterations. One jitted
    call, no host sync.

    Args:
      new_scale: a float or a one-element array: the new scale; the growth
        tracker is left as it is. A float must be positive and finite; an
        array is used as it is (checking it would need a host sync).

    Raises:
      AssertionError: ``"No inf checks were recorded prior to update."`` when
        no optimizer was unscaled or stepped, or before the first
        :meth:`scale`.
      TypeError: (also ``AttributeError``/``AssertionError``, PyTorch's types)
        for a ``new_scale`` that is neither a float nor a one-element array
        (an ``int`` included, as PyTorch).
    """
    if not self._enabled:
      return
    state = self._check_scale_growth_tracker("update")
    if new_scale is not None:
      if is_array(new_scale):
        if np.size(new_scale) != 1:
          raise NewScaleError(_NEW_SCALE_REASON)
        value = jnp.asarray(new_scale).reshape(()).astype(jnp.float32)
      elif isinstance(new_scale, float):
        value = jnp.asarray(loss_scale.check_scale("new_scale", new_scale), jnp.float32)
      else:
        raise NewScaleError(_NEW_SCALE_REASON + f" Got {new_scale!r} of type "
                            f"{type(new_scale).__name__}.")
      self._state = state._replace(scale=value)
    else:
      found_infs = tuple(r.found_inf for r in self._per_optimizer_states.values()
                         if r.found_inf is not None)
      if not found_infs:
        raise AssertionError("No inf checks were recorded prior to update.")
      self._state, _ = update_fn(self._rule)(state, found_infs)
    self._per_optimizer_states = collections.defaultdict(OptimizerRecord)

  # -- getters and setters ----------------------------------------------------------------------

  def get_scale(self) -> float:
    """The current scale as a Python float (a host sync), 1.0 when disabled."""
    if not self._enabled:
      return 1.0
    if self._state is None:
      return float(self._init_scale)
    return float(self._state.scale)

  def _get_growth_tracker(self) -> int:
    if not self._enabled:
      return 0
    if self._state is None:
      return int(self._init_growth_tracker)
    return int(self._state.growth_tracker)

  def get_growth_factor(self) -> float:
    """The growth factor."""
    return self._growth_factor

  def set_growth_factor(self, new_factor: float) -> None:
    """Sets the growth factor (> 1); the next ``update()`` compiles once for the new rule."""
    if self._enabled:
      self._rule = self._make_rule(new_factor, self._backoff_factor, self._growth_interval)
    self._growth_factor = new_factor

  def get_backoff_factor(self) -> float:
    """The backoff factor."""
    return self._backoff_factor

  def set_backoff_factor(self, new_factor: float) -> None:
    """Sets the backoff factor (in (0, 1)); the next ``update()`` compiles once for the new rule."""
    if self._enabled:
      self._rule = self._make_rule(self._growth_factor, new_factor, self._growth_interval)
    self._backoff_factor = new_factor

  def get_growth_interval(self) -> int:
    """The growth interval."""
    return self._growth_interval

  def set_growth_interval(self, new_interval: int) -> None:
    """Sets the growth interval (>= 1); the next ``update()`` compiles once for the new rule."""
    if self._enabled:
      self._rule = self._make_rule(self._growth_factor, self._backoff_factor, new_interval)
    self._growth_interval = new_interval

  def is_enabled(self) -> bool:
    """Whether this scaler scales."""
    return self._enabled

  # -- checkpoints ------------------------------------------------------------------------------

  def state_dict(self) -> dict[str, Any]:
    """The scaler's state in PyTorch's format (``{}`` when disabled).

    Keys and Python types: ``scale`` (float), ``growth_factor`` (float),
    ``backoff_factor`` (float), ``growth_interval`` (int), ``_growth_tracker``
    (int). Reading the scale and tracker is a host sync: call it after
    ``update()``, when checkpointing.
    """
    if not self._enabled:
      return {}
    return {
        "scale": self.get_scale(),
        "growth_factor": float(self._growth_factor),
        "backoff_factor": float(self._backoff_factor),
        "growth_interval": int(self._growth_interval),
        "_growth_tracker": self._get_growth_tracker(),
    }

  def load_state_dict(self, state_dict: dict[str, Any]) -> None:
    """Loads a state dict of this class or of ``torch.amp.GradScaler`` (no-op when disabled).

    Loaded before the first :meth:`scale`, it takes effect from the first
    iteration. A dict saved by PyTorch continues the same trajectory.

    Raises:
      RuntimeError: for an empty dict (saved by a disabled scaler).
      KeyError: for a missing key.
      ValueError, TypeError: for values this scaler cannot use.
    """
    if not self._enabled:
      return
    if len(state_dict) == 0:
      raise RuntimeError("The source state dict is empty, possibly because it was saved "
                         "from a disabled instance of GradScaler.")
    growth_factor = state_dict["growth_factor"]
    backoff_factor = state_dict["backoff_factor"]
    growth_interval = state_dict["growth_interval"]
    rule = self._make_rule(growth_factor, backoff_factor, growth_interval)
    scale = loss_scale.check_scale("scale", as_float("scale", state_dict["scale"]))
    tracker = as_count("_growth_tracker", state_dict["_growth_tracker"])
    self._rule = rule
    self._growth_factor = float(growth_factor)
    self._backoff_factor = float(backoff_factor)
    self._growth_interval = int(growth_interval)
    self._init_scale = scale
    self._init_growth_tracker = tracker
    if self._state is not None:
      self._state = make_state(scale, tracker, self._state.overflow_count)
