"""A griffe extension rendering the reStructuredText bits of jaxamp's docstrings as Markdown.

The docstrings follow the Google style with a few reStructuredText habits that
read well in ``help()`` and in the source: roles such as :func:`scale_loss`
and literal blocks introduced by ``::``. mkdocstrings renders docstrings as
Markdown, where those come out as stray colons and run-together lines. This
extension rewrites them when griffe loads each object: a role whose target is
documented on the site becomes a cross-reference (mkdocs-autorefs'
``[`title`][identifier]``, a link checked by ``mkdocs build --strict``), any
other role a code span, and a ``::`` block a fenced code block.

A role's target is looked up as Sphinx would: as written (``jaxamp.Policy``),
as a public name of ``jaxamp`` (``scale_loss``), and as a member of the
documented class the docstring belongs to or inherits from (``:meth:`step```
in ``GradScaler``'s docstrings). The documented names are those listed in
``__all__`` of the public modules, with the members of documented classes
that have a docstring of their own.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
from typing import Any, Callable, Dict, List, Optional

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|data|attr|mod|obj|exc|const):`~?([^`]+)`")
_TITLED = re.compile(r"^(.*?)\s*<([^<>]+)>$")

# Modules whose ``__all__`` is documented (module names themselves included).
PUBLIC_MODULES = ("jaxamp", "jaxamp.paddle", "jaxamp.nnx")

Resolver = Callable[[str], Optional[str]]


def _split_role(text: str):
  """``'title <target>'`` -> ``(title, target)``; ``'target'`` -> ``(target, target)``."""
  match = _TITLED.match(text)
  if match:
    return match.group(1), match.group(2).lstrip("~")
  return text, text


def _role(match: re.Match, resolve: Optional[Resolver]) -> str:
  title, target = _split_role(match.group(1))
  identifier = resolve(target) if resolve is not None else None
  if identifier is None:
    return f"`{title}`"
  return f"[`{title}`][{identifier}]"


def _indent(line: str) -> int:
  return len(line) - len(line.lstrip())


def _language(block: str) -> str:
  try:
    ast.parse(block)
  except SyntaxError:
    return "text"
  return "python"


def rst_to_markdown(text: str, resolve: Optional[Resolver] = None) -> str:
  """Returns ``text`` with roles as links or code spans and ``::`` literal blocks fenced.

  Args:
    text: a docstring.
    resolve: maps a role's target to the identifier of a documented object,
      or to ``None`` (then the role becomes a code span). Without it every
      role becomes a code span.
  """
  sub = lambda line: _ROLE.sub(lambda m: _role(m, resolve), line)  # noqa: E731
  lines = text.splitlines()
  out: List[str] = []
  i = 0
  while i < len(lines):
    line = lines[i]
    stripped = line.rstrip()
    if not stripped.endswith("::") or stripped.lstrip().startswith(">>>"):
      out.append(sub(line))
      i += 1
      continue
    base = _indent(line)
    head = stripped[:-2].rstrip()
    if head.strip():
      out.append(sub(head) + ":")
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


def _canonical(obj: Any) -> Optional[str]:
  module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
  return f"{module}.{qualname}" if module and qualname else None


def _documented_members(cls: type) -> List[str]:
  """Public members defined (not inherited) in ``cls`` with a docstring of their own."""
  names = []
  for name, member in vars(cls).items():
    if name.startswith("_"):
      continue
    if isinstance(member, (staticmethod, classmethod)):
      member = member.__func__
    if isinstance(member, property) or inspect.isfunction(member):
      if (member.__doc__ or "").strip():
        names.append(name)
  return names


class PublicNames:
  """The identifiers documented on the site, and the public name of each documented object."""

  def __init__(self, modules=PUBLIC_MODULES):
    self.ids: set = set()
    self.public_of: Dict[str, str] = {}  # canonical path -> public identifier
    self.classes: Dict[str, type] = {}  # public identifier -> class
    for module_name in modules:
      try:
        module = importlib.import_module(module_name)
      except ImportError:  # jaxamp.nnx without flax: not documented then either
        continue
      self.ids.add(module_name)
      for name in getattr(module, "__all__", ()):
        obj = getattr(module, name)
        public = f"{module_name}.{name}"
        self.ids.add(public)
        canonical = _canonical(obj) if not inspect.ismodule(obj) else obj.__name__
        if canonical and canonical not in self.public_of:
          self.public_of[canonical] = public
        if inspect.isclass(obj):
          self.classes[public] = obj
          self.ids.update(f"{public}.{m}" for m in _documented_members(obj))

  def resolver(self, path: str) -> Resolver:
    """Resolves role targets in the docstring of the object at canonical ``path``."""
    scopes: List[str] = []
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
      public = self.public_of.get(".".join(parts[:end]))
      cls = self.classes.get(public) if public else None
      if cls is not None:
        for base in cls.__mro__:
          base_public = self.public_of.get(_canonical(base) or "")
          if base_public in self.classes:
            scopes.append(base_public)
        break

    def resolve(target: str) -> Optional[str]:
      target = target.lstrip(".")
      candidates = [target, f"jaxamp.{target}", self.public_of.get(target)]
      candidates += [f"{scope}.{target}" for scope in scopes]
      head, _, rest = target.partition(".")
      if rest:  # ``Class.member`` with the class's public name
        candidates += [f"{scope}.{rest}" for scope in scopes if scope.endswith(f".{head}")]
      for candidate in candidates:
        if candidate in self.ids:
          return candidate
      return None

    return resolve


class RstMarkup(griffe.Extension):
  """Rewrites every loaded docstring with :func:`rst_to_markdown`, roles as cross-references."""

  def __init__(self) -> None:
    super().__init__()
    self._names: Optional[PublicNames] = None

  def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
    del kwargs
    if obj.docstring is None:
      return
    if self._names is None:
      self._names = PublicNames()
    obj.docstring.value = rst_to_markdown(obj.docstring.value, self._names.resolver(obj.path))
