"""``build_optim_wrapper``: mmengine-style config dicts to optimizer wrappers.

PyTorch's optimizers (SGD, Adam, AdamW, RMSprop, Adagrad) are written here as
optax transformations with PyTorch's update rules, built through
``optax.inject_hyperparams`` so that their hyperparameters can be read and
set (``get_lr()``, ``param_groups[i]['lr'] = ...``). ``paramwise_cfg`` splits
the parameters into groups over their pytree paths with ``optax.partition``.
"""

from __future__ import annotations

import dataclasses
import numbers
import re
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp._src import numerics
from jaxamp._src.facade import mmengine

# -------------------------------------------------------------------------------------------------
# PyTorch's optimizers as optax transformations.
# -------------------------------------------------------------------------------------------------


class TorchSGDState(NamedTuple):
  """State of PyTorch's SGD: the step count and the momentum buffers (``()`` without momentum)."""

  count: jax.Array
  momentum_buffer: Any


class TorchAdamState(NamedTuple):
  """State of PyTorch's Adam/AdamW (``max_exp_avg_sq`` is ``()`` without amsgrad)."""

  count: jax.Array
  exp_avg: Any
  exp_avg_sq: Any
  max_exp_avg_sq: Any


class TorchRMSpropState(NamedTuple):
  """State of PyTorch's RMSprop (``()`` for the buffers it does not use)."""

  count: jax.Array
  square_avg: Any
  momentum_buffer: Any
  grad_avg: Any


class TorchAdagradState(NamedTuple):
  """State of PyTorch's Adagrad."""

  count: jax.Array
  state_sum: Any


def _like(x: Any, ref: jax.Array) -> jax.Array:
  return jnp.asarray(x).astype(ref.dtype)


def _need_params(params: Any, name: str) -> None:
  if params is None:
    raise ValueError(f"{name} needs the params in update(grads, state, params) (for weight decay)")


def _prepare_grad(g, p, weight_decay, maximize: bool, coupled: bool):
  """PyTorch's first lines: negate for ``maximize``, add ``weight_decay * p`` (L2)."""
  if maximize:
    g = -g
  if coupled:
    wd = _like(weight_decay, g)
    g = jnp.where(wd != 0, g + wd * p.astype(g.dtype), g)
  return g


def _zeros(params: Any) -> Any:
  return jax.tree.map(jnp.zeros_like, params)


def torch_sgd(learning_rate, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
              maximize=False, buffered=True) -> optax.GradientTransformation:
  """``torch.optim.SGD``: L2 weight decay into the gradient, then momentum, then the step::

    g = g + weight_decay * p
    buf = g (first step) or momentum * buf + (1 - dampening) * g
    g = g + momentum * buf (nesterov) or buf
    p = p - lr * g

  ``buffered`` (static) allocates the momentum buffers.
  """

  def init_fn(params):
    return TorchSGDState(jnp.zeros([], jnp.int32), _zeros(params) if buffered else ())

  def update_fn(grads, state, params=None):
    _need_params(params, "SGD")
    g_leaves, treedef = jax.tree.flatten(grads)
    p_leaves = treedef.flatten_up_to(params)
    b_leaves = treedef.flatten_up_to(state.momentum_buffer) if buffered else [None] * len(g_leaves)
    first = state.count == 0
    updates, buffers = [], []
    for g, p, buf in zip(g_leaves, p_leaves, b_leaves):
      g = _prepare_grad(g, p, weight_decay, maximize, True)
      lr = _like(learning_rate, g)
      if buffered:
        m = _like(momentum, g)
        moved = m * buf + (1 - _like(dampening, g)) * g
        new_buf = jnp.where(m != 0, jnp.where(first, g, moved), buf)
        direction = g + m * new_buf if nesterov else new_buf
        g = jnp.where(m != 0, direction, g)
        buffers.append(new_buf)
      updates.append(-lr * g)
    new_buffers = jax.tree.unflatten(treedef, buffers) if buffered else ()
    return (jax.tree.unflatten(treedef, updates),
            TorchSGDState(numerics.safe_increment(state.count), new_buffers))

  return optax.GradientTransformation(init_fn, update_fn)


def _bias_correction(complement, t):
  """``1 - beta**t`` with ``beta = 1 - complement``, accurate in float32 (``-expm1(t log1p(-c))``)."""
  return -jnp.expm1(t * jnp.log1p(-complement))


