"""Shared set-up of the 8-device tests (run by tests/_multidevice.py in child processes)."""

import jax
import pytest
from jax.sharding import AxisType

if jax.device_count() != 8:
  raise pytest.UsageError(
      "tests/multidevice needs 8 devices: run it through tests/test_multidevice*.py, or with "
      "XLA_FLAGS=--xla_force_host_platform_device_count=8 JAXAMP_MULTIDEVICE=1")


@pytest.fixture(scope="session")
def mesh():
  """8 devices on one data axis (Explicit axes, JAX's default for make_mesh)."""
  return jax.make_mesh((8,), ("data",))


@pytest.fixture(scope="session")
def auto_mesh():
  """8 devices on one data axis with Auto axes (sharding left to XLA's propagation)."""
  return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))


@pytest.fixture(scope="session")
def mesh2d():
  """A 4 x 2 mesh: 'data' by 'model'."""
  return jax.make_mesh((4, 2), ("data", "model"))
