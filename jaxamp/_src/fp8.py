"""Flax's fp8 layers: the overwrite-with-gradient state, kept out of the optimizer and overwritten.

Flax's fp8 layers (``flax.linen.fp8_ops``: ``Fp8DirectDotGeneralOp``,
``Fp8Einsum``) keep delayed-scaling statistics (amax histories and scales)
in the variable collection ``'_overwrite_with_gradient'``. Their backward
pass returns the *new values* of those variables where the gradients would
be. Every jaxamp path treats them as flax's ``TrainState`` does, with the
functions of this module:

- the optimizer, the loss scaler's unscaling and its finite check see the
  tree without that collection (:func:`split`);
- the collection is overwritten with the returned values when the step is
  applied and they are finite, and keeps its old values on a skipped step or
  a micro-step that does not close its accumulation window (:func:`overwrite`);
- a non-finite returned value (the inf amax of an overflowing gradient, which
  the layer's e5m2 quantization saturates, so that the parameters' gradients
  may stay finite) skips the step as a non-finite gradient does, where the
  transformation can skip (:func:`flag_overflow`): the loss scale backs off;
- micro-steps combine by an elementwise maximum (:func:`accumulate`): every
  micro-step of a window starts from the same fp8 state, so the scales and
  the rolled histories they return are identical and only the newest amax
  differs; the maximum of the returned trees is what one step on the
  concatenated batch returns.

A tree "holds fp8 state" when it is a mapping with the key
``'_overwrite_with_gradient'`` at its top, as Linen's variable dicts are.
jaxamp never imports flax for this.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxamp._src import finite
from jaxamp._src import state as state_lib
from jaxamp._src import validation
from jaxamp._src.state import AccumulationState

OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"


def holds_fp8(tree: Any) -> bool:
  """Whether ``tree`` is a mapping with the overwrite-with-gradient collection at its top."""
  return isinstance(tree, Mapping) and OVERWRITE_WITH_GRADIENT in tree


def split(tree: Any) -> tuple[Any, Any]:
  """``(rest, fp8)``: the tree without the fp8 collection, and the collection (or None)."""
  if not holds_fp8(tree):
    return tree, None
  rest = {k: v for k, v in tree.items() if k != OVERWRITE_WITH_GRADIENT}
  return _like(tree, rest), tree[OVERWRITE_WITH_GRADIENT]


def merge(rest: Any, fp8: Any) -> Any:
  """The inverse of :func:`split` (``rest`` itself when ``fp8`` is None)."""
  if fp8 is None:
    return rest
  return _like(rest, {**rest, OVERWRITE_WITH_GRADIENT: fp8})


def _like(template: Mapping, items: dict) -> Any:
  """``items`` as a mapping of ``template``'s type (dict, flax's FrozenDict, ...)."""
  if type(template) is dict:
    return items
  kind: Any = type(template)
  try:
    return kind(items)
  except TypeError:
    return items


def map_parts(rest_fn: Callable[..., Any], fp8_fn: Callable[..., Any], tree: Any,
              *others: Any) -> Any:
  """``jax.tree.map`` of ``rest_fn`` over the ordinary leaves and ``fp8_fn`` over the fp8 ones."""
  rest, fp8 = split(tree)
  others_split = [split(o) for o in others]
  new_rest = jax.tree.map(rest_fn, rest, *(r for r, _ in others_split))
  if fp8 is None:
    return new_rest
  return merge(new_rest, jax.tree.map(fp8_fn, fp8, *(f for _, f in others_split)))


def _maximum(acc: jax.Array, value: jax.Array) -> jax.Array:
  """How fp8 values combine over micro-steps: the elementwise maximum, in ``acc``'s dtype."""
  return jnp.maximum(acc, value.astype(acc.dtype))


def accumulate(acc: Any, grads: Any, add: Callable[[Any, Any], Any]) -> Any:
  """Adds a micro-step's gradients into ``acc`` with ``add``; fp8 values combine by maximum."""
  return map_parts(add, _maximum, acc, grads)


def select(applied: jax.Array, new: Any, old: Any) -> Any:
  """``new`` where ``applied``, else ``old`` (leafwise, in ``old``'s dtypes)."""
  # The casts of this module are to a leaf's own dtype (float32 in Flax's layers): jaxamp rounds
  # nothing here; the fp8 quantization is the layers' own.
  return jax.tree.map(lambda n, o: jnp.where(applied, jnp.asarray(n).astype(o.dtype), o), new, old)


