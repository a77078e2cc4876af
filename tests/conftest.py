"""Test configuration: strict dtype and rank promotion, as the house style asks."""

import os

import jax
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

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
