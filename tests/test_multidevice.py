"""Runs the 8-device tests (tests/multidevice/) in a child process of their own.

The number of simulated CPU devices is fixed when jax starts, so these tests
cannot share a process with the rest of the suite, which keeps one device.
The child uses the same interpreter and the same pytest configuration, with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``; its output is shown
when it fails.
"""

import os
import pathlib
import subprocess
import sys

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_TIMEOUT_S = 900


def test_multidevice_suite():
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=8"])
  env["JAXAMP_MULTIDEVICE"] = "1"
  env["JAX_PLATFORMS"] = "cpu"
  cmd = [sys.executable, "-m", "pytest", "tests/multidevice", "-q", "-p", "no:cacheprovider",
         "-n", "0"]
  try:
    proc = subprocess.run(cmd, cwd=_ROOT, env=env, capture_output=True, text=True,
                          timeout=_TIMEOUT_S, check=False)
  except subprocess.TimeoutExpired as e:
    out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    raise AssertionError(f"the 8-device tests did not finish in {_TIMEOUT_S} s:\n{out}") from None
  if proc.returncode != 0:
    raise AssertionError(
        f"the 8-device tests failed (exit code {proc.returncode}); {' '.join(cmd)} says:\n"
        f"{proc.stdout}\n{proc.stderr}")
