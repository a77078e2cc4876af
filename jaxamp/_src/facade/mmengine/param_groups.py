"""mmengine's parameter groups over an optax state: their books, the live view, saved groups.

A :class:`GroupSpec` is what a wrapper knows about one parameter group (one
injected state): its leaf names, its hyperparameters by PyTorch name, the
keys fixed at construction and user extras. :class:`ParamGroup` is the live
``param_groups[i]`` view mmengine's schedulers read and write;
:func:`load_groups` checks and writes saved groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, MutableMapping
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Tuple

import numpy as np

from jaxamp._src.facade.hyperparam_codecs import HyperparamCodec
from jaxamp._src.facade.hyperparam_codecs import shortest_float
from jaxamp._src.facade.hyperparam_codecs import with_hyperparam


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


class GroupOwner(Protocol):
  """What a :class:`ParamGroup` reads and writes through (the wrapper)."""

  def _group_specs(self) -> List[GroupSpec]: ...

  def _read_hyperparam(self, index: int, key: str) -> Any: ...

  def _write_hyperparams(self, index: int, values: Dict[str, Any]) -> None: ...


# PyTorch's hyperparameters that mmengine's parameter schedulers write: stored as a plain entry, a
# written value would change nothing, silently.
_SCHEDULED = ("lr", "momentum", "betas", "weight_decay", "eps", "dampening", "alpha", "lr_decay")


def _refuse_unheld(where: str, key: str) -> None:
  """Raises when ``key`` is a hyperparameter the group's optax state does not hold."""
  if key in _SCHEDULED:
    raise ValueError(
        f"{where}: this optimizer's state holds no injected {key!r}, so the value would change "
        "nothing. Build the optimizer as, e.g., optax.inject_hyperparams(optax.sgd)("
        "learning_rate=0.1), or with jaxamp.build_optim_wrapper, to make it settable.")


def _is_fixed(value: Any, fixed: Any) -> bool:
  """Whether ``value`` is the value a code-selecting key was built with (a scalar equal to it)."""
  return np.ndim(value) == 0 and bool(value == fixed)


def _named(where: str, err: Exception) -> Exception:
  """``err`` of the same type, its message prefixed with where the value was written."""
  return type(err)(f"{where}: {err}")


def with_values(opt_state: Any, index: int, spec: GroupSpec, values: Mapping[str, Any],
                where: str) -> Any:
  """``opt_state`` with the hyperparameters ``values`` (PyTorch names) written into group ``index``.

  Each value is checked as written and as stored (:func:`.hyperparam_codecs.stored_values`);
  an error is prefixed with ``where[key]`` (``where``: ``"param_groups[0]"``, say). Nothing is
  changed: the caller installs the returned state once every value passed.
  """
  for key, value in values.items():
    try:
      opt_state = with_hyperparam(opt_state, index, spec.codecs[key], value)
    except (TypeError, ValueError) as err:
      raise _named(f"{where}[{key!r}]", err) from None
  return opt_state


