"""``clip_grad``: mmengine's validation of the clipping config, and the clipping transformation.

mmengine passes ``clip_grad`` to ``torch.nn.utils.clip_grad_norm_`` (type
``'norm'``, the default) or ``clip_grad_value_`` (type ``'value'``); the
checks here raise what mmengine and those functions raise, before anything
is built. :class:`ClipConfig` builds the matching transformation of
:mod:`jaxamp._src.clipping`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

import optax

from jaxamp._src import clipping
from jaxamp._src import outside
from jaxamp._src import validation
from jaxamp._src.facade.errors import AssertionTypeError
from jaxamp._src.facade.errors import AssertionValueError

_CLIP_KEYS = {"norm": ("max_norm", "norm_type", "error_if_nonfinite", "foreach"),
              "value": ("clip_value", "foreach")}
_CLIP_FUNCS = {"norm": "clip_grad_norm_", "value": "clip_grad_value_"}
_CLIP_REQUIRED = {"norm": "max_norm", "value": "clip_value"}


@dataclasses.dataclass(frozen=True)
class ClipConfig:
  """A validated ``clip_grad``: ``kind`` is ``'norm'`` or ``'value'``."""

  kind: str
  max_norm: float = 0.0
  norm_type: Any = 2.0
  error_if_nonfinite: bool = False
  clip_value: float = 0.0

  def transformation(self) -> optax.GradientTransformation:
    """``clip_grad_norm(max_norm, norm_type)`` or ``clip_grad_value(clip_value)``."""
    if self.kind == "norm":
      return clipping.clip_grad_norm(self.max_norm, self.norm_type)
    return clipping.clip_grad_value(self.clip_value)


def parse_clip_grad(clip_grad: Optional[dict]) -> Optional[ClipConfig]:
  """Validates ``clip_grad`` as mmengine does, without mutating the caller's dict."""
  if clip_grad is None:
    return None
  message = ("If `clip_grad` is not None, it should be a `dict` which is the arguments of "
             "`torch.nn.utils.clip_grad_norm_` or clip_grad_value_`.")
  if not isinstance(clip_grad, Mapping):
    raise AssertionTypeError(f"{message} Got {clip_grad!r} of type {type(clip_grad).__name__}.")
  if not clip_grad:
    raise AssertionValueError(f"{message} Got an empty dict.")
  cfg = dict(clip_grad)
  kind = cfg.pop("type", "norm")
  if kind not in ("norm", "value"):
    raise ValueError(f'type of clip_grad should be "norm" or "value" but got {kind}')
  if not cfg:
    raise AssertionValueError(
        "`clip_grad` should contain other arguments besides `type`. The arguments should match "
        "with the `torch.nn.utils.clip_grad_norm_` or clip_grad_value_`")
  func = _CLIP_FUNCS[kind]
  for key in cfg:
    if key not in _CLIP_KEYS[kind]:
      raise TypeError(f"{func}() got an unexpected keyword argument '{key}' "
                      f"(clip_grad of type {kind!r} accepts {list(_CLIP_KEYS[kind])} and 'type')")
  required = _CLIP_REQUIRED[kind]
  if required not in cfg:
    raise TypeError(f"{func}() missing 1 required positional argument: '{required}'")
  if kind == "value":
    value = outside.clip_value("clip_grad['clip_value']", cfg["clip_value"])
    return ClipConfig("value", clip_value=value)
  max_norm = outside.max_norm("clip_grad['max_norm']", cfg["max_norm"])
  norm_type = cfg.get("norm_type", 2.0)
  clipping.norm_order(norm_type)
  error = validation.check_bool("error_if_nonfinite", cfg.get("error_if_nonfinite", False))
  return ClipConfig("norm", max_norm=max_norm, norm_type=norm_type,
                     error_if_nonfinite=error)

