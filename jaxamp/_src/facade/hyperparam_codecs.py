"""Hyperparameters by their PyTorch names, in optax's ``inject_hyperparams`` states.

``optax.inject_hyperparams`` keeps an optimizer's hyperparameters as arrays
in its state, so they can change without a recompilation. A
:class:`HyperparamCodec` maps a PyTorch name (``'lr'``, ``'betas'``) onto
those state keys (``learning_rate``; ``b1`` and ``b2``, or their complements
``1 - beta``); :func:`with_hyperparam` writes a value through one, after
checking it as PyTorch's constructor does and then as it will be stored
(:func:`stored_values`: finite in the dtype the state holds it in, and in
range there).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp._src import outside

_INJECT_TYPES = (optax.InjectStatefulHyperparamsState, optax.InjectHyperparamsState)


def _is_inject(x: Any) -> bool:
  return isinstance(x, _INJECT_TYPES)


def inject_nodes(opt_state: Any) -> List[Any]:
  """The outermost ``optax.inject_hyperparams`` states inside ``opt_state``, in leaf order."""
  return [x for x in jax.tree.leaves(opt_state, is_leaf=_is_inject) if _is_inject(x)]


@dataclasses.dataclass(frozen=True)
class HyperparamCodec:
  """How a PyTorch-named hyperparameter (``'lr'``, ``'betas'``) maps onto optax state keys.

  Attributes:
    keys: the keys of ``InjectHyperparamsState.hyperparams`` holding it.
    labels: how messages name the value stored under each key (``'lr'``,
      ``'1 - betas[0]'``).
    encode: PyTorch value -> tuple of floats for ``keys`` (checked: a real
      number in PyTorch's range, see :func:`jaxamp._src.outside.hyperparam`;
      :func:`stored_values` checks them as stored).
    decode: tuple of floats read from ``keys`` -> PyTorch value.
  """

  keys: Tuple[str, ...]
  labels: Tuple[str, ...]
  encode: Callable[[Any], Tuple[float, ...]]
  decode: Callable[[Tuple[float, ...]], Any]


def _user(name: str, value: Any, key: str) -> float:
  """``value`` checked in the form the user writes it (as a float64, before it is stored)."""
  return outside.hyperparam(name, value, key=key, dtype=np.float64)


def identity_codec(key: str, name: str = "") -> HyperparamCodec:
  """The hyperparameter stored as it is under ``key``; ``name`` (default ``key``) in messages."""
  name = name or key
  return HyperparamCodec((key,), (name,), lambda v: (_user(name, v, key),), lambda t: t[0])


def pair_codec(name: str, keys: Tuple[str, str], complement: bool) -> HyperparamCodec:
  """A pair (``betas``) stored under two keys, as ``1 - value`` when ``complement``."""
  def encode(v):
    if not isinstance(v, (tuple, list)) or len(v) != 2:
      raise TypeError(f"{name} must be a pair of numbers, got {v!r}")
    a, b = _user(f"{name}[0]", v[0], f"{name}[0]"), _user(f"{name}[1]", v[1], f"{name}[1]")
    return (1.0 - a, 1.0 - b) if complement else (a, b)

  def decode(t):
    return (1.0 - t[0], 1.0 - t[1]) if complement else (t[0], t[1])

  prefix = "1 - " if complement else ""
  return HyperparamCodec(keys, (f"{prefix}{name}[0]", f"{prefix}{name}[1]"), encode, decode)


def complement_codec(key: str, name: str) -> HyperparamCodec:
  """A number (``alpha``) stored as ``1 - value`` under ``key``."""
  return HyperparamCodec((key,), (f"1 - {name}",), lambda v: (1.0 - _user(name, v, name),),
                         lambda t: 1.0 - t[0])


def stored_values(codec: HyperparamCodec, value: Any, dtypes: Sequence[Any]) -> List[np.ndarray]:
  """``value`` encoded for ``codec.keys``, each checked and cast as stored in its dtype.

  The one rule of every write (constructor, setter, loader): the PyTorch
  value is checked as the user writes it (``encode``), then each stored
  value in the dtype the state holds it in (finite there, within the range
  of its key: a ``1e39`` learning rate is an infinite float32).

  Raises:
    TypeError: not a real number (or not a pair, for ``betas``).
    ValueError: out of range as written or as stored.
  """
  encoded = codec.encode(value)
  return [np.asarray(outside.hyperparam(label, v, key=k, dtype=dtype), dtype)
          for label, k, v, dtype in zip(codec.labels, codec.keys, encoded, dtypes)]


def generic_codecs(hyperparams: Mapping[str, Any]) -> Dict[str, HyperparamCodec]:
  """PyTorch names for the hyperparameters of an arbitrary injected optax optimizer.

  ``learning_rate`` reads as ``lr``, ``b1``/``b2`` as ``betas``; other
  scalar hyperparameters keep their optax names.
  """
  betas = "b1" in hyperparams and "b2" in hyperparams
  codecs = {}
  for key, value in hyperparams.items():
    if jnp.shape(value) == () and not (betas and key in ("b1", "b2")):
      name = "lr" if key == "learning_rate" else key
      codecs[name] = identity_codec(key, name)
  if betas:
    codecs["betas"] = pair_codec("betas", ("b1", "b2"), complement=False)
  return codecs


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


def with_hyperparam(opt_state: Any, index: int, codec: HyperparamCodec, value: Any) -> Any:
  """``opt_state`` with ``value`` written into its ``index``-th injected state.

  Each array keeps its dtype and sharding, so the next step does not compile
  again.
  """
  leaves, treedef = jax.tree.flatten(opt_state, is_leaf=_is_inject)
  position = [i for i, x in enumerate(leaves) if _is_inject(x)][index]
  hyperparams = dict(leaves[position].hyperparams)
  olds = [hyperparams[k] for k in codec.keys]
  stored = stored_values(codec, value, [old.dtype for old in olds])
  for k, v, old in zip(codec.keys, stored, olds):
    hyperparams[k] = jax.device_put(v, old.sharding)
  leaves[position] = leaves[position]._replace(hyperparams=hyperparams)
  return jax.tree.unflatten(treedef, leaves)
