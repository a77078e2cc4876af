"""mmengine-style optimizer wrappers: OptimWrapper, AmpOptimWrapper, OptimWrapperDict.

The wrappers are thin: they hold a pytree (parameters, the optax state,
accumulated gradients) and Python counters, and call jitted functions built
from the functional core (:func:`jaxamp.dynamic_loss_scale`,
:func:`jaxamp.static_loss_scale`, :func:`jaxamp.clip_grad_norm`, optax).
The counting and the loss factors of gradient accumulation are mmengine's,
call by call.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import numbers
import warnings
from collections.abc import Mapping, MutableMapping
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxamp._src import clipping
from jaxamp._src import loss_scale as ls
from jaxamp._src import numerics
from jaxamp._src import policy as policy_lib

# -------------------------------------------------------------------------------------------------
# Errors that keep mmengine's exception types (it uses ``assert``) and Python's usual ones.
# -------------------------------------------------------------------------------------------------


class _AssertionValueError(AssertionError, ValueError):
  """mmengine raises AssertionError here; a ValueError is what Python code expects."""


class _AssertionTypeError(AssertionError, TypeError):
  """mmengine raises AssertionError here; a TypeError is what Python code expects."""


class _AssertionRuntimeError(AssertionError, RuntimeError):
  """mmengine raises AssertionError here; a RuntimeError is what Python code expects."""


class _AssertionKeyError(AssertionError, KeyError):
  """mmengine raises AssertionError for a missing name; a mapping raises KeyError."""

  def __str__(self) -> str:
    return str(self.args[0]) if self.args else ""


# -------------------------------------------------------------------------------------------------
# Helpers: pytree paths, arrays, the static/dynamic split of a loss function call.
# -------------------------------------------------------------------------------------------------


def _key_name(key: Any) -> str:
  if isinstance(key, jax.tree_util.DictKey):
    return str(key.key)
  if isinstance(key, jax.tree_util.GetAttrKey):
    return str(key.name)
  if isinstance(key, jax.tree_util.SequenceKey):
    return str(key.idx)
  if isinstance(key, jax.tree_util.FlattenedIndexKey):
    return str(key.key)
  return str(key)


def path_parts(path: Sequence[Any]) -> List[str]:
  """The names along a pytree path, without the ``.value`` of flax Variables."""
  parts = [_key_name(k) for k in path]
  if len(path) > 1 and isinstance(path[-1], jax.tree_util.GetAttrKey) and parts[-1] in (
      "value", "raw_value"):
    parts = parts[:-1]
  return parts


def param_names(params: Any) -> List[str]:
  """Dotted names of the leaves of ``params`` (``'backbone.conv.kernel'``), in leaf order."""
  return [".".join(path_parts(p)) or "<root>"
          for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _where(path: Sequence[Any]) -> str:
  return jax.tree_util.keystr(tuple(path)) or "<root>"


class _Static:
  """A hashable box for a non-array leaf passed to a jitted function as static data."""

  __slots__ = ("value", "_hash")

  def __init__(self, value: Any):
    self.value = value
    try:
      self._hash = hash((type(value), value))
    except TypeError:
      self._hash = id(value)

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other: Any) -> bool:
    if not isinstance(other, _Static):
      return False
    a, b = self.value, other.value
    if a is b:
      return True
    if type(a) is not type(b) or self._hash != other._hash:
      return False
    try:
      return bool(a == b)
    except Exception:  # pylint: disable=broad-except
      return False


@dataclasses.dataclass(frozen=True, eq=False)
class _CallSpec:
  """The static part of ``loss_fn(params, *args, **kwargs)``: tree structure and non-array leaves."""

  treedef: Any
  statics: Tuple[Optional[_Static], ...]
  has_aux: bool

  def __post_init__(self):
    object.__setattr__(self, "_hash", hash((self.treedef, self.statics, self.has_aux)))

  def __hash__(self) -> int:
    return self._hash  # type: ignore[attr-defined]

  def __eq__(self, other: Any) -> bool:
    return (isinstance(other, _CallSpec) and self._hash == other._hash  # type: ignore[attr-defined]
            and self.has_aux == other.has_aux and self.treedef == other.treedef
            and self.statics == other.statics)


def _split_call(loss_fn: Any, args: tuple, kwargs: dict, has_aux: bool):
  """Flattens ``(loss_fn, args, kwargs)``: array leaves are traced, the rest static."""
  leaves, treedef = jax.tree.flatten((loss_fn, args, kwargs))
  dynamic = []
  statics = []
  for leaf in leaves:
    if _is_array(leaf):
      dynamic.append(leaf)
      statics.append(None)
    else:
      statics.append(_Static(leaf))
  return tuple(dynamic), _CallSpec(treedef, tuple(statics), bool(has_aux))


def _merge_call(spec: _CallSpec, dynamic: Sequence[Any]):
  it = iter(dynamic)
  leaves = [next(it) if s is None else s.value for s in spec.statics]
  return jax.tree.unflatten(spec.treedef, leaves)


def _fusable(method: Callable) -> Callable:
  """Marks a method whose behaviour the fused backward+step path reproduces."""
  method._jaxamp_fusable = True  # type: ignore[attr-defined]
  return method


# -------------------------------------------------------------------------------------------------
# clip_grad: mmengine's validation, the clipping transformation.
# -------------------------------------------------------------------------------------------------

_CLIP_KEYS = {"norm": ("max_norm", "norm_type", "error_if_nonfinite", "foreach"),
              "value": ("clip_value", "foreach")}
_CLIP_FUNCS = {"norm": "clip_grad_norm_", "value": "clip_grad_value_"}
_CLIP_REQUIRED = {"norm": "max_norm", "value": "clip_value"}


@dataclasses.dataclass(frozen=True)
class _ClipConfig:
  kind: str
  max_norm: float = 0.0
  norm_type: Any = 2.0
  error_if_nonfinite: bool = False
  clip_value: float = 0.0

  def transformation(self) -> optax.GradientTransformation:
    if self.kind == "norm":
      return clipping.clip_grad_norm(self.max_norm, self.norm_type)
    return clipping.clip_grad_value(self.clip_value)


def parse_clip_grad(clip_grad: Optional[dict]) -> Optional[_ClipConfig]:
  """Validates ``clip_grad`` as mmengine does, without mutating the caller's dict."""
  if clip_grad is None:
    return None
  message = ("If `clip_grad` is not None, it should be a `dict` which is the arguments of "
             "`torch.nn.utils.clip_grad_norm_` or clip_grad_value_`.")
  if not isinstance(clip_grad, Mapping):
    raise _AssertionTypeError(f"{message} Got {clip_grad!r} of type {type(clip_grad).__name__}.")
  if not clip_grad:
    raise _AssertionValueError(f"{message} Got an empty dict.")
  cfg = dict(clip_grad)
  kind = cfg.pop("type", "norm")
  if kind not in ("norm", "value"):
    raise ValueError(f'type of clip_grad should be "norm" or "value" but got {kind}')
  if not cfg:
    raise _AssertionValueError(
        "`clip_grad` should contain other arguments besides `type`. The arguments should match "
        "with the `torch.nn.utils.clip_grad_norm_` or clip_grad_value_`")
  func = _CLIP_FUNCS[kind]
  for key in cfg:
    if key not in _CLIP_KEYS[kind]:
      raise TypeError(f"{func}() got an unexpected keyword argument '{key}' "
                      f"(clip_grad of type {kind!r} accepts {list(_CLIP_KEYS[kind])} and 'type')")
  required = _CLIP_REQUIRED[kind]
  if required not in cfg:
    raise TypeError(f"{func}() missing 1 required positional argument: '{required}'")
  if kind == "value":
    value = clipping._check_real("clip_value", cfg["clip_value"])  # pylint: disable=protected-access
    return _ClipConfig("value", clip_value=value)
  max_norm = clipping._check_real("max_norm", cfg["max_norm"])  # pylint: disable=protected-access
  norm_type = cfg.get("norm_type", 2.0)
  clipping._norm_order(norm_type)  # pylint: disable=protected-access
  error = cfg.get("error_if_nonfinite", False)
  if not isinstance(error, (bool, np.bool_)):
    raise TypeError(f"error_if_nonfinite must be a bool, got {error!r}")
  return _ClipConfig("norm", max_norm=max_norm, norm_type=norm_type,
                     error_if_nonfinite=bool(error))