def torch_adam(learning_rate, one_minus_b1, one_minus_b2, eps, weight_decay, amsgrad=False,
               maximize=False, decoupled=False) -> optax.GradientTransformation:
  """``torch.optim.Adam`` (``decoupled=False``) and ``torch.optim.AdamW`` (``decoupled=True``)::

    g = g + weight_decay * p                      # Adam (L2 into the gradient)
    p = p * (1 - lr * weight_decay)               # AdamW (decoupled), before the step
    m = m + (1 - b1) * (g - m);  v = b2 * v + (1 - b2) * g * g
    denom = sqrt(max(v_max, v) if amsgrad else v) / sqrt(1 - b2**t) + eps
    p = p - lr / (1 - b1**t) * m / denom

  The betas are held as ``1 - beta`` so that ``1 - 0.999`` is exactly the
  float32 rounding of PyTorch's float64 value; the bias corrections are
  computed as ``-expm1(t * log1p(-(1 - beta)))``, accurate in float32.
  """

  def init_fn(params):
    return TorchAdamState(jnp.zeros([], jnp.int32), _zeros(params), _zeros(params),
                          _zeros(params) if amsgrad else ())

  def update_fn(grads, state, params=None):
    _need_params(params, "AdamW" if decoupled else "Adam")
    count = numerics.safe_increment(state.count)
    t = count.astype(jnp.float32)
    c1 = jnp.asarray(one_minus_b1, jnp.float32)
    c2 = jnp.asarray(one_minus_b2, jnp.float32)
    step_size = jnp.asarray(learning_rate, jnp.float32) / _bias_correction(c1, t)
    bc2_sqrt = jnp.sqrt(_bias_correction(c2, t))
    g_leaves, treedef = jax.tree.flatten(grads)
    p_leaves = treedef.flatten_up_to(params)
    m_leaves = treedef.flatten_up_to(state.exp_avg)
    v_leaves = treedef.flatten_up_to(state.exp_avg_sq)
    x_leaves = treedef.flatten_up_to(state.max_exp_avg_sq) if amsgrad else [None] * len(g_leaves)
    outs = {"u": [], "m": [], "v": [], "x": []}
    for g, p, m, v, vmax in zip(g_leaves, p_leaves, m_leaves, v_leaves, x_leaves):
      g = _prepare_grad(g, p, weight_decay, maximize, not decoupled)
      m = m + _like(c1, g) * (g - m)
      v = v * (1 - _like(c2, g)) + (_like(c2, g) * g) * g
      if amsgrad:
        vmax = jnp.maximum(vmax, v)
        outs["x"].append(vmax)
        root = jnp.sqrt(vmax)
      else:
        root = jnp.sqrt(v)
      denom = root / _like(bc2_sqrt, g) + _like(eps, g)
      update = (-_like(step_size, g) * m) / denom
      if decoupled:
        lr = _like(learning_rate, g)
        decayed = p.astype(g.dtype) * (1 - lr * _like(weight_decay, g))
        update = (decayed + update) - p.astype(g.dtype)
      outs["u"].append(update)
      outs["m"].append(m)
      outs["v"].append(v)
    unflat = lambda xs: jax.tree.unflatten(treedef, xs)  # noqa: E731
    return unflat(outs["u"]), TorchAdamState(count, unflat(outs["m"]), unflat(outs["v"]),
                                             unflat(outs["x"]) if amsgrad else ())

  return optax.GradientTransformation(init_fn, update_fn)


def torch_rmsprop(learning_rate, one_minus_alpha, eps, weight_decay, momentum, centered=False,
                  maximize=False, buffered=False) -> optax.GradientTransformation:
  """``torch.optim.RMSprop``: eps added *outside* the square root, ``alpha`` the decay::

    g = g + weight_decay * p
    sq = alpha * sq + (1 - alpha) * g * g
    avg = sqrt(sq - ga * ga) (centered, ga = lerp(ga, g, 1 - alpha)) or sqrt(sq); avg += eps
    buf = momentum * buf + g / avg; p -= lr * buf   (momentum > 0)
    p -= lr * g / avg                                (otherwise)
  """

  def init_fn(params):
    return TorchRMSpropState(jnp.zeros([], jnp.int32), _zeros(params),
                             _zeros(params) if buffered else (), _zeros(params) if centered else ())

  def update_fn(grads, state, params=None):
    _need_params(params, "RMSprop")
    g_leaves, treedef = jax.tree.flatten(grads)
    n = len(g_leaves)
    p_leaves = treedef.flatten_up_to(params)
    s_leaves = treedef.flatten_up_to(state.square_avg)
    b_leaves = treedef.flatten_up_to(state.momentum_buffer) if buffered else [None] * n
    a_leaves = treedef.flatten_up_to(state.grad_avg) if centered else [None] * n
    outs = {"u": [], "s": [], "b": [], "a": []}
    for g, p, sq, buf, ga in zip(g_leaves, p_leaves, s_leaves, b_leaves, a_leaves):
      g = _prepare_grad(g, p, weight_decay, maximize, True)
      ca = _like(one_minus_alpha, g)
      lr = _like(learning_rate, g)
      sq = sq * (1 - ca) + (ca * g) * g
      if centered:
        ga = ga + ca * (g - ga)
        outs["a"].append(ga)
        avg = jnp.sqrt(sq - ga * ga)
      else:
        avg = jnp.sqrt(sq)
      avg = avg + _like(eps, g)
      plain = (-lr * g) / avg
      if buffered:
        m = _like(momentum, g)
        new_buf = jnp.where(m > 0, buf * m + g / avg, buf)
        outs["b"].append(new_buf)
        plain = jnp.where(m > 0, -lr * new_buf, plain)
      outs["u"].append(plain)
      outs["s"].append(sq)
    unflat = lambda xs: jax.tree.unflatten(treedef, xs)  # noqa: E731
    return unflat(outs["u"]), TorchRMSpropState(
        numerics.safe_increment(state.count), unflat(outs["s"]),
        unflat(outs["b"]) if buffered else (), unflat(outs["a"]) if centered else ())

  return optax.GradientTransformation(init_fn, update_fn)


