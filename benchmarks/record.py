"""The benchmarks' results as JSON: ``--json PATH``, with the command, commit, date and machine.

Each benchmark writes ``{"runs": [{"provenance": ..., "results": ...}]}``:
what it printed, and where it came from (:func:`provenance`).
``benchmarks/render_docs.py`` renders the documentation's tables from these
files (``benchmarks/results/``), and ``benchmarks/refresh.py`` re-runs the
benchmarks into them. Nothing here imports jax at import time, so that a
benchmark can set ``XLA_FLAGS`` after adding its arguments.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import shlex
import subprocess
import sys
from typing import Any, Dict, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent


def add_json_args(parser) -> None:
  """Adds ``--json PATH`` and ``--append`` (see :func:`write_json`)."""
  parser.add_argument("--json", metavar="PATH", default=None,
                      help="also write the results, with the commit, date, machine and command, "
                           "to PATH (the tables of the docs are rendered from such files)")
  parser.add_argument("--append", action="store_true",
                      help="with --json: add this run to the runs already in PATH")


def _git(*args: str) -> str:
  try:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          check=True, timeout=30).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return ""


def cpu_model() -> str:
  """The CPU's model name (from ``/proc/cpuinfo`` on Linux), else the platform's processor."""
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def command_line(argv: Sequence[str]) -> str:
  """``python benchmarks/NAME.py ARGS``: the command that reproduces a run, without ``--json``."""
  args, skip = [], False
  for arg in argv[1:]:
    if skip:
      skip = False
    elif arg == "--json":
      skip = True
    elif arg != "--append" and not arg.startswith("--json="):
      args.append(arg)
  script = pathlib.Path(argv[0]).resolve()
  try:
    script_name = script.relative_to(ROOT).as_posix()
  except ValueError:
    script_name = script.name
  return shlex.join(["python", script_name, *args])


def provenance(argv: Sequence[str] | None = None) -> Dict[str, Any]:
  """Where a run comes from: command, commit, date, machine and versions."""
  import jax  # noqa: E402 (imported by the benchmark already; see the module's notes)
  import jaxlib

  # Uncommitted changes to what the figures depend on: jaxamp and the benchmarks themselves.
  changed = _git("status", "--porcelain", "--", "jaxamp", "benchmarks/bench_*.py",
                 "benchmarks/common.py")
  devices = jax.devices()
  return {
      "command": command_line(sys.argv if argv is None else argv),
      "commit": _git("rev-parse", "--short=7", "HEAD"),
      "uncommitted_changes": bool(changed),
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "system": platform.system(),
                  "load_average": [round(x, 2) for x in os.getloadavg()]},
      "devices": f"{len(devices)} x {devices[0].device_kind} ({jax.default_backend()})",
      "jax": jax.__version__,
      "jaxlib": jaxlib.__version__,
      "python": platform.python_version(),
  }


def write_json(path: str | os.PathLike | None, results: Dict[str, Any], append: bool = False,
               argv: Sequence[str] | None = None) -> None:
  """Writes ``{"runs": [{"provenance": ..., "results": results}]}`` to ``path`` (if given).

  With ``append``, the run is added to the runs already in ``path`` (the
  documentation then shows the range over the runs).
  """
  if path is None:
    return
  path = pathlib.Path(path)
  runs = []
  if append and path.exists():
    runs = json.loads(path.read_text())["runs"]
  runs.append({"provenance": provenance(argv), "results": results})
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps({"runs": runs}, indent=1, sort_keys=True) + "\n")
  print(f"\nwrote {path}")
