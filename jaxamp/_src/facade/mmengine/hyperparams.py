"""Hyperparameters by their PyTorch names, read from and written to optax's injected state.

``optax.inject_hyperparams`` keeps an optimizer's hyperparameters as arrays
in its state, so they can change without a recompilation. A
:class:`HyperparamCodec` maps a PyTorch name (``'lr'``, ``'betas'``) onto
those state keys (``learning_rate``; ``b1`` and ``b2``, or their complements
``1 - beta``); a :class:`GroupSpec` describes one parameter group (one
injected state), and :class:`ParamGroup` is the live ``param_groups[i]``
view mmengine's schedulers read and write.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp._src import outside

if TYPE_CHECKING:
  from jaxamp._src.facade.mmengine.optim_wrapper import OptimWrapper

_INJECT_TYPES = (optax.InjectStatefulHyperparamsState, optax.InjectHyperparamsState)


def _is_inject(x: Any) -> bool:
  return isinstance(x, _INJECT_TYPES)


def inject_nodes(opt_state: Any) -> List[Any]:
  """The outermost ``optax.inject_hyperparams`` states inside ``opt_state``, in leaf order."""
  return [x for x in jax.tree.leaves(opt_state, is_leaf=_is_inject) if _is_inject(x)]


def replace_inject_node(opt_state: Any, index: int, node: Any) -> Any:
  """``opt_state`` with its ``index``-th injected state replaced by ``node``."""
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


def identity_codec(key: str) -> HyperparamCodec:
  """The hyperparameter stored as it is under ``key``."""
  return HyperparamCodec((key,), lambda v: (as_float(key, v),), lambda t: t[0])


def pair_codec(name: str, keys: Tuple[str, str], complement: bool) -> HyperparamCodec:
  """A pair (``betas``) stored under two keys, as ``1 - value`` when ``complement``."""
  def encode(v):
    if not isinstance(v, (tuple, list)) or len(v) != 2:
      raise TypeError(f"{name} must be a pair of numbers, got {v!r}")
    a, b = as_float(f"{name}[0]", v[0]), as_float(f"{name}[1]", v[1])
    return (1.0 - a, 1.0 - b) if complement else (a, b)

  def decode(t):
    return (1.0 - t[0], 1.0 - t[1]) if complement else (t[0], t[1])

  return HyperparamCodec(keys, encode, decode)


def complement_codec(key: str, name: str) -> HyperparamCodec:
  """A number (``alpha``) stored as ``1 - value`` under ``key``."""
  return HyperparamCodec((key,), lambda v: (1.0 - as_float(name, v),), lambda t: 1.0 - t[0])


def as_float(name: str, value: Any) -> float:
  """A hyperparameter written after construction, as a float: finite, and in PyTorch's range.

  ``name`` is the optax key or the PyTorch name (``'learning_rate'``,
  ``'betas[0]'``), which selects the range (see :func:`jaxamp._src.outside.hyperparam`).
  """
  return outside.hyperparam(name, value)


def _named(where: str, err: Exception) -> Exception:
  """``err`` of the same type, its message prefixed with where the value was written."""
  out = type(err)(f"{where}: {err}")
  return out


def shortest_float(array: np.ndarray) -> float:
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
    codecs["lr" if key == "learning_rate" else key] = identity_codec(key)
  if "b1" in hyperparams and "b2" in hyperparams:
    codecs["betas"] = pair_codec("betas", ("b1", "b2"), complement=False)
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

  def __init__(self, wrapper: OptimWrapper, index: int):
    self._wrapper = wrapper
    self._index = index

  @property
  def _spec(self) -> GroupSpec:
    return self._wrapper._group_specs()[self._index]  # noqa: SLF001

  def __getitem__(self, key: str) -> Any:
    spec = self._spec
    if key == "params":
      return list(spec.names) if spec.names is not None else None
    if key in spec.codecs:
      return self._wrapper._read_hyperparam(self._index, key)  # noqa: SLF001
    if key in spec.fixed:
      return spec.fixed[key]
    return spec.extras[key]

  def __setitem__(self, key: str, value: Any) -> None:
    spec = self._spec
    if key == "params":
      raise ValueError("The 'params' of a parameter group cannot be changed; build a new wrapper.")
    if key in spec.codecs:
      try:
        self._wrapper._write_hyperparam(self._index, key, value)  # noqa: SLF001
      except (TypeError, ValueError) as err:
        raise _named(f"param_groups[{self._index}][{key!r}]", err) from None
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



def read_hyperparam(spec: GroupSpec, node: Any, key: str) -> Any:
  """The value of ``key`` in the injected state ``node`` of the group ``spec`` (a host sync).

  The Python value last written (``spec.mirror``) is returned while the
  device still holds it, so ``group['lr'] = 0.1`` reads back ``0.1``, not
  the float32 rounding of it.
  """
  codec = spec.codecs[key]
  arrays = [np.asarray(node.hyperparams[k]) for k in codec.keys]
  values = tuple(shortest_float(a) for a in arrays)
  if key in spec.mirror:
    mirrored = codec.encode(spec.mirror[key])
    if all(np.asarray(m, a.dtype) == a for m, a in zip(mirrored, arrays)):
      return spec.mirror[key]
  return codec.decode(values)


def with_hyperparam(opt_state: Any, index: int, codec: HyperparamCodec, value: Any) -> Any:
  """``opt_state`` with ``value`` written into its ``index``-th injected state.

  Each array keeps its dtype and sharding, so the next step does not compile
  again.
  """
  encoded = codec.encode(value)
  node = inject_nodes(opt_state)[index]
  hyperparams = dict(node.hyperparams)
  for k, v in zip(codec.keys, encoded):
    old = hyperparams[k]
    hyperparams[k] = jax.device_put(np.asarray(v, dtype=old.dtype), old.sharding)
  return replace_inject_node(opt_state, index, node._replace(hyperparams=hyperparams))


def load_groups(groups: Any, specs: List[GroupSpec], opt_state: Any
                ) -> Tuple[Any, Callable[[], None]]:
  """Validates saved ``param_groups`` against ``specs`` and writes their hyperparameters.

  Returns ``opt_state`` with the saved hyperparameters in it, and the
  function that records the rest in ``specs`` (the Python values written,
  extra keys such as ``initial_lr``). Nothing is changed before that
  function is called, so a bad group leaves the wrapper as it was.

  Raises:
    ValueError: another number of groups, other parameter names, or a
      code-selecting hyperparameter (``nesterov``...) of another value.
    TypeError: a group that is not a dict.
  """
  if not isinstance(groups, (list, tuple)):
    raise TypeError(f"state_dict['param_groups'] must be a list of dicts, got {groups!r}")
  if len(groups) != len(specs):
    raise ValueError("loaded state dict has a different number of parameter groups")
  writes = []
  extras = []
  for index, (group, spec) in enumerate(zip(groups, specs)):
    if not isinstance(group, Mapping):
      raise TypeError(f"param_groups[{index}] must be a dict, got {type(group).__name__}")
    names = group.get("params")
    if names is not None and not (isinstance(names, (list, tuple))
                                  and all(isinstance(n, str) for n in names)):
      raise TypeError(f"state_dict['param_groups'][{index}]['params'] must be a list of "
                      f"parameter names, got {names!r}")
    if spec.names is not None and names is not None and list(names) != list(spec.names):
      raise ValueError("loaded state dict contains a parameter group that doesn't match the "
                       "size of optimizer's group")
    group_extras = {}
    for key, value in group.items():
      if key == "params":
        continue
      if key in spec.codecs:
        try:
          opt_state = with_hyperparam(opt_state, index, spec.codecs[key], value)
        except (TypeError, ValueError) as err:
          raise _named(f"state_dict['param_groups'][{index}][{key!r}]", err) from None
        writes.append((index, key, value))
      elif key in spec.fixed:
        if value != spec.fixed[key]:
          raise ValueError(f"param_groups[{index}][{key!r}] is {value!r} but this optimizer "
                           f"was built with {spec.fixed[key]!r}: a state of a different "
                           "optimizer")
      else:
        group_extras[key] = value
    extras.append(group_extras)

  def commit() -> None:
    for index, key, value in writes:
      specs[index].mirror[key] = value
    for spec, group_extras in zip(specs, extras):
      spec.extras.update(group_extras)

  return opt_state, commit
