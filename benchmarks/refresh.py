"""Re-runs the benchmarks behind the documentation's tables into ``benchmarks/results/NAME.json``.

Every table of figures in the docs is rendered from these files by
``python benchmarks/render_docs.py``; this script re-creates them. Each job is one
benchmark command, run in its own process with ``--json``::

  python benchmarks/refresh.py                     # every job (about 40 minutes on 2 cores)
  python benchmarks/refresh.py grad_scaler autocast
  python benchmarks/refresh.py --quick             # fewer rounds (about 15 minutes)
  python benchmarks/refresh.py --runs 2 sharding   # two runs: the tables show their range
  python benchmarks/refresh.py --lock /tmp/bench.lock  # hold a lock around each job
  python benchmarks/refresh.py --list              # the jobs and their commands

then ``python benchmarks/render_docs.py``. Timings need a quiet machine: on a
shared one, ``--lock`` takes an exclusive ``flock`` on the file around each
job (one job at a time, at most a few minutes each), the way other timing runs
can wait for it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import pathlib
import subprocess
import sys
import time
from typing import Dict, List, NamedTuple

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"


class Job(NamedTuple):
  script: str
  args: List[str]
  quick: List[str]  # replaces the timing arguments with --quick


_ROUNDS_5 = ["--rounds", "5"]
_COMPILE_VARIANTS = ["--variants", "plain", "check_only", "jaxamp", "apply_if_finite"]

JOBS: Dict[str, Job] = {
    "train_step_compute": Job("bench_train_step.py", ["--regime", "compute", "--cost"], _ROUNDS_5),
    "train_step_update": Job("bench_train_step.py", ["--regime", "update", "--cost"], _ROUNDS_5),
    "train_step_update_clip": Job("bench_train_step.py",
                                  ["--regime", "update", "--clip", "--cost"], _ROUNDS_5),
    "train_step_update_bfloat16": Job("bench_train_step.py",
                                      ["--regime", "update", "--dtype", "bfloat16", "--cost"],
                                      _ROUNDS_5),
    "loss_scale_float32": Job("bench_loss_scale.py", [], ["--rounds", "10"]),
    "loss_scale_bfloat16": Job("bench_loss_scale.py", ["--dtype", "bfloat16"], ["--rounds", "10"]),
    "accumulation": Job("bench_accumulation.py", [], ["--rounds", "3"]),
    "grad_scaler": Job("bench_grad_scaler.py", [], _ROUNDS_5),
    "optim_wrapper": Job("bench_optim_wrapper.py", [], _ROUNDS_5),
    "sharding": Job("bench_sharding.py", [], ["--rounds", "3"]),
    "sharding_1_device": Job("bench_sharding.py", ["--devices", "1"], ["--rounds", "3"]),
    "autocast": Job("bench_autocast.py", [], _ROUNDS_5),
    "low_precision_numerics": Job("bench_low_precision.py", ["--what", "drift", "convergence"], []),
    "low_precision_lm": Job("bench_low_precision.py",
                            ["--what", "lm", "--plot", "docs/img/low_precision_lm.png"], []),
    "low_precision_lm_lr3e-3": Job("bench_low_precision.py", ["--what", "lm", "--lr", "3e-3"], []),
    "low_precision_time": Job("bench_low_precision.py", ["--what", "time"], _ROUNDS_5),
    # The compile-time sweep, in four jobs of a few minutes each.
    "compile": Job("bench_compile.py", ["--leaves", "10", "100", "400", "--lm", "--hlo"],
                   ["--repeats", "1"]),
    "compile_1000": Job("bench_compile.py", ["--leaves", "1000", "--hlo"], ["--repeats", "1"]),
    "compile_autocast": Job("bench_compile.py",
                            ["--leaves", "10", "100", "400", "--lm", "--hlo", "--autocast", "on"],
                            ["--repeats", "1"]),
    "compile_autocast_1000": Job("bench_compile.py",
                                 ["--leaves", "1000", "--hlo", "--autocast", "on"],
                                 ["--repeats", "1"]),
    "compile_xla_passes": Job("bench_compile.py",
                              ["--leaves", "10", "100", "400", "--lm", "--xla-passes",
                               *_COMPILE_VARIANTS], ["--repeats", "1"]),
    "compile_attribute": Job("bench_compile.py",
                             ["--leaves", "10", "100", "--attribute", "--hlo", "--xla-passes",
                              *_COMPILE_VARIANTS], ["--repeats", "1"]),
}


def command(name: str, quick: bool = False, append: bool = False) -> List[str]:
  """The command line of job ``name``, writing ``benchmarks/results/NAME.json``."""
  job = JOBS[name]
  args = list(job.args) + (list(job.quick) if quick else [])
  out = ["--json", str((RESULTS / f"{name}.json").relative_to(ROOT))]
  return [sys.executable, f"benchmarks/{job.script}", *args, *out] + (["--append"] if append
                                                                       else [])


@contextlib.contextmanager
def holding(lock: str | None):
  """An exclusive ``flock`` on the file ``lock`` (none when ``None``)."""
  if lock is None:
    yield
    return
  with open(lock, "a", encoding="utf-8") as file:
    fcntl.flock(file, fcntl.LOCK_EX)
    yield


def run(name: str, quick: bool, append: bool, lock: str | None) -> float:
  """Runs one job (holding ``lock`` if given); returns its seconds."""
  cmd = command(name, quick, append)
  print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
  with holding(lock):
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    return time.perf_counter() - start


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
  parser.add_argument("jobs", nargs="*", metavar="JOB", help="jobs to run (default: all)")
  parser.add_argument("--quick", action="store_true", help="fewer timing rounds")
  parser.add_argument("--runs", type=int, default=1, help="runs of each job, kept side by side")
  parser.add_argument("--lock", metavar="PATH", default=None,
                      help="hold an exclusive flock on PATH while each job runs")
  parser.add_argument("--list", action="store_true", help="print the jobs and their commands")
  args = parser.parse_args(argv)
  unknown = sorted(set(args.jobs) - set(JOBS))
  if unknown:
    parser.error(f"unknown jobs {unknown}; the jobs are {sorted(JOBS)}")
  names = args.jobs or list(JOBS)
  if args.list:
    for name in names:
      print(f"{name:<28} {' '.join(command(name, args.quick)[1:])}")
    return
  seconds = {}
  for name in names:
    for r in range(args.runs):
      seconds[name] = seconds.get(name, 0.0) + run(name, args.quick, r > 0, args.lock)
  print("\nseconds per job: " + ", ".join(f"{n} {s:.0f}" for n, s in seconds.items()))
  print("now render the tables: python benchmarks/render_docs.py")


if __name__ == "__main__":
  main()