# -------------------------------------------------------------------------------------------------
# Hyperparameters: readable and settable through optax.inject_hyperparams states.
# -------------------------------------------------------------------------------------------------

_INJECT_TYPES = (optax.InjectStatefulHyperparamsState, optax.InjectHyperparamsState)


def _is_inject(x: Any) -> bool:
  return isinstance(x, _INJECT_TYPES)


def inject_nodes(opt_state: Any) -> List[Any]:
  """The outermost ``optax.inject_hyperparams`` states inside ``opt_state``, in leaf order."""
  return [x for x in jax.tree.leaves(opt_state, is_leaf=_is_inject) if _is_inject(x)]


def _replace_inject_node(opt_state: Any, index: int, node: Any) -> Any:
  leaves, treedef = jax.tree.flatten(opt_state, is_leaf=_is_inject)
  positions = [i for i, x in enumerate(leaves) if _is_inject(x)]
  leaves[positions[index]] = node
  return jax.tree.unflatten(treedef, leaves)


@dataclasses.dataclass(frozen=True)
class HyperparamCodec:
  """How a PyTorch-named hyperparameter (``'lr'``, ``'betas'``) maps onto optax state keys.

  Attributes:
    keys: the keys of ``InjectHyperparamsState.hyperparams`` holding it.
    encode: PyTorch value -> tuple of floats for ``keys``.
    decode: tuple of floats read from ``keys`` -> PyTorch value.
  """

  keys: Tuple[str, ...]
  encode: Callable[[Any], Tuple[float, ...]]
  decode: Callable[[Tuple[float, ...]], Any]


def _identity_codec(key: str) -> HyperparamCodec:
  return HyperparamCodec((key,), lambda v: (_as_float(key, v),), lambda t: t[0])


def _pair_codec(name: str, keys: Tuple[str, str], complement: bool) -> HyperparamCodec:
  def encode(v):
    if not isinstance(v, (tuple, list)) or len(v) != 2:
      raise TypeError(f"{name} must be a pair of numbers, got {v!r}")
    a, b = _as_float(f"{name}[0]", v[0]), _as_float(f"{name}[1]", v[1])
    return (1.0 - a, 1.0 - b) if complement else (a, b)

  def decode(t):
    return (1.0 - t[0], 1.0 - t[1]) if complement else (t[0], t[1])

  return HyperparamCodec(keys, encode, decode)


def _complement_codec(key: str, name: str) -> HyperparamCodec:
  return HyperparamCodec((key,), lambda v: (1.0 - _as_float(name, v),), lambda t: 1.0 - t[0])


def _as_float(name: str, value: Any) -> float:
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, np.generic,
                                                                     np.ndarray, jax.Array)):
    raise TypeError(f"{name} must be a real number, got {value!r}")
  out = float(np.asarray(value))
  return out


def _shortest_float(array: np.ndarray) -> float:
  """The shortest decimal that rounds to ``array``'s value in its dtype (float32 0.1 -> 0.1)."""
  value = float(array)
  if not math.isfinite(value) or not np.issubdtype(array.dtype, np.inexact):
    return value
  try:
    short = float(str(array[()]))
  except ValueError:
    return value
  return short if np.asarray(short, array.dtype) == array else value


def generic_codecs(hyperparams: Mapping[str, Any]) -> Dict[str, HyperparamCodec]:
  """PyTorch names for the hyperparameters of an arbitrary injected optax optimizer.

  ``learning_rate`` reads as ``lr``, ``b1``/``b2`` as ``betas``; other
  scalar hyperparameters keep their optax names.
  """
  codecs: Dict[str, HyperparamCodec] = {}
  for key, value in hyperparams.items():
    if key in ("b1", "b2") and "b1" in hyperparams and "b2" in hyperparams:
      continue
    if jnp.shape(value) != ():
      continue
    codecs["lr" if key == "learning_rate" else key] = _identity_codec(key)
  if "b1" in hyperparams and "b2" in hyperparams:
    codecs["betas"] = _pair_codec("betas", ("b1", "b2"), complement=False)
  return codecs


@dataclasses.dataclass
class GroupSpec:
  """What the wrapper knows about one parameter group (built by :func:`build_optim_wrapper`).

  Attributes:
    names: dotted names of the leaves in the group (``None``: unknown).
    codecs: settable hyperparameters, by PyTorch name.
    fixed: hyperparameters fixed at construction (``nesterov``, ``amsgrad``...).
    extras: other entries (``lr_mult``, ``decay_mult``, user keys).
    mirror: the Python values last set, returned while the device still holds them.
  """

  names: Optional[List[str]]
  codecs: Dict[str, HyperparamCodec]
  fixed: Dict[str, Any] = dataclasses.field(default_factory=dict)
  extras: Dict[str, Any] = dataclasses.field(default_factory=dict)
  mirror: Dict[str, Any] = dataclasses.field(default_factory=dict)


class ParamGroup(MutableMapping):
  """A live view of one parameter group, as ``torch.optim.Optimizer.param_groups[i]``.

  Reading ``group['lr']`` reads the learning rate from the optax state (a host
  sync); writing ``group['lr'] = 0.01`` writes it there, so mmengine-style
  parameter schedulers work unchanged, without a recompilation. ``'params'``
  lists the dotted names of the group's leaves. Keys that are not
  hyperparameters (``initial_lr``, ``lr_mult``...) are kept as plain entries.
  """

  def __init__(self, wrapper: "OptimWrapper", index: int):
    self._wrapper = wrapper
    self._index = index

  @property
  def _spec(self) -> GroupSpec:
    return self._wrapper._group_specs()[self._index]  # pylint: disable=protected-access

  def __getitem__(self, key: str) -> Any:
    spec = self._spec
    if key == "params":
      return list(spec.names) if spec.names is not None else None
    if key in spec.codecs:
      return self._wrapper._read_hyperparam(self._index, key)  # pylint: disable=protected-access
    if key in spec.fixed:
      return spec.fixed[key]
    return spec.extras[key]

  def __setitem__(self, key: str, value: Any) -> None:
    spec = self._spec
    if key == "params":
      raise ValueError("The 'params' of a parameter group cannot be changed; build a new wrapper.")
    if key in spec.codecs:
      self._wrapper._write_hyperparam(self._index, key, value)  # pylint: disable=protected-access
    elif key in spec.fixed:
      if value != spec.fixed[key]:
        raise ValueError(f"{key!r} selects code and is fixed at construction "
                         f"(it is {spec.fixed[key]!r}); build a new wrapper to change it.")
    else:
      spec.extras[key] = value

  def __delitem__(self, key: str) -> None:
    del self._spec.extras[key]

  def __iter__(self) -> Iterator[str]:
    spec = self._spec
    yield "params"
    yield from spec.codecs
    yield from spec.fixed
    yield from spec.extras

  def __len__(self) -> int:
    spec = self._spec
    return 1 + len(spec.codecs) + len(spec.fixed) + len(spec.extras)

  def __repr__(self) -> str:
    return f"ParamGroup({dict(self)!r})"


# -------------------------------------------------------------------------------------------------
# OptimWrapper
# -------------------------------------------------------------------------------------------------


def _check_optimizer(optimizer: Any) -> optax.GradientTransformation:
  if not (callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))):
    raise _AssertionTypeError(
        "optimizer must be an optax `GradientTransformation` (with init and update), but got "
        f"{type(optimizer)}")
  return optimizer


def _check_params(params: Any) -> Any:
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
  if not leaves_with_path:
    raise ValueError("params must be a non-empty pytree of floating-point arrays, got "
                     f"{params!r}")
  out = []
  for path, leaf in leaves_with_path:
    if not _is_array(leaf):
      raise TypeError(f"params leaf {_where(path)} must be an array, got {type(leaf).__name__} "
                      f"{leaf!r}")
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
      raise TypeError(f"params leaf {_where(path)} has dtype {leaf.dtype}; only floating-point "
                      "parameters can be optimized (keep other state outside the wrapper)")
    out.append(leaf if isinstance(leaf, jax.Array) else jnp.asarray(leaf))
  return jax.tree.unflatten(treedef, out)


