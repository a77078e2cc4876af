"""``jaxamp.paddle.GradScaler``: Paddle's ``paddle.amp.GradScaler`` for JAX training loops.

It shares the holders (:mod:`.holder`), state (:mod:`.scaler_state`) and stages (:mod:`.stages`)
of :class:`jaxamp.GradScaler`, with Paddle's hysteresis as ``ScaleRule(hysteresis=...)``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional, cast

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._src import state as state_lib
from jaxamp._src import loss_scale
from jaxamp._src import outside
from jaxamp._src import validation
from jaxamp._src.facade import holder
from jaxamp._src.facade import scaler_state
from jaxamp._src.facade.stages import OptState, OptimizerRecord, StageBook
from jaxamp._src.facade import stall
from jaxamp._src.facade.errors import AssertionValueError
from jaxamp._src.facade.scaled_loss import ScaledLoss, ScalesInUse


_STATE_KEYS = ("scale", "incr_ratio", "decr_ratio", "incr_every_n_steps",
               "decr_every_n_nan_or_inf", "incr_count", "decr_count", "use_dynamic_loss_scaling")


_PADDLE_NAMES = {"growth_factor": "incr_ratio", "backoff_factor": "decr_ratio",
                 "growth_interval": "incr_every_n_steps",
                 "hysteresis": "decr_every_n_nan_or_inf"}


def _paddle_rule(where: str = "", **values: Any) -> loss_scale.ScaleRule:
  """``loss_scale.make_rule`` with its errors naming Paddle's arguments (``incr_ratio``...)."""
  try:
    return loss_scale.make_rule(**values)
  except (TypeError, ValueError) as err:
    message = str(err)
    for core_name, paddle_name in _PADDLE_NAMES.items():
      name = f"{where}[{paddle_name!r}]" if where else paddle_name
      message = message.replace(core_name, name)
    raise type(err)(message) from None


