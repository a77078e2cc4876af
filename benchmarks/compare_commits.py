"""A regression guard: the update sweep of jaxamp at two commits, run alternately, as ratios.

Exports ``jaxamp/`` of each commit (``git archive``) into a temporary
directory and runs ``bench_update_sweep.py`` (this checkout's) against each in
turn, ``--repeats`` times, alternating the two so that a change in the
machine's load hits both alike. Each run already times jaxamp interleaved
with its baselines and reports ratios to them; this script prints, per cell,
mode and variant, the median over the repeats of each commit's ratio and the
new commit's ratio over the old one's (below 1: faster than before). It is a
benchmark, not a test: it fails nothing, it prints.

Run: ``python benchmarks/compare_commits.py OLD [NEW] [--repeats 2] [--lock PATH] [--json PATH]
-- [sweep arguments, e.g. --grid issue --modes given --rounds 5]``. ``NEW`` defaults to the
working tree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
SWEEP = os.path.join(_HERE, "bench_update_sweep.py")


def export(commit: str, into: str) -> str:
  """``jaxamp/`` of ``commit`` extracted under ``into``; returns the directory to import it from."""
  archive = subprocess.run(["git", "-C", _ROOT, "archive", commit, "jaxamp"], check=True,
                           capture_output=True).stdout
  subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
  name = subprocess.run(["git", "-C", _ROOT, "rev-parse", "--short=7", commit], check=True,
                        capture_output=True, text=True).stdout.strip()
  with open(os.path.join(into, "COMMIT"), "w") as f:
    f.write(name + "\n")
  return into


def run_sweep(jaxamp_dir: Optional[str], sweep_args: Sequence[str], out: str,
              lock: Optional[str] = None) -> Dict[str, Any]:
  command = [sys.executable, SWEEP, *sweep_args, "--json", out]
  if jaxamp_dir is not None:
    command += ["--jaxamp", jaxamp_dir]
  if lock is not None:
    command = ["flock", lock, *command]
  subprocess.run(command, check=True)
  with open(out) as f:
    return json.load(f)["runs"][0]


def _key(record) -> tuple:
  return (record["leaves"], record["elements"], record["mode"], record["clip"])


def compare(old_runs: List[Dict[str, Any]], new_runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
  """Per cell and variant, the median over runs of each side's ratio, and new over old."""
  def ratios(runs):
    table: Dict[tuple, Dict[str, List[float]]] = {}
    for run in runs:
      for record in run["results"]["records"]:
        for name, r in record["ratios"].items():
          if name != record["baseline"]:
            table.setdefault(_key(record), {}).setdefault(name, []).append(r["ratio"])
    return table

  old, new = ratios(old_runs), ratios(new_runs)
  rows = []
  for key in new:
    for name in new[key]:
      if name not in old.get(key, {}):
        continue
      a, b = statistics.median(old[key][name]), statistics.median(new[key][name])
      leaves, elements, mode, clip = key
      rows.append({"leaves": leaves, "elements": elements, "mode": mode, "clip": clip,
                   "variant": name, "old": a, "new": b, "new_over_old": b / a,
                   "old_runs": old[key][name], "new_runs": new[key][name]})
  return rows


def main(argv: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
  argv = list(sys.argv[1:] if argv is None else argv)
  sweep_args: List[str] = []
  if "--" in argv:
    sweep_args = argv[argv.index("--") + 1:]
    argv = argv[:argv.index("--")]
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("old", help="the commit to compare against, e.g. 74ed360")
  parser.add_argument("new", nargs="?", default=None,
                      help="the commit to compare (default: the working tree)")
  parser.add_argument("--repeats", type=int, default=2, help="runs of the sweep per commit")
  parser.add_argument("--json", metavar="PATH", help="also write every run and the comparison")
  parser.add_argument("--lock", metavar="PATH",
                      help="hold an exclusive flock on PATH around each run of the sweep (so that "
                           "timing runs on a shared machine take turns)")
  args = parser.parse_args(argv)

  with tempfile.TemporaryDirectory(prefix="jaxamp-compare-") as tmp:
    sides = {"old": os.path.join(tmp, "old"), "new": os.path.join(tmp, "new")}
    os.makedirs(sides["old"])
    export(args.old, sides["old"])
    new_dir: Optional[str] = None
    if args.new is not None:
      os.makedirs(sides["new"])
      new_dir = export(args.new, sides["new"])
    runs: Dict[str, List[Dict[str, Any]]] = {"old": [], "new": []}
    for repeat in range(args.repeats):
      # Alternate which side goes first, so that neither always runs on a warmer machine.
      order = ["old", "new"] if repeat % 2 == 0 else ["new", "old"]
      for side in order:
        print(f"\n== run {repeat + 1}/{args.repeats}: {side} "
              f"({args.old if side == 'old' else args.new or 'working tree'})", flush=True)
        directory = sides["old"] if side == "old" else new_dir
        runs[side].append(run_sweep(directory, sweep_args,
                                    os.path.join(tmp, f"{side}-{repeat}.json"), args.lock))
  rows = compare(runs["old"], runs["new"])
  new_name = args.new or "working tree"
  old_commit, new_commit = (
      runs[side][0]["provenance"]["commit"]
      + ("+" if runs[side][0]["provenance"]["uncommitted_changes"] else "") for side in ("old", "new"))
  print(f"\nRatios to each run's baseline (median of {args.repeats} runs), old = {args.old} "
        f"({old_commit}), new = {new_name} ({new_commit}); new/old below 1 is faster:")
  for row in rows:
    cell = f"{row['leaves']} x {row['elements']:,}"
    print(f"  {cell:>16}  {row['mode']:<8} {'clip' if row['clip'] else '    '}  "
          f"{row['variant']:<20} old {row['old']:5.2f}  new {row['new']:5.2f}  "
          f"new/old {row['new_over_old']:5.2f}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"old": args.old, "new": new_name, "runs": runs, "comparison": rows}, f, indent=1)
  return rows


if __name__ == "__main__":
  main()
