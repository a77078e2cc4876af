"""The small regression problem the sharded tests share: params, micro-batches (one overflowing), loss."""

import jax.numpy as jnp
import numpy as np

MICRO, DIN, DOUT = 16, 8, 4  # micro-batch rows (2 per device)
STEPS, BAD_STEP, BAD_ROW = 6, 2, 5  # micro-step 2 overflows, on device 2 only
INIT_SCALE = 1024.0


def params():
  rng = np.random.default_rng(0)
  return {"w": (rng.standard_normal((DIN, DOUT)) * 0.3).astype(np.float32),
          "b": np.zeros((DOUT,), np.float32)}


def micro_batches(rows=MICRO, steps=STEPS, bad_row=BAD_ROW, seed=2):
  """``steps`` batches ``(x, y)`` of ``rows`` rows; row ``bad_row`` of step BAD_STEP overflows."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(steps):
    x = rng.standard_normal((rows, DIN)).astype(np.float32)
    y = rng.standard_normal((rows, DOUT)).astype(np.float32)
    if i == BAD_STEP:
      x[bad_row, 0] = 1e20  # its squared error overflows float32
    out.append((x, y))
  return out


def loss(p, x, y):
  return jnp.mean((x @ p["w"] + p["b"][None, :] - y) ** 2)
