"""A griffe extension rendering the reStructuredText bits of jaxamp's docstrings as Markdown.

The docstrings follow the Google style with a few reStructuredText habits that
read well in ``help()`` and in the source: roles such as :func:`scale_loss`
and literal blocks introduced by ``::``. mkdocstrings renders docstrings as
Markdown, where those come out as stray colons and run-together lines. This
extension rewrites them when griffe loads each object: a role becomes a code
span, and a ``::`` block becomes a fenced code block.
"""

from __future__ import annotations

import ast
import re
import textwrap
from typing import Any, List

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|data|attr|mod|obj|exc|const):`~?([^`]+)`")


def _role(match: re.Match) -> str:
  return f"`{match.group(1)}`"


def _indent(line: str) -> int:
  return len(line) - len(line.lstrip())


def _language(block: str) -> str:
  try:
    ast.parse(block)
  except SyntaxError:
    return "text"
  return "python"


def rst_to_markdown(text: str) -> str:
  """Returns ``text`` with roles as code spans and ``::`` literal blocks fenced."""
  lines = text.splitlines()
  out: List[str] = []
  i = 0
  while i < len(lines):
    line = lines[i]
    stripped = line.rstrip()
    if not stripped.endswith("::") or stripped.lstrip().startswith(">>>"):
      out.append(_ROLE.sub(_role, line))
      i += 1
      continue
    base = _indent(line)
    head = stripped[:-2].rstrip()
    if head.strip():
      out.append(_ROLE.sub(_role, head) + ":")
    j = i + 1
    block: List[str] = []
    while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > base):
      block.append(lines[j])
      j += 1
    trailing = 0
    while block and not block[-1].strip():
      block.pop()
      trailing += 1
    while block and not block[0].strip():
      block.pop(0)
    if block:
      code = textwrap.dedent("\n".join(block))
      pad = " " * base
      out.append("")
      out.append(f"{pad}```{_language(code)}")
      out.extend(pad + row if row else "" for row in code.splitlines())
      out.append(f"{pad}```")
    out.extend([""] * trailing)
    i = j
  return "\n".join(out)


class RstMarkup(griffe.Extension):
  """Rewrites every loaded docstring with :func:`rst_to_markdown`."""

  def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
    del kwargs
    if obj.docstring is not None:
      obj.docstring.value = rst_to_markdown(obj.docstring.value)
