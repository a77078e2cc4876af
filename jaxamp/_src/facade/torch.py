"""``jaxamp.GradScaler``: PyTorch's ``torch.amp.GradScaler``; ``clip_grad_norm_`` on a holder.

It steps optimizer holders (:mod:`.holder`) and shares its state (:mod:`.scaler_state`) and the
stages of each optimizer (:mod:`.stages`) with the Paddle facade.
"""

from __future__ import annotations

import contextlib
import numbers
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._src import clipping
from jaxamp._src import state as state_lib
from jaxamp._src import loss_scale
from jaxamp._src import outside
from jaxamp._src import validation
from jaxamp._src.facade import holder
from jaxamp._src.facade import scaler_state
from jaxamp._src.facade.stages import OptState, StageBook
from jaxamp._src.facade import stall
from jaxamp._src.facade.errors import AssertionValueError
from jaxamp._src.facade.errors import NewScaleError
from jaxamp._src.facade.scaled_loss import ScaledLoss, ScalesInUse

_NEW_SCALE_REASON = ("new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                     "torch.FloatTensor with requires_grad=False.")

_STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")

_NOT_SCALED_FIX = ("This may indicate your script did not use scaler.scale(loss or outputs) "
                   "earlier in the iteration.")
_FROZEN_FIX = (
    "GradScaler.{what} was called while JAX traces a function: its scale would be frozen into "
    "the compiled code at its current value. Call it from a loss function that the scaler "
    "scales, opt.backward(scaler.scale(loss_fn), ...): inside loss_fn, scaler.scale(x) and "
    "scaler.get_scale() use the scale passed into the traced call. In your own jitted "
    "function, pass scaler.state.scale in as an argument and multiply by it.")


def _tracing() -> bool:
  """Whether JAX is tracing a function to compile it (a new array is then a tracer)."""
  return isinstance(jnp.zeros(()), jax.core.Tracer)


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

  ``opt`` is a :class:`jaxamp.OptimWrapper` or any object with its
  optimizer-holder protocol (``params``, ``opt_state``, settable ``grads``,
  ``backward``, ``apply_gradients(grads=None, *, skip=None)``; see
  :mod:`jaxamp._src.facade.holder`). When :meth:`unscale_` was not called,
  a holder with ``apply_scaled_gradients`` unscales, checks and applies in
  one call; ``opt.grads`` reads the gradients unscaled afterwards, as
  PyTorch's ``.grad``.

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

  What differs from PyTorch, and why, is listed in the porting guide
  (``docs/porting.md``, "From PyTorch"): ``step`` returns ``None`` (no host
  sync), the scale has a floor and is checked on the unscaled gradients, the
  setters validate. A run whose gradients stay inf or nan at every scale is
  reported: after ``stall_after`` consecutive skipped iterations (or a skip at
  the smallest scale) :meth:`update` warns with :class:`jaxamp.StallWarning`,
  naming the gradient leaves that held inf or nan, looking every
  ``stall_check_every`` updates (one host sync per that many iterations);
  ``on_stall='raise'`` raises :class:`jaxamp.StalledError` instead,
  ``'ignore'`` stays silent. PyTorch skips silently, forever.

  Args:
    device: a device-type string, accepted and ignored (see above).
    init_scale: the initial scale, positive and finite.
    growth_factor: multiplier after ``growth_interval`` finite iterations; > 1.
    backoff_factor: multiplier after an iteration with inf/nan; in (0, 1).
    growth_interval: consecutive finite iterations before growing; >= 1.
    enabled: ``False`` makes ``scale`` the identity, ``step`` an
      unconditional ``apply_gradients()``, the other methods no-ops,
      ``get_scale()`` 1.0 and ``state_dict()`` ``{}``.
    on_stall: ``'warn'``, ``'raise'`` or ``'ignore'``: what :meth:`update`
      does when the run is stalled (see above).
    stall_after: consecutive skipped iterations that make a stall; >= 1.
    stall_check_every: how often, in updates, the stall flag is read; >= 1.

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
               growth_interval: int = 2000, enabled: bool = True, *, on_stall: str = "warn",
               stall_after: int = loss_scale.DEFAULT_STALL_AFTER,
               stall_check_every: int = 10) -> None:
    if not isinstance(device, str):
      raise TypeError(f"device must be a device-type string such as 'cpu' or 'cuda', "
                      f"got {device!r}")
    self._device = device
    self._enabled = validation.check_bool("enabled", enabled)
    self._init_scale = float(init_scale) if isinstance(init_scale, numbers.Real) else init_scale
    self._growth_factor = growth_factor
    self._backoff_factor = backoff_factor
    self._growth_interval = growth_interval
    self._init_growth_tracker = 0
    self._state: Optional[state_lib.LossScaleState] = None
    self._stages = StageBook()
    self._scales_in_use = ScalesInUse()
    self._stall_after = validation.check_count("stall_after", stall_after)
    self._monitor = stall.StallMonitor(on_stall, stall_check_every)
    if self._enabled:
      growth, backoff = scaler_state.check_factors(growth_factor=growth_factor,
                                                   backoff_factor=backoff_factor)
      if growth <= 1.0:
        raise AssertionValueError("The growth factor must be > 1.0.")
      if backoff >= 1.0:
        raise AssertionValueError("The backoff factor must be < 1.0.")
      self._rule = self._make_rule(growth_factor, backoff_factor, growth_interval)
      self._init_scale = validation.check_scale("init_scale", init_scale, self._rule.min_scale,
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

  def _lazy_init_scale_growth_tracker(self) -> state_lib.LossScaleState:
    if self._state is None:
      self._state = loss_scale.initial_state(self._init_scale, self._init_growth_tracker)
    return self._state

  def _check_scale_growth_tracker(self, funcname: str) -> state_lib.LossScaleState:
    if self._state is None:
      raise AssertionError(f"Attempted {funcname} but _scale is None.  " + _NOT_SCALED_FIX)
    return self._state

  def _scale_array(self) -> jax.Array:
    """The scale a loss scaled now is multiplied by: a scaled loss call's, else the state's."""
    return self._scales_in_use.current_or(lambda: self._lazy_init_scale_growth_tracker().scale)

  def using_scale(self, scale: jax.Array) -> contextlib.AbstractContextManager:
    """Inside, :meth:`scale` and :meth:`get_scale` use ``scale`` (a :class:`ScaledLoss` call's)."""
    return self._scales_in_use.using(scale)

  def _current_scale(self, what: str) -> jax.Array:
    """The scale in use, or the state's (refused while tracing: it would be frozen)."""
    if self._scales_in_use.current() is None and _tracing():
      raise RuntimeError(_FROZEN_FIX.format(what=what))
    return self._scale_array()

  @property
  def state(self) -> Optional[state_lib.LossScaleState]:
    """The device state; ``None`` when disabled.

    Created by the first access (or the first :meth:`scale`), so that the
    scale can be passed into a jitted function from the first iteration on.
    """
    if not self._enabled:
      return None
    return self._lazy_init_scale_growth_tracker()

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
        gradients and a training loop compiles once. Inside a loss function
        this scaler scales, both forms (and :meth:`get_scale`) use the scale
        that call multiplies by, traced in a compiled backward pass: PyTorch's
        gradient-penalty recipe may write ``jax.grad(scaler.scale(loss_fn))``
        or ``scaler.scale(loss)`` alike.
      has_aux: for a callable returning ``(loss, aux)``: scale only ``loss``.

    Returns:
      The scaled outputs; ``outputs`` itself when the scaler is disabled.

    Raises:
      ValueError: ``"outputs must be a Tensor or an iterable of Tensors"`` for
        anything else (e.g. a Python float).
    """
    if not self._enabled:
      return outputs
    if callable(outputs) and not isinstance(outputs, (list, tuple)) and not validation.is_array(outputs):
      self._lazy_init_scale_growth_tracker()
      # Inside a scaled loss being traced, the new function multiplies by that loss's (traced)
      # scale, not by the state's, which the compiled code would freeze.
      in_use = self._scales_in_use.current()
      return ScaledLoss(outputs, self, bool(has_aux), in_use)
    scale = self._current_scale("scale")
    if validation.is_array(outputs):
      return state_lib.multiply_by_scale(outputs, scale)

    def apply_scale(val: Any) -> Any:
      if validation.is_array(val):
        return state_lib.multiply_by_scale(val, scale)
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
    record = self._stages.check_unscale(optimizer)
    found_inf = holder.unscale_grads(optimizer, state.scale, allow_float16=False)
    if found_inf is not None:
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
    record = self._stages.check_step(optimizer)
    if record.stage is OptState.READY and not args and not kwargs:
      found_inf = holder.fused_step(optimizer, state.scale, allow_float16=False)
      if found_inf is not None:
        record.found_inf, record.stage = found_inf, OptState.STEPPED
        return None
    if record.stage is OptState.READY:
      if not holder.holds_grads(optimizer):
        # Refused before anything is recorded: the optimizer stays READY, so the next
        # iteration works (PyTorch leaves it UNSCALED, and every later step raises).
        raise AssertionError("No inf checks were recorded for this optimizer.")
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
      new_scale: a float or a one-element array: the new scale; the
        growth tracker is left as it is. It must be finite and within
        ``[min_scale, max_scale]`` (an array is read on the host to check it:
        one sync, on a call that is rare).

    Raises:
      AssertionError: ``"No inf checks were recorded prior to update."`` when
        no optimizer was unscaled or stepped, or before the first
        :meth:`scale`.
      TypeError: (also ``AttributeError``/``AssertionError``, PyTorch's types)
        for a ``new_scale`` that is neither a float nor a one-element array
        (an ``int`` included, as PyTorch).
      ValueError: a nan, infinite, zero, negative ``new_scale``, or one
        outside ``[min_scale, max_scale]`` (PyTorch accepts it; a nan scale
        skips every later step). Nothing changes then.
    """
    if not self._enabled:
      return
    state = self._check_scale_growth_tracker("update")
    if new_scale is not None:
      if validation.is_array(new_scale) and np.size(new_scale) != 1:
        raise NewScaleError(_NEW_SCALE_REASON)
      if not (validation.is_array(new_scale) or isinstance(new_scale, float)):
        raise NewScaleError(_NEW_SCALE_REASON + f" Got {new_scale!r} of type "
                            f"{type(new_scale).__name__}.")
      value = outside.scale("new_scale", new_scale, self._rule.min_scale, self._rule.max_scale)
      self._state = state._replace(scale=jnp.asarray(value, jnp.float32))
    else:
      found_infs = self._stages.found_infs()
      if not found_infs:
        raise AssertionError("No inf checks were recorded prior to update.")
      self._state, _ = scaler_state.update_fn(self._rule, self._stall_after)(state, found_infs)
      optimizers = self._stages.optimizers()
      self._monitor.after_step(self._state.stalled, self._state.skip_streak,
                               lambda: stall.nonfinite_grad_leaves(optimizers))
    self._stages.reset()

  def step_metrics(self) -> dict:
    """:func:`jaxamp.step_metrics`: the scale and the skip counters, as device scalars."""
    if not self._enabled:
      raise ValueError("step_metrics needs loss scaling: this GradScaler is disabled")
    return state_lib.step_metrics(self._lazy_init_scale_growth_tracker())

  # -- getters and setters ----------------------------------------------------------------------

  def get_scale(self) -> Any:
    """The current scale as a Python float (a host sync), 1.0 when disabled.

    Inside a loss function that this scaler scales (``scaler.scale(loss_fn)``),
    the scale that call multiplies by: a traced array while the backward pass
    is compiled, so ``1. / scaler.get_scale()`` follows the scale from step to
    step (PyTorch's gradient-penalty recipe). Anywhere else inside a traced
    function it raises, as the value would be frozen at trace time.
    """
    if not self._enabled:
      return 1.0
    in_use = self._scales_in_use.current()
    if in_use is not None:
      return in_use
    if _tracing():
      raise RuntimeError(_FROZEN_FIX.format(what="get_scale()"))
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

    Every value is checked with the constructor's rules (a scale within
    ``[min_scale, max_scale]``, a tracker in ``[0, 2**31 - 1]``) before
    anything changes: a refused dict leaves the scaler as it was.

    Raises:
      RuntimeError: for an empty dict (saved by a disabled scaler).
      KeyError: for a missing key.
      ValueError, TypeError: for values this scaler cannot use, unexpected
        keys, or a state dict that is not a dict.
    """
    if not self._enabled:
      return
    scaler_state.checked_state_dict(state_dict, _STATE_KEYS, "The source state dict is empty, "
                                    "possibly because it was saved from a disabled instance of "
                                    "GradScaler.")
    growth_factor = state_dict["growth_factor"]
    backoff_factor = state_dict["backoff_factor"]
    growth_interval = state_dict["growth_interval"]
    rule = self._make_rule(growth_factor, backoff_factor, growth_interval)
    scale = outside.scale("state_dict['scale']", state_dict["scale"], rule.min_scale,
                          rule.max_scale)
    tracker = outside.counter("state_dict['_growth_tracker']", state_dict["_growth_tracker"])
    self._rule = rule
    self._growth_factor = float(growth_factor)
    self._backoff_factor = float(backoff_factor)
    self._growth_interval = int(growth_interval)
    self._init_scale = scale
    self._init_growth_tracker = tracker
    if self._state is not None:
      self._state = loss_scale.initial_state(scale, tracker, self._state.overflow_count)


_clip_by_total_norm = jax.jit(clipping.clip_by_total_norm, static_argnames="order")


def clip_grad_norm_(optimizer: Any, max_norm: float, norm_type: float | str = 2.0,
                    error_if_nonfinite: bool = False, foreach: Optional[bool] = None) -> jax.Array:
  """``torch.nn.utils.clip_grad_norm_`` on an optimizer holder's gradients, in place.

  The literal port of PyTorch's "unscale, clip, step" recipe::

    scaler.unscale_(opt)
    jaxamp.clip_grad_norm_(opt, max_norm)   # torch.nn.utils.clip_grad_norm_(params, max_norm)
    scaler.step(opt)

  Clips ``optimizer.grads`` with PyTorch's arithmetic (see
  :func:`jaxamp.clip_grad_norm`) and returns the total norm before clipping,
  as a device scalar (no host sync). Non-finite gradients give a non-finite
  norm and coefficient, as in PyTorch; the scaler then skips the step.

  Args:
    optimizer: an optimizer holder with settable ``grads``
      (:class:`jaxamp.OptimWrapper`).
    max_norm: the largest total norm allowed.
    norm_type: the order of the norm: a float, or ``'inf'``.
    error_if_nonfinite: as PyTorch: when true, a non-finite total norm
      raises (and the gradients stay as they were). Reading the norm is a
      host sync, so only this option waits for the device.
    foreach: accepted for PyTorch's signature (``None``, ``True`` or
      ``False``): it picks PyTorch's kernels; XLA fuses the computation either way.

  Returns:
    The total norm of the gradients before clipping.

  Raises:
    TypeError: when ``optimizer`` holds no ``grads`` (a pytree of gradients
      cannot be changed in place: use :func:`jaxamp.clip_grad_norm`).
    ValueError: when there are no gradients to clip.
    RuntimeError: with ``error_if_nonfinite=True``, when the total norm is
      inf or nan (PyTorch's message).

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> opt = jaxamp.OptimWrapper(optax.sgd(0.1), {'w': jnp.zeros(2)})
    >>> opt.grads = {'w': jnp.array([3.0, 4.0])}
    >>> jaxamp.clip_grad_norm_(opt, 1.0), opt.grads['w']
    (Array(5., dtype=float32), Array([0.5999999 , 0.79999983], dtype=float32))
  """
  if not hasattr(optimizer, "grads"):
    raise TypeError(f"clip_grad_norm_ clips an optimizer holder's grads in place, got "
                    f"{type(optimizer).__name__}; for a pytree of gradients use the "
                    "jaxamp.clip_grad_norm transformation")
  grads = optimizer.grads
  if grads is None:
    raise ValueError("the optimizer holds no gradients to clip (call backward first)")
  max_norm_ = jnp.float32(outside.max_norm("max_norm", max_norm))
  validation.check_bool("error_if_nonfinite", error_if_nonfinite)
  if foreach is not None:
    validation.check_bool("foreach", foreach)
  clipped, norm = _clip_by_total_norm(grads, max_norm_, clipping.norm_order(norm_type))
  if error_if_nonfinite:
    clipping.check_total_norm(norm, norm_type)
  optimizer.grads = clipped
  return norm
