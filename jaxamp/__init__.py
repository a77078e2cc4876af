"""jaxamp: automatic mixed precision for JAX, built on optax."""

from jaxamp import paddle
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
from jaxamp._src.numerics import all_finite
from jaxamp._src.policy import Policy
from jaxamp._src.policy import get_policy
from jaxamp._src.policy import mixed_precision

__version__ = "0.1.0"

__all__ = (
    "DEFAULT_MAX_SCALE",
    "DEFAULT_MIN_SCALE",
    "GradScaler",
    "LossScaleState",
    "Policy",
    "all_finite",
    "dynamic_loss_scale",
    "get_loss_scale",
    "get_loss_scale_state",
    "get_policy",
    "mixed_precision",
    "paddle",
    "scale_loss",
    "set_loss_scale",
    "static_loss_scale",
)
