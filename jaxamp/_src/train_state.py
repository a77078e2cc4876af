"""A Flax-style train state that carries the loss-scale state and counts only applied steps."""

from __future__ import annotations

import dataclasses
import importlib
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp._src import fp8
from jaxamp._src import sharding
from jaxamp._src import outside
from jaxamp._src import state as state_lib
from jaxamp._src import validation


@dataclasses.dataclass(frozen=True)
class TrainState:
  """A train state for Flax Linen (or any functional model) with loss scaling built in.

  It has the fields and methods of ``flax.training.train_state.TrainState``
  (``step``, ``apply_fn``, ``params``, ``tx``, ``opt_state``, ``create``,
  ``apply_gradients``, ``replace``) without importing flax, and differs in one
  respect: ``step`` counts the parameter updates actually applied. A step
  skipped because the (loss-scaled) gradients were not finite, and a
  non-emitting micro-step of :func:`accumulate_gradients`, leave it unchanged,
  so it always equals the optimizer's own step count and drives schedules,
  logging and checkpoint names correctly. (Flax's ``DynamicScale`` recipe
  selects the old params and optimizer state on a bad step, but its ``step``
  still advances.)

  The loss-scale state lives inside ``opt_state``: build ``tx`` with
  :func:`dynamic_loss_scale` (optionally inside :func:`accumulate_gradients`),
  multiply the loss with :meth:`scale_loss` inside the differentiated function
  and pass the resulting gradients to :meth:`apply_gradients`, which unscales,
  checks, skips or steps. Without a loss-scale state in ``tx`` the scale is
  1.0 and nothing is skipped, so the same step function runs with and without
  loss scaling.

  With Flax's fp8 layers (``flax.linen.fp8_ops``) pass the whole variable
  dict as ``params``: as in Flax's ``TrainState``, the collection
  ``'_overwrite_with_gradient'`` is kept from ``tx`` and overwritten with
  the values the backward pass returned, and only where the step is applied
  (see :func:`overwrite_with_gradient`, which ``tx`` is wrapped in then).

  ``apply_fn`` and ``tx`` are static (part of the tree structure); the other
  fields are pytree data. To add fields (``batch_stats`` for BatchNorm, say),
  subclass it as flax's is subclassed::

    class State(jaxamp.TrainState):
      batch_stats: Any

    state = State.create(apply_fn=..., params=..., tx=..., batch_stats=...)

  :meth:`create` makes the subclass a frozen dataclass and a registered
  pytree if it is not one yet (decorating it yourself works too). In a
  program that imports flax before creating the state, states (subclasses
  included) serialize with ``flax.serialization.to_bytes``/``from_bytes``
  and ``to_state_dict`` (jaxamp never imports flax on its own).

  Attributes:
    step: int32 scalar, the number of applied updates (saturates).
    apply_fn: the model's apply function, e.g. ``module.apply`` (static).
    params: the (float32 master) parameters.
    tx: the optax transformation (static).
    opt_state: its state, holding the loss-scale state.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxamp
    >>> apply_fn = lambda params, x: x @ params['w'].astype(x.dtype)
    >>> state = jaxamp.TrainState.create(
    ...     apply_fn=apply_fn, params={'w': jnp.ones((2, 1))},
    ...     tx=jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**8))
    >>> @jax.jit
    ... def train_step(state, x, y):
    ...   def loss_fn(params):
    ...     pred = state.apply_fn(params, x.astype(jnp.float16))
    ...     return state.scale_loss(jnp.mean((pred.astype(jnp.float32) - y) ** 2))
    ...   grads = jax.grad(loss_fn)(state.params)
    ...   return state.apply_gradients(grads=grads)
    >>> x, y = jnp.ones((4, 2)), jnp.zeros((4, 1))
    >>> state = train_step(state, x, y)
    >>> state.step, state.loss_scale
    (Array(1, dtype=int32), Array(256., dtype=float32))
    >>> state = train_step(state, x.at[0, 0].set(jnp.inf), y)  # overflow: skipped
    >>> state.step, state.loss_scale, state.skipped_steps
    (Array(1, dtype=int32), Array(128., dtype=float32), Array(1, dtype=int32))
  """

  step: jax.Array
  apply_fn: Callable[..., Any] = dataclasses.field(metadata={"static": True})
  params: Any
  tx: optax.GradientTransformation = dataclasses.field(metadata={"static": True})
  opt_state: optax.OptState

  @classmethod
  def create(cls, *, apply_fn: Callable[..., Any], params: Any,
             tx: optax.GradientTransformation, **kwargs: Any) -> "TrainState":
    """Creates the state with ``step = 0`` and ``opt_state = tx.init(params)``.

    Args:
      apply_fn: the model's apply function.
      params: the (float32) parameters; a Linen ``{'params': ...}`` dict is
        not unwrapped, pass ``variables['params']``, or the whole variable
        dict for a model with fp8 layers.
      tx: the optax transformation.
      **kwargs: values of the fields a subclass adds.

    Returns:
      The new state.

    Raises:
      TypeError: when ``tx`` is not an optax transformation.
      ValueError: when ``tx`` holds a loss scaler in a composition that
        cannot work (see :func:`jaxamp.get_loss_scale_state`).
    """
    if not validation.is_gradient_transformation(tx):
      raise TypeError(f"tx must be an optax GradientTransformation, got {tx!r}")
    _make_pytree(cls)
    opt_state = _with_fp8(tx, params).init(params)
    state_lib.check_compositions(opt_state)
    return cls(step=jnp.zeros([], jnp.int32), apply_fn=apply_fn, params=params, tx=tx,
               opt_state=opt_state, **kwargs)

  def value_and_grad(self, fun: Callable[..., Any], argnums: Any = 0, has_aux: bool = False,
                     axis_name: Any = None) -> Callable[..., tuple[Any, Any]]:
    """``jax.value_and_grad`` of ``fun`` times the loss scale: the drop-in for flax's ``DynamicScale``.

    Returns a function that gives ``(value, grads)``: ``value`` is ``fun``'s
    own (unscaled) output, ``(loss, aux)`` with ``has_aux``, and ``grads`` the
    gradients of the scaled loss, averaged over ``axis_name`` (``lax.pmean``)
    when given, ready for :meth:`apply_gradients`, which unscales, checks and
    skips. Inside ``shard_map`` each device differentiates its own copy of
    replicated parameters, so that their gradients are averaged, not summed
    over the devices first; Flax's fp8 values take the maximum over the
    devices (``lax.pmax``). Flax's ``dynamic_scale.value_and_grad(fun, has_aux=True)(params)``
    returns ``(dynamic_scale, is_fin, aux, grads)`` instead: here the scale and
    the decision live in ``opt_state``.
    """

    def scaled(*args: Any) -> Any:
      out = fun(*args)
      loss, aux = out if has_aux else (out, None)
      return self.scale_loss(loss), (loss, aux)

    grad_fn = jax.grad(scaled, argnums, has_aux=True)

    def wrapped(*args: Any) -> tuple[Any, Any]:
      if axis_name is not None:
        # Each device's own gradients, averaged once (see sharding.own_copies).
        nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
        args = tuple(sharding.own_copies(a, axis_name) if i in nums else a
                     for i, a in enumerate(args))
      grads, (loss, aux) = grad_fn(*args)
      if axis_name is not None:
        grads = fp8.pmean(grads, axis_name)
      return ((loss, aux) if has_aux else loss), grads

    return wrapped

  def apply_gradients(self, *, grads: Any, **kwargs: Any) -> "TrainState":
    """Runs ``tx.update`` and applies the updates; ``step`` advances only if applied.

    Args:
      grads: the gradients of the *scaled* loss (see :meth:`scale_loss`),
        with the structure and float32 dtypes of ``params``.
      **kwargs: other fields to replace (e.g. ``batch_stats``). On a step
        skipped for non-finite gradients, and wherever the new values hold an
        inf or a nan, each keeps its previous value (see
        :func:`jaxamp.keep_if_skipped`): the statistics of a bad batch never
        reach the state. A field whose new value has another tree structure
        than the old one is replaced as given.

    Returns:
      The new state.

    Raises:
      ValueError: gradients of another tree structure or leaf shape than
        ``params`` (a gradient of shape ``(1,)`` would otherwise step every
        element of its parameter; extra leading, per-example axes are
        accepted when ``tx`` reduces them), or updates of another shape,
        named by the leaf.
    """
    validation.check_shapes_like("the gradients", grads, "the parameters", self.params,
                                 leading=True)
    updates, opt_state = _with_fp8(self.tx, self.params).update(grads, self.opt_state,
                                                                 self.params)
    validation.check_shapes_like("the updates", fp8.split(updates)[0], "the parameters",
                                 fp8.split(self.params)[0])
    with state_lib.promotion_for_updates(opt_state):
      params = fp8.apply_updates(self.params, updates)
    applied = state_lib.update_applied(self.opt_state, opt_state)
    step = jnp.where(applied, optax.safe_increment(self.step), self.step)
    for name, value in kwargs.items():
      previous = getattr(self, name, None)
      same_tree = jax.tree.structure(previous) == jax.tree.structure(value)  # type: ignore[operator]
      if same_tree:
        kwargs[name] = state_lib.keep_if_skipped(value, previous, self.opt_state, opt_state)
    return self.replace(step=step.astype(self.step.dtype), params=params, opt_state=opt_state,
                        **kwargs)

  def replace(self, **changes: Any) -> "TrainState":
    """Returns a copy with the given fields replaced."""
    return dataclasses.replace(self, **changes)

  @property
  def loss_scale(self) -> jax.Array:
    """The current loss scale (float32 scalar); 1.0 without loss scaling."""
    return state_lib.loss_scale_or_one(self.opt_state)

  def scale_loss(self, loss: Any) -> jax.Array:
    """Returns ``loss * loss_scale``, promoting a half-precision loss to float32."""
    return state_lib.multiply_by_scale(loss, self.loss_scale)

  def step_metrics(self) -> dict:
    """:func:`jaxamp.step_metrics` of :attr:`opt_state`."""
    return state_lib.step_metrics(self.opt_state)

  @property
  def skipped_steps(self) -> jax.Array:
    """Optimizer steps skipped so far for non-finite gradients (see :func:`skipped_steps`)."""
    return state_lib.skipped_steps(self.opt_state)


