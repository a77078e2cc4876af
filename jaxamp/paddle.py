"""Paddle-style loss scaling: ``jaxamp.paddle.GradScaler`` (``paddle.amp.GradScaler``'s API)."""

from jaxamp._src.facade.paddle import GradScaler

__all__ = ("GradScaler",)
