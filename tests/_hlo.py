"""The collectives in a compiled step's HLO text, for the tests and benchmarks of communication."""

from __future__ import annotations

import re

_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                "collective-broadcast", "ragged-all-to-all")


def hlo_collectives(hlo_text: str) -> list:
  r"""Lists the collectives in the text of a compiled (or lowered) XLA HLO module.

  Tells which communication a step contains, e.g.
  ``hlo_collectives(jax.jit(step).lower(*args).compile().as_text())``.

  Returns:
    A list of ``(op, result_shape, computation)`` tuples in program order:
    ``op`` such as ``'all-reduce'`` (asynchronous ``-start`` halves are counted
    once, ``-done`` halves not at all), ``result_shape`` as HLO prints it
    (``'f32[64,32]{1,0}'``, ``'(pred[], pred[])'``), and the name of the HLO
    computation that contains it (``'ENTRY'`` for the entry computation), which
    tells whether it sits inside a branch of a conditional.

  Examples:
    >>> import jax
    >>> hlo_collectives(jax.jit(lambda x: x + 1).lower(1.0).compile().as_text())
    []
    >>> hlo_collectives("ENTRY %main {\n  %r = f32[4]{0} all-reduce(f32[4]{0} %x), to_apply=%add\n}")
    [('all-reduce', 'f32[4]{0}', 'ENTRY')]
  """
  found = []
  computation = ""
  for line in hlo_text.splitlines():
    stripped = line.strip()
    if stripped.endswith("{") and "=" not in stripped.split("(")[0]:
      words = stripped.split()
      computation = "ENTRY" if words[0] == "ENTRY" else words[0].lstrip("%")
      continue
    if " = " not in stripped:
      continue
    rhs = stripped.split(" = ", 1)[1]
    for op in _COLLECTIVES:
      for suffix in ("(", "-start("):
        marker = f" {op}{suffix}"
        if marker in rhs:
          found.append((op, rhs[:rhs.index(marker)].strip(), computation))
          break
      else:
        continue
      break
  return found


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*?)\)(?:,|$)")
#: The ops XLA's GPU GEMM rewriter moves before a dequantization (its "commutative" ops).
_PASS_THROUGH = ("bitcast", "copy", "reshape", "transpose", "slice", "dynamic-slice", "pad")


def _instructions(hlo_text: str) -> tuple:
  """``({(computation, name): (opcode, operand names)}, {(computation, name): shape})``.

  The shapes are those the instructions are defined with, and those printed
  next to operands (where the text prints them).
  """
  table, shapes, computation = {}, {}, ""
  for line in hlo_text.splitlines():
    stripped = line.strip()
    if stripped.endswith("{") and "=" not in stripped.split("(")[0]:
      computation = stripped.split()[1 if stripped.startswith("ENTRY") else 0].lstrip("%")
      continue
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    name, shape, opcode, operands = match.groups()
    names = []
    for operand in (o.split() for o in operands.split(", ") if o.strip()):
      names.append(operand[-1].lstrip("%"))
      if len(operand) == 2:
        shapes.setdefault((computation, names[-1]), operand[0])
    table[(computation, name)] = (opcode, names)
    shapes[(computation, name)] = shape
  return table, shapes


def fp8_products(hlo_text: str) -> list:
  """The dots and convolutions of an HLO module's text, with the float8 format of each operand.

  An operand counts as dequantized from float8 when it is, after any ops the
  GPU rewriter moves out of the way (reshape, transpose, copy, bitcast, slice,
  dynamic-slice, pad), ``multiply(convert(x), broadcast(s))`` with ``x`` of a
  float8 type and ``s`` a scalar: the form XLA's GPU compiler rewrites into a
  cuBLASLt float8 GEMM (and, directly before a convolution, into cuDNN's
  float8 convolution). Read the text of
  ``jax.jit(f).lower(...).as_text(dialect="hlo")``.

  Returns:
    A list of ``(computation, name, opcode, (lhs format, rhs format))`` in
    program order, ``opcode`` ``'dot'`` or ``'convolution'``, a format such as
    ``'f8e4m3fn'``, or None for an operand not in that form.

  Examples:
    >>> text = '''
    ... ENTRY %main {
    ...   c = bf16[4,4]{1,0} convert(f8e4m3fn[4,4]{1,0} q)
    ...   b = bf16[4,4]{1,0} broadcast(bf16[] s), dimensions={}
    ...   m = bf16[4,4]{1,0} multiply(c, b)
    ...   d = bf16[4,4]{1,0} dot(m, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    ... }'''
    >>> fp8_products(text)
    [('main', 'd', 'dot', ('f8e4m3fn', None))]
  """
  table, shapes = _instructions(hlo_text)

  def operand(computation, name, opcode):
    entry = table.get((computation, name))
    return entry[1][0] if entry and entry[0] == opcode else None

  def fmt(computation, name):
    entry = table.get((computation, name))
    while entry is not None and entry[0] in _PASS_THROUGH:
      name = entry[1][0]
      entry = table.get((computation, name))
    if entry is None or entry[0] != "multiply" or len(entry[1]) != 2:
      return None
    for a, b in (entry[1], entry[1][::-1]):
      source, scalar = operand(computation, a, "convert"), operand(computation, b, "broadcast")
      if source is None or scalar is None:
        continue
      source_shape = shapes.get((computation, source), "")
      if source_shape.startswith("f8") and re.match(r"^\w+\[\]", shapes.get((computation, scalar), "")):
        return source_shape.split("[")[0]
    return None

  return [(computation, name, opcode, tuple(fmt(computation, o) for o in operands[:2]))
          for (computation, name), (opcode, operands) in table.items()
          if opcode in ("dot", "convolution")]
