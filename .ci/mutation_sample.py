"""Prints a fixed random sample of mutant names: N per module (from mutants/**/*.meta).

Usage: python .ci/mutation_sample.py N [MODULE ...]   (module as in the score: loss_scale,
facade/torch, ...; all mutated modules by default). The same N gives the same sample as long
as the module's mutants are the same, so that a sampled score can be compared over time.
"""

from __future__ import annotations

import json
import pathlib
import random
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main() -> None:
  n = int(sys.argv[1])
  wanted = set(sys.argv[2:])
  base = ROOT / "mutants" / "jaxamp" / "_src"
  for meta in sorted(base.rglob("*.py.meta")):
    module = meta.relative_to(base).as_posix()[:-len(".py.meta")]
    if wanted and module not in wanted:
      continue
    names = sorted(json.loads(meta.read_text())["exit_code_by_key"])
    for name in random.Random(f"{module}:{n}").sample(names, min(n, len(names))):
      print(name)


if __name__ == "__main__":
  main()
