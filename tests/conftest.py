"""Test configuration: trace counting, the 8-device tests (strict promotion: ../conftest.py)."""

import os

import pytest

from tests import _tracing

# Every trace of the optimizer wrappers' jitted functions is counted, by name
# (tests._tracing.trace_counts reads them).
_tracing.install()

# tests/multihost/ holds scripts that tests start as processes of their own. The
# 8-device tests need XLA_FLAGS set before jax starts: tests/_multidevice.py runs
# them in a child process that sets JAXAMP_MULTIDEVICE; the ordinary run skips them.
collect_ignore_glob = ["multihost", "multihost/*"]
if os.environ.get("JAXAMP_MULTIDEVICE") != "1":
  collect_ignore_glob += ["multidevice", "multidevice/*"]

# The files that take longest, longest first. The run hands whole files to its workers in
# collection order (pyproject: --dist loadfile --no-loadscope-reorder); these go first, so that
# no long file starts last and runs alone while the other workers wait.
_LONGEST_FIRST = [
    "tests/test_multidevice.py",
    "tests/test_examples.py",
    "tests/conformance/test_flax_linen.py",
    "tests/test_docs.py",
    "tests/test_fp8_autocast.py",
    "tests/test_fp8.py",
    "tests/conformance/test_fp8_autocast.py",
    "tests/test_autocast.py",
    "tests/conformance/test_equinox.py",
    "tests/conformance/test_pure_jax.py",
    "tests/test_multidevice_accumulation.py",
    "tests/test_multidevice_facades.py",
    "tests/test_bad_values.py",
    "tests/conformance/test_flax_nnx.py",
    "tests/test_flax.py",
    "tests/test_demo.py",
    "tests/upstream/test_torch_grad_scaling.py",
    "tests/test_excess_precision.py",
    "tests/test_autocast_programs.py",
    "tests/test_multidevice_data_parallel.py",
    # -m benchmarks (.ci/run's stage of their own)
    "tests/test_benchmarks.py",
    "tests/test_bench_fp8_autocast.py",
    "tests/test_bench_low_precision.py",
]


def pytest_collection_modifyitems(config, items):
  del config
  rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable


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