def _with_fp8(tx: optax.GradientTransformation, params: Any) -> optax.GradientTransformation:
  """``tx``, wrapped in :func:`overwrite_with_gradient` when ``params`` hold Flax's fp8 state."""
  return fp8.overwrite_with_gradient(tx) if fp8.holds_fp8(params) else tx


def _make_pytree(cls: type) -> None:
  """Makes a subclass of :class:`TrainState` a frozen dataclass and a registered pytree."""
  if "__dataclass_params__" not in cls.__dict__:
    dataclasses.dataclass(frozen=True)(cls)
  try:
    jax.tree_util.register_dataclass(cls)
  except ValueError:  # registered already (by its own decorator, or an earlier create)
    pass
  serialization = _flax_serialization()
  if serialization is not None:
    serialization.register_serialization_state(cls, _to_state_dict, _from_state_dict, override=True)


def _flax_serialization() -> Any:
  """``flax.serialization`` when the program uses flax (never imports flax on its own)."""
  if "flax" not in sys.modules:
    return None
  return importlib.import_module("flax.serialization")


def _data_fields(state: Any) -> list[str]:
  return [f.name for f in dataclasses.fields(state) if not f.metadata.get("static")]


def _to_state_dict(state: Any) -> dict:
  serialization = _flax_serialization()
  return {name: serialization.to_state_dict(getattr(state, name)) for name in _data_fields(state)}


