"""Prints the mutation score of each mutated module from mutmut's results (mutants/**/*.meta).

score = killed / (killed + survived), where a timeout or a crash counts as killed, a mutant
that no selected test reaches counts as survived, and the mutants listed in
.ci/mutation_equivalent.txt (one name per line, then the reason) are left out of both.
Mutants not run yet are counted apart. Exits with status 1 when a module is under its
target (95% for the core, 90% for the facades) and --check is given.
"""

from __future__ import annotations

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# pytest's exit status in the mutant's process: 1 failed, 2 a collection error (the mutant
# breaks an import), 3 an internal error; and mutmut's for a timeout, a crash or an exception
# out of pytest (255).
KILLED = {1, 2, 3, 24, -24, 152, 255, 36, -11, -9}
SURVIVED = {0, 5, 33}
CORE = ("loss_scale", "finite", "selective_update", "accumulation", "microbatch", "clipping",
        "state", "policy", "autocast", "train_state")


def equivalent() -> dict[str, str]:
  listed = {}
  path = ROOT / ".ci" / "mutation_equivalent.txt"
  for line in path.read_text().splitlines() if path.exists() else []:
    line = line.strip()
    if line and not line.startswith("#"):
      name, _, reason = line.partition(" ")
      listed[name] = reason.strip()
  return listed


def main() -> int:
  equivalents = equivalent()
  rows = []
  for meta in sorted((ROOT / "mutants" / "jaxamp").rglob("*.py.meta")):
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    if not codes:
      continue
    module = meta.relative_to(ROOT / "mutants" / "jaxamp" / "_src").as_posix()[:-len(".py.meta")]
    killed = survived = unrun = equiv = 0
    for name, code in codes.items():
      if name in equivalents:
        equiv += 1
      elif code is None:
        unrun += 1
      elif code in KILLED:
        killed += 1
      elif code in SURVIVED:
        survived += 1
      else:  # suspicious, skipped: not a verdict
        unrun += 1
    rows.append((module, killed, survived, equiv, unrun))
  print(f"{'module':34} {'killed':>6} {'total':>6} {'score':>7} {'equiv.':>6} {'not run':>7}")
  failed = False
  for module, killed, survived, equiv, unrun in rows:
    total = killed + survived
    target = 95.0 if module in CORE else 90.0
    failed |= bool(total) and 100.0 * killed / total < target
    score = f"{100.0 * killed / total:6.1f}%" if total else "      -"
    print(f"{module:34} {killed:6d} {total:6d} {score} {equiv:6d} {unrun:7d}")
  return 1 if failed and "--check" in sys.argv else 0


if __name__ == "__main__":
  sys.exit(main())