def torch_adagrad(learning_rate, lr_decay, weight_decay, eps, initial_accumulator_value=0.0,
                  maximize=False) -> optax.GradientTransformation:
  """``torch.optim.Adagrad``::

    g = g + weight_decay * p
    clr = lr / (1 + (t - 1) * lr_decay)
    sum += g * g                     # starts at initial_accumulator_value
    p -= clr * g / (sqrt(sum) + eps)
  """

  def init_fn(params):
    return TorchAdagradState(
        jnp.zeros([], jnp.int32),
        jax.tree.map(lambda p: jnp.full_like(p, initial_accumulator_value), params))

  def update_fn(grads, state, params=None):
    _need_params(params, "Adagrad")
    count = numerics.safe_increment(state.count)
    t = count.astype(jnp.float32)
    clr = jnp.asarray(learning_rate, jnp.float32) / (
        1 + (t - 1) * jnp.asarray(lr_decay, jnp.float32))
    g_leaves, treedef = jax.tree.flatten(grads)
    p_leaves = treedef.flatten_up_to(params)
    s_leaves = treedef.flatten_up_to(state.state_sum)
    updates, sums = [], []
    for g, p, s in zip(g_leaves, p_leaves, s_leaves):
      g = _prepare_grad(g, p, weight_decay, maximize, True)
      s = s + g * g
      std = jnp.sqrt(s) + _like(eps, g)
      updates.append((-_like(clr, g) * g) / std)
      sums.append(s)
    return (jax.tree.unflatten(treedef, updates),
            TorchAdagradState(count, jax.tree.unflatten(treedef, sums)))

  return optax.GradientTransformation(init_fn, update_fn)


# -------------------------------------------------------------------------------------------------
# Optimizer configs: PyTorch names and defaults, validation, the injected transformation.
# -------------------------------------------------------------------------------------------------

_IGNORED = ("foreach", "differentiable", "fused", "capturable")


def _real(name: str, value: Any) -> float:
  if isinstance(value, bool) or not isinstance(value, (numbers.Real, np.generic)):
    raise TypeError(f"{name} must be a real number, got {value!r}")
  return float(value)


def _flag(name: str, value: Any) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool, got {value!r}")
  return bool(value)


def _check_common(cfg: dict) -> None:
  if not 0.0 <= cfg["lr"]:
    raise ValueError(f"Invalid learning rate: {cfg['lr']}")
  if "eps" in cfg and not 0.0 <= cfg["eps"]:
    raise ValueError(f"Invalid epsilon value: {cfg['eps']}")
  if "momentum" in cfg and not 0.0 <= cfg["momentum"]:
    raise ValueError(f"Invalid momentum value: {cfg['momentum']}")
  if not 0.0 <= cfg["weight_decay"]:
    raise ValueError(f"Invalid weight_decay value: {cfg['weight_decay']}")


def _check_sgd(cfg: dict) -> None:
  _check_common(cfg)
  if cfg["nesterov"] and (cfg["momentum"] <= 0 or cfg["dampening"] != 0):
    raise ValueError("Nesterov momentum requires a momentum and zero dampening")


def _check_adam(cfg: dict) -> None:
  _check_common(cfg)
  for i, beta in enumerate(cfg["betas"]):
    if not 0.0 <= beta < 1.0:
      raise ValueError(f"Invalid beta parameter at index {i}: {beta}")


def _check_rmsprop(cfg: dict) -> None:
  _check_common(cfg)
  if not 0.0 <= cfg["alpha"]:
    raise ValueError(f"Invalid alpha value: {cfg['alpha']}")


def _check_adagrad(cfg: dict) -> None:
  _check_common(cfg)
  if not 0.0 <= cfg["lr_decay"]:
    raise ValueError(f"Invalid lr_decay value: {cfg['lr_decay']}")
  if not 0.0 <= cfg["initial_accumulator_value"]:
    raise ValueError("Invalid initial_accumulator_value value: "
                     f"{cfg['initial_accumulator_value']}")


def _betas(value: Any) -> Tuple[float, float]:
  if not isinstance(value, (tuple, list)) or len(value) != 2:
    raise TypeError(f"betas must be a pair of numbers, got {value!r}")
  return (_real("betas[0]", value[0]), _real("betas[1]", value[1]))


@dataclasses.dataclass(frozen=True)
class _TorchOptimizer:
  """One PyTorch optimizer: its defaults, fixed (code-selecting) keys, checks and factory."""

  name: str
  defaults: Dict[str, Any]
  fixed: Tuple[str, ...]
  check: Callable[[dict], None]
  build: Callable[[dict], optax.GradientTransformation]
  codecs: Callable[[dict], Dict[str, mmengine.HyperparamCodec]]

  @property
  def accepted(self) -> List[str]:
    return sorted(list(self.defaults) + list(_IGNORED))

  def resolve(self, cfg: Mapping[str, Any]) -> dict:
    """PyTorch's defaults updated with ``cfg``, type-checked and range-checked."""
    out = dict(self.defaults)
    for key, value in cfg.items():
      if key in _IGNORED:
        continue
      if key not in self.defaults:
        raise TypeError(f"{self.name}.__init__() got an unexpected keyword argument '{key}'; "
                        f"accepted: {self.accepted}")
      out[key] = value
    for key, value in out.items():
      if key == "betas":
        out[key] = _betas(value)
      elif key in self.fixed:
        out[key] = (_real(key, value) if key == "initial_accumulator_value"
                    else _flag(key, value))
      else:
        out[key] = _real(key, value)
    self.check(out)
    return out


