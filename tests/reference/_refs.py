"""Imports of the reference libraries, skipping cleanly when they are absent.

Install them with ``pip install -e ".[reference]"`` (PyTorch CPU, mmengine, Paddle).
With ``JAXAMP_REQUIRE_REFERENCE=1`` (as ``.ci/run`` sets it) a missing library is
an error instead of a skip.
"""

import importlib
import os
import warnings
from unittest import mock

import pytest


def import_reference(name: str):
  """Imports a reference library (silencing its import-time warnings) or skips the module."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    if os.environ.get("JAXAMP_REQUIRE_REFERENCE") == "1":
      return importlib.import_module(name)
    return pytest.importorskip(name)


class _AnyPlace:
  """Paddle enables its scaler only on accelerator places; its arithmetic runs on CPU as well."""

  def __init__(self, place):
    self._place = place

  def __getattr__(self, name):
    return getattr(self._place, name)

  def is_custom_place(self):
    return True


class _Tracer:
  def __init__(self, tracer):
    self._tracer = tracer
    self._expected_place = _AnyPlace(tracer._expected_place)

  def __getattr__(self, name):
    return getattr(self._tracer, name)


def paddle_scaler_on_cpu(**kw):
  """A ``paddle.amp.GradScaler(**kw)`` enabled on CPU (or a skip without Paddle)."""
  paddle = import_reference("paddle")
  module = import_reference("paddle.amp.grad_scaler")
  real = module._dygraph_tracer
  with mock.patch.object(module, "_dygraph_tracer", lambda: _Tracer(real())):
    return paddle.amp.GradScaler(**kw)
