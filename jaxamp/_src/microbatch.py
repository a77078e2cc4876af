"""In-step microbatching: the gradient of a large batch as a scan over micro-batches."""

from __future__ import annotations

import numbers
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxamp._src import finite
from jaxamp._src import fp8
from jaxamp._src import sharding
from jaxamp._src import state as state_lib
from jaxamp._src import validation


def _wider(dtype: jnp.dtype, floor: jnp.dtype) -> jnp.dtype:
  """``dtype`` if it has more bits than ``floor``, else ``floor`` (whatever the promotion mode).

  A complex ``dtype`` gives a complex dtype whose parts are the wider of its
  parts and ``floor``: complex gradients keep their imaginary parts.
  """
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    part = _wider(jnp.finfo(dtype).dtype, floor)
    return jnp.dtype(jnp.complex128 if part == jnp.float64 else jnp.complex64)
  if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits > jnp.finfo(floor).bits:
    return dtype
  return jnp.dtype(floor)


def _scale_value(loss_scale: Any) -> Optional[jax.Array]:
  """The loss scale as a float32 scalar: given directly, or found in an optax state."""
  if loss_scale is None:
    return None
  if isinstance(loss_scale, (jax.Array, np.ndarray, np.generic, numbers.Real)):
    value = jnp.asarray(loss_scale)
    real = jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype, jnp.integer)
    if value.shape != () or not real:
      raise ValueError("loss_scale must be a scalar or an optimizer state holding a loss "
                       f"scale, got an array of shape {value.shape} and dtype {value.dtype}")
    return value.astype(jnp.float32)
  return state_lib.loss_scale(loss_scale)


def _split(batch: Any, num: int) -> Any:
  """Splits every leaf's leading axis into ``num`` strided micro-batches (leading axis)."""
  leaves = jax.tree.leaves(batch)
  if not leaves:
    raise ValueError("batch must hold at least one array with a leading batch axis")
  sizes = set()
  for leaf in leaves:
    shape = jnp.shape(leaf)
    if not shape:
      raise ValueError("every leaf of batch needs a leading batch axis, got a scalar leaf")
    sizes.add(shape[0])
  if len(sizes) != 1:
    raise ValueError(f"every leaf of batch must have the same leading (batch) size, got sizes "
                     f"{sorted(sizes)}")
  (size,) = sizes
  if size % num:
    raise ValueError(f"the batch size {size} is not a multiple of num_microbatches={num}")
  per = size // num

  def split(x):
    x = jnp.asarray(x)
    # Example i*num + j goes to micro-batch j: a batch sharded along its
    # leading axis keeps every device busy in every micro-batch.
    return jnp.swapaxes(x.reshape((per, num) + x.shape[1:]), 0, 1)

  return jax.tree.map(split, batch)