def _sgd_build(c: dict) -> optax.GradientTransformation:
  return optax.inject_hyperparams(torch_sgd, hyperparam_dtype=jnp.float32)(
      learning_rate=c["lr"], momentum=c["momentum"], dampening=c["dampening"],
      weight_decay=c["weight_decay"], nesterov=c["nesterov"], maximize=c["maximize"],
      buffered=c["momentum"] != 0)


def _sgd_codecs(c: dict) -> Dict[str, mmengine.HyperparamCodec]:
  codecs = {"lr": mmengine._identity_codec("learning_rate"),  # pylint: disable=protected-access
            "dampening": mmengine._identity_codec("dampening"),  # pylint: disable=protected-access
            "weight_decay": mmengine._identity_codec("weight_decay")}  # pylint: disable=protected-access
  if c["momentum"] != 0:
    codecs["momentum"] = mmengine._identity_codec("momentum")  # pylint: disable=protected-access
  return codecs


def _adam_build(decoupled: bool) -> Callable[[dict], optax.GradientTransformation]:
  def build(c: dict) -> optax.GradientTransformation:
    return optax.inject_hyperparams(torch_adam, hyperparam_dtype=jnp.float32)(
        learning_rate=c["lr"], one_minus_b1=1.0 - c["betas"][0], one_minus_b2=1.0 - c["betas"][1],
        eps=c["eps"], weight_decay=c["weight_decay"], amsgrad=c["amsgrad"],
        maximize=c["maximize"], decoupled=decoupled or c.get("decoupled_weight_decay", False))

  return build


def _adam_codecs(c: dict) -> Dict[str, mmengine.HyperparamCodec]:
  del c
  return {"lr": mmengine._identity_codec("learning_rate"),  # pylint: disable=protected-access
          "betas": mmengine._pair_codec(  # pylint: disable=protected-access
              "betas", ("one_minus_b1", "one_minus_b2"), complement=True),
          "eps": mmengine._identity_codec("eps"),  # pylint: disable=protected-access
          "weight_decay": mmengine._identity_codec("weight_decay")}  # pylint: disable=protected-access


def _rmsprop_build(c: dict) -> optax.GradientTransformation:
  return optax.inject_hyperparams(torch_rmsprop, hyperparam_dtype=jnp.float32)(
      learning_rate=c["lr"], one_minus_alpha=1.0 - c["alpha"], eps=c["eps"],
      weight_decay=c["weight_decay"], momentum=c["momentum"], centered=c["centered"],
      maximize=c["maximize"], buffered=c["momentum"] > 0)


def _rmsprop_codecs(c: dict) -> Dict[str, mmengine.HyperparamCodec]:
  codecs = {"lr": mmengine._identity_codec("learning_rate"),  # pylint: disable=protected-access
            "alpha": mmengine._complement_codec("one_minus_alpha", "alpha"),  # pylint: disable=protected-access
            "eps": mmengine._identity_codec("eps"),  # pylint: disable=protected-access
            "weight_decay": mmengine._identity_codec("weight_decay")}  # pylint: disable=protected-access
  if c["momentum"] > 0:
    codecs["momentum"] = mmengine._identity_codec("momentum")  # pylint: disable=protected-access
  return codecs


def _adagrad_build(c: dict) -> optax.GradientTransformation:
  return optax.inject_hyperparams(torch_adagrad, static_args=("initial_accumulator_value",),
                                  hyperparam_dtype=jnp.float32)(
      learning_rate=c["lr"], lr_decay=c["lr_decay"], weight_decay=c["weight_decay"],
      eps=c["eps"], initial_accumulator_value=c["initial_accumulator_value"],
      maximize=c["maximize"])


def _adagrad_codecs(c: dict) -> Dict[str, mmengine.HyperparamCodec]:
  del c
  return {"lr": mmengine._identity_codec("learning_rate"),  # pylint: disable=protected-access
          "lr_decay": mmengine._identity_codec("lr_decay"),  # pylint: disable=protected-access
          "weight_decay": mmengine._identity_codec("weight_decay"),  # pylint: disable=protected-access
          "eps": mmengine._identity_codec("eps")}  # pylint: disable=protected-access


_ADAM_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False,
                      maximize=False)

TORCH_OPTIMIZERS: Dict[str, _TorchOptimizer] = {
    "SGD": _TorchOptimizer(
        "SGD", dict(lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                    maximize=False),
        ("nesterov", "maximize"), _check_sgd, _sgd_build, _sgd_codecs),
    "Adam": _TorchOptimizer(
        "Adam", dict(_ADAM_DEFAULTS, decoupled_weight_decay=False),
        ("amsgrad", "maximize", "decoupled_weight_decay"), _check_adam, _adam_build(False),
        _adam_codecs),
    "AdamW": _TorchOptimizer(
        "AdamW", dict(_ADAM_DEFAULTS, weight_decay=1e-2), ("amsgrad", "maximize"), _check_adam,
        _adam_build(True), _adam_codecs),
    "RMSprop": _TorchOptimizer(
        "RMSprop", dict(lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0,
                        centered=False, maximize=False),
        ("centered", "maximize"), _check_rmsprop, _rmsprop_build, _rmsprop_codecs),
    "Adagrad": _TorchOptimizer(
        "Adagrad", dict(lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0,
                        eps=1e-10, maximize=False),
        ("initial_accumulator_value", "maximize"), _check_adagrad, _adagrad_build,
        _adagrad_codecs),
}


