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


def micro_batches():
  rng = np.random.default_rng(2)
  out = []
  for i in range(STEPS):
    x = rng.standard_normal((MICRO, DIN)).astype(np.float32)
    y = rng.standard_normal((MICRO, DOUT)).astype(np.float32)
    if i == BAD_STEP:
      x[BAD_ROW, 0] = 1e20
    out.append((x, y))
  return out


def loss(p, x, y):
  return jnp.mean((x @ p["w"] + p["b"][None, :] - y) ** 2)
