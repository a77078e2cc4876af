"""Imports of the reference libraries, skipping cleanly when they are absent.

Install them with ``pip install -e ".[reference]"`` (PyTorch CPU, mmengine, Paddle).
"""

import warnings

import pytest


def import_reference(name: str):
  """Imports a reference library (silencing its import-time warnings) or skips the module."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return pytest.importorskip(name)
