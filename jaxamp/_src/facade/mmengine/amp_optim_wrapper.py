"""mmengine's ``AmpOptimWrapper``: the ``OptimWrapper`` with loss scaling and a compute dtype."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp._src import state as state_lib
from jaxamp._src import autocast as autocast_lib
from jaxamp._src import loss_scale as ls
from jaxamp._src import policy as policy_lib
from jaxamp._src import outside
from jaxamp._src import validation
from jaxamp._src.facade.errors import AssertionTypeError
from jaxamp._src.facade.errors import AssertionValueError
from jaxamp._src.facade import stall
from jaxamp._src.facade.mmengine.optim_wrapper import OptimWrapper

_SCALER_KEYS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled",
                "device", "hysteresis", "min_scale", "max_scale")
_TORCH_SCALER_DEFAULTS = dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                              growth_interval=2000)
_SCALER_STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval",
                      "_growth_tracker")


@dataclasses.dataclass(frozen=True)
class ScalerConfig:
  """A validated ``loss_scale``: ``kind`` is ``'dynamic'``, ``'static'`` or ``'disabled'``.

  ``rule`` is the dynamic rule (PyTorch's defaults unless given; unused when static).
  """

  kind: str
  init_scale: float = 2.0**16
  rule: ls.ScaleRule = ls.ScaleRule()


def parse_loss_scale(loss_scale: Any) -> ScalerConfig:
  """Validates ``loss_scale`` as mmengine's ``AmpOptimWrapper`` takes it (see the class)."""
  if isinstance(loss_scale, str) and loss_scale == "dynamic":
    return ScalerConfig("dynamic")
  if isinstance(loss_scale, (float, np.floating)) or (
      isinstance(loss_scale, (np.ndarray, jax.Array)) and np.ndim(loss_scale) == 0
      and jnp.issubdtype(jnp.result_type(loss_scale), jnp.floating)):
    return ScalerConfig("static", init_scale=outside.scale("loss_scale", loss_scale))
  if isinstance(loss_scale, Mapping):
    cfg = dict(loss_scale)
    for key in cfg:
      if key not in _SCALER_KEYS:
        raise TypeError(f"GradScaler.__init__() got an unexpected keyword argument '{key}' "
                        f"(loss_scale accepts {list(_SCALER_KEYS)})")
    cfg.pop("device", None)
    enabled = validation.check_bool("enabled", cfg.pop("enabled", True))
    merged = dict(_TORCH_SCALER_DEFAULTS, **cfg)
    # Validated by the core: the same checks and messages as dynamic_loss_scale.
    ls.dynamic_loss_scale(optax.identity(), **merged)
    if not enabled:
      return ScalerConfig("disabled")
    init_scale = float(merged.pop("init_scale"))
    return ScalerConfig("dynamic", init_scale, ls.make_rule(**merged))
  raise TypeError(f'loss_scale must be of type float, dict, or "dynamic", but got {loss_scale}')


def _back_to_scale(tx: optax.GradientTransformation, scale: float) -> optax.GradientTransformation:
  """``tx`` with its state's scale set to ``scale`` after every update.

  mmengine's static scale calls ``GradScaler.update(loss_scale)`` after each
  step: a scale loaded from a state dict serves one step, then the configured
  one is back.
  """

  def update(updates, state, params=None):
    updates, state = tx.update(updates, state, params)
    return updates, state._replace(scale=jnp.full_like(state.scale, scale))

  return optax.GradientTransformation(tx.init, update)


class AmpOptimWrapper(OptimWrapper):
  """mmengine's ``AmpOptimWrapper``: :class:`OptimWrapper` with loss scaling and a compute dtype.

  Its transformation is ``jaxamp.dynamic_loss_scale(optax.chain(clip,
  optimizer))`` (``jaxamp.static_loss_scale`` for a float ``loss_scale``):
  ``backward`` multiplies the loss by the current scale; the step unscales
  the summed gradients, clips them, skips the update when any is inf or nan
  (params and optimizer state untouched) and adjusts the scale, once per
  optimizer step, not per micro-batch. ``get_scale()`` returns the scale,
  ``loss_scaler`` the scale state.

  ``dtype`` is the compute dtype. With float16 or bfloat16 the loss
  function runs under :func:`jaxamp.autocast` (``cast='autocast'``, the
  default, as mmengine's wrapper runs under ``torch.autocast``): matmuls and
  convolutions in ``dtype``, precision-sensitive ops in float32, the cast made
  at each op. ``cast='whole'`` casts every floating param and array input to
  ``dtype`` instead (:func:`jaxamp.mixed_precision`, jmp's way, this
  wrapper's behaviour before autocast). Either way the master params and the
  gradients stay float32 and the loss (with ``has_aux``, the floating leaves
  of the aux output too) is returned in float32. ``dtype=None``
  casts nothing: the loss function runs as written (e.g. a Flax module with
  its own ``dtype``). :meth:`optim_context` yields the whole-cast function,
  for code the user runs in the compute dtype himself.

  Differences from mmengine, and why:

  * ``loss_scale`` dicts also accept jaxamp's ``hysteresis``, ``min_scale``
    and ``max_scale``; the scale never falls to 0 (it stops at
    ``jaxamp.DEFAULT_MIN_SCALE``) and never grows to inf.
  * ``state_dict()['loss_scaler']`` is PyTorch's GradScaler format (Python
    values), plus ``'_hysteresis_tracker'`` when ``hysteresis > 1``. Loading
    growth or backoff factors or an interval that differ from the current
    ones rebuilds the step (one recompilation). With a float ``loss_scale`` a loaded
    scale serves the next step, then the configured one is back, as in
    mmengine.
  * With ``error_if_nonfinite=True`` an overflow raises, as it does in
    mmengine, where ``clip_grad_norm_`` sees the unscaled inf first.
  * ``apply_gradients(grads)`` expects gradients of the *scaled* loss (what
    ``backward`` accumulates) and unscales them itself.

  Args:
    optimizer: an optax ``GradientTransformation``.
    params: float32 (or bfloat16) master parameters; float16 is refused.
    loss_scale: ``'dynamic'`` (PyTorch's defaults: 65536, x2 every 2000 good
      steps, x0.5 on overflow), a float (a fixed scale, non-finite steps still
      skipped) or a dict of GradScaler arguments (``init_scale``,
      ``growth_factor``, ``backoff_factor``, ``growth_interval``,
      ``enabled``, ``device`` (ignored), ``hysteresis``, ``min_scale``,
      ``max_scale``).
    dtype: ``None``, ``'float16'``, ``'bfloat16'``, ``'float32'``,
      ``'float64'`` or a floating dtype.
    accumulative_counts: as :class:`OptimWrapper`.
    clip_grad: as :class:`OptimWrapper`.
    donate: as :class:`OptimWrapper` (buffer donation; invalidates arrays
      read from the wrapper at the next step).
    cast: ``'autocast'`` (per operation, the default) or ``'whole'`` (every
      floating input), how a float16/bfloat16 ``dtype`` is applied.
    on_stall: ``'warn'`` (the default), ``'raise'`` or ``'ignore'``: what a
      step does once the run is stalled (``stall_after`` consecutive skipped
      steps, or a skip at the smallest scale): warn with
      :class:`jaxamp.StallWarning` or raise :class:`jaxamp.StalledError`,
      naming the gradient leaves that held inf or nan. The flag is read every
      ``stall_check_every`` steps, once computed (no wait on the device).
    stall_after: consecutive skipped steps that make a stall; >= 1.
    stall_check_every: how often, in steps, the stall flag is read; >= 1.

  Raises:
    TypeError: ``loss_scale`` of another type (mmengine's message) or
      unknown GradScaler arguments.
    AssertionError: (also a ``ValueError``) an unknown dtype name.
    ValueError: float16 parameters, out-of-range scaler arguments.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> wrapper = jaxamp.AmpOptimWrapper(
    ...     optax.sgd(0.1), {'w': jnp.ones(2)}, loss_scale=dict(init_scale=4.0),
    ...     dtype='bfloat16')
    >>> loss_fn = lambda p, x: jnp.sum(p['w'] * x)
    >>> loss = wrapper.update_params(loss_fn, jnp.array([1.0, jnp.inf]))  # overflow: skipped
    >>> wrapper.params['w'], wrapper.get_scale()
    (Array([1., 1.], dtype=float32), 2.0)
    >>> loss = wrapper.update_params(loss_fn, jnp.array([1.0, 2.0]))
    >>> wrapper.params['w']
    Array([0.9, 0.8], dtype=float32)
  """

  valid_dtypes = ("float16", "bfloat16", "float32", "float64")

  def __init__(self, optimizer: optax.GradientTransformation, params: Any, *,
               loss_scale: Union[str, float, dict] = "dynamic", dtype: Any = None,
               accumulative_counts: int = 1, clip_grad: Optional[dict] = None,
               donate: bool = False, cast: str = "autocast", on_stall: str = "warn",
               stall_after: int = ls.DEFAULT_STALL_AFTER, stall_check_every: int = 10):
    if cast not in ("autocast", "whole"):
      raise ValueError(f"cast must be 'autocast' (per operation, as torch.autocast) or 'whole' "
                       f"(every floating input, as jmp), got {cast!r}")
    self._cast = cast
    self._scaler = parse_loss_scale(loss_scale)
    self._stall_after = validation.check_count("stall_after", stall_after)
    self._monitor = stall.StallMonitor(on_stall, stall_check_every)
    self.cast_dtype = self._parse_dtype(dtype)
    self._amp_policy = (None if self.cast_dtype is None else
                        policy_lib.Policy(jnp.float32, self.cast_dtype, jnp.float32))
    super().__init__(optimizer, params, accumulative_counts=accumulative_counts,
                     clip_grad=clip_grad, donate=donate)

  def _parse_dtype(self, dtype: Any) -> Optional[jnp.dtype]:
    if dtype is None:
      return None
    if isinstance(dtype, str) and dtype not in self.valid_dtypes:
      raise AssertionValueError(f"dtype should be any of {self.valid_dtypes}, got {dtype}")
    try:
      return policy_lib.canonical_dtype(dtype)
    except (TypeError, ValueError):
      raise AssertionTypeError(
          f"dtype should be None or a floating dtype or one of {self.valid_dtypes}, got "
          f"{dtype!r}") from None

  # -- transformation --------------------------------------------------------------------------

  def _build_transformation(self) -> optax.GradientTransformation:
    inner = super()._build_transformation()
    cfg = self._scaler
    if cfg.kind == "disabled":
      return inner
    if cfg.kind == "static":
      static = ls.static_loss_scale(inner, cfg.init_scale, stall_after=self._stall_after,
                                    on_stall="record")  # the wrapper reports stalls itself
      return _back_to_scale(static, cfg.init_scale)
    rule = cfg.rule
    return ls.dynamic_loss_scale(
        inner, init_scale=cfg.init_scale, growth_factor=rule.growth_factor,
        backoff_factor=rule.backoff_factor, growth_interval=rule.growth_interval,
        hysteresis=rule.hysteresis, min_scale=rule.min_scale, max_scale=rule.max_scale,
        stall_after=self._stall_after, on_stall="record")  # the wrapper reports stalls itself

  def _commit_step(self, params: Any, state: Any, norm: Optional[jax.Array]) -> None:
    super()._commit_step(params, state, norm)
    if self._scaling:
      self._monitor.after_step(state.stalled, state.skip_streak,
                               lambda: state_lib.skip_report(self._state, self._params))

  def step_metrics(self) -> dict:
    """:func:`jaxamp.step_metrics` of the wrapper's state (the loss-scale metrics and the norm)."""
    if not self._scaling:
      raise ValueError("step_metrics needs loss scaling: this AmpOptimWrapper has it disabled")
    metrics = state_lib.step_metrics(self._state)
    if self._last_grad_norm is not None:
      metrics["grad_norm"] = self._last_grad_norm
    return metrics

  @property
  def _scaling(self) -> bool:
    return self._scaler.kind != "disabled"

  def _compute_in_dtype(self, loss_fn: Callable) -> Callable:
    policy = self._amp_policy
    if policy is None:
      return loss_fn
    if self._cast == "autocast" and self.cast_dtype in (jnp.float16, jnp.bfloat16):
      autocast_fn = autocast_lib.autocast(loss_fn, self.cast_dtype)
      # A loss whose last operation is a matmul comes out in the compute dtype: returned in
      # float32, as the whole cast returns it.
      return lambda *args, **kwargs: policy.cast_to_output(autocast_fn(*args, **kwargs))
    return policy_lib.mixed_precision(loss_fn, policy)

  def _cast_fn(self) -> Callable[[Any], Any]:
    policy = self._amp_policy
    if policy is None:
      return super()._cast_fn()
    return policy.cast_to_compute

  def step(self, closure: Optional[Callable] = None) -> None:
    """Unscales, clips, skips or applies, and adjusts the scale, in one jitted call."""
    if closure is not None and self._scaling:
      raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
    super().step(closure)

  # -- loss scale ------------------------------------------------------------------------------

  @property
  def loss_scaler(self) -> Optional[state_lib.LossScaleState]:
    """The loss-scale state (``scale``, ``growth_tracker``...; ``inner_state`` left out).

    ``None`` when the scaler is disabled (``loss_scale=dict(enabled=False)``).
    """
    if not self._scaling:
      return None
    return self._state._replace(inner_state=())

  def get_scale(self) -> float:
    """The current loss scale as a Python float (a host sync); 1.0 when disabled."""
    if not self._scaling:
      return 1.0
    return float(self._state.scale)

  def _scaler_state_dict(self) -> dict:
    if not self._scaling:
      return {}
    rule = self._scaler.rule
    out = {"scale": float(self._state.scale), "growth_factor": float(rule.growth_factor),
           "backoff_factor": float(rule.backoff_factor),
           "growth_interval": int(rule.growth_interval),
           "_growth_tracker": int(self._state.growth_tracker)}
    if rule.hysteresis > 1:
      out["_hysteresis_tracker"] = int(self._state.overflow_count)
    return out

  def state_dict(self) -> dict:
    """The optimizer's state dict plus ``'loss_scaler'`` in PyTorch's GradScaler format."""
    out = super().state_dict()
    out["loss_scaler"] = self._scaler_state_dict()
    return out

  def _prepare_scaler_load(self, scaler: Any) -> Callable[[Any], Any]:
    """Validates a GradScaler state dict; returns ``state -> state`` (and may rebuild the step)."""
    if not isinstance(scaler, Mapping):
      raise TypeError(f"state_dict['loss_scaler'] must be a dict, got {type(scaler).__name__}")
    if not self._scaling:
      return lambda state: state
    if len(scaler) == 0:
      raise RuntimeError("The source state dict is empty, possibly because it was saved from a "
                         "disabled instance of GradScaler.")
    allowed = set(_SCALER_STATE_KEYS) | {"_hysteresis_tracker"}
    missing = sorted(set(_SCALER_STATE_KEYS) - set(scaler))
    extra = sorted(set(scaler) - allowed)
    if missing or extra:
      raise ValueError(f"state_dict['loss_scaler'] must have the keys {list(_SCALER_STATE_KEYS)}: "
                       f"missing {missing}, unexpected {extra}")
    cfg = self._scaler
    tracker = outside.counter("state_dict['loss_scaler']['_growth_tracker']",
                              scaler["_growth_tracker"])
    hysteresis_tracker = outside.counter("state_dict['loss_scaler']['_hysteresis_tracker']",
                                         scaler.get("_hysteresis_tracker", 0))
    # Kept (and checked) for a static scale too, which does not use them, as GradScaler keeps them.
    rule = ls.make_rule(growth_factor=scaler["growth_factor"],
                        backoff_factor=scaler["backoff_factor"],
                        growth_interval=scaler["growth_interval"],
                        hysteresis=cfg.rule.hysteresis, min_scale=cfg.rule.min_scale,
                        max_scale=cfg.rule.max_scale)
    new_cfg = dataclasses.replace(cfg, rule=rule)
    scale = outside.scale("state_dict['loss_scaler']['scale']", scaler["scale"],
                          rule.min_scale, rule.max_scale)

    def install(state):
      if new_cfg != self._scaler:
        self._scaler = new_cfg
        self._tx = self._build_transformation()
        self._build_steps()
      old = state
      return old._replace(
          scale=jax.device_put(np.float32(scale), old.scale.sharding),
          growth_tracker=jax.device_put(np.int32(tracker), old.growth_tracker.sharding),
          overflow_count=jax.device_put(np.int32(hysteresis_tracker), old.overflow_count.sharding))

    return install

  def _prepare_load(self, state_dict: Any) -> Callable[[], None]:
    if not isinstance(state_dict, Mapping):
      raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    state_dict = dict(state_dict)
    scaler = state_dict.pop("loss_scaler", None)
    install = None if scaler is None else self._prepare_scaler_load(scaler)
    commit_optimizer = super()._prepare_load(state_dict)

    def commit():
      commit_optimizer()
      if install is not None:
        self._state = install(self._state)

    return commit

