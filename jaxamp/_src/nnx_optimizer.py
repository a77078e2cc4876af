"""Flax NNX: an ``nnx.Optimizer`` whose step counter ignores skipped steps."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.nnx import variablelib

from jaxamp._src import fp8
from jaxamp._src import state as state_lib

OverwriteWithGradient = variablelib.variable_type_from_name(fp8.OVERWRITE_WITH_GRADIENT,
                                                            allow_register=True)
"""The NNX variable type of Flax's fp8 state (the Linen collection ``'_overwrite_with_gradient'``,
as ``nnx.bridge.ToNNX`` names it)."""

# Variables replaced by their values: ``nnx.as_pure``, or ``nnx.pure`` (Flax 0.12.0 to 0.12.6).
_as_pure: Any = getattr(nnx, "as_pure", None) or getattr(nnx, "pure")  # noqa: B009


class Optimizer(nnx.Optimizer):
  """``flax.nnx.Optimizer`` whose ``step`` counts only the updates actually applied.

  A drop-in replacement: same constructor, same :meth:`update`. With a
  loss-scaled ``tx`` (built with ``jaxamp.dynamic_loss_scale``, optionally
  inside ``jaxamp.accumulate_gradients``) ``nnx.Optimizer.update`` advances
  ``step`` on every call, also when the step was skipped for non-finite
  gradients and on the micro-steps that only accumulate. The parameters and
  the inner optax state are right either way (jaxamp returns zero updates
  and keeps the inner state); only the counter is off. This class advances
  it only when :func:`jaxamp.update_applied` says the parameters changed, so
  it equals the inner optimizer's own step count. It also offers
  :attr:`loss_scale`, :meth:`scale_loss` and :attr:`skipped_steps` as plain
  arrays.

  Flax's fp8 layers (Linen's, through ``nnx.bridge.ToNNX``) keep their
  state in :data:`OverwriteWithGradient` variables. Build the optimizer with
  ``wrt=nnx.Param`` (a ``wrt`` selecting them is refused) and differentiate
  with respect to ``nnx.Any(nnx.Param, OverwriteWithGradient)``:
  :meth:`update` steps the parameters and overwrites those variables with
  the values the backward pass returned, where the step was applied (under
  :func:`jaxamp.accumulate_gradients`, with the window's maximum).

  With ``nnx.Optimizer`` itself the same counter is obtained by hand::

    before = nnx.as_pure(optimizer.opt_state)
    optimizer.update(model, grads)
    applied = jaxamp.update_applied(before, nnx.as_pure(optimizer.opt_state))

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> from flax import nnx
    >>> import jaxamp.nnx
    >>> model = nnx.Linear(2, 1, dtype=jnp.float16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    >>> tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**8)
    >>> optimizer = jaxamp.nnx.Optimizer(model, tx, wrt=nnx.Param)
    >>> @nnx.jit
    ... def train_step(model, optimizer, x, y):
    ...   def loss_fn(model):
    ...     loss = jnp.mean((model(x).astype(jnp.float32) - y) ** 2)
    ...     return optimizer.scale_loss(loss)
    ...   optimizer.update(model, nnx.grad(loss_fn)(model))
    >>> x, y = jnp.ones((4, 2)), jnp.zeros((4, 1))
    >>> train_step(model, optimizer, x, y)
    >>> train_step(model, optimizer, x.at[0, 0].set(jnp.inf), y)  # overflow: skipped
    >>> optimizer.step[...], optimizer.loss_scale, optimizer.skipped_steps
    (Array(1, dtype=uint32), Array(128., dtype=float32), Array(1, dtype=int32))
  """

  def __init__(self, model: Any, tx: Any, *, wrt: Any, **kwargs: Any):
    super().__init__(model, tx, wrt=wrt, **kwargs)
    state_lib.check_compositions(_as_pure(self.opt_state))
    if jax.tree.leaves(nnx.state(nnx.state(model, wrt), OverwriteWithGradient)):
      raise ValueError(
          f"wrt={wrt!r} selects Flax's fp8 state ({fp8.OVERWRITE_WITH_GRADIENT} variables): "
          "the optimizer must not step it. Pass wrt=nnx.Param and differentiate with respect to "
          "nnx.Any(nnx.Param, jaxamp.nnx.OverwriteWithGradient); update() overwrites it.")
    values = _as_pure(nnx.state(model, OverwriteWithGradient))
    accumulates = bool(state_lib.find_states(_as_pure(self.opt_state),
                                             state_lib.AccumulationState))
    # The open accumulation window's maximum of the fp8 values (see fp8.py).
    self.fp8_window = (nnx.data(jax.tree.map(nnx.OptState, fp8.empty_window(values)))
                       if accumulates and jax.tree.leaves(values) else None)

  def update(self, model: Any, grads: Any, /, **kwargs: Any) -> Any:
    """Updates the parameters and optimizer state; ``step`` advances only if applied.

    Args:
      model: the module being optimized.
      grads: the gradients of the *scaled* loss (see :meth:`scale_loss`).
      **kwargs: extra arguments for ``tx.update``.

    Returns:
      The updates that were applied (zeros for a skipped step).
    """
    step = self.step[...]
    before = _as_pure(self.opt_state)
    # A non-finite fp8 value (a saturated overflow) skips the step (fp8.flag_overflow).
    new = _as_pure(nnx.state(grads, OverwriteWithGradient))
    if jax.tree.leaves(new):
      grads = fp8.flag_overflow(grads, new, before)
    with state_lib.promotion_for_updates(before):
      updates = super().update(model, grads, **kwargs)
    after = _as_pure(self.opt_state)
    applied = state_lib.update_applied(before, after)
    self._overwrite_fp8(model, grads, applied, after)
    self.step[...] = jnp.where(applied, optax.safe_increment(step), step).astype(step.dtype)
    return updates

  def _overwrite_fp8(self, model: Any, grads: Any, applied: jax.Array, after: Any) -> None:
    """Writes the fp8 values of ``grads`` into ``model`` where the step was applied."""
    new = _as_pure(nnx.state(grads, OverwriteWithGradient))
    if not jax.tree.leaves(new):
      return
    old = _as_pure(nnx.state(model, OverwriteWithGradient))
    window = None if self.fp8_window is None else _as_pure(self.fp8_window)
    window, values = fp8.step_values(window, new, old, applied, after)
    if self.fp8_window is not None:
      jax.tree.map(lambda var, value: var.set_value(value), self.fp8_window, window,
                   is_leaf=lambda x: isinstance(x, nnx.Variable))
    nnx.update(model, values)

  @property
  def loss_scale(self) -> jax.Array:
    """The current loss scale (float32 scalar); 1.0 without loss scaling."""
    return state_lib.loss_scale_or_one(_as_pure(self.opt_state))

  def scale_loss(self, loss: Any) -> jax.Array:
    """Returns ``loss * loss_scale``, promoting a half-precision loss to float32."""
    return state_lib.multiply_by_scale(loss, self.loss_scale)

  @property
  def skipped_steps(self) -> jax.Array:
    """Optimizer steps skipped so far for non-finite gradients."""
    return state_lib.skipped_steps(_as_pure(self.opt_state))

  def step_metrics(self) -> dict:
    """:func:`jaxamp.step_metrics` of the optimizer state."""
    return state_lib.step_metrics(_as_pure(self.opt_state))
