"""Float32 constants and bit-level helpers shared by the numerical tests."""

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
