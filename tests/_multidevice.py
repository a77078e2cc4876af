"""Runs groups of the 8-device tests (tests/multidevice/) in child processes of their own.

The number of simulated CPU devices is fixed when jax starts, so these tests
cannot share a process with the rest of the suite, which keeps one device.
Each child uses the same interpreter and the same pytest configuration, with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``, and runs serially; its
output is shown when it fails. The files are split into :data:`GROUPS`, one
wrapper test file each (``tests/test_multidevice*.py``), so that the workers of
the parent run (one test file per worker) run the groups side by side.
"""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DIR = ROOT / "tests" / "multidevice"
_TIMEOUT_S = 900

#: The wrapper test file of each group, and the files of tests/multidevice/ it runs.
GROUPS = {
    "test_multidevice.py": ["test_soundness_sharded.py"],
    "test_multidevice_accumulation.py": ["test_accumulation_sharded.py", "test_multihost.py"],
    "test_multidevice_data_parallel.py": ["test_data_parallel.py", "test_detection.py",
                                          "test_diagnostics_sharded.py", "test_fp8_sharded.py"],
    "test_multidevice_facades.py": ["test_facade_sharded.py", "test_low_precision_sharded.py",
                                    "test_autocast_sharded.py"],
}


def run(wrapper: str) -> None:
  """Runs the group of ``wrapper`` (its file name) on 8 simulated devices; fails if any fails."""
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=8"])
  env["JAXAMP_MULTIDEVICE"] = "1"
  env["JAX_PLATFORMS"] = "cpu"
  files = [f"tests/multidevice/{name}" for name in GROUPS[wrapper]]
  cmd = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "-n", "0"]
  try:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=_TIMEOUT_S, check=False)
  except subprocess.TimeoutExpired as e:
    out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    raise AssertionError(f"the 8-device tests did not finish in {_TIMEOUT_S} s:\n{out}") from None
  if proc.returncode != 0:
    raise AssertionError(
        f"the 8-device tests failed (exit code {proc.returncode}); {' '.join(cmd)} says:\n"
        f"{proc.stdout}\n{proc.stderr}")