def _pinned(sharding: Any) -> Optional[Any]:
  """The sharding a params-shaped output must be pinned to, or None (single device)."""
  if sharding is None or isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return None
  return sharding


def _explicit(sharding: Any) -> bool:
  axis_types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
  return any(t == jax.sharding.AxisType.Explicit for t in axis_types)


def _replicate_scalars(state: Any, params: Any) -> Any:
  """Puts the single-device scalars of ``state`` on the params' mesh, replicated.

  That is where the jitted steps return them; a state fresh from ``init``
  would otherwise bring other shardings to the second step, and compile again.
  """
  mesh = next((p.sharding.mesh for p in jax.tree.leaves(params)
               if isinstance(getattr(p, "sharding", None), jax.sharding.NamedSharding)), None)
  if mesh is None:
    return state
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def put(x):
    if (isinstance(x, jax.Array) and x.ndim == 0
        and isinstance(x.sharding, jax.sharding.SingleDeviceSharding)):
      return jax.device_put(x, replicated)
    return x

  return jax.tree.map(put, state)


def _shardings(params: Any) -> Optional[Tuple[Any, ...]]:
  """Per params leaf, the sharding outputs must be pinned to (None: nothing to pin)."""
  shardings = tuple(_pinned(getattr(p, "sharding", None)) for p in jax.tree.leaves(params))
  return shardings if any(s is not None for s in shardings) else None


def _pin(x: jax.Array, sharding: Any) -> jax.Array:
  if sharding is None:
    return x
  if _explicit(sharding):
    # Explicit axes: the sharding is part of the type (gradients of a contraction over a
    # sharded batch come back replicated, say); move it back to the parameter's.
    return jax.sharding.reshard(x, sharding)
  return lax.with_sharding_constraint(x, sharding)


def _constrain(tree: Any, shardings: Optional[Tuple[Any, ...]]) -> Any:
  """Pins the leaves of ``tree`` (traced, params-shaped) to the params' shardings."""
  if shardings is None:
    return tree
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, [_pin(x, s) for x, s in zip(leaves, shardings)])


_unscale = jax.jit(numerics.unscale)