def _held_like(value: Any, target: Any) -> Any:
  """A restored (checked) leaf as the target's leaf is held: a JAX array of its dtype and sharding.

  ``flax.serialization`` restores numpy arrays and Python numbers; a numpy
  scalar in the optimizer state would be a constant of the traced update.
  """
  if isinstance(value, jax.Array) or not isinstance(target, jax.Array):
    return value
  return jax.device_put(np.asarray(value, target.dtype), target.sharding)


def _from_state_dict(target: Any, state_dict: dict) -> Any:
  """The restore hook of ``flax.serialization``: ``target`` with the values of ``state_dict``.

  What it restores is checked as every state from outside is: ``step`` a
  whole number in an int32, ``opt_state`` with :func:`jaxamp.validate_opt_state`
  against the target's (a restored scale of nan would skip every later step),
  and held as the target holds it (see :func:`_held_like`). Under a trace
  (abstract values) only the structure is restored.
  """
  serialization = _flax_serialization()
  missing = [name for name in _data_fields(target) if name not in state_dict]
  if missing:
    raise ValueError(f"the state dict of {type(target).__name__} lacks the fields {missing}")
  restored = {name: serialization.from_state_dict(getattr(target, name), state_dict[name],
                                                  name=name)
              for name in _data_fields(target)}
  if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(restored)):
    outside.counter("step", outside.scalar("step", restored["step"]))
    outside.validate_opt_state(restored["opt_state"], target.opt_state)
    for name in ("step", "opt_state"):
      restored[name] = jax.tree.map(_held_like, restored[name], getattr(target, name))
  return target.replace(**restored)


_make_pytree(TrainState)