class GradScaler:
  """Dynamic loss scaling with Paddle's ``paddle.amp.GradScaler`` API and rule.

  ::

    scaler = jaxamp.paddle.GradScaler(init_loss_scaling=1024)
    for batch in data:
      opt.backward(scaler.scale(loss_fn), batch)  # scaled = scaler.scale(loss); scaled.backward()
      scaler.minimize(opt)                        # unscale, skip-or-step, update the scale
      opt.zero_grad()                             # optimizer.clear_grad()

  or ``scaler.step(opt); scaler.update()`` in place of ``minimize``, with an
  optional ``scaler.unscale_(opt)`` before ``step`` (to clip unscaled
  gradients). ``opt`` is a :class:`jaxamp.OptimWrapper` or any object with
  its protocol (``params``, ``opt_state``, settable ``grads``, ``backward``,
  ``apply_gradients(grads=None, *, skip=None)``).

  The rule (Paddle's, from the flags of the iteration's steps)::

    if found_inf:
      incr_count = 0; decr_count += 1
      if decr_count == decr_every_n_nan_or_inf:
        scale = scale * decr_ratio; decr_count = 0
    else:
      decr_count = 0; incr_count += 1
      if incr_count == incr_every_n_steps:
        scale = scale * incr_ratio; incr_count = 0

  A step with inf/nan gradients is always skipped (bit-identical parameters
  and optimizer state, no host sync), even when the scale is not lowered
  yet. With ``use_dynamic_loss_scaling=False`` the scale stays fixed and bad
  steps are still skipped; with ``enable=False`` nothing is scaled and every
  step is applied.

  What differs from Paddle (whose defects are not copied), and why, is
  listed in the porting guide (``docs/porting.md``, "From Paddle"): the
  scale never grows to inf nor falls below :data:`jaxamp.DEFAULT_MIN_SCALE`,
  an iteration is bad when *any* optimizer stepped since the last update
  found inf/nan. With dynamic scaling, a run whose gradients stay inf or nan
  at every scale is reported by :meth:`update` and :meth:`minimize`, as
  :class:`jaxamp.GradScaler` reports it (``on_stall``, ``stall_after``,
  ``stall_check_every``); Paddle skips silently, forever.

  The defaults are Paddle 3.3.1's ``paddle.amp.GradScaler`` (65536, x2
  after 2000 good steps, x0.5 after every bad one). Paddle's older
  ``AmpScaler`` defaults to 32768/1000/1 and the 2.x documentation of
  ``GradScaler`` gave 32768/1000/2: pass those values to reproduce such a run.

  Args:
    enable: whether to scale at all.
    init_loss_scaling: the initial scale, positive and finite.
    incr_ratio: multiplier after ``incr_every_n_steps`` finite steps; > 1.
    decr_ratio: multiplier after ``decr_every_n_nan_or_inf`` consecutive bad
      steps; in (0, 1).
    incr_every_n_steps: consecutive finite steps before growing; >= 1.
    decr_every_n_nan_or_inf: consecutive bad steps before backing off; >= 1.
    use_dynamic_loss_scaling: ``False`` fixes the scale.
    on_stall: ``'warn'``, ``'raise'`` or ``'ignore'``, as in
      :class:`jaxamp.GradScaler`.
    stall_after: consecutive skipped iterations that make a stall; >= 1.
    stall_check_every: how often, in updates, the stall flag is read; >= 1.

  Raises:
    ValueError: also an ``AssertionError``, with Paddle's messages, for
      ``incr_ratio <= 1`` or ``decr_ratio >= 1``; a plain ``ValueError`` for
      other out-of-range values.
    TypeError: for arguments of the wrong type.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> opt = jaxamp.OptimWrapper(optax.sgd(0.5), {'w': jnp.ones(2)})
    >>> scaler = jaxamp.paddle.GradScaler(init_loss_scaling=1024, decr_every_n_nan_or_inf=2)
    >>> loss_fn = lambda params, x: jnp.sum(params['w'] * x)
    >>> for x in (jnp.array([jnp.inf, 1.0]), jnp.array([1.0, 2.0]), jnp.array([jnp.nan, 1.0])):
    ...   loss = opt.backward(scaler.scale(loss_fn), x)
    ...   scaler.minimize(opt)
    ...   opt.zero_grad()
    >>> opt.params['w'], scaler.state_dict()['scale']  # one good step; bad steps not consecutive
    (Array([0.5, 0. ], dtype=float32), array([1024.], dtype=float32))
    >>> scaler.scale(jnp.float32(0.25))
    Array(256., dtype=float32)
  """

  def __init__(self, enable: bool = True, init_loss_scaling: float = 65536.0,
               incr_ratio: float = 2.0, decr_ratio: float = 0.5,
               incr_every_n_steps: int = 2000, decr_every_n_nan_or_inf: int = 1,
               use_dynamic_loss_scaling: bool = True, *, on_stall: str = "warn",
               stall_after: int = loss_scale.DEFAULT_STALL_AFTER,
               stall_check_every: int = 10) -> None:
    self._enable = validation.check_bool("enable", enable)
    self._stall_after = validation.check_count("stall_after", stall_after)
    self._monitor = stall.StallMonitor(on_stall, stall_check_every)
    validation.check_bool("use_dynamic_loss_scaling", use_dynamic_loss_scaling)
    self._use_dynamic_loss_scaling = False
    self._init_loss_scaling: Any = 1.0
    self._incr_ratio = incr_ratio
    self._decr_ratio = decr_ratio
    self._incr_every_n_steps = incr_every_n_steps
    self._decr_every_n_nan_or_inf = decr_every_n_nan_or_inf
    self._rule: Optional[loss_scale.ScaleRule] = None
    if self._enable:
      incr, decr = scaler_state.check_factors(incr_ratio=incr_ratio, decr_ratio=decr_ratio)
      if incr <= 1.0:
        raise AssertionValueError("The incr_ratio must be > 1.0.")
      if decr >= 1.0:
        raise AssertionValueError("The decr_ratio must be < 1.0.")
      self._rule = self._make_rule()
      validation.check_scale("init_loss_scaling", init_loss_scaling, self._rule.min_scale,
                             self._rule.max_scale)
      self._init_loss_scaling = init_loss_scaling
      self._use_dynamic_loss_scaling = bool(use_dynamic_loss_scaling)
    self._state = loss_scale.initial_state(self._init_loss_scaling)
    self._stages = StageBook()
    # Flags of the steps since the last update, and the flag the last update used.
    self._pending: list[jax.Array] = []
    self._last_found_inf = jnp.zeros([], jnp.bool_)
    self._scales_in_use = ScalesInUse()

  def _make_rule(self, **changes: Any) -> loss_scale.ScaleRule:
    values: dict[str, Any] = dict(
        growth_factor=self._incr_ratio, backoff_factor=self._decr_ratio,
        growth_interval=self._incr_every_n_steps, hysteresis=self._decr_every_n_nan_or_inf)
    values.update(changes)
    return _paddle_rule(**values)

  def __repr__(self) -> str:
    return (f"GradScaler(enable={self._enable}, incr_ratio={self._incr_ratio!r}, "
            f"decr_ratio={self._decr_ratio!r}, incr_every_n_steps={self._incr_every_n_steps!r}, "
            f"decr_every_n_nan_or_inf={self._decr_every_n_nan_or_inf!r}, "
            f"use_dynamic_loss_scaling={self._use_dynamic_loss_scaling})")

  @property
  def state(self) -> state_lib.LossScaleState:
    """The device state: ``scale``, ``growth_tracker`` (incr_count), ``overflow_count`` (decr_count)."""
    return self._state

  def _scale_array(self) -> jax.Array:
    """The scale a loss scaled now is multiplied by: a scaled loss call's, else the state's."""
    return self._scales_in_use.current_or(lambda: self._state.scale)

  def using_scale(self, scale: jax.Array) -> contextlib.AbstractContextManager:
    """Inside, :meth:`scale` uses ``scale`` (the one a scaled loss being called multiplies by)."""
    return self._scales_in_use.using(scale)

  # -- scaling ----------------------------------------------------------------------------------

  def scale(self, var: Any, *, has_aux: bool = False) -> Any:
    """Multiplies a loss by the scale, or wraps a loss function to do so.

    Args:
      var: an array: returns ``var * scale`` (float32 at least); a callable
        ``loss_fn``: returns a pytree callable whose output is multiplied by
        the scale current when it is called (or flattened into a jitted
        call), so ``opt.backward(scaler.scale(loss_fn), batch)`` computes
        scaled gradients without recompiling as the scale changes. Inside a
        loss function this scaler scales, both forms use the scale that call
        multiplies by (traced in a compiled backward pass).
      has_aux: for a callable returning ``(loss, aux)``: scale only ``loss``.

    Returns:
      The scaled loss (or function); ``var`` itself when scaling is disabled.

    Raises:
      TypeError: for anything else.
    """
    if not (validation.is_array(var) or callable(var)):
      raise TypeError(f"The type of 'var' in GradScaler.scale() must be (<class 'jax.Array'>, "
                      f"a loss function), but received {type(var)}. ")
    if not self._enable:
      return var
    if validation.is_array(var):
      return state_lib.multiply_by_scale(var, self._scale_array())
    # Inside a scaled loss being traced, multiply by its (traced) scale, not the state's.
    in_use = self._scales_in_use.current()
    return ScaledLoss(var, self, bool(has_aux), in_use)

  # -- unscale / step / update ------------------------------------------------------------------

  def unscale_(self, optimizer: Any) -> None:
    """Divides ``optimizer.grads`` by the scale and records whether any is inf/nan.

    One jitted call, no host sync; ``optimizer.grads`` is replaced by the
    unscaled gradients. Half-precision gradients are allowed (as Paddle);
    they are unscaled in float32 and cast back.

    Raises:
      RuntimeError: when called twice for ``optimizer`` since the last
        update, or after ``step(optimizer)`` (Paddle's messages).
    """
    if not self._enable:
      return
    record = self._stages.check_unscale(optimizer)
    found_inf = holder.unscale_grads(optimizer, self._state.scale, allow_float16=True)
    record.found_inf = jnp.zeros([], jnp.bool_) if found_inf is None else found_inf
    record.stage = OptState.UNSCALED

  def _apply(self, optimizer: Any, record: OptimizerRecord) -> None:
    if record.stage is OptState.READY:
      found_inf = holder.fused_step(optimizer, self._state.scale, allow_float16=True)
      if found_inf is not None:
        record.found_inf = found_inf
        self._pending.append(found_inf)
        return
      self.unscale_(optimizer)
    if optimizer.grads is not None:  # without gradients Paddle's step changes nothing
      optimizer.apply_gradients(skip=record.found_inf)
    self._pending.append(cast(jax.Array, record.found_inf))  # set by unscale_ above

  def step(self, optimizer: Any) -> None:
    """Unscales (unless :meth:`unscale_` did) and applies the gradients unless one is inf/nan.

    The decision stays on the device (``apply_gradients(skip=found_inf)``).
    Call :meth:`update` afterwards (with ``use_dynamic_loss_scaling=False``
    the stage is reset here already, as in Paddle).

    Raises:
      RuntimeError: ``"step() has already been called since the last update()."``
    """
    if not self._enable:
      optimizer.apply_gradients()
      return None
    record = self._stages.check_step(optimizer)
    self._apply(optimizer, record)
    record.stage = OptState.STEPPED
    if not self._use_dynamic_loss_scaling:
      self._stages.reset()
    return None

  def _update(self) -> None:
    flags = tuple(self._pending) if self._pending else (self._last_found_inf,)
    rule = self._rule if self._rule is not None else self._make_rule()
    self._state, self._last_found_inf = scaler_state.update_fn(rule, self._stall_after)(self._state, flags)
    self._pending = []
    optimizers = self._stages.optimizers()
    self._monitor.after_step(self._state.stalled, self._state.skip_streak,
                             lambda: stall.nonfinite_grad_leaves(optimizers))

  def update(self) -> None:
    """Updates the scale from the steps since the last update (dynamic scaling only)."""
    if not self._enable:
      return None
    if self._use_dynamic_loss_scaling:
      self._update()
      self._stages.reset()
    return None

  def minimize(self, optimizer: Any, scaled_loss: Any = None, *args: Any, **kwargs: Any) -> None:
    """Unscales, steps unless a gradient is inf/nan, and updates the scale.

    Args:
      optimizer: the optimizer holder whose ``grads`` hold the scaled gradients.
      scaled_loss: accepted for Paddle's call style and ignored: the
        gradients were computed by ``optimizer.backward``.
      *args: ignored likewise (Paddle forwards them to ``optimizer.minimize``).
      **kwargs: ignored likewise.

    Returns:
      ``None``.
    """
    del scaled_loss, args, kwargs
    if not self._enable:
      optimizer.apply_gradients()
      return None
    self._apply(optimizer, self._stages.record(optimizer))
    if self._use_dynamic_loss_scaling:
      self._update()
    self._stages.reset()
    return None

  def step_metrics(self) -> dict:
    """:func:`jaxamp.step_metrics`: the scale and the skip counters, as device scalars."""
    if not self._enable:
      raise ValueError("step_metrics needs loss scaling: this GradScaler is disabled")
    return state_lib.step_metrics(self._state)

  # -- getters and setters ----------------------------------------------------------------------

  def is_enable(self) -> bool:
    """Whether loss scaling is enabled."""
    return self._enable

  def is_use_dynamic_loss_scaling(self) -> bool:
    """Whether the scale is updated dynamically (``False`` when disabled)."""
    return self._use_dynamic_loss_scaling

  def get_init_loss_scaling(self) -> Any:
    """The initial loss scaling (as given; 1.0 when disabled)."""
    return self._init_loss_scaling

  def set_init_loss_scaling(self, new_init_loss_scaling: float) -> None:
    """Sets the initial loss scaling and resets the current scale to it (counters kept)."""
    rule = self._rule or loss_scale.ScaleRule()
    value = outside.scale("new_init_loss_scaling", new_init_loss_scaling, rule.min_scale,
                          rule.max_scale)
    self._init_loss_scaling = new_init_loss_scaling
    self._state = self._state._replace(scale=jnp.asarray(value, jnp.float32))

  def get_incr_ratio(self) -> float:
    """The multiplier used to increase the scale."""
    return self._incr_ratio

  def set_incr_ratio(self, new_incr_ratio: float) -> None:
    """Sets the increase multiplier (> 1)."""
    if scaler_state.check_factors(new_incr_ratio=new_incr_ratio)[0] <= 1.0:
      raise AssertionValueError("The new_incr_ratio must be > 1.0.")
    if self._enable:
      self._rule = self._make_rule(growth_factor=new_incr_ratio)
    self._incr_ratio = new_incr_ratio

  def get_decr_ratio(self) -> float:
    """The multiplier used to decrease the scale."""
    return self._decr_ratio

  def set_decr_ratio(self, new_decr_ratio: float) -> None:
    """Sets the decrease multiplier (< 1)."""
    if scaler_state.check_factors(new_decr_ratio=new_decr_ratio)[0] >= 1.0:
      raise AssertionValueError("The new_decr_ratio must be < 1.0.")
    if self._enable:
      self._rule = self._make_rule(backoff_factor=new_decr_ratio)
    self._decr_ratio = new_decr_ratio

  def get_incr_every_n_steps(self) -> int:
    """Consecutive finite steps before the scale grows."""
    return self._incr_every_n_steps

  def set_incr_every_n_steps(self, new_incr_every_n_steps: int) -> None:
    """Sets the consecutive finite steps before the scale grows (>= 1)."""
    if self._enable:
      self._rule = self._make_rule(growth_interval=new_incr_every_n_steps)
    self._incr_every_n_steps = new_incr_every_n_steps

  def get_decr_every_n_nan_or_inf(self) -> int:
    """Consecutive bad steps before the scale shrinks."""
    return self._decr_every_n_nan_or_inf

  def set_decr_every_n_nan_or_inf(self, new_decr_every_n_nan_or_inf: int) -> None:
    """Sets the consecutive bad steps before the scale shrinks (>= 1)."""
    if self._enable:
      self._rule = self._make_rule(hysteresis=new_decr_every_n_nan_or_inf)
    self._decr_every_n_nan_or_inf = new_decr_every_n_nan_or_inf

  # -- checkpoints ------------------------------------------------------------------------------

  def state_dict(self) -> dict[str, Any]:
    """The state in Paddle's format (``{}`` when disabled); a host sync.

    Keys: ``scale`` (a float32 numpy array of shape ``(1,)``), ``incr_ratio``,
    ``decr_ratio``, ``incr_every_n_steps``, ``decr_every_n_nan_or_inf``,
    ``incr_count`` (int), ``decr_count`` (int), ``use_dynamic_loss_scaling``
    (bool).
    """
    if not self._enable:
      return {}
    return {
        "scale": np.asarray(self._state.scale, np.float32).reshape(1),
        "incr_ratio": self._incr_ratio,
        "decr_ratio": self._decr_ratio,
        "incr_every_n_steps": self._incr_every_n_steps,
        "decr_every_n_nan_or_inf": self._decr_every_n_nan_or_inf,
        "incr_count": int(self._state.growth_tracker),
        "decr_count": int(self._state.overflow_count),
        "use_dynamic_loss_scaling": self._use_dynamic_loss_scaling,
    }

  def load_state_dict(self, state_dict: dict[str, Any]) -> None:
    """Loads a state dict in Paddle's format (no-op when disabled).

    ``scale`` may be Paddle's one-element array or a plain number. Every
    value is checked with the constructor's rules before anything changes
    (a scale within ``[min_scale, max_scale]``, counters in
    ``[0, 2**31 - 1]``, ``use_dynamic_loss_scaling`` a bool): a refused dict
    leaves the scaler as it was.

    Raises:
      RuntimeError: for an empty dict (saved by a disabled scaler).
      KeyError: for a missing key.
      ValueError, TypeError: for values this scaler cannot use (Paddle
        reads ``"False"`` as true and uses the first element of a longer
        ``scale``), unexpected keys, or a state dict that is not a dict.
    """
    if not self._enable:
      return
    scaler_state.checked_state_dict(state_dict, _STATE_KEYS, "The input state dict is empty, "
                                    "possibly because it was saved from a disabled instance of "
                                    "GradScaler.")
    rule = _paddle_rule(growth_factor=state_dict["incr_ratio"],
                        backoff_factor=state_dict["decr_ratio"],
                        growth_interval=state_dict["incr_every_n_steps"],
                        hysteresis=state_dict["decr_every_n_nan_or_inf"], where="state_dict")
    scale = outside.scale("state_dict['scale']", state_dict["scale"], rule.min_scale,
                          rule.max_scale)
    incr_count = outside.counter("state_dict['incr_count']", state_dict["incr_count"])
    decr_count = outside.counter("state_dict['decr_count']", state_dict["decr_count"])
    dynamic = outside.flag("state_dict['use_dynamic_loss_scaling']",
                           state_dict["use_dynamic_loss_scaling"])
    self._rule = rule
    self._init_loss_scaling = scale
    self._incr_ratio = rule.growth_factor
    self._decr_ratio = rule.backoff_factor
    self._incr_every_n_steps = rule.growth_interval
    self._decr_every_n_nan_or_inf = rule.hysteresis
    self._use_dynamic_loss_scaling = dynamic
    self._state = loss_scale.initial_state(scale, incr_count, decr_count)
