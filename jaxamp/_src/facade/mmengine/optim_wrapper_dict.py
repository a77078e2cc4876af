"""mmengine's ``OptimWrapperDict``: several named wrappers, e.g. a GAN's generator and critic."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
import functools
from typing import Any, Callable, Dict, Iterator, List, Tuple

import jax
import jax.numpy as jnp

from jaxamp._src import state as state_lib

from jaxamp._src.facade.errors import AssertionKeyError
from jaxamp._src.facade.errors import AssertionTypeError
from jaxamp._src.facade.mmengine.param_groups import ParamGroup
from jaxamp._src.facade.mmengine.optim_wrapper import OptimWrapper
from jaxamp._src.facade.scaled_loss import ScaledLoss



class OptimWrapperDict(OptimWrapper):
  """mmengine's ``OptimWrapperDict``: several named wrappers, e.g. a GAN's generator and critic.

  Behaves as a read-only mapping of name -> wrapper (``[]``, ``in``,
  ``len``, ``keys``/``values``/``items``, iteration over names).
  ``zero_grad`` clears all; ``state_dict``/``load_state_dict`` work per
  name (all entries are validated before any is loaded); ``get_lr()`` and
  ``get_momentum()`` return ``{'gen.lr': [...], 'disc.lr': [...]}``;
  ``param_groups`` is a dict of each wrapper's groups. ``update_params``,
  ``backward``, ``step`` and ``optim_context`` raise ``NotImplementedError``:
  call them on each wrapper. :meth:`backward_all` (jaxamp's) computes the
  gradients of one loss for several wrappers in one backward pass.

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

  def backward_all(self, loss_fn: Callable[..., Any], *args: Any, has_aux: bool = False,
                   **kwargs: Any) -> Any:
    """One backward pass for a loss of several wrappers' parameters, adding into each one's grads.

    PyTorch's ``loss.backward()`` fills the gradients of every model the loss
    depends on; here ``loss_fn({name: params, ...}, *args, **kwargs)`` takes
    the parameters of every wrapper by name, and its gradient with respect to
    each wrapper's parameters is added to that wrapper's ``grads``. So
    PyTorch's "multiple models, losses and optimizers" recipe takes one
    forward and backward pass per loss::

      wrappers.backward_all(scaler.scale(loss0_fn), x)   # scaler.scale(loss0).backward()
      wrappers.backward_all(scaler.scale(loss1_fn), x)   # scaler.scale(loss1).backward()
      scaler.step(wrappers['a']); scaler.step(wrappers['b']); scaler.update()

    ``loss_fn`` may be ``scaler.scale(fn)``: the scale is passed into the
    compiled call (one compile for the loop), and the returned loss is the one
    before scaling.

    Returns:
      The loss as ``loss_fn`` computed it (``(loss, aux)`` with ``has_aux``).

    Raises:
      ValueError: for a wrapper with ``accumulative_counts > 1`` (each
        wrapper would divide the shared loss by its own count: call
        ``backward`` on each wrapper instead).
    """
    for name, wrapper in self.optim_wrappers.items():
      if wrapper._counter.accumulative_counts != 1:  # noqa: SLF001
        raise ValueError(f"backward_all needs accumulative_counts=1, but wrapper {name!r} "
                         f"accumulates {wrapper._counter.accumulative_counts} calls: call "  # noqa: SLF001
                         "its own backward instead")
    params = {name: wrapper.params for name, wrapper in self.optim_wrappers.items()}
    if isinstance(loss_fn, ScaledLoss):
      fn, scaler, scale = loss_fn.fn, loss_fn.scaler, loss_fn.scale
    else:
      fn, scaler, scale = loss_fn, None, jnp.float32(1.0)
    out, grads = _value_and_grads(fn, scaler, bool(has_aux), scale, params, args, kwargs)
    for name, wrapper in self.optim_wrappers.items():
      held = wrapper.grads
      wrapper.grads = grads[name] if held is None else jax.tree.map(jnp.add, held, grads[name])
    return out

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
    """Loads ``{name: state_dict}``; every entry is validated before any is loaded.

    Raises:
      KeyError: (also an ``AssertionError``, mmengine's type) a name that is
        not a wrapper here, or a wrapper without an entry (mmengine leaves it
        silently unrestored).
    """
    if not isinstance(state_dict, Mapping):
      raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    for name in state_dict:
      if name not in self.optim_wrappers:
        raise AssertionKeyError(f"Mismatched `state_dict`! cannot found {name} in "
                                 "OptimWrapperDict")
    missing = [name for name in self.optim_wrappers if name not in state_dict]
    if missing:
      raise AssertionKeyError(f"Mismatched `state_dict`! it holds no entry for {missing} of this "
                              "OptimWrapperDict (it has "
                              f"{list(self.optim_wrappers)}): those would not be restored")
    commits = []
    for name, sub in state_dict.items():
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


def _per_wrapper(name: str) -> Callable[..., None]:
  """A method mmengine's ``OptimWrapperDict`` leaves to each wrapper: its ``NotImplementedError``."""

  def method(self: OptimWrapperDict, *args: Any, **kwargs: Any) -> None:
    raise NotImplementedError(f"`{name}` should be called by each optimizer separately`")

  method.__name__ = name
  method.__doc__ = f"Not implemented: call ``{name}`` of each wrapper."
  return method


def _not_held(name: str) -> property:
  """A member mmengine's ``OptimWrapperDict`` inherits but cannot serve: its ``AttributeError``."""

  def get(self: OptimWrapperDict) -> Any:
    names = list(self.optim_wrappers)
    example = f"wrappers[{names[0]!r}].{name}" if names else f"wrapper.{name}"
    raise AttributeError(
        f"'OptimWrapperDict' object has no attribute '{name}': each wrapper holds its own "
        f"(read {example}), as in mmengine, whose OptimWrapperDict has no optimizer or counters")

  get.__doc__ = f"Not held: ``{name}`` belongs to each wrapper (an ``AttributeError``)."
  return property(get)


# The members of OptimWrapper that belong to one wrapper: mmengine's OptimWrapperDict inherits them
# and fails with AttributeError on the state it does not hold.
for _name in ("params", "opt_state", "grads", "donate", "last_grad_norm", "inner_count",
              "defaults", "should_update", "should_sync", "scale_loss", "apply_scaled_gradients",
              "optimizer", "clip_grad_kwargs", "base_param_settings"):
  setattr(OptimWrapperDict, _name, _not_held(_name))
for _name in ("update_params", "backward", "step", "apply_gradients"):
  setattr(OptimWrapperDict, _name, _per_wrapper(_name))
del _name


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _value_and_grads(fn: Callable[..., Any], scaler: Any, has_aux: bool, scale: jax.Array,
                     params: Any, args: tuple, kwargs: dict) -> tuple[Any, Any]:
  def objective(p):
    if scaler is None:
      out = fn(p, *args, **kwargs)
    else:
      with scaler.using_scale(scale):  # scaler.scale() inside fn uses this scale
        out = fn(p, *args, **kwargs)
    loss, aux = out if has_aux else (out, None)
    return state_lib.multiply_by_scale(loss, scale), (loss, aux)

  grads, (loss, aux) = jax.grad(objective, has_aux=True)(params)
  return ((loss, aux) if has_aux else loss), grads
