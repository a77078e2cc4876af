"""Where the optimizer update's time goes: the memory traffic of each compiled kernel.

Compiles the donated update of ``bench_update_sweep.py`` (``given`` mode: float32
gradients passed in) for one cell ``L x N`` and reads XLA's optimized program
(``compiled.as_text()``): for every instruction of the entry computation that
runs as a kernel (fusions, copies, conditionals, reductions, ...) the bytes of
the arrays it reads (its operands) and writes (its result). The update of an
update-bound step is memory-bound, so the sum is what its time follows; the
script prints each variant's total as a multiple of adam's and of one read of
the gradients, and with ``--kernels`` the kernels of one variant, largest first.

Deterministic, unlike the timings: it explains them. A conditional counts as the
kernels of its last branch, a ``lax.cond``'s true branch: the one that a finite
step with a scale of 1 or more takes in each conditional that moves arrays
(jaxamp's check of the raw gradients, ``apply_if_finite``'s update).

Run: ``python benchmarks/update_traffic.py [--cells 4x1048576,32x131072] [--clip no|yes|both]
[--kernels VARIANT]``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import optax  # noqa: E402

from benchmarks import bench_update_sweep as sweep  # noqa: E402

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([0-9,]*)\]")
_LINE = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*)$")
# Instructions that move no data: they name, alias or reinterpret buffers.
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}

VARIANTS = ("adam", "jaxamp", "apply_if_finite", "flax_dynamic_scale")


def _nbytes(shape_text: str) -> int:
  total = 0
  for dtype, dims in _ARRAY.findall(shape_text):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * _BYTES[dtype]
  return total


def _computations(hlo_text: str) -> Dict[str, List[str]]:
  """The lines of each computation of an HLO module, by name (the entry's as ``ENTRY``)."""
  out: Dict[str, List[str]] = {}
  name = None
  for line in hlo_text.splitlines():
    if line.startswith("ENTRY "):
      name = "ENTRY"
      out[name] = []
    elif line.startswith("%") and line.rstrip().endswith("{"):
      name = line.split()[0]
      out[name] = []
    elif line.startswith("}"):
      name = None
    elif name is not None:
      out[name].append(line)
  return out


def _kernels_of(computations: Dict[str, List[str]], name: str) -> List[Tuple[str, str, int, int]]:
  sizes: Dict[str, int] = {}
  out: List[Tuple[str, str, int, int]] = []
  for line in computations[name]:
    match = _LINE.match(line)
    if not match:
      continue
    target, shape, opcode, rest = match.groups()
    sizes[target] = _nbytes(shape)
    if opcode in _FREE:
      continue
    if opcode == "conditional":
      # The kernels of the last branch: a lax.cond's true branch (see the module docstring).
      branches = re.findall(r"(%[\w.\-]+)", rest.split("computation", 1)[1])
      out += _kernels_of(computations, branches[-1])
      continue
    operands = rest.split(")", 1)[0]  # operand names end at the first closing parenthesis
    read = sum(sizes.get(op, 0) for op in set(re.findall(r"%[\w.\-]+", operands)))
    out.append((target, opcode, read, sizes[target]))
  return out


def kernels(hlo_text: str) -> List[Tuple[str, str, int, int]]:
  """``(name, opcode, bytes read, bytes written)`` of each kernel the compiled program runs.

  A conditional contributes the kernels of its last branch.
  """
  return _kernels_of(_computations(hlo_text), "ENTRY")


def compiled_text(variant: str, leaves: int, elements: int, clip: bool) -> str:
  """The optimized program of ``variant``'s donated update of a ``leaves x elements`` cell."""
  params = sweep.make_params(leaves, elements)
  grads = jax.tree.map(lambda p: p * 1e-3, params)
  inner = optax.adam(1e-3)
  if clip:
    inner = optax.chain(optax.clip_by_global_norm(1.0), inner)
  init, step = sweep.MODES["given"][1][variant](inner)
  state = jax.jit(init)(params)
  return jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads).compile().as_text()


def traffic(variant: str, leaves: int, elements: int, clip: bool) -> Dict[str, float]:
  """The bytes ``variant``'s update reads and writes, and its number of kernels."""
  ks = kernels(compiled_text(variant, leaves, elements, clip))
  return {"read": sum(k[2] for k in ks), "written": sum(k[3] for k in ks), "kernels": len(ks)}


def main(argv: Optional[Sequence[str]] = None) -> Dict[tuple, Dict[str, Dict[str, float]]]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--cells", default="4x1048576,32x131072")
  parser.add_argument("--clip", choices=("no", "yes", "both"), default="both")
  parser.add_argument("--kernels", metavar="VARIANT", choices=VARIANTS,
                      help="also list this variant's kernels, largest first")
  args = parser.parse_args(argv)
  clips = {"no": [False], "yes": [True], "both": [False, True]}[args.clip]
  results = {}
  for leaves, elements in sweep.parse_cells(args.cells):
    grad_bytes = 4 * leaves * elements
    for clip in clips:
      row = {v: traffic(v, leaves, elements, clip) for v in VARIANTS}
      results[(leaves, elements, clip)] = row
      base = row["adam"]["read"] + row["adam"]["written"]
      print(f"{leaves} x {elements:,}{', clipped' if clip else ''}: adam moves "
            f"{base / 1e6:.1f} MB ({base / grad_bytes:.1f} reads of the gradients)")
      for v, t in row.items():
        moved = t["read"] + t["written"]
        print(f"  {v:<19} {moved / 1e6:8.1f} MB  {moved / base:5.2f}x adam  "
              f"{(moved - base) / grad_bytes:+5.2f} gradient reads  {t['kernels']:4d} kernels")
      if args.kernels:
        ks = kernels(compiled_text(args.kernels, leaves, elements, clip))
        for name, opcode, read, written in sorted(ks, key=lambda k: -(k[2] + k[3]))[:12]:
          print(f"    {args.kernels}: {name:<32} {opcode:<12} reads {read / 1e6:7.2f} MB, "
                f"writes {written / 1e6:7.2f} MB")
  return results


if __name__ == "__main__":
  main()
