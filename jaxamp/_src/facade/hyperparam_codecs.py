"""Hyperparameters by their PyTorch names, in optax's ``inject_hyperparams`` states.

``optax.inject_hyperparams`` keeps an optimizer's hyperparameters as arrays
in its state, so they can change without a recompilation. A
:class:`HyperparamCodec` maps a PyTorch name (``'lr'``, ``'betas'``) onto
those state keys (``learning_rate``; ``b1`` and ``b2``, or their complements
``1 - beta``); :func:`with_hyperparam` writes a value through one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Tuple

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
    encode: PyTorch value -> tuple of floats for ``keys`` (checked: finite,
      in PyTorch's range, see :func:`jaxamp._src.outside.hyperparam`).
    decode: tuple of floats read from ``keys`` -> PyTorch value.
  """

  keys: Tuple[str, ...]
  encode: Callable[[Any], Tuple[float, ...]]
  decode: Callable[[Tuple[float, ...]], Any]


def identity_codec(key: str) -> HyperparamCodec:
  """The hyperparameter stored as it is under ``key``."""
  return HyperparamCodec((key,), lambda v: (outside.hyperparam(key, v),), lambda t: t[0])


def pair_codec(name: str, keys: Tuple[str, str], complement: bool) -> HyperparamCodec:
  """A pair (``betas``) stored under two keys, as ``1 - value`` when ``complement``."""
  def encode(v):
    if not isinstance(v, (tuple, list)) or len(v) != 2:
      raise TypeError(f"{name} must be a pair of numbers, got {v!r}")
    a, b = outside.hyperparam(f"{name}[0]", v[0]), outside.hyperparam(f"{name}[1]", v[1])
    return (1.0 - a, 1.0 - b) if complement else (a, b)

  def decode(t):
    return (1.0 - t[0], 1.0 - t[1]) if complement else (t[0], t[1])

  return HyperparamCodec(keys, encode, decode)


def complement_codec(key: str, name: str) -> HyperparamCodec:
  """A number (``alpha``) stored as ``1 - value`` under ``key``."""
  return HyperparamCodec((key,), lambda v: (1.0 - outside.hyperparam(name, v),),
                         lambda t: 1.0 - t[0])


def generic_codecs(hyperparams: Mapping[str, Any]) -> Dict[str, HyperparamCodec]:
  """PyTorch names for the hyperparameters of an arbitrary injected optax optimizer.

  ``learning_rate`` reads as ``lr``, ``b1``/``b2`` as ``betas``; other
  scalar hyperparameters keep their optax names.
  """
  betas = "b1" in hyperparams and "b2" in hyperparams
  codecs = {"lr" if key == "learning_rate" else key: identity_codec(key)
            for key, value in hyperparams.items()
            if jnp.shape(value) == () and not (betas and key in ("b1", "b2"))}
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
  encoded = codec.encode(value)
  leaves, treedef = jax.tree.flatten(opt_state, is_leaf=_is_inject)
  position = [i for i, x in enumerate(leaves) if _is_inject(x)][index]
  hyperparams = dict(leaves[position].hyperparams)
  for k, v in zip(codec.keys, encoded):
    old = hyperparams[k]
    hyperparams[k] = jax.device_put(np.asarray(v, dtype=old.dtype), old.sharding)
  leaves[position] = leaves[position]._replace(hyperparams=hyperparams)
  return jax.tree.unflatten(treedef, leaves)