@dataclasses.dataclass(frozen=True)
class _OptaxFactory:
  """An optax factory (``optax.adamw``...) given as the ``type`` of an optimizer config."""

  factory: Callable[..., optax.GradientTransformation]

  @property
  def name(self) -> str:
    return getattr(self.factory, "__name__", repr(self.factory))

  def resolve(self, cfg: Mapping[str, Any]) -> dict:
    return dict(cfg)

  def build(self, c: dict) -> optax.GradientTransformation:
    return optax.inject_hyperparams(self.factory)(**c)


# -------------------------------------------------------------------------------------------------
# paramwise_cfg: groups over pytree paths.
# -------------------------------------------------------------------------------------------------

_PARAMWISE_KEYS = ("custom_keys", "bias_lr_mult", "bias_decay_mult", "norm_decay_mult",
                   "dwconv_decay_mult", "flat_decay_mult", "bypass_duplicate",
                   "dcn_offset_lr_mult")
_NORM_NAME = re.compile(r".*norm.*|(bn|gn|ln)(_?[a-z0-9]{0,3})", re.IGNORECASE)


def _is_norm_module(name: str) -> bool:
  return bool(_NORM_NAME.fullmatch(name))


def _is_dwconv_module(leaves: Sequence[Tuple[str, Tuple[int, ...]]]) -> bool:
  for name, shape in leaves:
    if name == "kernel" and len(shape) == 4 and shape[-2] == 1:  # Flax HWIO, in/groups == 1
      return True
    if name == "weight" and len(shape) == 4 and shape[1] == 1:  # PyTorch OIHW
      return True
  return False


def _check_paramwise(paramwise: Any, base_wd: Optional[float], hp_keys: Sequence[str]) -> dict:
  if paramwise is None:
    return {}
  if not isinstance(paramwise, Mapping):
    raise TypeError(f"paramwise_cfg should be None or a dict, but got {type(paramwise)}")
  paramwise = dict(paramwise)
  for key in paramwise:
    if key not in _PARAMWISE_KEYS:
      raise ValueError(f"Unknown paramwise_cfg key {key!r}; accepted: {list(_PARAMWISE_KEYS)}")
  if "custom_keys" in paramwise:
    custom = paramwise["custom_keys"]
    if not isinstance(custom, Mapping):
      raise TypeError(f"If specified, custom_keys must be a dict, but got {type(custom)}")
    accepted = ["lr_mult", "decay_mult"] + list(hp_keys)
    for name, entry in custom.items():
      if not isinstance(entry, Mapping):
        raise TypeError(f"custom_keys[{name!r}] must be a dict, got {entry!r}")
      for key in entry:
        if key not in accepted:
          raise ValueError(f"Unknown key {key!r} in custom_keys[{name!r}]; accepted: {accepted}")
      if base_wd is None and "decay_mult" in entry:
        raise ValueError("base_wd should not be None")
  if base_wd is None and any(k in paramwise for k in ("bias_decay_mult", "norm_decay_mult",
                                                      "dwconv_decay_mult")):
    raise ValueError("base_wd should not be None")
  for key in ("bias_lr_mult", "bias_decay_mult", "norm_decay_mult", "dwconv_decay_mult",
              "flat_decay_mult", "dcn_offset_lr_mult"):
    if paramwise.get(key) is not None:
      _real(key, paramwise[key])
  return paramwise


def _hashable(value: Any) -> Any:
  if isinstance(value, (list, tuple)):
    return tuple(_hashable(v) for v in value)
  if isinstance(value, Mapping):
    return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
  return value