def microbatch_value_and_grad(
    loss_fn: Callable[..., Any],
    num_microbatches: int,
    *,
    has_aux: bool = False,
    axis_name: finite.AxisName = None,
    accumulator_dtype: Any = jnp.float32,
) -> Callable[..., Any]:
  """Like ``jax.value_and_grad``, computing a large batch as a scan over micro-batches.

  The returned function ``fn(params, batch, *args, loss_scale=None,
  **kwargs)`` splits every leaf of ``batch`` along its leading axis into
  ``num_microbatches`` equal micro-batches, runs ``loss_fn(params,
  micro_batch, *args, **kwargs)`` and its gradient on each inside one
  ``lax.scan`` (so only one micro-batch's activations are alive at a time),
  adds the gradients into an accumulator of ``accumulator_dtype``, and
  returns the mean loss and the mean gradients: those of the whole batch,
  within float rounding, when ``loss_fn`` returns a mean over its examples.
  Micro-batch ``j`` holds the examples ``j, j + n, j + 2n, ...`` (``n =
  num_microbatches``), so a batch sharded along its leading axis keeps every
  device busy in every micro-batch. ``args`` and ``kwargs`` are passed
  unchanged to every call (split random keys yourself, or put per-example
  keys in ``batch``).

  With ``loss_scale`` (a scalar, or an optimizer state holding a
  :func:`dynamic_loss_scale`/:func:`static_loss_scale` state, found as
  :func:`loss_scale` finds it), the gradients are those of
  ``loss * loss_scale`` (the loss promoted to float32 first), ready for the
  loss-scaling transformation to unscale and check, while the returned loss
  is the unscaled mean. The scale is the same for every micro-batch, and
  the loss scaler checks and skips the whole batch once: PyTorch's
  accumulation recipe, in one call.

  The values that Flax's fp8 layers return for their collection
  ``'_overwrite_with_gradient'`` are combined by their maximum, not
  averaged (``lax.pmax`` over ``axis_name``): the fp8 state of one step on
  the whole batch (see :func:`overwrite_with_gradient`).

  With ``has_aux``, ``loss_fn`` returns ``(loss, aux)`` and the returned
  aux is every micro-batch's aux stacked along a new leading axis of size
  ``num_microbatches`` (take ``.mean(0)`` of metrics, ``[-1]`` of a state).
  With ``axis_name`` (inside ``shard_map``/``pmap``) the mean loss and
  gradients are also averaged across that mapped axis, once per call.

  Choose this over :func:`accumulate_gradients` when the whole large batch
  is at hand in one step: one jitted call, one optimizer update, no
  accumulator in the optimizer state, one all-reduce. Choose
  :func:`accumulate_gradients` when micro-batches arrive over separate
  calls (a data loader yielding micro-batches, ported PyTorch/mmengine
  loops, ``total_steps`` remainders).

  Args:
    loss_fn: ``loss_fn(params, batch, *args, **kwargs)`` returning a scalar
      loss (the mean over the examples of ``batch``), or ``(loss, aux)``
      with ``has_aux``.
    num_microbatches: number of micro-batches, an int >= 1 dividing the batch
      size.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    axis_name: mapped axis name (or tuple of names) to average the loss and
      gradients over; ``None`` for none.
    accumulator_dtype: floating dtype of the gradient and loss accumulators;
      a leaf of a wider dtype keeps its own, and a complex leaf sums in a
      complex dtype whose parts are at least as wide.

  Returns:
    ``fn(params, batch, *args, loss_scale=None, **kwargs)`` returning
    ``(loss, grads)``, or ``((loss, aux), grads)`` with ``has_aux``. The
    gradients have the dtypes ``jax.grad`` gives; the loss is returned in
    float32 (or its own dtype if wider).

  Raises:
    TypeError: for arguments of the wrong type.
    ValueError: for ``num_microbatches < 1``; at trace time, for a batch size
      that ``num_microbatches`` does not divide.

  Examples:
    >>> import jax.numpy as jnp, jaxamp
    >>> def loss_fn(w, batch):
    ...   return jnp.mean((batch['x'] * w - batch['y']) ** 2)
    >>> batch = {'x': jnp.arange(8.0), 'y': jnp.ones(8)}
    >>> fn = jaxamp.microbatch_value_and_grad(loss_fn, 4)
    >>> loss, grad = fn(jnp.float32(0.5), batch)
    >>> loss, grad
    (Array(1.875, dtype=float32), Array(10.5, dtype=float32))
    >>> fn(jnp.float32(0.5), batch, loss_scale=8.0)[1]  # gradient of 8 * loss
    Array(84., dtype=float32)
  """
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {loss_fn!r}")
  if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, numbers.Integral):
    raise TypeError(f"num_microbatches must be an int, got {num_microbatches!r} of type "
                    f"{type(num_microbatches).__name__}")
  if num_microbatches < 1:
    raise ValueError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}")
  num = int(num_microbatches)
  if not isinstance(has_aux, (bool, np.bool_)):
    raise TypeError(f"has_aux must be a bool, got {has_aux!r}")
  acc_dtype = validation.check_float_dtype("accumulator_dtype", accumulator_dtype)

  def fn(params: optax.Params, batch: Any, *args: Any, loss_scale: Any = None,
         **kwargs: Any) -> Any:
    scale = _scale_value(loss_scale)
    micro = _split(batch, num)
    # Differentiate this device's copy of the params: inside shard_map the
    # gradients of replicated params would otherwise be summed over the
    # devices on every micro-batch, instead of averaged once below.
    params = sharding.own_copies(params, axis_name)

    def objective(p, mb):
      out = loss_fn(p, mb, *args, **kwargs)
      loss, aux = out if has_aux else (out, None)
      loss = jnp.asarray(loss)
      if loss.shape != ():
        raise ValueError(f"loss_fn must return a scalar loss, got shape {loss.shape}")
      loss = loss.astype(_wider(loss.dtype, jnp.dtype(jnp.float32)))
      scaled = loss if scale is None else state_lib.multiply_by_scale(loss, scale)
      return scaled, (loss, aux)

    grad_fn = jax.grad(objective, has_aux=True)
    first = jax.tree.map(lambda x: x[0], micro)
    grads_shape, (loss_shape, _) = jax.eval_shape(grad_fn, params, first)

    def acc_dtype_of(x):
      return _wider(x.dtype, acc_dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else x.dtype

    # Typed (sharding, varying axes) like what the scan adds into them.
    # Flax's fp8 values (fp8.py) combine by maximum, from -inf.
    acc0 = fp8.map_parts(lambda g: sharding.full_like_type(g, 0, acc_dtype_of(g)),
                         lambda g: sharding.full_like_type(g, -jnp.inf, g.dtype), grads_shape)
    loss0 = sharding.full_like_type(loss_shape, 0, acc_dtype_of(loss_shape))

    def body(carry, mb):
      acc, loss_sum = carry
      grads, (loss, aux) = grad_fn(params, mb)
      acc = fp8.accumulate(acc, grads, finite.add_stored)
      return (acc, loss_sum + loss.astype(loss_sum.dtype)), aux

    if num == 1:
      (acc, loss_sum), aux = body((acc0, loss0), first)
      aux = jax.tree.map(lambda a: jnp.expand_dims(a, 0), aux)
    else:
      (acc, loss_sum), aux = lax.scan(body, (acc0, loss0), micro)
    mean = fp8.map_parts(lambda a: a / jnp.asarray(num, a.dtype), lambda a: a, acc)
    loss = loss_sum / jnp.asarray(num, loss_sum.dtype)
    if axis_name is not None:
      mean, loss = fp8.pmean(mean, axis_name, loss)
    grads = jax.tree.map(lambda m, g: m.astype(g.dtype), mean, grads_shape)
    loss = loss.astype(loss_shape.dtype)
    return ((loss, aux), grads) if has_aux else (loss, grads)

  return fn
