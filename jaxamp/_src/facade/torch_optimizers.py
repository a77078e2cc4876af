"""PyTorch's optimizers as optax transformations, with PyTorch's names, defaults and checks.

``torch_sgd``, ``torch_adam`` (Adam and AdamW), ``torch_rmsprop`` and
``torch_adagrad`` follow PyTorch's update rules where optax's differ
(weight decay added to the gradient, eps outside the square root, the first
momentum step, amsgrad on the raw second moment). :data:`TORCH_OPTIMIZERS`
describes each one as ``build_optim_wrapper`` takes it: PyTorch's defaults,
the keys that select code (fixed at construction), PyTorch's argument checks
and messages, and how each hyperparameter is read and written in the
``optax.inject_hyperparams`` state (:mod:`.hyperparam_codecs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, NamedTuple, Tuple

import jax
import jax.numpy as jnp
import optax

from jaxamp._src import validation
from jaxamp._src.facade import hyperparam_codecs as hp

# -------------------------------------------------------------------------------------------------
# The update rules.
# -------------------------------------------------------------------------------------------------


class TorchSGDState(NamedTuple):
  """State of PyTorch's SGD: the step count and the momentum buffers (``()`` without momentum)."""

  count: jax.Array  # type: ignore[assignment]  # optax's name; shadows tuple.count
  momentum_buffer: Any


class TorchAdamState(NamedTuple):
  """State of PyTorch's Adam/AdamW (``max_exp_avg_sq`` is ``()`` without amsgrad)."""

  count: jax.Array  # type: ignore[assignment]  # optax's name; shadows tuple.count
  exp_avg: Any
  exp_avg_sq: Any
  max_exp_avg_sq: Any


class TorchRMSpropState(NamedTuple):
  """State of PyTorch's RMSprop (``()`` for the buffers it does not use)."""

  count: jax.Array  # type: ignore[assignment]  # optax's name; shadows tuple.count
  square_avg: Any
  momentum_buffer: Any
  grad_avg: Any


class TorchAdagradState(NamedTuple):
  """State of PyTorch's Adagrad."""

  count: jax.Array  # type: ignore[assignment]  # optax's name; shadows tuple.count
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
            TorchSGDState(optax.safe_increment(state.count), new_buffers))

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
    count = optax.safe_increment(state.count)
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
        optax.safe_increment(state.count), unflat(outs["s"]),
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
    count = optax.safe_increment(state.count)
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
# Constructor arguments: PyTorch's names and defaults, validation, the injected transformation.
# -------------------------------------------------------------------------------------------------

_IGNORED = ("foreach", "differentiable", "fused", "capturable")


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
  return (validation.check_real("betas[0]", value[0]), validation.check_real("betas[1]", value[1]))


@dataclasses.dataclass(frozen=True)
class TorchOptimizer:
  """One PyTorch optimizer: its defaults, fixed (code-selecting) keys, checks and factory.

  Attributes:
    name: PyTorch's class name (``'AdamW'``).
    defaults: PyTorch's constructor defaults, by argument name.
    fixed: the arguments that select code, fixed at construction.
    check: PyTorch's range checks of the resolved arguments.
    build: resolved arguments -> the injected optax transformation.
    codecs: resolved arguments -> how each settable hyperparameter is
      stored in the injected state.
  """

  name: str
  defaults: Dict[str, Any]
  fixed: Tuple[str, ...]
  check: Callable[[dict], None]
  build: Callable[[dict], optax.GradientTransformation]
  codecs: Callable[[dict], Dict[str, hp.HyperparamCodec]]

  @property
  def accepted(self) -> List[str]:
    """The accepted argument names (those PyTorch ignores here included)."""
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
        out[key] = (validation.check_real(key, value) if key == "initial_accumulator_value"
                    else validation.check_bool(key, value))
      else:
        out[key] = validation.check_real(key, value)
    self.check(out)
    return out


def _sgd_build(c: dict) -> optax.GradientTransformation:
  return optax.inject_hyperparams(torch_sgd, hyperparam_dtype=jnp.float32)(
      learning_rate=c["lr"], momentum=c["momentum"], dampening=c["dampening"],
      weight_decay=c["weight_decay"], nesterov=c["nesterov"], maximize=c["maximize"],
      buffered=c["momentum"] != 0)