def paramwise_groups(params: Any, paramwise: dict, base_lr: Optional[float],
                     base_wd: Optional[float], lr_key: str = "lr",
                     wd_key: str = "weight_decay") -> Tuple[List[dict], List[int]]:
  """mmengine's parameter-wise rules over pytree paths.

  Returns the distinct per-leaf overrides (in order of first appearance)
  and, for every leaf, the index of its group.
  """
  paths = jax.tree_util.tree_flatten_with_path(params)[0]
  modules: Dict[str, List[Tuple[str, Tuple[int, ...]]]] = {}
  infos = []
  for path, leaf in paths:
    parts = mmengine.path_parts(path)
    name, prefix = parts[-1], ".".join(parts[:-1])
    shape = tuple(jnp.shape(leaf))
    modules.setdefault(prefix, []).append((name, shape))
    infos.append((name, prefix, parts, shape))
  custom = dict(paramwise.get("custom_keys", {}))
  sorted_keys = sorted(sorted(custom), key=len, reverse=True)
  bias_lr_mult = paramwise.get("bias_lr_mult")
  bias_decay_mult = paramwise.get("bias_decay_mult")
  norm_decay_mult = paramwise.get("norm_decay_mult")
  dwconv_decay_mult = paramwise.get("dwconv_decay_mult")
  flat_decay_mult = paramwise.get("flat_decay_mult")

  groups: List[dict] = []
  keys: Dict[Any, int] = {}
  labels: List[int] = []
  for name, prefix, parts, shape in infos:
    group: Dict[str, Any] = {}
    full = f"{prefix}.{name}"
    is_norm = len(parts) >= 2 and _is_norm_module(parts[-2]) and len(shape) <= 1
    is_dwconv = _is_dwconv_module(modules[prefix]) if prefix else False
    matched = next((k for k in sorted_keys if k in full), None)
    if matched is not None:
      entry = custom[matched]
      if base_lr is not None:
        group[lr_key] = base_lr * float(entry.get("lr_mult", 1.0))
      if base_wd is not None:
        group[wd_key] = base_wd * float(entry.get("decay_mult", 1.0))
      for k, v in entry.items():
        group[lr_key if k == "lr" else k] = v
    else:
      if name == "bias" and not is_norm and bias_lr_mult is not None and base_lr is not None:
        group[lr_key] = base_lr * float(bias_lr_mult)
      if base_wd is not None:
        if is_norm and norm_decay_mult is not None:
          group[wd_key] = base_wd * float(norm_decay_mult)
        elif name == "bias" and bias_decay_mult is not None:
          group[wd_key] = base_wd * float(bias_decay_mult)
        elif is_dwconv and dwconv_decay_mult is not None:
          group[wd_key] = base_wd * float(dwconv_decay_mult)
        elif len(shape) == 1 and flat_decay_mult is not None:
          group[wd_key] = base_wd * float(flat_decay_mult)
    key = _hashable(group)
    if key not in keys:
      keys[key] = len(groups)
      groups.append(group)
    labels.append(keys[key])
  return groups, labels


# -------------------------------------------------------------------------------------------------
# build_optim_wrapper
# -------------------------------------------------------------------------------------------------

_WRAPPER_KEYS = {"OptimWrapper": ("accumulative_counts", "clip_grad", "donate"),
                 "AmpOptimWrapper": ("accumulative_counts", "clip_grad", "donate", "loss_scale",
                                     "dtype")}
_META_KEYS = ("type", "optimizer", "paramwise_cfg", "constructor")


def _wrapper_class(kind: Any) -> type:
  if isinstance(kind, str):
    if kind == "OptimWrapper":
      return mmengine.OptimWrapper
    if kind == "AmpOptimWrapper":
      return mmengine.AmpOptimWrapper
  elif (isinstance(kind, type) and issubclass(kind, mmengine.OptimWrapper)
        and not issubclass(kind, mmengine.OptimWrapperDict)):
    return kind
  raise ValueError(f"Unknown optim wrapper type {kind!r}; accepted: {sorted(_WRAPPER_KEYS)} "
                   "or a subclass of jaxamp.OptimWrapper")


def _optimizer_kind(optimizer_cfg: Mapping[str, Any]) -> Any:
  if "type" not in optimizer_cfg:
    raise ValueError(f"The optimizer config needs a 'type' (one of {sorted(TORCH_OPTIMIZERS)} "
                     f"or an optax factory), got {dict(optimizer_cfg)!r}")
  kind = optimizer_cfg["type"]
  if isinstance(kind, str):
    if kind not in TORCH_OPTIMIZERS:
      raise ValueError(f"Unknown optimizer type {kind!r}; accepted: {sorted(TORCH_OPTIMIZERS)} "
                       "or an optax factory such as optax.adamw")
    return TORCH_OPTIMIZERS[kind]
  if callable(kind):
    return _OptaxFactory(kind)
  raise ValueError(f"Unknown optimizer type {kind!r}; accepted: {sorted(TORCH_OPTIMIZERS)} or "
                   "an optax factory such as optax.adamw")


def _build_optimizer(params: Any, optimizer_cfg: Mapping[str, Any], paramwise_cfg: Any):
  """Returns ``(transformation, group specs or None, defaults)``."""
  if not isinstance(optimizer_cfg, Mapping):
    raise TypeError(f"optimizer must be a config dict or an optax transformation, got "
                    f"{optimizer_cfg!r}")
  cfg = dict(optimizer_cfg)
  kind = _optimizer_kind(cfg)
  cfg.pop("type")
  if "params" in cfg:
    raise ValueError("The optimizer config must not contain 'params': the parameters are the "
                     "first argument of build_optim_wrapper")
  torch_like = isinstance(kind, _TorchOptimizer)
  lr_key, wd_key = ("lr", "weight_decay") if torch_like else ("learning_rate", "weight_decay")
  base = kind.resolve(cfg)
  base_lr = base.get(lr_key)
  base_wd = cfg.get(wd_key)  # mmengine: only an explicit weight_decay enables the decay rules
  hp_keys = list(kind.defaults) if torch_like else list(cfg)
  paramwise = _check_paramwise(paramwise_cfg, None if base_wd is None else _real(wd_key, base_wd),
                               hp_keys)
  if paramwise:
    overrides, labels = paramwise_groups(
        params, paramwise, None if base_lr is None else float(base_lr),
        None if base_wd is None else float(base_wd), lr_key, wd_key)
  else:
    overrides, labels = [{}], [0] * len(jax.tree.leaves(params))
  names = mmengine.param_names(params)
  transforms, specs = [], []
  for index, override in enumerate(overrides):
    hp = {k: v for k, v in override.items() if k not in ("lr_mult", "decay_mult")}
    extras = {k: v for k, v in override.items() if k in ("lr_mult", "decay_mult")}
    group_cfg = kind.resolve(dict(cfg, **hp)) if torch_like else dict(cfg, **hp)
    transforms.append(kind.build(group_cfg))
    group_names = [n for n, label in zip(names, labels) if label == index]
    if torch_like:
      codecs = kind.codecs(group_cfg)
      fixed = {k: group_cfg[k] for k in kind.defaults if k not in codecs}
      mirror = {k: group_cfg[k] for k in codecs}
      specs.append(mmengine.GroupSpec(group_names, codecs, fixed, extras, mirror))
    else:
      specs.append((group_names, extras, group_cfg))
  if len(transforms) == 1:
    tx = transforms[0]
  else:
    width = len(str(len(transforms) - 1))
    label_names = [f"group_{i:0{width}d}" for i in range(len(transforms))]
    treedef = jax.tree.structure(params)
    tx = optax.partition(dict(zip(label_names, transforms)),
                         jax.tree.unflatten(treedef, [label_names[i] for i in labels]))
  defaults = base if torch_like else dict(cfg)
  return tx, specs, defaults, torch_like