def written(applied: jax.Array, new_fp8: Any) -> jax.Array:
  """Whether the step writes the fp8 values: applied, and every value finite."""
  return jnp.logical_and(applied, finite.all_finite(new_fp8))


def check_values(new_fp8: Any, old_fp8: Any) -> None:
  """Refuses returned fp8 values of another tree structure or shape than the collection's."""
  validation.check_shapes_like(f"the returned '{OVERWRITE_WITH_GRADIENT}' values", new_fp8,
                               "the variables", old_fp8)


def step_values(window: Any, new_fp8: Any, old_fp8: Any, applied: jax.Array,
                after: Any) -> tuple[Any, Any]:
  """``(window, values)``: one step's fp8 values to write, and the accumulation window after it.

  The one copy of the rule, for :func:`overwrite_with_gradient` (and so
  ``TrainState``) and ``jaxamp.nnx.Optimizer``: the step's returned values
  ``new_fp8`` join the open window by maximum; the window starts afresh
  (:func:`empty_window`) where the update closed it; the values written are
  the combined ones where the step was applied and they are finite
  (:func:`written`), ``old_fp8`` otherwise.

  Args:
    window: the open window's maximum; ``None`` or ``optax.EmptyState()``
      (returned as given) when nothing accumulates.
    new_fp8: the values the step's backward pass returned.
    old_fp8: the values before the step.
    applied: bool scalar, whether the step was applied
      (``state.update_applied``).
    after: the optimizer state the update returned (says whether the window
      closed).
  """
  check_values(new_fp8, old_fp8)
  combined = new_fp8
  if jax.tree.leaves(window):
    combined = jax.tree.map(_maximum, window, new_fp8)
    window = select(state_lib.window_closed(after), empty_window(window), combined)
  return window, select(written(applied, combined), combined, old_fp8)


def overwrite(rest: Any, old_fp8: Any, new_fp8: Any, applied: jax.Array) -> Any:
  """``rest`` with the fp8 collection: ``new_fp8`` where :func:`written`, else ``old_fp8``."""
  if old_fp8 is None:
    return rest
  return merge(rest, step_values(None, new_fp8, old_fp8, applied, None)[1])


def can_skip(inner_state: Any) -> bool:
  """Whether the transformation of ``inner_state`` skips non-finite steps (static)."""
  return (state_lib.skips_nonfinite_steps(inner_state)
          or bool(state_lib.find_states(inner_state, AccumulationState)))


def flag_overflow(grads: Any, new_fp8: Any, inner_state: Any) -> Any:
  """``grads``, made NaN when a returned fp8 value is not finite and the transformation skips.

  An fp8 layer's backward pass quantizes the output gradients to e5m2 with
  saturation: an overflowing (scaled) gradient leaves an inf amax but finite
  parameter gradients. Handed on as non-finite gradients, the overflow skips
  the step and backs off the loss scale, as it would without fp8 layers.
  """
  if new_fp8 is None or not can_skip(inner_state):
    return grads
  ok = finite.all_finite(new_fp8)

  def flag(g):
    if not jnp.issubdtype(jnp.result_type(g), jnp.inexact):
      return g
    return jnp.where(ok, g, jnp.asarray(jnp.nan, jnp.result_type(g)))

  return jax.tree.map(flag, grads)


def unscale(grads: Any, scale: jax.Array) -> Any:
  """``finite.unscale`` of the gradients; the fp8 values are not gradients and stay as they are."""
  rest, values = split(grads)
  return merge(finite.unscale(rest, scale), values)


def unscale_and_check(grads: Any, scale: jax.Array) -> tuple[Any, jax.Array]:
  """``(unscale(grads, scale), found_inf)``, for the facades' scalers.

  ``found_inf`` is checked on the unscaled gradients as they are returned (the
  facades keep them, as ``opt.grads``: a donating holder writes them into the
  scaled ones' buffer, and the check then reads that buffer rather than the
  raw gradients, which would need a copy), and is also set by a non-finite
  fp8 value (a saturated overflow, see :func:`flag_overflow`).
  """
  rest, values = split(grads)
  unscaled = finite.unscale(rest, scale)
  found_inf = jnp.logical_not(finite.all_finite(unscaled))
  if values is not None:
    found_inf = jnp.logical_or(found_inf, jnp.logical_not(finite.all_finite(values)))
  return merge(unscaled, values), found_inf


