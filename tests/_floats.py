"""Float constants and helpers shared by the numerical tests."""

import jax
import numpy as np

F32_TINY = float(np.finfo(np.float32).tiny)
F32_MAX = float(np.finfo(np.float32).max)


def bits(x):
  """The raw bits of a float32 (or 16-bit) array, to compare -0.0 and nan payloads too."""
  return np.asarray(x).view(np.uint32 if np.asarray(x).dtype == np.float32 else np.uint16)


def torch_unscale(g, scale):
  """PyTorch's unscale: g * float32(1 / float64(scale)), denormals kept (numpy keeps them)."""
  inv = np.float32(1.0 / np.float64(np.float32(scale)))
  return (np.asarray(g, np.float32) * inv).astype(np.float32)


def enable_x64(on=True):
  """A context with 64-bit floats on (or off): ``jax.enable_x64`` where it exists.

  The oldest supported jax has it as ``jax.experimental.enable_x64`` only.
  """
  if hasattr(jax, "enable_x64"):
    return jax.enable_x64(on)
  from jax import experimental  # pylint: disable=import-outside-toplevel
  return experimental.enable_x64(on)
