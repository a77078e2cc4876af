"""Counts the traces of the optimizer wrappers' jitted steps, by kind, per wrapper.

A wrapper jits four traced implementations (``_grad_impl``, ``_fused_impl``,
``_apply_impl``, ``_apply_scaled_impl``). :func:`install` wraps them so that
each trace is counted under the kind of step it is, read from its arguments:
``'grad'`` or ``'grad_acc'`` (a backward pass without or with gradients to add
to), ``'fused'`` or ``'fused_acc'`` (backward and step in one call),
``'apply'`` or ``'apply_skip'`` (a step without or with an external skip flag)
and ``'apply_scaled'``. :func:`trace_counts` reads a wrapper's counts.
tests/conftest.py installs the counters for the whole session.
"""

from __future__ import annotations

import collections
import functools
import weakref

from jaxamp._src.facade.mmengine.optim_wrapper import OptimWrapper

# Each implementation and how its arguments (after self) name the kind of step.
_KINDS = {
    "_grad_impl": lambda params, buffer, *rest: "grad" if buffer is None else "grad_acc",
    "_fused_impl": lambda params, state, buffer, *rest: "fused" if buffer is None else "fused_acc",
    "_apply_impl": lambda params, state, grads, skip=None: "apply" if skip is None else "apply_skip",
    "_apply_scaled_impl": lambda *args: "apply_scaled",
}
_COUNTS: "weakref.WeakKeyDictionary[OptimWrapper, collections.Counter]" = (
    weakref.WeakKeyDictionary())


def _counting(method, kind):
  @functools.wraps(method)
  def counted(self, *args, **kwargs):
    _COUNTS.setdefault(self, collections.Counter())[kind(*args, **kwargs)] += 1
    return method(self, *args, **kwargs)

  counted.jaxamp_counted = True
  return counted


def install() -> None:
  """Wraps the traced implementations of ``OptimWrapper`` (once)."""
  for attr, kind in _KINDS.items():
    method = getattr(OptimWrapper, attr)
    if not getattr(method, "jaxamp_counted", False):
      setattr(OptimWrapper, attr, _counting(method, kind))


def trace_counts(wrapper: OptimWrapper) -> collections.Counter:
  """How often each kind of jitted step of ``wrapper`` was traced (a live ``Counter``)."""
  return _COUNTS.setdefault(wrapper, collections.Counter())