def _has_batch_norm(model: Any) -> bool:
  if model is None:
    return False
  found = []

  def is_leaf(x):
    if "batchnorm" in type(x).__name__.lower():
      found.append(x)
      return True
    return False

  try:
    paths = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_leaf)[0]
  except Exception:  # pylint: disable=broad-except
    return False
  if found:
    return True
  for path, _ in paths:
    for part in path_parts(path):
      low = part.lower()
      if "batchnorm" in low or "batch_norm" in low or low == "batch_stats":
        return True
  return False


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

  **The optimizer protocol** (used by :class:`jaxamp.GradScaler`, which
  accepts any object exposing it):

  * ``params``: the current parameters (a pytree of arrays; settable).
  * ``opt_state``: the state of ``optimizer`` (the clipping state and, for
    :class:`AmpOptimWrapper`, the loss-scale state are kept beside it).
  * ``grads``: the accumulated gradients, ``None`` after :meth:`zero_grad`;
    assignable with a pytree of the params' structure, shapes and dtypes.
  * ``backward(loss_fn, *args, has_aux=False, **kwargs)``: adds the
    gradients of ``loss_fn(params, ...)`` to ``grads``; returns the loss.
  * ``apply_gradients(grads=None, *, skip=None)``: one jitted call that
    clips (recording the norm before clipping), runs the optimizer and
    applies the updates. With ``skip``, a device boolean scalar, the
    parameters and ``opt_state`` stay bit-identical where it is true: a
    selection on the device, no host sync.
  * ``apply_scaled_gradients(scale)``: divides ``grads`` by a loss scale,
    checks them and applies them unless one is inf/nan, in one jitted call
    (what the scalers' ``step`` uses).

  **Learning rates.** ``get_lr()``, ``get_momentum()`` and ``param_groups``
  read the hyperparameters from ``optax.inject_hyperparams`` states found
  anywhere in the optimizer state (one parameter group per such state), and
  writing ``param_groups[i]['lr']`` writes them there. Optimizers built by
  :func:`jaxamp.build_optim_wrapper` are always built that way. For an optax
  transformation without injected hyperparameters ``get_lr()`` and
  ``get_momentum()`` raise a ``ValueError`` saying how to build it, and
  ``param_groups`` holds one group with only ``'params'``.

  Differences from mmengine, and why:

  * ``backward``/``update_params`` take a loss function (see above) and
    return the loss as a device array; ``update_params`` returns the loss
    before the accumulation factor, as the user computed it.
  * ``update_params`` fuses backward, step and ``zero_grad`` into one jitted
    call when it is going to step (one dispatch, like a hand-written step).
  * ``state_dict()`` is ``{'state': <optax state of optimizer>,
    'param_groups': [...]}`` with device arrays; the parameters are not in
    it (they are in :attr:`params`, as PyTorch keeps them in the model).
  * ``clip_grad=dict(..., error_if_nonfinite=True)`` needs one host sync per
    step to raise (the check must reach Python); without it nothing syncs.
  * ``last_grad_norm`` holds the norm before clipping (mmengine logs it as
    ``train/grad_norm``); ``None`` without norm clipping.

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
  by the next ``backward`` that adds to them or a scaler's ``unscale_`` (and
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
    if (isinstance(accumulative_counts, bool)
        or not isinstance(accumulative_counts, numbers.Integral)):
      raise _AssertionTypeError(
          f"accumulative_counts must be an int >= 1, got {accumulative_counts!r}")
    if accumulative_counts <= 0:
      raise _AssertionValueError("_accumulative_counts at least greater than or equal to 1")
    self._accumulative_counts = int(accumulative_counts)
    self._optimizer = _check_optimizer(optimizer)
    self._clip = parse_clip_grad(clip_grad)
    self._params = _check_params(params)
    self._shardings = _shardings(self._params)
    self._tx = self._build_transformation()
    self._state = self._init_state(self._params)
    self._grads: Optional[Any] = None
    # Set by apply_scaled_gradients: ``_grads`` holds the scaled gradients, and
    # ``grads`` reads them divided by this (unscaled on first read).
    self._grads_scale: Optional[jax.Array] = None
    self._last_grad_norm: Optional[jax.Array] = None
    self._inner_count = 0
    self._max_counts = -1
    self._remainder_counts = -1
    self._jits: Dict[str, Callable] = {}
    self._trace_counts: collections.Counter = collections.Counter()
    self._factors: Dict[float, jax.Array] = {}
    self._specs: Optional[List[GroupSpec]] = None
    self._defaults: Optional[dict] = None

  # -- the transformation and its state ---------------------------------------------------------

  def _init_state(self, params: Any) -> Any:
    return _replicate_scalars(self._tx.init(params), params)

  def _inner_transformation(self) -> optax.GradientTransformation:
    if self._clip is None:
      return self._optimizer
    return optax.chain(self._clip.transformation(), self._optimizer)

  def _build_transformation(self) -> optax.GradientTransformation:
    return self._inner_transformation()

  def _inner_of(self, state: Any) -> Any:
    """The state of ``chain(clip, optimizer)`` (or of ``optimizer``) inside the full state."""
    return state

  def _with_inner(self, state: Any, inner: Any) -> Any:
    del state
    return inner

  def _opt_of(self, state: Any) -> Any:
    inner = self._inner_of(state)
    return inner if self._clip is None else inner[1]

  def _with_opt(self, state: Any, opt_state: Any) -> Any:
    inner = opt_state if self._clip is None else (self._inner_of(state)[0], opt_state)
    return self._with_inner(state, inner)

  def _loss_scale_of(self, state: Any) -> Optional[jax.Array]:
    del state
    return None

  @property
  def _policy(self) -> Optional[policy_lib.Policy]:
    return None

  # -- jitted functions -------------------------------------------------------------------------

  def _count_trace(self, name: str) -> None:
    self._trace_counts[name] += 1

  @property
  def donate(self) -> bool:
    """Whether the jitted steps donate the wrapper's buffers (see the class notes)."""
    return self._donate

  def _jitted(self, name: str) -> Callable:
    fn = self._jits.get(name)
    if fn is None:
      # Only buffers that an output of the same shape can reuse are donated
      # (XLA warns about the others): params and state into the new params
      # and state, the accumulated gradients into the new sum.
      donated: Tuple[int, ...] = ()
      if name in ("grad", "grad_acc"):
        if self._donate and name == "grad_acc":
          donated = (1,)
        fn = jax.jit(functools.partial(self._grad_impl, name), static_argnums=(5,),
                     donate_argnums=donated)
      elif name in ("fused", "fused_acc"):
        if self._donate:
          donated = (0, 1)
        fn = jax.jit(functools.partial(self._fused_impl, name), static_argnums=(5,),
                     donate_argnums=donated)
      elif name in ("apply", "apply_skip", "apply_scaled"):
        if self._donate:
          donated = (0, 1)
        impl = self._apply_scaled_impl if name == "apply_scaled" else self._apply_impl
        fn = jax.jit(functools.partial(impl, name), donate_argnums=donated)
      else:  # pragma: no cover
        raise KeyError(name)
      self._jits[name] = fn
    return fn

  def _objective(self, spec: _CallSpec, dynamic: Sequence[Any], factor: jax.Array,
                 scale: Optional[jax.Array]) -> Callable:
    loss_fn, args, kwargs = _merge_call(spec, dynamic)
    policy = self._policy
    if policy is not None:
      loss_fn = policy_lib.mixed_precision(loss_fn, policy)

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
      value = loss.astype(jnp.promote_types(loss.dtype, jnp.float32)) / factor
      if scale is not None:
        value = value * scale.astype(value.dtype)
      return value, (loss, aux)

    return objective

  def _grads_and_loss(self, params, dynamic, factor, scale, spec):
    objective = self._objective(spec, dynamic, factor, scale)
    grads, (loss, aux) = jax.grad(objective, has_aux=True)(params)
    out = (loss, aux) if spec.has_aux else loss
    return out, grads

  def _grad_impl(self, name, params, buffer, dynamic, factor, scale, spec):
    self._count_trace(name)
    out, grads = self._grads_and_loss(params, dynamic, factor, scale, spec)
    if buffer is not None:
      grads = jax.tree.map(jnp.add, buffer, grads)
    return out, _constrain(grads, self._shardings)

  def _update(self, params, state, grads, skip):
    """Traced: one optimizer step. Returns ``(params, state, grad_norm)``."""
    grads = _constrain(grads, self._shardings)
    if skip is None:
      updates, new_state = self._tx.update(grads, state, params)
    else:
      # The step counts only where not skipped, selected where the optimizer
      # computes it (no copy of the state); the clipping state, with the norm,
      # advances either way.
      updates, new_state = numerics.select_update(
          jnp.logical_not(skip), lambda: self._tx.update(grads, state, params), state)
      if self._clip is not None:
        _, clip_state = self._clip.transformation().update(grads, self._inner_of(state)[0], params)
        new_state = self._with_inner(new_state, (clip_state, self._opt_of(new_state)))
    new_params = optax.apply_updates(params, updates)
    norm = None
    if self._clip is not None and self._clip.kind == "norm":
      norm = self._inner_of(new_state)[0].total_norm
    return _constrain(new_params, self._shardings), new_state, norm

  def _apply_impl(self, name, params, state, grads, skip=None):
    self._count_trace(name)
    return self._update(params, state, grads, skip)

  def _apply_scaled_impl(self, name, params, state, grads, scale):
    found_inf = jnp.logical_not(numerics.unscaled_all_finite(grads, scale))
    params, state, norm = self._apply_impl(name, params, state, numerics.unscale(grads, scale),
                                           found_inf)
    return params, state, norm, found_inf

  def _fused_impl(self, name, params, state, buffer, dynamic, factor, spec):
    self._count_trace(name)
    scale = self._loss_scale_of(state)
    out, grads = self._grads_and_loss(params, dynamic, factor, scale, spec)
    if buffer is not None:
      grads = jax.tree.map(jnp.add, buffer, grads)
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
    self._shardings = _shardings(self._params)

  @property
  def opt_state(self) -> Any:
    """The optax state of ``optimizer`` (without the clipping or loss-scale state)."""
    return self._opt_of(self._state)

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
    return self._inner_count

  @property
  def last_grad_norm(self) -> Optional[jax.Array]:
    """The total gradient norm before clipping at the last step (a float32 device scalar).

    ``None`` before the first step and without ``clip_grad`` of type
    ``'norm'`` (mmengine logs no ``grad_norm`` then either).
    """
    return self._last_grad_norm

  def _validated_like_params(self, value: Any, what: str) -> Any:
    ref_leaves, ref_def = jax.tree_util.tree_flatten_with_path(self._params)
    leaves, treedef = jax.tree.flatten(value)
    if treedef != ref_def:
      raise ValueError(f"{what} must have the structure of params: expected "
                       f"{_short(ref_def)}, got {_short(treedef)}")
    out = []
    for (path, ref), leaf in zip(ref_leaves, leaves):
      if not _is_array(leaf):
        raise TypeError(f"{what} leaf {_where(path)} must be an array, got "
                        f"{type(leaf).__name__}")
      if tuple(leaf.shape) != tuple(ref.shape) or jnp.dtype(leaf.dtype) != jnp.dtype(ref.dtype):
        raise ValueError(f"{what} leaf {_where(path)} must have shape {tuple(ref.shape)} and dtype "
                         f"{ref.dtype} like the parameter, got shape {tuple(leaf.shape)} and dtype "
                         f"{leaf.dtype}")
      out.append(leaf if isinstance(leaf, jax.Array) else jax.device_put(leaf, ref.sharding))
    return jax.tree.unflatten(treedef, out)

  # -- counting (mmengine) ----------------------------------------------------------------------

  def initialize_count_status(self, model: Any, init_counts: int, max_counts: int) -> None:
    """Sets the counters for a run of ``max_counts`` calls starting at ``init_counts``.

    As mmengine: warns when resuming at a count that is not a multiple of
    ``accumulative_counts`` (the gradients of a partial window are lost), and
    when ``model`` (any pytree or object; may be ``None``) has BatchNorm
    layers and gradients are accumulated.
    """
    for name, value in (("init_counts", init_counts), ("max_counts", max_counts)):
      if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    self._inner_count = int(init_counts)
    self._max_counts = int(max_counts)
    if self._inner_count % self._accumulative_counts != 0:
      warnings.warn(
          "Resumed iteration number is not divisible by `_accumulative_counts` in "
          "`GradientCumulativeOptimizerHook`, which means the gradient of some iterations is "
          "lost and the result may be influenced slightly.", UserWarning, stacklevel=2)
    if self._accumulative_counts > 1 and _has_batch_norm(model):
      warnings.warn("Gradient accumulative may slightly decrease performance because the model "
                    "has BatchNorm layers.", UserWarning, stacklevel=2)
    self._remainder_counts = self._max_counts % self._accumulative_counts

  def should_update(self) -> bool:
    """Whether the current call (after ``backward``) should step (mmengine's rule)."""
    return (self._inner_count % self._accumulative_counts == 0
            or self._inner_count == self._max_counts)

  def should_sync(self) -> bool:
    """Whether the next ``backward`` ends a window (so gradients should be synchronized)."""
    return ((self._inner_count + 1) % self._accumulative_counts == 0
            or (self._inner_count + 1) == self._max_counts)

  def _loss_factor(self) -> int:
    acc = self._accumulative_counts
    if acc == 1:
      return 1
    if self._max_counts == -1:
      return acc
    if self._inner_count >= self._max_counts:
      raise _AssertionRuntimeError(
          f"Called past max_counts: inner_count is {self._inner_count} but "
          f"initialize_count_status set max_counts={self._max_counts}, so no accumulation "
          "window is left to divide the loss by. Stop the loop at max_counts, or call "
          "initialize_count_status again with the right counts.")
    if self._inner_count < self._max_counts - self._remainder_counts:
      return acc
    return self._remainder_counts

  def scale_loss(self, loss: Any) -> Any:
    """Divides ``loss`` by mmengine's accumulation factor for the current call.

    ``loss`` is an array (returns ``loss / factor``) or a loss function
    (returns a function whose loss is divided; with ``has_aux`` outputs only
    the loss is divided). The factor is ``accumulative_counts``, or the size of
    the last window after :meth:`initialize_count_status`.

    Raises:
      AssertionError: (also a ``RuntimeError``) past ``max_counts``.
    """
    factor = self._loss_factor()
    if callable(loss) and not _is_array(loss):
      return _DividedLoss(loss, self._factor(float(factor)))
    loss = jnp.asarray(loss)
    return loss / jnp.asarray(factor, loss.dtype)

  # -- backward / step ------------------------------------------------------------------------

  def _run_backward(self, loss_fn: Any, args: tuple, kwargs: dict, has_aux: bool,
                    factor: float) -> Any:
    dynamic, spec = _split_call(loss_fn, args, kwargs, has_aux)
    buffer = self.grads
    name = "grad" if buffer is None else "grad_acc"
    scale = self._loss_scale_of(self._state)
    out, grads = self._jitted(name)(self._params, buffer, dynamic, self._factor(factor),
                                    scale, spec)
    self._grads = grads
    self._inner_count += 1
    return out

  @_fusable
  def backward(self, loss_fn: Callable[..., Any], *args: Any, has_aux: bool = False,
               **kwargs: Any) -> Any:
    """Adds the gradients of ``loss_fn(params, *args, **kwargs)`` to :attr:`grads`.

    Increments :attr:`inner_count`. Returns the loss (and, with
    ``has_aux=True``, ``(loss, aux)``) as device arrays: nothing waits for
    the device. Array leaves of ``loss_fn``/``args``/``kwargs`` are traced,
    other leaves are static (see the class notes), so repeated calls compile
    once.
    """
    return self._run_backward(loss_fn, args, kwargs, has_aux, 1.0)

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
      result = self._jitted("apply")(self._params, self._state, grads)
    else:
      skip = jnp.asarray(skip)
      if skip.shape != () or skip.dtype != jnp.bool_:
        raise ValueError(f"skip must be a boolean scalar, got dtype {skip.dtype} and shape "
                         f"{skip.shape}")
      result = self._jitted("apply_skip")(self._params, self._state, grads, skip)
    self._commit_step(*result)

  def apply_scaled_gradients(self, scale: Any) -> Optional[jax.Array]:
    """Unscales :attr:`grads` by ``scale``, checks them and applies them unless one is inf/nan.

    :meth:`GradScaler.unscale_ <jaxamp.GradScaler.unscale_>` and
    :meth:`apply_gradients` in one jitted call, so that the unscaled gradients
    are not written out and read back: the scalers' ``step`` uses it when
    nothing has to see the gradients unscaled in between. Afterwards
    :attr:`grads` reads the unscaled gradients (computed on the first read).

    Args:
      scale: the loss scale, a float32 scalar (no host sync).

    Returns:
      ``found_inf``, a device boolean: whether a gradient was inf or nan (the
      step was skipped); ``None`` when there are no gradients (nothing changes).
    """
    grads = self.grads
    if grads is None:
      return None
    scale = jnp.asarray(scale, jnp.float32)
    params, state, norm, found_inf = self._jitted("apply_scaled")(self._params, self._state,
                                                                 grads, scale)
    self._commit_step(params, state, norm)
    self._grads_scale = scale
    return found_inf

  def _commit_step(self, params: Any, state: Any, norm: Optional[jax.Array]) -> None:
    if self._clip is not None and self._clip.error_if_nonfinite and norm is not None:
      clipping.check_total_norm(norm, self._clip.norm_type)
    self._params, self._state, self._last_grad_norm = params, state, norm

  @_fusable
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
    cls = type(self)
    return (getattr(cls.step, "_jaxamp_fusable", False)
            and getattr(cls.backward, "_jaxamp_fusable", False)
            and not (self._clip is not None and self._clip.error_if_nonfinite))

  def update_params(self, loss_fn: Callable[..., Any], *args: Any,
                    step_kwargs: Optional[dict] = None, zero_kwargs: Optional[dict] = None,
                    has_aux: bool = False, **kwargs: Any) -> Any:
    """One training iteration: :meth:`scale_loss`, :meth:`backward`, and step when due.

    When :meth:`should_update` is true after the backward pass, the
    parameters are stepped (:meth:`step`) and the gradients cleared
    (:meth:`zero_grad`); the three run as one jitted call.

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
    """
    step_kwargs = {} if step_kwargs is None else dict(step_kwargs)
    zero_kwargs = {} if zero_kwargs is None else dict(zero_kwargs)
    factor = float(self._loss_factor())
    if self.should_sync() and self._can_fuse() and not step_kwargs:
      dynamic, spec = _split_call(loss_fn, args, kwargs, has_aux)
      buffer = self.grads
      name = "fused" if buffer is None else "fused_acc"
      out, params, state, norm = self._jitted(name)(
          self._params, self._state, buffer, dynamic, self._factor(factor), spec)
      self._inner_count += 1
      self._params, self._state, self._last_grad_norm = params, state, norm
      self._grads = None
      self.zero_grad(**zero_kwargs)
      return out
    out = self._run_backward(loss_fn, args, kwargs, has_aux, factor)
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
    :class:`AmpOptimWrapper`.
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

  def _group_specs(self) -> List[GroupSpec]:
    if self._specs is None:
      nodes = inject_nodes(self.opt_state)
      names = param_names(self._params)
      if not nodes:
        self._specs = [GroupSpec(names=names, codecs={})]
      else:
        self._specs = [GroupSpec(names=names if len(nodes) == 1 else None,
                                 codecs=generic_codecs(node.hyperparams)) for node in nodes]
    return self._specs

  def _set_group_specs(self, specs: List[GroupSpec], defaults: dict) -> None:
    """Installs the groups known to :func:`build_optim_wrapper` (names, codecs, values)."""
    if len(specs) != len(inject_nodes(self.opt_state)):
      raise ValueError("one parameter group per inject_hyperparams state is expected")
    self._specs = specs
    self._defaults = dict(defaults)

  def _read_hyperparam(self, index: int, key: str) -> Any:
    spec = self._group_specs()[index]
    codec = spec.codecs[key]
    node = inject_nodes(self.opt_state)[index]
    arrays = [np.asarray(node.hyperparams[k]) for k in codec.keys]
    values = tuple(_shortest_float(a) for a in arrays)
    if key in spec.mirror:
      mirrored = codec.encode(spec.mirror[key])
      if all(np.asarray(m, a.dtype) == a for m, a in zip(mirrored, arrays)):
        return spec.mirror[key]
    return codec.decode(values)

  def _hyperparam_state(self, opt_state: Any, index: int, key: str, value: Any) -> Any:
    codec = self._group_specs()[index].codecs[key]
    encoded = codec.encode(value)
    node = inject_nodes(opt_state)[index]
    hyperparams = dict(node.hyperparams)
    for k, v in zip(codec.keys, encoded):
      old = hyperparams[k]
      hyperparams[k] = jax.device_put(np.asarray(v, dtype=old.dtype), old.sharding)
    return _replace_inject_node(opt_state, index, node._replace(hyperparams=hyperparams))

  def _write_hyperparam(self, index: int, key: str, value: Any) -> None:
    opt_state = self._hyperparam_state(self.opt_state, index, key, value)
    self._state = self._with_opt(self._state, opt_state)
    self._group_specs()[index].mirror[key] = value

  @property
  def param_groups(self) -> List[ParamGroup]:
    """The parameter groups: live views of the hyperparameters (see :class:`ParamGroup`)."""
    return [ParamGroup(self, i) for i in range(len(self._group_specs()))]

  @property
  def defaults(self) -> dict:
    """The optimizer's default hyperparameters (PyTorch names), as ``Optimizer.defaults``.

    For a wrapper built by :func:`build_optim_wrapper`: the optimizer config
    with PyTorch's defaults filled in. Otherwise the first group's injected
    hyperparameters when first asked for, or ``{}`` when nothing is injected.
    """
    if self._defaults is None:
      group = self.param_groups[0]
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
    return self.param_groups

  def get_lr(self) -> Dict[str, List[float]]:
    """``{'lr': [learning rate of each parameter group]}`` (Python floats).

    Raises:
      ValueError: when the optimizer has no injected hyperparameters.
    """
    lrs = []
    for group in self._readable_groups("learning rate"):
      if "lr" not in group:
        raise ValueError(f"A parameter group has no injected learning rate: {dict(group)!r}")
      lrs.append(group["lr"])
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

  def state_dict(self) -> dict:
    """``{'state': <optax state of optimizer>, 'param_groups': [...]}``.

    ``state`` holds device arrays (no copy, shardings kept; with
    ``donate=True`` on-device copies, so that the next step, which donates
    the wrapper's buffers, leaves them valid); ``param_groups`` the groups'
    names and hyperparameters as Python values.
    """
    groups = []
    for group in self.param_groups:
      groups.append({k: group[k] for k in group})
    state = self.opt_state
    if self._donate:
      state = jax.tree.map(jnp.copy, state)
    return {"state": state, "param_groups": groups}

  def _prepare_load(self, state_dict: Any) -> Callable[[], None]:
    """Validates ``state_dict`` fully; returns the function that installs it."""
    if not isinstance(state_dict, Mapping):
      raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    expected = {"state", "param_groups"}
    missing = sorted(expected - set(state_dict))
    extra = sorted(set(state_dict) - expected)
    if missing or extra:
      raise ValueError(f"state_dict must have exactly the keys {sorted(expected)}: missing "
                       f"{missing}, unexpected {extra}")
    opt_state = _validated_like(state_dict["state"], self.opt_state, "state_dict['state']")
    groups = state_dict["param_groups"]
    specs = self._group_specs()
    if not isinstance(groups, (list, tuple)) or len(groups) != len(specs):
      raise ValueError("loaded state dict has a different number of parameter groups")
    writes = []
    extras = []
    for index, (group, spec) in enumerate(zip(groups, specs)):
      if not isinstance(group, Mapping):
        raise TypeError(f"param_groups[{index}] must be a dict, got {type(group).__name__}")
      names = group.get("params")
      if spec.names is not None and names is not None and list(names) != list(spec.names):
        raise ValueError("loaded state dict contains a parameter group that doesn't match the "
                         "size of optimizer's group")
      group_extras = {}
      for key, value in group.items():
        if key == "params":
          continue
        if key in spec.codecs:
          opt_state = self._hyperparam_state(opt_state, index, key, value)
          writes.append((index, key, value))
        elif key in spec.fixed:
          if value != spec.fixed[key]:
            raise ValueError(f"param_groups[{index}][{key!r}] is {value!r} but this optimizer "
                             f"was built with {spec.fixed[key]!r}: a state of a different "
                             "optimizer")
        else:
          group_extras[key] = value
      extras.append(group_extras)

    def commit():
      self._state = self._with_opt(self._state, opt_state)
      for index, key, value in writes:
        specs[index].mirror[key] = value
      for spec, group_extras in zip(specs, extras):
        spec.extras.update(group_extras)

    return commit

  def load_state_dict(self, state_dict: dict) -> None:
    """Loads a :meth:`state_dict`; validates everything before changing anything.

    Raises:
      ValueError: missing or unexpected keys, another tree structure (a
        different optimizer or parameters), other shapes or dtypes, other
        parameter groups.
      TypeError: a non-dict, or leaves that are not arrays.
    """
    self._prepare_load(state_dict)()

  def __repr__(self) -> str:
    return (f"Type: {type(self).__name__}\n_accumulative_counts: {self._accumulative_counts}\n"
            f"optimizer: \n{self._optimizer!r}\n")


def _short(treedef: Any, limit: int = 300) -> str:
  text = str(treedef)
  return text if len(text) <= limit else text[:limit] + "..."


def _validated_like(value: Any, reference: Any, what: str) -> Any:
  """``value`` as a pytree with ``reference``'s structure, shapes and dtypes (on its devices)."""
  ref_leaves, ref_def = jax.tree_util.tree_flatten_with_path(reference)
  try:
    leaves, treedef = jax.tree.flatten(value)
  except Exception as e:  # pylint: disable=broad-except
    raise TypeError(f"{what} is not a pytree: {e}") from None
  if treedef != ref_def:
    raise ValueError(f"{what} does not match this optimizer's state (a state of a different "
                     f"optimizer, or of other parameters): expected {_short(ref_def)}, got "
                     f"{_short(treedef)}")
  out = []
  for (path, ref), leaf in zip(ref_leaves, leaves):
    if isinstance(leaf, (numbers.Number, np.generic)) and not isinstance(leaf, jax.Array):
      leaf = np.asarray(leaf)
      if jnp.shape(ref) == () and np.can_cast(leaf.dtype, ref.dtype, "same_kind"):
        leaf = leaf.astype(ref.dtype)
    if not _is_array(leaf):
      raise TypeError(f"{what} leaf {_where(path)} must be an array, got {type(leaf).__name__}")
    if tuple(leaf.shape) != tuple(jnp.shape(ref)) or jnp.dtype(leaf.dtype) != jnp.dtype(ref.dtype):
      raise ValueError(f"{what} leaf {_where(path)} must have shape {tuple(jnp.shape(ref))} and "
                       f"dtype {jnp.dtype(ref.dtype)}, got shape {tuple(leaf.shape)} and dtype "
                       f"{leaf.dtype}")
    sharding = getattr(ref, "sharding", None)
    if isinstance(leaf, jax.Array) and (sharding is None or leaf.sharding == sharding):
      out.append(leaf)
    else:
      out.append(jax.device_put(leaf, sharding))
  return jax.tree.unflatten(ref_def, out)


class _DividedLoss:
  """``loss_fn`` with its loss divided by a factor; a pytree whose child is the factor."""

  __slots__ = ("fn", "factor")

  def __init__(self, fn: Callable[..., Any], factor: jax.Array):
    self.fn = fn
    self.factor = factor

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    out = self.fn(*args, **kwargs)
    if isinstance(out, tuple) and len(out) == 2:
      loss, aux = out
      return _divide(loss, self.factor), aux
    return _divide(out, self.factor)

  def __eq__(self, other: Any) -> bool:
    return type(other) is _DividedLoss and self.fn == other.fn

  def __hash__(self) -> int:
    return hash((_DividedLoss, self.fn))


def _divide(loss: Any, factor: jax.Array) -> jax.Array:
  loss = jnp.asarray(loss)
  loss = loss.astype(jnp.promote_types(loss.dtype, jnp.float32))
  return loss / factor.astype(loss.dtype)


jax.tree_util.register_pytree_node(
    _DividedLoss, lambda f: ((f.factor,), f.fn), lambda fn, children: _DividedLoss(fn, children[0]))


# -------------------------------------------------------------------------------------------------
# AmpOptimWrapper
# -------------------------------------------------------------------------------------------------

_SCALER_KEYS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled",
                "device", "hysteresis", "min_scale", "max_scale")
