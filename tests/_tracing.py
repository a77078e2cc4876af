"""Counts the traces of the optimizer wrappers' jitted functions, by name, per wrapper.

A wrapper builds one jitted function per step kind (``'grad'``, ``'grad_acc'``,
``'fused'``, ``'fused_acc'``, ``'apply'``, ``'apply_skip'``, ``'apply_scaled'``)
from its traced implementations, which take that name as their first
argument. :func:`install` wraps those implementations so that each trace is
counted; :func:`trace_counts` reads a wrapper's counts. tests/conftest.py
installs the counters for the whole session.
"""

from __future__ import annotations

import collections
import functools
import weakref

from jaxamp._src.facade.mmengine.optim_wrapper import OptimWrapper

# The implementations whose every trace is one trace of the jitted function named by
# their first argument (``_apply_scaled_impl`` traces through ``_apply_impl``).
_COUNTED = ("_grad_impl", "_apply_impl", "_fused_impl")
_COUNTS: "weakref.WeakKeyDictionary[OptimWrapper, collections.Counter]" = (
    weakref.WeakKeyDictionary())


def _counting(method):
  @functools.wraps(method)
  def counted(self, name, *args, **kwargs):
    _COUNTS.setdefault(self, collections.Counter())[name] += 1
    return method(self, name, *args, **kwargs)

  counted.jaxamp_counted = True
  return counted


def install() -> None:
  """Wraps the traced implementations of ``OptimWrapper`` (once)."""
  for attr in _COUNTED:
    method = getattr(OptimWrapper, attr)
    if not getattr(method, "jaxamp_counted", False):
      setattr(OptimWrapper, attr, _counting(method))


def trace_counts(wrapper: OptimWrapper) -> collections.Counter:
  """How often each jitted function of ``wrapper`` was traced (a live ``Counter``)."""
  return _COUNTS.setdefault(wrapper, collections.Counter())
