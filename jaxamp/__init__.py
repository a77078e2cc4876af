"""jaxamp: automatic mixed precision for JAX, built on optax."""

from jaxamp import paddle
from jaxamp._src.accumulation import AccumulationState
from jaxamp._src.accumulation import accumulate_gradients
from jaxamp._src.accumulation import get_accumulation_state
from jaxamp._src.accumulation import has_updated
from jaxamp._src.autocast import autocast
from jaxamp._src.clipping import ClipGradNormState
from jaxamp._src.clipping import clip_grad_norm
from jaxamp._src.clipping import clip_grad_value
from jaxamp._src.clipping import total_grad_norm
from jaxamp._src.facade.builder import build_optim_wrapper
from jaxamp._src.facade.mmengine import AmpOptimWrapper
from jaxamp._src.facade.mmengine import OptimWrapper
from jaxamp._src.facade.mmengine import OptimWrapperDict
from jaxamp._src.facade.torch import GradScaler
from jaxamp._src.loss_scale import DEFAULT_MAX_SCALE
from jaxamp._src.loss_scale import DEFAULT_MIN_SCALE
from jaxamp._src.loss_scale import LossScaleState
from jaxamp._src.loss_scale import dynamic_loss_scale
from jaxamp._src.loss_scale import get_loss_scale
from jaxamp._src.loss_scale import get_loss_scale_state
from jaxamp._src.loss_scale import scale_loss
from jaxamp._src.loss_scale import set_loss_scale
from jaxamp._src.loss_scale import static_loss_scale
from jaxamp._src.microbatch import microbatch_value_and_grad
from jaxamp._src.numerics import all_finite
from jaxamp._src.policy import Policy
from jaxamp._src.policy import get_policy
from jaxamp._src.policy import mixed_precision
from jaxamp._src.train_state import TrainState
from jaxamp._src.train_state import skipped_steps
from jaxamp._src.train_state import update_applied

__version__ = "0.1.0"

__all__ = (
    "AccumulationState",
    "AmpOptimWrapper",
    "ClipGradNormState",
    "DEFAULT_MAX_SCALE",
    "DEFAULT_MIN_SCALE",
    "GradScaler",
    "LossScaleState",
    "OptimWrapper",
    "OptimWrapperDict",
    "Policy",
    "TrainState",
    "accumulate_gradients",
    "all_finite",
    "autocast",
    "build_optim_wrapper",
    "clip_grad_norm",
    "clip_grad_value",
    "dynamic_loss_scale",
    "get_accumulation_state",
    "get_loss_scale",
    "get_loss_scale_state",
    "get_policy",
    "has_updated",
    "microbatch_value_and_grad",
    "mixed_precision",
    "paddle",
    "scale_loss",
    "set_loss_scale",
    "skipped_steps",
    "static_loss_scale",
    "total_grad_norm",
    "update_applied",
)