def _sgd_codecs(c: dict) -> Dict[str, hp.HyperparamCodec]:
  codecs = {"lr": hp.identity_codec("learning_rate"),
            "dampening": hp.identity_codec("dampening"),
            "weight_decay": hp.identity_codec("weight_decay")}
  if c["momentum"] != 0:
    codecs["momentum"] = hp.identity_codec("momentum")
  return codecs


def _adam_build(decoupled: bool) -> Callable[[dict], optax.GradientTransformation]:
  def build(c: dict) -> optax.GradientTransformation:
    return optax.inject_hyperparams(torch_adam, hyperparam_dtype=jnp.float32)(
        learning_rate=c["lr"], one_minus_b1=1.0 - c["betas"][0], one_minus_b2=1.0 - c["betas"][1],
        eps=c["eps"], weight_decay=c["weight_decay"], amsgrad=c["amsgrad"],
        maximize=c["maximize"], decoupled=decoupled or c.get("decoupled_weight_decay", False))

  return build


def _adam_codecs(c: dict) -> Dict[str, hp.HyperparamCodec]:
  del c
  return {"lr": hp.identity_codec("learning_rate"),
          "betas": hp.pair_codec(
              "betas", ("one_minus_b1", "one_minus_b2"), complement=True),
          "eps": hp.identity_codec("eps"),
          "weight_decay": hp.identity_codec("weight_decay")}


def _rmsprop_build(c: dict) -> optax.GradientTransformation:
  return optax.inject_hyperparams(torch_rmsprop, hyperparam_dtype=jnp.float32)(
      learning_rate=c["lr"], one_minus_alpha=1.0 - c["alpha"], eps=c["eps"],
      weight_decay=c["weight_decay"], momentum=c["momentum"], centered=c["centered"],
      maximize=c["maximize"], buffered=c["momentum"] > 0)


def _rmsprop_codecs(c: dict) -> Dict[str, hp.HyperparamCodec]:
  codecs = {"lr": hp.identity_codec("learning_rate"),
            "alpha": hp.complement_codec("one_minus_alpha", "alpha"),
            "eps": hp.identity_codec("eps"),
            "weight_decay": hp.identity_codec("weight_decay")}
  if c["momentum"] > 0:
    codecs["momentum"] = hp.identity_codec("momentum")
  return codecs


def _adagrad_build(c: dict) -> optax.GradientTransformation:
  return optax.inject_hyperparams(torch_adagrad, static_args=("initial_accumulator_value",),
                                  hyperparam_dtype=jnp.float32)(
      learning_rate=c["lr"], lr_decay=c["lr_decay"], weight_decay=c["weight_decay"],
      eps=c["eps"], initial_accumulator_value=c["initial_accumulator_value"],
      maximize=c["maximize"])


def _adagrad_codecs(c: dict) -> Dict[str, hp.HyperparamCodec]:
  del c
  return {"lr": hp.identity_codec("learning_rate"),
          "lr_decay": hp.identity_codec("lr_decay"),
          "weight_decay": hp.identity_codec("weight_decay"),
          "eps": hp.identity_codec("eps")}


_ADAM_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False,
                      maximize=False)

TORCH_OPTIMIZERS: Dict[str, TorchOptimizer] = {
    "SGD": TorchOptimizer(
        "SGD", dict(lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                    maximize=False),
        ("nesterov", "maximize"), _check_sgd, _sgd_build, _sgd_codecs),
    "Adam": TorchOptimizer(
        "Adam", dict(_ADAM_DEFAULTS, decoupled_weight_decay=False),
        ("amsgrad", "maximize", "decoupled_weight_decay"), _check_adam, _adam_build(False),
        _adam_codecs),
    "AdamW": TorchOptimizer(
        "AdamW", dict(_ADAM_DEFAULTS, weight_decay=1e-2), ("amsgrad", "maximize"), _check_adam,
        _adam_build(True), _adam_codecs),
    "RMSprop": TorchOptimizer(
        "RMSprop", dict(lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0,
                        centered=False, maximize=False),
        ("centered", "maximize"), _check_rmsprop, _rmsprop_build, _rmsprop_codecs),
    "Adagrad": TorchOptimizer(
        "Adagrad", dict(lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0,
                        eps=1e-10, maximize=False),
        ("initial_accumulator_value", "maximize"), _check_adagrad, _adagrad_build,
        _adagrad_codecs),
}

