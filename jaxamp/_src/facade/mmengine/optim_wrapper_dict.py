"""mmengine's ``OptimWrapperDict``: several named wrappers, e.g. a GAN's generator and critic."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Dict, Iterator, List, Optional, Tuple

from jaxamp._src.facade.errors import AssertionKeyError
from jaxamp._src.facade.errors import AssertionTypeError
from jaxamp._src.facade.mmengine.hyperparams import ParamGroup
from jaxamp._src.facade.mmengine.optim_wrapper import OptimWrapper



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

  def __init__(self, **optim_wrapper_dict: OptimWrapper):  # holds no state: no super().__init__
    for key, value in optim_wrapper_dict.items():
      if not isinstance(value, OptimWrapper):
        raise AssertionTypeError("`OptimWrapperDict` only accept OptimWrapper instance, "
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
    yield  # pragma: no cover

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
        raise AssertionKeyError(f"Mismatched `state_dict`! cannot found {name} in "
                                 "OptimWrapperDict")
      commits.append(self.optim_wrappers[name]._prepare_load(sub))  # noqa: SLF001
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
      raise AssertionKeyError(f"Cannot find {key} in OptimWrapperDict, please check your "
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