def build_optim_wrapper(params: Any, cfg: Mapping[str, Any]) -> mmengine.OptimWrapper:
  """Builds an :class:`OptimWrapper`/:class:`AmpOptimWrapper` from an mmengine-style config.

  ::

    cfg = dict(type='AmpOptimWrapper',
               optimizer=dict(type='AdamW', lr=1e-3, weight_decay=0.05),
               clip_grad=dict(max_norm=1.0), accumulative_counts=4,
               loss_scale='dynamic', dtype='bfloat16',
               paramwise_cfg=dict(norm_decay_mult=0.0, bias_decay_mult=0.0,
                                  custom_keys={'backbone': dict(lr_mult=0.1)}))
    wrapper = jaxamp.build_optim_wrapper(params, cfg)

  **Optimizers** by their PyTorch names, with PyTorch's update rules,
  defaults and argument checks (messages included):

  * ``SGD(lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False,
    maximize=False)``: weight decay is L2 added to the gradient *before*
    momentum; the first step fills the momentum buffer with the gradient.
  * ``Adam(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
    amsgrad=False, maximize=False, decoupled_weight_decay=False)``: weight
    decay is L2 added to the gradient (optax's ``adamw`` decays the weights
    instead); eps is added outside the square root of the bias-corrected
    second moment; amsgrad keeps the maximum of the raw second moment, as
    PyTorch does (optax's keeps that of the bias-corrected one).
  * ``AdamW(..., weight_decay=1e-2)``: decoupled decay ``p *= 1 - lr * wd``
    before the Adam step (the same as optax's ``adamw`` up to rounding).
  * ``RMSprop(lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0,
    centered=False, maximize=False)``: eps added outside the square root
    (optax's ``rmsprop`` adds it inside by default).
  * ``Adagrad(lr=1e-2, lr_decay=0, weight_decay=0,
    initial_accumulator_value=0, eps=1e-10, maximize=False)``: eps outside the
    square root, the accumulator starts at ``initial_accumulator_value``.
  * ``foreach``, ``fused``, ``capturable``, ``differentiable`` are accepted
    and ignored (they select PyTorch kernels, not arithmetic).
  * An optax factory may be given as the type: ``dict(type=optax.lion,
    learning_rate=1e-4)`` builds ``optax.inject_hyperparams(optax.lion)(...)``;
    ``lr_mult`` then scales ``learning_rate`` and ``decay_mult``
    ``weight_decay``.

  Hyperparameters are injected (``optax.inject_hyperparams``), so
  ``get_lr()``, ``get_momentum()`` and ``param_groups[i]['lr'] = ...`` work
  without recompiling. Keys that select code (``nesterov``, ``amsgrad``,
  ``centered``, ``maximize``, ``initial_accumulator_value``, and
  ``momentum`` when built as 0) are fixed at construction. Betas and alpha
  are stored as ``1 - beta`` so that float32 holds PyTorch's ``1 - 0.999``
  exactly.

  **paramwise_cfg** follows mmengine's ``DefaultOptimWrapperConstructor``
  over the pytree paths of ``params``. A leaf's name is its dotted path
  (``'backbone.layer1.conv.kernel'``; the ``.value`` of Flax variables is
  dropped); its *module* is the path without the last part. The rules:

  * ``custom_keys``: the longest key (then the alphabetically first) that is
    a substring of ``'<module>.<leaf>'`` wins (a top-level leaf ``w`` reads
    ``'.w'``, as in mmengine) and overrides every other rule: ``lr = base_lr *
    lr_mult``, ``weight_decay = base_wd * decay_mult``, and any optimizer
    argument in the entry (e.g. ``momentum``) applies to that group.
  * *bias*: the last path part is ``bias``. ``bias_lr_mult`` scales its
    learning rate unless the leaf is a norm parameter; ``bias_decay_mult``
    its weight decay.
  * *norm*: the module name contains ``norm`` (``LayerNorm_0``,
    ``BatchNorm_0``, ``norm1``, ``rmsnorm``) or is ``bn``/``gn``/``ln``
    with an optional short suffix (``bn1``, ``ln_f``), and the leaf has at
    most one dimension (``scale``/``bias``). ``norm_decay_mult`` applies.
  * *depthwise conv*: the module has a 4-d ``kernel`` with ``shape[-2] == 1``
    (Flax HWIO with one input channel per group) or a 4-d ``weight`` with
    ``shape[1] == 1`` (PyTorch OIHW). ``dwconv_decay_mult`` applies to its
    leaves.
  * *flat*: one-dimensional leaves; ``flat_decay_mult`` applies.
  * The decay rules are tried in mmengine's order (norm, bias, depthwise,
    flat) and need an explicit ``weight_decay`` in the optimizer config
    (``ValueError('base_wd should not be None')`` otherwise).
    ``dcn_offset_lr_mult`` and ``bypass_duplicate`` are accepted and have no
    effect (no deformable convolutions; pytree leaves are never shared).

  Leaves with identical settings share one parameter group (mmengine makes
  one group per parameter); groups are ordered by their first leaf, and
  ``param_groups[i]['params']`` lists the leaf names.

  Args:
    params: the parameters, a pytree of floating-point arrays.
    cfg: ``type`` (``'OptimWrapper'`` (default), ``'AmpOptimWrapper'`` or a
      wrapper class), ``optimizer`` (a config dict as above, or an optax
      transformation when there is no ``paramwise_cfg``),
      ``paramwise_cfg``, ``constructor`` (only
      ``'DefaultOptimWrapperConstructor'``), and the wrapper's arguments
      (``accumulative_counts``, ``clip_grad``, ``donate``; ``loss_scale``,
      ``dtype`` for ``AmpOptimWrapper``). The dict is not mutated.

  Returns:
    The wrapper.

  Raises:
    ValueError: unknown wrapper or optimizer types, unknown paramwise keys,
      out-of-range hyperparameters (PyTorch's messages).
    TypeError: unknown wrapper or optimizer arguments (the accepted ones are
      listed).

  Examples:
    >>> import jax.numpy as jnp, jaxamp
    >>> params = {'backbone': {'kernel': jnp.ones((2, 2)), 'bias': jnp.zeros(2)},
    ...           'head': {'kernel': jnp.ones((2, 1)), 'bias': jnp.zeros(1)}}
    >>> wrapper = jaxamp.build_optim_wrapper(params, dict(
    ...     optimizer=dict(type='SGD', lr=0.1, momentum=0.9, weight_decay=1e-4),
    ...     paramwise_cfg=dict(bias_decay_mult=0.0,
    ...                        custom_keys={'backbone': dict(lr_mult=0.1)})))
    >>> wrapper.get_lr()
    {'lr': [0.010000000000000002, 0.1, 0.1]}
    >>> [(g['params'], g['weight_decay']) for g in wrapper.param_groups]
    [(['backbone.bias', 'backbone.kernel'], 0.0001), (['head.bias'], 0.0), (['head.kernel'], 0.0001)]
  """
  if not isinstance(cfg, Mapping):
    raise TypeError(f"optim_wrapper cfg should be a dict, but got {type(cfg)}")
  cfg = dict(cfg)
  constructor = cfg.pop("constructor", None)
  if constructor not in (None, "DefaultOptimWrapperConstructor"):
    raise ValueError(f"Unknown constructor {constructor!r}; accepted: "
                     "['DefaultOptimWrapperConstructor']")
  if "optimizer" not in cfg:
    raise mmengine._AssertionValueError(  # pylint: disable=protected-access
        '`optim_wrapper_cfg` must contain "optimizer" config')
  optimizer_cfg = cfg.pop("optimizer")
  paramwise_cfg = cfg.pop("paramwise_cfg", None)
  wrapper_cls = _wrapper_class(cfg.pop("type", "OptimWrapper"))
  accepted = (_WRAPPER_KEYS["AmpOptimWrapper"] if issubclass(wrapper_cls, mmengine.AmpOptimWrapper)
              else _WRAPPER_KEYS["OptimWrapper"])
  unknown = sorted(set(cfg) - set(accepted))
  if unknown:
    raise TypeError(f"{wrapper_cls.__name__} got unexpected config keys {unknown}; accepted: "
                    f"{sorted(accepted)} and {list(_META_KEYS)}")
  if callable(getattr(optimizer_cfg, "init", None)) and callable(
      getattr(optimizer_cfg, "update", None)):
    if paramwise_cfg:
      raise ValueError("paramwise_cfg needs the optimizer as a config dict (each group is built "
                       "with its own hyperparameters), got an optax transformation")
    return wrapper_cls(optimizer_cfg, params, **cfg)
  params = mmengine._check_params(params)  # pylint: disable=protected-access
  tx, specs, defaults, torch_like = _build_optimizer(params, optimizer_cfg, paramwise_cfg)
  wrapper = wrapper_cls(tx, params, **cfg)
  if torch_like:
    wrapper._set_group_specs(specs, defaults)  # pylint: disable=protected-access
  else:
    generic = wrapper._group_specs()  # pylint: disable=protected-access
    for spec, (names, extras, _) in zip(generic, specs):
      spec.names = names
      spec.extras.update(extras)
  return wrapper
