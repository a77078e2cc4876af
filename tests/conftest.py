"""Test configuration: trace counting, the 8-device tests (strict promotion: ../conftest.py)."""

import os

import pytest

from tests import _tracing

# Every trace of the optimizer wrappers' jitted functions is counted, by name
# (tests._tracing.trace_counts reads them).
_tracing.install()

# tests/multihost/ holds scripts that tests start as processes of their own. The
# 8-device tests need XLA_FLAGS set before jax starts: tests/test_multidevice.py runs
# them in a child process that sets JAXAMP_MULTIDEVICE; the ordinary run skips them.
collect_ignore_glob = ["multihost", "multihost/*"]
if os.environ.get("JAXAMP_MULTIDEVICE") != "1":
  collect_ignore_glob += ["multidevice", "multidevice/*"]


@pytest.fixture
def count_traces():
  """Wraps a function so that each trace (compilation) of it is counted."""

  def wrap(fn):
    counter = {"n": 0}

    def traced(*args, **kwargs):
      counter["n"] += 1
      return fn(*args, **kwargs)

    return traced, counter

  return wrap
