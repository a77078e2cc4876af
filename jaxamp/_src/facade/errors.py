"""Exception types of the facades: the original's type and Python's usual one at once.

PyTorch, mmengine and Paddle check many arguments with ``assert``, so code
ported from them may catch ``AssertionError``; Python code expects a
``ValueError`` or a ``TypeError``. The facades raise these classes, which are
both, with the original's message where jaxamp mimics it.
"""

from __future__ import annotations


class AssertionValueError(AssertionError, ValueError):
  """A bad value where the original raises ``AssertionError``; also a ``ValueError``."""


class AssertionTypeError(AssertionError, TypeError):
  """A bad type where the original raises ``AssertionError``; also a ``TypeError``."""


class AssertionRuntimeError(AssertionError, RuntimeError):
  """A misuse where the original raises ``AssertionError``; also a ``RuntimeError``."""


class AssertionKeyError(AssertionError, KeyError):
  """A missing name where mmengine raises ``AssertionError``; also a ``KeyError``.

  Its message reads as given (``KeyError`` would print it quoted).
  """

  def __str__(self) -> str:
    return str(self.args[0]) if self.args else ""


class NewScaleError(TypeError, AttributeError, AssertionError):
  """A ``new_scale`` of a type ``GradScaler.update`` does not accept.

  PyTorch fails on such a value with ``AssertionError`` (a tensor of the wrong
  size) or ``AttributeError`` (not a tensor); this is both, and a ``TypeError``.
  """