_TORCH_SCALER_DEFAULTS = dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                              growth_interval=2000)
_SCALER_STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval",
                      "_growth_tracker")


@dataclasses.dataclass(frozen=True)
class _ScalerConfig:
  kind: str  # 'dynamic', 'static' or 'disabled'
  init_scale: float = 2.0**16
  growth_factor: float = 2.0
  backoff_factor: float = 0.5
  growth_interval: int = 2000
  hysteresis: int = 1
  min_scale: Optional[float] = None
  max_scale: Optional[float] = None


def _parse_loss_scale(loss_scale: Any) -> _ScalerConfig:
  if isinstance(loss_scale, str) and loss_scale == "dynamic":
    return _ScalerConfig("dynamic")
  if isinstance(loss_scale, float):
    ls.check_scale("loss_scale", loss_scale)
    return _ScalerConfig("static", init_scale=float(loss_scale))
  if isinstance(loss_scale, Mapping):
    cfg = dict(loss_scale)
    for key in cfg:
      if key not in _SCALER_KEYS:
        raise TypeError(f"GradScaler.__init__() got an unexpected keyword argument '{key}' "
                        f"(loss_scale accepts {list(_SCALER_KEYS)})")
    cfg.pop("device", None)
    enabled = cfg.pop("enabled", True)
    if not isinstance(enabled, (bool, np.bool_)):
      raise TypeError(f"enabled must be a bool, got {enabled!r}")
    merged = dict(_TORCH_SCALER_DEFAULTS, **cfg)
    # Validated by the core: the same checks and messages as dynamic_loss_scale.
    ls.dynamic_loss_scale(optax.identity(), **merged)
    if not enabled:
      return _ScalerConfig("disabled")
    return _ScalerConfig("dynamic", init_scale=float(merged["init_scale"]),
                         growth_factor=float(merged["growth_factor"]),
                         backoff_factor=float(merged["backoff_factor"]),
                         growth_interval=int(merged["growth_interval"]),
                         hysteresis=int(merged.get("hysteresis", 1)),
                         min_scale=merged.get("min_scale"), max_scale=merged.get("max_scale"))
  raise TypeError(f'loss_scale must be of type float, dict, or "dynamic", but got {loss_scale}')


