"""The type check (mypy) and the linter (ruff) pass, as configured in pyproject.toml.

Each is skipped when its tool is not installed (both come with the ``test`` extra).
"""

import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
  if importlib.util.find_spec(module) is None:
    pytest.skip(f"{module} is not installed (it comes with the test extra)")
  return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=600, check=False)


def test_mypy_passes():
  proc = _run("mypy")
  assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_passes():
  proc = _run("ruff", "check", ".")
  assert proc.returncode == 0, proc.stdout + proc.stderr
