"""The collectives in a compiled step's HLO text, for the tests and benchmarks of communication."""

from __future__ import annotations

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