class AmpOptimWrapper(OptimWrapper):
  """mmengine's ``AmpOptimWrapper``: :class:`OptimWrapper` with loss scaling and a compute dtype.

  Its transformation is ``jaxamp.dynamic_loss_scale(optax.chain(clip,
  optimizer))`` (``jaxamp.static_loss_scale`` for a float ``loss_scale``):
  ``backward`` multiplies the loss by the current scale; the step unscales
  the summed gradients, clips them, skips the update when any is inf or nan
  (params and optimizer state untouched) and adjusts the scale, once per
  optimizer step, not per micro-batch. ``get_scale()`` returns the scale,
  ``loss_scaler`` the scale state.

  ``dtype`` is the compute dtype: inside ``backward`` the floating params and
  array inputs are cast to it (:func:`jaxamp.mixed_precision`), while the
  master params and the gradients stay float32 and the loss is returned in
  float32. ``dtype=None`` casts nothing: the loss function runs as written
  (e.g. a Flax module with its own ``dtype``). :meth:`optim_context` yields
  the cast function, for code the user runs in the compute dtype himself.

  Differences from mmengine, and why:

  * ``loss_scale`` dicts also accept jaxamp's ``hysteresis``, ``min_scale``
    and ``max_scale``; the scale never falls to 0 (it stops at
    ``jaxamp.DEFAULT_MIN_SCALE``) and never grows to inf.
  * ``state_dict()['loss_scaler']`` is PyTorch's GradScaler format (Python
    values), plus ``'_hysteresis_tracker'`` when ``hysteresis > 1``. Loading
    growth or backoff factors or an interval that differ from the current
    ones rebuilds the step (one recompilation).
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
               donate: bool = False):
    self._scaler = _parse_loss_scale(loss_scale)
    self.cast_dtype = self._parse_dtype(dtype)
    self._amp_policy = (None if self.cast_dtype is None else
                        policy_lib.Policy(jnp.float32, self.cast_dtype, jnp.float32))
    super().__init__(optimizer, params, accumulative_counts=accumulative_counts,
                     clip_grad=clip_grad, donate=donate)

  def _parse_dtype(self, dtype: Any) -> Optional[jnp.dtype]:
    if dtype is None:
      return None
    if isinstance(dtype, str):
      if dtype not in self.valid_dtypes:
        raise _AssertionValueError(f"dtype should be any of {self.valid_dtypes}, got {dtype}")
      return policy_lib.canonical_dtype(dtype)
    try:
      return policy_lib.canonical_dtype(dtype)
    except (TypeError, ValueError):
      raise _AssertionTypeError(
          f"dtype should be None or a floating dtype or one of {self.valid_dtypes}, got "
          f"{dtype!r}") from None

  # -- transformation --------------------------------------------------------------------------

  def _build_transformation(self) -> optax.GradientTransformation:
    inner = self._inner_transformation()
    cfg = self._scaler
    if cfg.kind == "disabled":
      return inner
    if cfg.kind == "static":
      return ls.static_loss_scale(inner, cfg.init_scale)
    return ls.dynamic_loss_scale(
        inner, init_scale=cfg.init_scale, growth_factor=cfg.growth_factor,
        backoff_factor=cfg.backoff_factor, growth_interval=cfg.growth_interval,
        hysteresis=cfg.hysteresis, min_scale=cfg.min_scale, max_scale=cfg.max_scale)

  @property
  def _scaling(self) -> bool:
    return self._scaler.kind != "disabled"

  def _inner_of(self, state: Any) -> Any:
    return state.inner_state if self._scaling else state

  def _with_inner(self, state: Any, inner: Any) -> Any:
    return state._replace(inner_state=inner) if self._scaling else inner

  def _loss_scale_of(self, state: Any) -> Optional[jax.Array]:
    return state.scale if self._scaling else None

  @property
  def _policy(self) -> Optional[policy_lib.Policy]:
    return self._amp_policy

  def _update(self, params, state, grads, skip):
    if not self._scaling:
      return super()._update(params, state, grads, skip)
    grads = _constrain(grads, self._shardings)
    updates, new_state = self._tx.update(grads, state, params)
    new_params = optax.apply_updates(params, updates)
    # A skipped step leaves the params bit-identical (even -0.0, which + 0 would turn to 0.0).
    # (Kept as a select with donation too: a conditional here would split the update from the
    # addition and change the rounding, e.g. where XLA contracts them into one multiply-add.)
    new_params = numerics.select_tree(new_state.skipped, params, new_params)
    norm = None
    if self._clip is not None and self._clip.kind == "norm":
      recorded = new_state.inner_state[0].total_norm
      order = self._clip.norm_type
      # A skipped step keeps the old inner state; measure the (non-finite) norm then.
      norm = lax.cond(
          new_state.skipped,
          lambda: clipping.total_grad_norm(numerics.unscale(grads, state.scale), order),
          lambda: recorded)
    if skip is not None:
      new_params = numerics.select_tree(skip, params, new_params)
      new_state = numerics.select_tree(skip, state, new_state)
    return _constrain(new_params, self._shardings), new_state, norm

  def _cast_fn(self) -> Callable[[Any], Any]:
    policy = self._amp_policy
    if policy is None:
      return super()._cast_fn()
    return policy.cast_to_compute

  @_fusable
  def step(self, closure: Optional[Callable] = None) -> None:
    """Unscales, clips, skips or applies, and adjusts the scale, in one jitted call."""
    if closure is not None and self._scaling:
      raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
    super().step(closure)

  @_fusable
  def backward(self, loss_fn: Callable[..., Any], *args: Any, has_aux: bool = False,
               **kwargs: Any) -> Any:
    """Adds the gradients of the scaled loss ``loss_fn(params, ...) * scale`` to :attr:`grads`.

    The loss is computed in the compute ``dtype``; the returned loss is the
    unscaled one (float32 when a ``dtype`` is set).
    """
    return self._run_backward(loss_fn, args, kwargs, has_aux, 1.0)

  @contextlib.contextmanager
  def optim_context(self, model: Any = None):
    """As :meth:`OptimWrapper.optim_context`; yields the cast to the compute ``dtype``.

    JAX has no global autocast: ``backward`` and ``update_params`` always
    run the loss in the compute dtype; inside the context, user code casts
    what it computes itself with the yielded function::

      with wrapper.optim_context() as cast:
        logits = model.apply(cast(params), cast(x))
    """
    with super().optim_context(model) as cast:
      yield cast

  # -- loss scale ------------------------------------------------------------------------------

  @property
  def loss_scaler(self) -> Optional[ls.LossScaleState]:
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
    cfg = self._scaler
    out = {"scale": float(self._state.scale), "growth_factor": float(cfg.growth_factor),
           "backoff_factor": float(cfg.backoff_factor), "growth_interval": int(cfg.growth_interval),
           "_growth_tracker": int(self._state.growth_tracker)}
    if cfg.hysteresis > 1:
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
    scale = ls.check_scale("loss_scaler['scale']", _as_float("scale", scaler["scale"]))
    tracker = scaler["_growth_tracker"]
    hysteresis_tracker = scaler.get("_hysteresis_tracker", 0)
    for name, value in (("_growth_tracker", tracker), ("_hysteresis_tracker", hysteresis_tracker)):
      if isinstance(value, bool) or not isinstance(value, (numbers.Integral, np.integer)):
        raise TypeError(f"loss_scaler[{name!r}] must be an int, got {value!r}")
    new_cfg = cfg
    if cfg.kind == "dynamic":
      new_cfg = dataclasses.replace(
          cfg, growth_factor=_as_float("growth_factor", scaler["growth_factor"]),
          backoff_factor=_as_float("backoff_factor", scaler["backoff_factor"]),
          growth_interval=scaler["growth_interval"])
      ls.make_rule(growth_factor=new_cfg.growth_factor, backoff_factor=new_cfg.backoff_factor,
                   growth_interval=new_cfg.growth_interval, hysteresis=new_cfg.hysteresis,
                   min_scale=new_cfg.min_scale, max_scale=new_cfg.max_scale)
      new_cfg = dataclasses.replace(new_cfg, growth_interval=int(new_cfg.growth_interval))

    def install(state):
      if new_cfg != self._scaler:
        self._scaler = new_cfg
        self._tx = self._build_transformation()
        self._jits.clear()
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
    state_dict.pop("base_param_settings", None)
    install = None if scaler is None else self._prepare_scaler_load(scaler)
    commit_optimizer = super()._prepare_load(state_dict)

    def commit():
      commit_optimizer()
      if install is not None:
        self._state = install(self._state)

    return commit

  def load_state_dict(self, state_dict: dict) -> None:
    """Loads the optimizer state and, when present, ``'loss_scaler'`` (PyTorch's format).

    A state dict without ``'loss_scaler'`` loads the optimizer only.
    Everything is validated before anything changes.

    Raises:
      RuntimeError: an empty ``'loss_scaler'`` (PyTorch's message).
      ValueError: see :meth:`OptimWrapper.load_state_dict`; scaler keys.
    """
    self._prepare_load(state_dict)()


# -------------------------------------------------------------------------------------------------
# OptimWrapperDict
# -------------------------------------------------------------------------------------------------


class OptimWrapperDict(OptimWrapper):
  """mmengine's ``OptimWrapperDict``: several named wrappers, e.g. a GAN's generator and critic.

  Behaves as a read-only mapping of name -> wrapper (``[]``, ``in``,
  ``len``, ``keys``/``values``/``items``, iteration over names).
  ``zero_grad`` clears all; ``state_dict``/``load_state_dict`` work per
  name (all entries are validated before any is loaded); ``get_lr()`` and
  ``get_momentum()`` return ``{'gen.lr': [...], 'disc.lr': [...]}``;
  ``param_groups`` is a dict of each wrapper's groups. ``update_params``,
  ``backward``, ``step`` and ``optim_context`` raise ``NotImplementedError``:
  call them on each wrapper.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> gen = jaxamp.OptimWrapper(optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
    ...                           {'w': jnp.zeros(2)})
    >>> disc = jaxamp.OptimWrapper(optax.inject_hyperparams(optax.sgd)(learning_rate=0.5),
    ...                            {'w': jnp.zeros(3)})
    >>> wrappers = jaxamp.OptimWrapperDict(gen=gen, disc=disc)
    >>> wrappers.get_lr()
    {'gen.lr': [0.001], 'disc.lr': [0.5]}
    >>> sorted(wrappers), 'gen' in wrappers, len(wrappers)
    (['disc', 'gen'], True, 2)
  """

  def __init__(self, **optim_wrapper_dict: OptimWrapper):  # pylint: disable=super-init-not-called
    for key, value in optim_wrapper_dict.items():
      if not isinstance(value, OptimWrapper):
        raise _AssertionTypeError("`OptimWrapperDict` only accept OptimWrapper instance, "
                                  f"but got {key}: {type(value)}")
    self.optim_wrappers = optim_wrapper_dict

  def update_params(self, loss_fn: Any = None, *args: Any, step_kwargs: Optional[dict] = None,
                    zero_kwargs: Optional[dict] = None, **kwargs: Any) -> None:
    """Not implemented: call ``update_params`` of each wrapper."""
    raise NotImplementedError("`update_params` should be called by each optimizer separately`")

  def backward(self, loss_fn: Any = None, *args: Any, **kwargs: Any) -> None:
    """Not implemented: call ``backward`` of each wrapper."""
    raise NotImplementedError("`backward` should be called by each optimizer separately`")

  def step(self, *args: Any, **kwargs: Any) -> None:
    """Not implemented: call ``step`` of each wrapper."""
    raise NotImplementedError("`step` should be called by each optimizer separately`")

  def apply_gradients(self, grads: Optional[Any] = None, *, skip: Optional[Any] = None) -> None:
    """Not implemented: call ``apply_gradients`` of each wrapper."""
    raise NotImplementedError("`apply_gradients` should be called by each optimizer separately`")

  def zero_grad(self, set_to_none: bool = True) -> None:
    """Clears the gradients of every wrapper."""
    for wrapper in self.optim_wrappers.values():
      wrapper.zero_grad(set_to_none)

  @contextlib.contextmanager
  def optim_context(self, model: Any = None):
    """Not implemented: use ``optim_context`` of each wrapper."""
    raise NotImplementedError("`optim_context` should be called by each optimizer separately")
    yield  # pragma: no cover  # pylint: disable=unreachable

  def initialize_count_status(self, model: Any, init_counts: int, max_counts: int) -> None:
    """Does nothing (as mmengine): call it on each wrapper."""
    return

  @property
  def param_groups(self) -> Dict[str, List[ParamGroup]]:  # type: ignore[override]
    """The parameter groups of each wrapper, by name."""
    return {key: value.param_groups for key, value in self.optim_wrappers.items()}

  def get_lr(self) -> Dict[str, List[float]]:
    """``{'<name>.lr': [...]}`` for every wrapper."""
    return {f"{name}.lr": wrapper.get_lr()["lr"] for name, wrapper in self.optim_wrappers.items()}

  def get_momentum(self) -> Dict[str, List[float]]:
    """``{'<name>.momentum': [...]}`` for every wrapper."""
    return {f"{name}.momentum": wrapper.get_momentum()["momentum"]
            for name, wrapper in self.optim_wrappers.items()}

  def state_dict(self) -> dict:
    """``{name: wrapper.state_dict()}``."""
    return {name: wrapper.state_dict() for name, wrapper in self.optim_wrappers.items()}

  def load_state_dict(self, state_dict: dict) -> None:
    """Loads ``{name: state_dict}``; every entry is validated before any is loaded."""
    if not isinstance(state_dict, Mapping):
      raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    commits = []
    for name, sub in state_dict.items():
      if name not in self.optim_wrappers:
        raise _AssertionKeyError(f"Mismatched `state_dict`! cannot found {name} in "
                                 "OptimWrapperDict")
      commits.append(self.optim_wrappers[name]._prepare_load(sub))  # pylint: disable=protected-access
    for commit in commits:
      commit()

  def items(self) -> Iterator[Tuple[str, OptimWrapper]]:
    """The ``(name, wrapper)`` pairs."""
    yield from self.optim_wrappers.items()

  def values(self) -> Iterator[OptimWrapper]:
    """The wrappers."""
    yield from self.optim_wrappers.values()

  def keys(self) -> Iterator[str]:
    """The names."""
    yield from self.optim_wrappers.keys()

  def __getitem__(self, key: str) -> OptimWrapper:
    if key not in self.optim_wrappers:
      raise _AssertionKeyError(f"Cannot find {key} in OptimWrapperDict, please check your "
                               "optimizer constructor.")
    return self.optim_wrappers[key]

  def __contains__(self, key: Any) -> bool:
    return key in self.optim_wrappers

  def __len__(self) -> int:
    return len(self.optim_wrappers)

  def __iter__(self) -> Iterator[str]:
    return iter(self.optim_wrappers)

  def __repr__(self) -> str:
    desc = ""
    for name, wrapper in self.optim_wrappers.items():
      desc += f"name: {name}\n" + repr(wrapper)
    return desc