def pmean(grads: Any, axis_name: Any, *others: Any) -> Any:
  """``lax.pmean`` of the gradients over ``axis_name``; the fp8 values take ``lax.pmax``.

  An fp8 value is an amax (or a scale and history derived from one): its
  average over the devices would underestimate it. ``others`` (a loss, say)
  are averaged in the same all-reduce as the gradients, and then
  ``(grads, *others)`` is returned.
  """
  rest, fp8 = split(grads)
  rest, *others = lax.pmean((rest, *others), axis_name)
  grads = merge(rest, None if fp8 is None else lax.pmax(fp8, axis_name))
  return (grads, *others) if others else grads


def empty_window(fp8: Any) -> Any:
  """The identity of the maximum, shaped like ``fp8``: no micro-step seen yet."""
  return jax.tree.map(lambda x: jnp.full(jnp.shape(x), -jnp.inf, jnp.result_type(x)), fp8)


def refuse(params: Any, where: str) -> None:
  """Raises when a transformation is initialized on a tree holding fp8 state."""
  if holds_fp8(params):
    raise ValueError(
        f"{where} was initialized on parameters holding Flax's fp8 collection "
        f"'{OVERWRITE_WITH_GRADIENT}': the optimizer and the loss scaler must not see it "
        "(it would be unscaled, averaged and stepped). Use jaxamp.TrainState, or wrap the "
        "whole transformation in jaxamp.overwrite_with_gradient(...) and apply its updates "
        "with jaxamp.apply_updates.")


@jax.tree_util.register_pytree_node_class
class Overwrite:
  """Values that replace the parameters' fp8 collection (not updates to add).

  Only :func:`apply_updates` applies them; ``optax.apply_updates`` refuses a
  tree holding one (its structure differs from the parameters').
  """

  def __init__(self, values: Any):
    self.values = values

  def tree_flatten(self) -> tuple[tuple[Any], None]:
    return (self.values,), None

  @classmethod
  def tree_unflatten(cls, aux: None, children: tuple[Any]) -> "Overwrite":
    del aux
    return cls(children[0])

  def __repr__(self) -> str:
    return f"Overwrite({self.values!r})"


@state_lib.declare_state_around_scaler
class OverwriteWithGradientState(NamedTuple):
  """State of :func:`overwrite_with_gradient`.

  Attributes:
    window: the elementwise maximum of the fp8 values returned by the
      micro-steps of the open accumulation window (``-inf`` where none
      was seen); ``optax.EmptyState()`` when the inner transformation does
      not accumulate.
    inner_state: the state of the wrapped transformation.
  """

  window: Any
  inner_state: Any


