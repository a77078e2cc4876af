"""Flax NNX helpers: ``jaxamp.nnx.Optimizer`` (requires flax; not imported by ``import jaxamp``)."""

from jaxamp._src.nnx_optimizer import Optimizer

__all__ = ("Optimizer",)
