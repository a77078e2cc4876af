"""Stateful facades with the APIs of PyTorch, mmengine and Paddle, over the functional core.

``docs/design.md`` maps their modules and the direction of their imports.
"""