def overwrite_with_gradient(inner: optax.GradientTransformation
                            ) -> optax.GradientTransformationExtraArgs:
  """Keeps Flax's fp8 collection away from ``inner`` and overwrites it, as flax's ``TrainState``.

  For the functional core with Flax's fp8 layers (``flax.linen.fp8_ops``),
  whose variables hold the collection ``'_overwrite_with_gradient'`` next to
  ``'params'``: wrap the whole transformation (loss scaling and
  accumulation included) and pass it the whole variable dict::

    tx = jaxamp.overwrite_with_gradient(jaxamp.dynamic_loss_scale(optax.adam(1e-3)))
    opt_state = tx.init(variables)
    grads = jax.grad(lambda v: jaxamp.scale_loss(loss_fn(v, batch), opt_state))(variables)
    updates, opt_state = tx.update(grads, opt_state, variables)
    variables = jaxamp.apply_updates(variables, updates)

  ``inner`` sees the tree without the collection: its gradients are
  unscaled, checked and stepped as usual, and the fp8 values take no part
  in the decision to skip, except that a non-finite one (an overflow that
  the layer's e5m2 quantization saturated) skips the step where ``inner``
  can skip (a loss scaler or :func:`accumulate_gradients` inside). The
  collection's entry of the returned updates holds the values to write (an
  ``Overwrite``): the values the backward pass returned when ``inner``
  applied its step, the old ones when it skipped the step (a non-finite
  amax never enters a history) or only accumulated. Inside
  :func:`accumulate_gradients` the values of a window's micro-steps are
  combined by an elementwise maximum, kept in this transformation's state,
  so the window's step writes what one step on the concatenated batch would.
  Apply the updates with :func:`apply_updates`; ``optax.apply_updates``
  refuses them. Keep this transformation outermost.

  :class:`TrainState`, ``jaxamp.nnx.Optimizer`` and the mmengine-style
  wrappers do all this themselves: pass them an unwrapped ``tx``.

  Args:
    inner: the transformation for everything but the fp8 collection.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is an
    :class:`OverwriteWithGradientState`. ``update`` needs ``params`` when
    the gradients hold the fp8 collection.

  Raises:
    TypeError: when ``inner`` is not an optax transformation.
    ValueError: (at ``update``, trace time) returned fp8 values of another
      tree structure or shape than the collection's, named by the leaf.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> variables = {'params': {'w': jnp.ones(2)},
    ...              '_overwrite_with_gradient': {'amax': jnp.zeros(2)}}
    >>> tx = jaxamp.overwrite_with_gradient(jaxamp.dynamic_loss_scale(optax.sgd(0.5)))
    >>> state = tx.init(variables)
    >>> grads = {'params': {'w': jnp.full(2, 2.0**16)},  # scaled by the loss scale
    ...          '_overwrite_with_gradient': {'amax': jnp.array([3.0, 4.0])}}
    >>> updates, state = tx.update(grads, state, variables)
    >>> variables = jaxamp.apply_updates(variables, updates)
    >>> variables['params']['w'], variables['_overwrite_with_gradient']['amax']
    (Array([0.5, 0.5], dtype=float32), Array([3., 4.], dtype=float32))
  """

  inner = validation.check_gradient_transformation(inner, "inner")

  def init_fn(params: Any) -> OverwriteWithGradientState:
    rest, fp8 = split(params)
    inner_state = inner.init(rest)
    state_lib.check_compositions(inner_state)
    accumulates = bool(state_lib.find_states(inner_state, AccumulationState))
    window = empty_window(fp8) if (fp8 is not None and accumulates) else optax.EmptyState()
    return OverwriteWithGradientState(window=window, inner_state=inner_state)

  def update_fn(updates: optax.Updates, state: Any, params: Optional[optax.Params] = None,
                **extra_args: Any) -> tuple[optax.Updates, Any]:
    grads, new_fp8 = split(updates)
    rest_params, old_fp8 = split(params)
    if new_fp8 is not None and old_fp8 is None:
      raise ValueError("overwrite_with_gradient: the gradients hold the fp8 collection "
                       f"'{OVERWRITE_WITH_GRADIENT}'; pass the variables as params to update()")
    if new_fp8 is not None:
      check_values(new_fp8, old_fp8)
    grads = flag_overflow(grads, new_fp8, state.inner_state)
    rest_updates, inner_state = inner.update(grads, state.inner_state, rest_params, **extra_args)
    if new_fp8 is None:
      return rest_updates, state._replace(inner_state=inner_state)
    applied = state_lib.update_applied(state.inner_state, inner_state)
    window, values = step_values(state.window, new_fp8, old_fp8, applied, inner_state)
    return (merge(rest_updates, Overwrite(values)),
            OverwriteWithGradientState(window=window, inner_state=inner_state))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def apply_updates(params: Any, updates: Any) -> Any:
  """``optax.apply_updates``, writing the fp8 values of :func:`overwrite_with_gradient`.

  The ordinary entries are added as ``optax.apply_updates`` adds them; the
  fp8 collection is replaced by the values the updates carry. Without fp8
  state this is ``optax.apply_updates``.

  Args:
    params: the variables (Linen's ``{'params': ..., '_overwrite_with_gradient': ...}``).
    updates: the updates of a transformation wrapped in :func:`overwrite_with_gradient`.

  Returns:
    The new variables.
  """
  rest_updates, fp8 = split(updates)
  if not isinstance(fp8, Overwrite):
    return optax.apply_updates(params, updates)
  rest_params, old = split(params)
  new = jax.tree.map(lambda n, o: jnp.asarray(n).astype(o.dtype), fp8.values, old)
  return merge(optax.apply_updates(rest_params, rest_updates), new)
