"""jaxamp: automatic mixed precision for JAX, built on optax."""

from jaxamp import paddle
from jaxamp._src.accumulation import accumulate_gradients
from jaxamp._src.autocast import AutocastWarning, autocast, autocast_disabled
from jaxamp._src.clipping import clip_grad_norm
from jaxamp._src.clipping import clip_grad_value
from jaxamp._src.clipping import total_grad_norm
from jaxamp._src.facade.builder import build_optim_wrapper
from jaxamp._src.loss_scale import StallWarning
from jaxamp._src.facade.stall import StalledError
from jaxamp._src.facade.mmengine.amp_optim_wrapper import AmpOptimWrapper
from jaxamp._src.facade.mmengine.optim_wrapper import OptimWrapper
from jaxamp._src.facade.mmengine.optim_wrapper_dict import OptimWrapperDict
from jaxamp._src.facade.torch import GradScaler
from jaxamp._src.facade.torch import clip_grad_norm_
from jaxamp._src.loss_scale import dynamic_loss_scale
from jaxamp._src.loss_scale import static_loss_scale
from jaxamp._src.low_precision import decode_compensation
from jaxamp._src.low_precision import low_precision_params
from jaxamp._src.microbatch import microbatch_value_and_grad
from jaxamp._src.outside import validate_opt_state
from jaxamp._src.finite import all_finite
from jaxamp._src.fp8 import OverwriteWithGradientState
from jaxamp._src.fp8 import apply_updates
from jaxamp._src.fp8 import overwrite_with_gradient
from jaxamp._src.fp8_autocast import Fp8Rule
from jaxamp._src.fp8_autocast import Fp8Site
from jaxamp._src.policy import Policy
from jaxamp._src.policy import get_policy
from jaxamp._src.policy import mixed_precision
from jaxamp._src.selective_update import set_fused_selection
from jaxamp._src.state import DEFAULT_MAX_SCALE
from jaxamp._src.state import DEFAULT_MIN_SCALE
from jaxamp._src.state import AccumulationState
from jaxamp._src.state import ClipGradNormState
from jaxamp._src.state import LossScaleState
from jaxamp._src.state import LowPrecisionState
from jaxamp._src.state import get_accumulation_state
from jaxamp._src.deprecated import get_loss_scale
from jaxamp._src.deprecated import has_updated
from jaxamp._src.state import get_loss_scale_state
from jaxamp._src.state import loss_scale
from jaxamp._src.state import keep_if_skipped
from jaxamp._src.state import scale_loss
from jaxamp._src.state import set_loss_scale
from jaxamp._src.state import skip_report
from jaxamp._src.state import skipped_steps
from jaxamp._src.state import stale_report
from jaxamp._src.state import stalled
from jaxamp._src.state import step_metrics
from jaxamp._src.state import update_applied
from jaxamp._src.state import upgrade_opt_state
from jaxamp._src.train_state import TrainState

__version__ = "0.1.0"

__all__ = (
    "AccumulationState",
    "AmpOptimWrapper",
    "AutocastWarning",
    "ClipGradNormState",
    "DEFAULT_MAX_SCALE",
    "DEFAULT_MIN_SCALE",
    "Fp8Rule",
    "Fp8Site",
    "GradScaler",
    "LossScaleState",
    "LowPrecisionState",
    "OptimWrapper",
    "OptimWrapperDict",
    "OverwriteWithGradientState",
    "Policy",
    "StallWarning",
    "StalledError",
    "TrainState",
    "accumulate_gradients",
    "all_finite",
    "apply_updates",
    "autocast",
    "autocast_disabled",
    "build_optim_wrapper",
    "clip_grad_norm",
    "clip_grad_norm_",
    "clip_grad_value",
    "decode_compensation",
    "dynamic_loss_scale",
    "get_accumulation_state",
    "get_loss_scale",
    "get_loss_scale_state",
    "get_policy",
    "low_precision_params",
    "has_updated",
    "keep_if_skipped",
    "loss_scale",
    "microbatch_value_and_grad",
    "mixed_precision",
    "overwrite_with_gradient",
    "paddle",
    "scale_loss",
    "set_fused_selection",
    "set_loss_scale",
    "skip_report",
    "skipped_steps",
    "stale_report",
    "stalled",
    "static_loss_scale",
    "step_metrics",
    "total_grad_norm",
    "update_applied",
    "upgrade_opt_state",
    "validate_opt_state",
)