class ParamGroup(MutableMapping):
  """A live view of one parameter group, as ``torch.optim.Optimizer.param_groups[i]``.

  Reading ``group['lr']`` reads the learning rate from the optax state (a host
  sync); writing ``group['lr'] = 0.01`` writes it there, so mmengine-style
  parameter schedulers work unchanged, without a recompilation. ``'params'``
  lists the dotted names of the group's leaves. Keys that are not
  hyperparameters (``initial_lr``, ``lr_mult``...) are kept as plain entries.
  """

  def __init__(self, owner: GroupOwner, index: int):
    self._owner = owner
    self._index = index

  @property
  def _spec(self) -> GroupSpec:
    return self._owner._group_specs()[self._index]  # noqa: SLF001

  def __getitem__(self, key: str) -> Any:
    spec = self._spec
    if key == "params":
      return list(spec.names) if spec.names is not None else None
    if key in spec.codecs:
      return self._owner._read_hyperparam(self._index, key)  # noqa: SLF001
    if key in spec.fixed:
      return spec.fixed[key]
    return spec.extras[key]

  def _where(self, key: str) -> str:
    return f"param_groups[{self._index}][{key!r}]"

  def __setitem__(self, key: str, value: Any) -> None:
    self.update({key: value})

  def update(self, other: Any = (), /, **kwargs: Any) -> None:
    """Sets several entries at once: every value is checked before any is written.

    A refused value (a beta out of range beside a new learning rate, say)
    leaves the group as it was, as every other refused write does.
    """
    items = dict(other, **kwargs)
    spec = self._spec
    hyperparams, extras = {}, {}
    for key, value in items.items():
      if key == "params":
        raise ValueError("The 'params' of a parameter group cannot be changed; build a new "
                         "wrapper.")
      if key in spec.codecs:
        hyperparams[key] = value
      elif key in spec.fixed:
        if not _is_fixed(value, spec.fixed[key]):
          raise ValueError(f"{key!r} selects code and is fixed at construction "
                           f"(it is {spec.fixed[key]!r}); build a new wrapper to change it.")
      else:
        _refuse_unheld(self._where(key), key)
        extras[key] = value
    if hyperparams:
      self._owner._write_hyperparams(self._index, hyperparams)  # noqa: SLF001
    spec.extras.update(extras)

  def __delitem__(self, key: str) -> None:
    spec = self._spec
    if key == "params" or key in spec.codecs or key in spec.fixed:
      held = ("names the group's parameters" if key == "params" else
              "is held in the optimizer state" if key in spec.codecs else
              "selects code and is fixed at construction")
      raise ValueError(f"{self._where(key)} cannot be deleted: it {held}. Set it to another "
                       "value instead, or build a new wrapper.")
    if key not in spec.extras:
      raise KeyError(f"param_groups[{self._index}] has no key {key!r}; it holds {list(self)}")
    del spec.extras[key]

  def popitem(self) -> Tuple[str, Any]:
    """Removes and returns the last entry that is neither ``'params'`` nor a hyperparameter."""
    extras = self._spec.extras
    if not extras:
      raise KeyError(f"popitem(): param_groups[{self._index}] holds only its 'params' and "
                     "hyperparameters, which cannot be deleted")
    return extras.popitem()

  def clear(self) -> None:
    """Refused: a group's ``'params'`` and hyperparameters cannot be deleted."""
    raise ValueError(f"param_groups[{self._index}].clear(): its 'params' and hyperparameters "
                     "cannot be deleted; delete the other keys one by one")

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
  if key in spec.mirror:
    mirrored = codec.encode(spec.mirror[key])
    if all(np.asarray(m, a.dtype) == a for m, a in zip(mirrored, arrays)):
      return spec.mirror[key]
  return codec.decode(tuple(shortest_float(a) for a in arrays))


def load_groups(groups: Any, specs: List[GroupSpec], opt_state: Any
                ) -> Tuple[Any, Callable[[], None]]:
  """Validates saved ``param_groups`` against ``specs`` and writes their hyperparameters.

  Returns ``opt_state`` with the saved hyperparameters in it, and the
  function that records the rest in ``specs`` (the Python values written,
  extra keys such as ``initial_lr``, which replace the group's: a key the
  saved group lacks is gone, as in PyTorch). Nothing is changed before that
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
        opt_state = with_values(opt_state, index, spec, {key: value},
                                f"state_dict['param_groups'][{index}]")
        writes.append((index, key, value))
      elif key in spec.fixed:
        if not _is_fixed(value, spec.fixed[key]):
          raise ValueError(f"param_groups[{index}][{key!r}] is {value!r} but this optimizer "
                           f"was built with {spec.fixed[key]!r}: a state of a different "
                           "optimizer")
      else:
        _refuse_unheld(f"state_dict['param_groups'][{index}][{key!r}]", key)
        group_extras[key] = value
    extras.append(group_extras)

  def commit() -> None:
    for index, key, value in writes:
      specs[index].mirror[key] = value
    for spec, group_extras in zip(specs, extras):
      # The loaded group replaces the old one, as in PyTorch: a key it lacks is gone.
      spec.extras.clear()
      spec.extras.update(group_extras)

  return opt_state, commit
