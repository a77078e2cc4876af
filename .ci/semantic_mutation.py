"""Runs the semantic mutants of .ci/semantic_mutants.toml: hand-written bugs, planted one at a time.

mutmut's mutants are one-token edits (a comparison flipped, a constant changed). The bugs a
developer writes are often not: arguments swapped, a write-back dropped, the old value used
for the new one, a sum for a maximum, a key not folded in, a counter reset in the wrong place.
The catalogue holds such bugs, each as an exact replacement in one file:

    [[mutant]]
    name = "streak-not-reset"          # unique
    kind = "wrong reset"               # what sort of bug
    file = "jaxamp/_src/loss_scale.py"
    find = "..."                       # must occur exactly once in the file
    replace = "..."
    tests = ["tests/test_x.py::test_y"]  # pytest node ids or files
    why = "what breaks for a user"
    # equivalent = "the reason"        # not run, left out of the score

Each mutant is applied to a copy of the tree (the files git tracks, and those it does not
ignore, under mutants/semantic/tree), and its tests run there (``-x -n 0``): a failure kills
it, a run where they all pass lets it survive. A test under tests/multidevice/ runs with 8
simulated devices, as tests/_multidevice.py runs them. Before the mutants, every selected test
runs on the unmutated copy and must pass (a mutant whose tests take longer than twice that run
counts as killed, as a hang), and the copy's jaxamp must be the one imported. JAX's
persistent compilation cache (mutants/semantic/.jax-cache) is shared by the runs: it is keyed
on the lowered program, so a mutant that changes a program misses it (see .ci/mutation).

    python .ci/semantic_mutation.py [--check] [--list] [NAME...]

``--list`` prints the catalogue; ``--check`` exits with status 1 when under 95% of the
non-equivalent mutants are killed. The results go to mutants/semantic/results.json.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
CATALOGUE = ROOT / ".ci" / "semantic_mutants.toml"
WORK = ROOT / "mutants" / "semantic"
TREE = WORK / "tree"
TARGET = 95.0
FIELDS = {"name", "kind", "file", "find", "replace", "tests", "why", "equivalent"}


def load() -> list[dict]:
  """The catalogue, checked: unique names, known fields, each ``find`` once in its file."""
  mutants = tomllib.loads(CATALOGUE.read_text())["mutant"]
  names = set()
  for m in mutants:
    unknown = set(m) - FIELDS
    missing = {"name", "kind", "file", "find", "replace", "tests", "why"} - set(m)
    if unknown or missing:
      raise SystemExit(f"{m.get('name')}: unknown fields {sorted(unknown)}, missing "
                       f"{sorted(missing)}")
    if m["name"] in names:
      raise SystemExit(f"{m['name']}: the name is used twice")
    names.add(m["name"])
    count = (ROOT / m["file"]).read_text().count(m["find"])
    if count != 1:
      raise SystemExit(f"{m['name']}: `find` occurs {count} times in {m['file']} (must be once): "
                       "the code changed, update the mutant")
  return mutants


def copy_tree() -> None:
  """The files git tracks, and those it does not ignore, copied to TREE (afresh)."""
  listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                          cwd=ROOT, capture_output=True, check=True).stdout.decode()
  shutil.rmtree(TREE, ignore_errors=True)
  for name in filter(None, listed.split("\0")):
    source = ROOT / name
    if source.is_file():
      (TREE / name).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(source, TREE / name)


def environment(multidevice: bool) -> dict:
  env = dict(os.environ)
  env.update(PYTHONPATH=str(TREE), PYTHONDONTWRITEBYTECODE="1", JAX_PLATFORMS="cpu",
             JAX_COMPILATION_CACHE_DIR=str(WORK / ".jax-cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  if multidevice:
    flags.append("--xla_force_host_platform_device_count=8")
    env["JAXAMP_MULTIDEVICE"] = "1"
  else:
    env.pop("JAXAMP_MULTIDEVICE", None)
  env["XLA_FLAGS"] = " ".join(flags)
  return env


def run_tests(tests: list[str], timeout: float | None = None) -> tuple[bool, str]:
  """Runs ``tests`` in TREE, the 8-device ones apart; ``(passed, the first failure's line)``."""
  groups = [[t for t in tests if t.startswith("tests/multidevice/")],
            [t for t in tests if not t.startswith("tests/multidevice/")]]
  for multidevice, group in zip((True, False), groups):
    if not group:
      continue
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider",
           "--no-header", *group]
    try:
      proc = subprocess.run(cmd, cwd=TREE, env=environment(multidevice), capture_output=True,
                            text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
      return False, f"timed out after {timeout:.0f} s"
    if proc.returncode != 0:
      lines = (proc.stdout + proc.stderr).splitlines()
      failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
      return False, (failed or lines[-3:] or [f"exit code {proc.returncode}"])[0][:160]
  return True, ""


def check_copy() -> None:
  """Fails unless the copy's jaxamp is the one its tests import."""
  out = subprocess.run([sys.executable, "-c", "import jaxamp; print(jaxamp.__file__)"], cwd=TREE,
                       env=environment(False), capture_output=True, text=True, check=True)
  if not pathlib.Path(out.stdout.strip()).is_relative_to(TREE):
    raise SystemExit(f"the tests would import {out.stdout.strip()}, not the copy in {TREE}")


def main(argv: list[str]) -> int:
  mutants = load()
  names = [a for a in argv if not a.startswith("--")]
  if names:
    unknown = set(names) - {m["name"] for m in mutants}
    if unknown:
      raise SystemExit(f"no such mutants: {sorted(unknown)}")
    mutants = [m for m in mutants if m["name"] in names]
  if "--list" in argv:
    for m in mutants:
      mark = " (equivalent)" if "equivalent" in m else ""
      print(f"{m['name']:40} {m['kind']:24} {m['file']}{mark}")
    return 0
  to_run = [m for m in mutants if "equivalent" not in m]
  WORK.mkdir(parents=True, exist_ok=True)
  copy_tree()
  check_copy()
  selected = sorted({t for m in to_run for t in m["tests"]})
  start = time.monotonic()
  passed, failure = run_tests(selected)
  if not passed:
    raise SystemExit(f"the selected tests fail on the unmutated tree: {failure}")
  clean = time.monotonic() - start
  print(f"clean run of {len(selected)} selections: {clean:.0f} s", flush=True)
  # A mutant runs a part of the clean run's tests: one that takes twice as long (and two
  # minutes more) hangs, and counts as killed, as mutmut counts a timeout.
  timeout = 2 * clean + 120
  results = []
  for m in to_run:
    path = TREE / m["file"]
    original = path.read_text()
    path.write_text(original.replace(m["find"], m["replace"]))
    start = time.monotonic()
    try:
      passed, failure = run_tests(m["tests"], timeout)
    finally:
      path.write_text(original)
    verdict = "survived" if passed else "killed"
    seconds = time.monotonic() - start
    results.append({"name": m["name"], "kind": m["kind"], "verdict": verdict,
                    "seconds": round(seconds, 1), "killer": failure})
    print(f"{verdict:8} {seconds:6.0f} s  {m['name']:40} {failure}", flush=True)
  equivalent = [m["name"] for m in mutants if "equivalent" in m]
  killed = sum(r["verdict"] == "killed" for r in results)
  score = 100.0 * killed / len(results) if results else 100.0
  (WORK / "results.json").write_text(json.dumps(
      {"results": results, "equivalent": equivalent}, indent=1))
  print(f"semantic mutants: {killed}/{len(results)} killed ({score:.1f}%), "
        f"{len(equivalent)} equivalent")
  return 1 if "--check" in argv and score < TARGET else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
