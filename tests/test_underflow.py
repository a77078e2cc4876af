"""The float16 underflow showcase: without loss scaling training stalls, with it training works."""

import numpy as np
import pytest

from jaxamp.demo import underflow

CONFIG = underflow.UnderflowConfig(steps=40)


@pytest.fixture(scope="module")
def runs():
  return underflow.run_all(CONFIG)


def test_without_scaling_every_float16_gradient_underflows_and_the_loss_stalls(runs):
  run = runs["float16"]
  np.testing.assert_array_equal(run["zero_fraction"], 1.0)
  np.testing.assert_array_equal(run["loss"], run["loss"][0])  # not one parameter moved
  np.testing.assert_array_equal(run["scale"], 1.0)


def test_with_dynamic_scaling_the_loss_decreases_like_float32(runs):
  scaled, reference = runs["float16+scaling"], runs["float32"]
  assert scaled["loss"][-1] < 0.5 * scaled["loss"][0]
  # Float16 compute with scaling follows the float32 run closely.
  np.testing.assert_allclose(scaled["loss"], reference["loss"], rtol=0.02)
  # Apart from the first step (the zero-initialized head blocks the backward
  # pass), at most a few tiny gradients still round to 0.
  assert scaled["zero_fraction"][1:].max() < 0.05


def test_the_scale_grows_and_never_backs_off(runs):
  expected = 2.0 ** (16 + np.arange(CONFIG.steps) // CONFIG.growth_interval)
  np.testing.assert_array_equal(runs["float16+scaling"]["scale"], expected)


def test_the_loss_gradient_is_below_float16s_smallest_subnormal():
  x, y, params = underflow.make_problem(CONFIG)
  # The initial output is 0 (zero head), so dL/dpred = -2 y / (batch * outputs).
  per_element = 2 * np.abs(np.asarray(y)) / (CONFIG.batch * CONFIG.outputs)
  assert per_element.max() < underflow.F16_SMALLEST_SUBNORMAL / 2  # rounds to 0
  assert per_element.max() * CONFIG.init_scale > underflow.F16_SMALLEST_NORMAL
  assert x.shape == (CONFIG.batch, CONFIG.inputs) and params["Dense_8"]["kernel"].shape == (
      CONFIG.width, CONFIG.outputs)


def test_bad_mode():
  with pytest.raises(ValueError, match="mode must be one of"):
    underflow.train(CONFIG, "float8")
