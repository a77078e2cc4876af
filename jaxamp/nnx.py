"""Flax NNX helpers: ``jaxamp.nnx.Optimizer`` (requires flax; not imported by ``import jaxamp``)."""

from jaxamp._src.nnx_optimizer import Optimizer
from jaxamp._src.nnx_optimizer import OverwriteWithGradient

__all__ = ("Optimizer", "OverwriteWithGradient")
