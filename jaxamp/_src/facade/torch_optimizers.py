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

from jaxamp._src import outside
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


def _per_leaf(fn: Callable[..., tuple], n_out: int, grads: Any, *trees: Any) -> List[Any]:
  """``fn`` leaf by leaf over ``grads`` and ``trees`` (``None``: no tree, ``None`` leaves).

  Returns its ``n_out`` outputs, each as a tree shaped like ``grads``.
  """
  treedef: Any
  g_leaves, treedef = jax.tree.flatten(grads)
  columns = [[None] * len(g_leaves) if t is None else treedef.flatten_up_to(t) for t in trees]
  outs = [fn(*leaves) for leaves in zip(g_leaves, *columns)]
  return [jax.tree.unflatten(treedef, [o[i] for o in outs]) for i in range(n_out)]


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
    first = state.count == 0

    def leaf(g, p, buf):
      g = _prepare_grad(g, p, weight_decay, maximize, True)
      if buffered:
        m = _like(momentum, g)
        moved = m * buf + (1 - _like(dampening, g)) * g
        buf = jnp.where(m != 0, jnp.where(first, g, moved), buf)
        g = jnp.where(m != 0, g + m * buf if nesterov else buf, g)
      return -_like(learning_rate, g) * g, buf

    updates, buffers = _per_leaf(leaf, 2, grads, params,
                                 state.momentum_buffer if buffered else None)
    return updates, TorchSGDState(optax.safe_increment(state.count),
                                  buffers if buffered else ())

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

    def leaf(g, p, m, v, vmax):
      g = _prepare_grad(g, p, weight_decay, maximize, not decoupled)
      m = m + _like(c1, g) * (g - m)
      v = v * (1 - _like(c2, g)) + (_like(c2, g) * g) * g
      if amsgrad:
        vmax = jnp.maximum(vmax, v)
      denom = jnp.sqrt(vmax if amsgrad else v) / _like(bc2_sqrt, g) + _like(eps, g)
      update = (-_like(step_size, g) * m) / denom
      if decoupled:
        decayed = p.astype(g.dtype) * (1 - _like(learning_rate, g) * _like(weight_decay, g))
        update = (decayed + update) - p.astype(g.dtype)
      return update, m, v, vmax

    updates, m, v, vmax = _per_leaf(leaf, 4, grads, params, state.exp_avg, state.exp_avg_sq,
                                    state.max_exp_avg_sq if amsgrad else None)
    return updates, TorchAdamState(count, m, v, vmax if amsgrad else ())

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

    def leaf(g, p, sq, buf, ga):
      g = _prepare_grad(g, p, weight_decay, maximize, True)
      ca, lr = _like(one_minus_alpha, g), _like(learning_rate, g)
      sq = sq * (1 - ca) + (ca * g) * g
      if centered:
        ga = ga + ca * (g - ga)
        avg = jnp.sqrt(sq - ga * ga)
      else:
        avg = jnp.sqrt(sq)
      avg = avg + _like(eps, g)
      update = (-lr * g) / avg
      if buffered:
        m = _like(momentum, g)
        buf = jnp.where(m > 0, buf * m + g / avg, buf)
        update = jnp.where(m > 0, -lr * buf, update)
      return update, sq, buf, ga

    updates, sq, buf, ga = _per_leaf(leaf, 4, grads, params, state.square_avg,
                                     state.momentum_buffer if buffered else None,
                                     state.grad_avg if centered else None)
    return updates, TorchRMSpropState(optax.safe_increment(state.count), sq,
                                      buf if buffered else (), ga if centered else ())

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

    def leaf(g, p, s):
      g = _prepare_grad(g, p, weight_decay, maximize, True)
      s = s + g * g
      return (-_like(clr, g) * g) / (jnp.sqrt(s) + _like(eps, g)), s

    updates, sums = _per_leaf(leaf, 2, grads, params, state.state_sum)
    return updates, TorchAdagradState(count, sums)

  return optax.GradientTransformation(init_fn, update_fn)


# -------------------------------------------------------------------------------------------------
# Constructor arguments: PyTorch's names and defaults, validation, the injected transformation.
# -------------------------------------------------------------------------------------------------

_IGNORED = ("foreach", "differentiable", "fused", "capturable")

#: The dtype of the injected hyperparameters in the state.
STATE_DTYPE = jnp.dtype(jnp.float32)


# PyTorch's range checks of the arguments that must be >= 0, in the order they run, with the names
# its messages give them.
_NON_NEGATIVE = {"lr": "learning rate", "eps": "epsilon value", "momentum": "momentum value",
                 "weight_decay": "weight_decay value", "alpha": "alpha value",
                 "lr_decay": "lr_decay value",
                 "initial_accumulator_value": "initial_accumulator_value value"}


def _check(cfg: dict) -> None:
  """PyTorch's range checks of the resolved arguments of any of its optimizers (its messages)."""
  for key, label in _NON_NEGATIVE.items():
    if key in cfg and not 0.0 <= cfg[key]:
      raise ValueError(f"Invalid {label}: {cfg[key]}")
  if cfg.get("nesterov") and (cfg["momentum"] <= 0 or cfg["dampening"] != 0):
    raise ValueError("Nesterov momentum requires a momentum and zero dampening")
  for i, beta in enumerate(cfg.get("betas", ())):
    if not 0.0 <= beta < 1.0:
      raise ValueError(f"Invalid beta parameter at index {i}: {beta}")


def _betas(value: Any) -> Tuple[float, float]:
  if not isinstance(value, (tuple, list)) or len(value) != 2:
    raise TypeError(f"betas must be a pair of numbers, got {value!r}")
  return (validation.check_real("betas[0]", value[0]), validation.check_real("betas[1]", value[1]))


@dataclasses.dataclass(frozen=True)
class TorchOptimizer:
  """One PyTorch optimizer: its defaults, fixed (code-selecting) keys and factory.

  Attributes:
    name: PyTorch's class name (``'AdamW'``).
    defaults: PyTorch's constructor defaults, by argument name.
    fixed: the arguments that select code, fixed at construction.
    build: resolved arguments -> the injected optax transformation.
    codecs: resolved arguments -> how each settable hyperparameter is
      stored in the injected state.
  """

  name: str
  defaults: Dict[str, Any]
  fixed: Tuple[str, ...]
  build: Callable[[dict], optax.GradientTransformation]
  codecs: Callable[[dict], Dict[str, hp.HyperparamCodec]]

  @property
  def accepted(self) -> List[str]:
    """The accepted argument names (those PyTorch ignores here included)."""
    return sorted(list(self.defaults) + list(_IGNORED))

  def resolve(self, cfg: Mapping[str, Any]) -> dict:
    """PyTorch's defaults updated with ``cfg``, type-checked and range-checked.

    PyTorch's own checks (and messages) come first; then every value is
    checked as the state will hold it (:func:`.hyperparam_codecs.stored_values`):
    finite in float32 (PyTorch accepts ``lr=1e39``, an infinite float32, and
    ``dampening=nan``, which it never checks), in range once rounded.
    """
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
    _check(out)
    for key, codec in self.codecs(out).items():
      hp.stored_values(codec, out[key], [STATE_DTYPE] * len(codec.keys))
    if "initial_accumulator_value" in out:  # the accumulator's first value
      outside.hyperparam("initial_accumulator_value", out["initial_accumulator_value"])
    return out


def _sgd_build(c: dict) -> optax.GradientTransformation:
  return optax.inject_hyperparams(torch_sgd, hyperparam_dtype=STATE_DTYPE)(
      learning_rate=c["lr"], momentum=c["momentum"], dampening=c["dampening"],
      weight_decay=c["weight_decay"], nesterov=c["nesterov"], maximize=c["maximize"],
      buffered=c["momentum"] != 0)


def _sgd_codecs(c: dict) -> Dict[str, hp.HyperparamCodec]:
  codecs = {"lr": hp.identity_codec("learning_rate", "lr"),
            "dampening": hp.identity_codec("dampening"),
            "weight_decay": hp.identity_codec("weight_decay")}
  if c["momentum"] != 0:
    codecs["momentum"] = hp.identity_codec("momentum")
  return codecs


def _adam_build(decoupled: bool) -> Callable[[dict], optax.GradientTransformation]:
  def build(c: dict) -> optax.GradientTransformation:
    return optax.inject_hyperparams(torch_adam, hyperparam_dtype=STATE_DTYPE)(
        learning_rate=c["lr"], one_minus_b1=1.0 - c["betas"][0], one_minus_b2=1.0 - c["betas"][1],
        eps=c["eps"], weight_decay=c["weight_decay"], amsgrad=c["amsgrad"],
        maximize=c["maximize"], decoupled=decoupled or c.get("decoupled_weight_decay", False))

  return build


def _adam_codecs(c: dict) -> Dict[str, hp.HyperparamCodec]:
  del c
  return {"lr": hp.identity_codec("learning_rate", "lr"),
          "betas": hp.pair_codec(
              "betas", ("one_minus_b1", "one_minus_b2"), complement=True),
          "eps": hp.identity_codec("eps"),
          "weight_decay": hp.identity_codec("weight_decay")}


def _rmsprop_build(c: dict) -> optax.GradientTransformation:
  return optax.inject_hyperparams(torch_rmsprop, hyperparam_dtype=STATE_DTYPE)(
      learning_rate=c["lr"], one_minus_alpha=1.0 - c["alpha"], eps=c["eps"],
      weight_decay=c["weight_decay"], momentum=c["momentum"], centered=c["centered"],
      maximize=c["maximize"], buffered=c["momentum"] > 0)


def _rmsprop_codecs(c: dict) -> Dict[str, hp.HyperparamCodec]:
  codecs = {"lr": hp.identity_codec("learning_rate", "lr"),
            "alpha": hp.complement_codec("one_minus_alpha", "alpha"),
            "eps": hp.identity_codec("eps"),
            "weight_decay": hp.identity_codec("weight_decay")}
  if c["momentum"] > 0:
    codecs["momentum"] = hp.identity_codec("momentum")
  return codecs


def _adagrad_build(c: dict) -> optax.GradientTransformation:
  return optax.inject_hyperparams(torch_adagrad, static_args=("initial_accumulator_value",),
                                  hyperparam_dtype=STATE_DTYPE)(
      learning_rate=c["lr"], lr_decay=c["lr_decay"], weight_decay=c["weight_decay"],
      eps=c["eps"], initial_accumulator_value=c["initial_accumulator_value"],
      maximize=c["maximize"])


def _adagrad_codecs(c: dict) -> Dict[str, hp.HyperparamCodec]:
  del c
  return {"lr": hp.identity_codec("learning_rate", "lr"),
          "lr_decay": hp.identity_codec("lr_decay"),
          "weight_decay": hp.identity_codec("weight_decay"),
          "eps": hp.identity_codec("eps")}


_ADAM_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False,
                      maximize=False)

TORCH_OPTIMIZERS: Dict[str, TorchOptimizer] = {
    "SGD": TorchOptimizer(
        "SGD", dict(lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                    maximize=False),
        ("nesterov", "maximize"), _sgd_build, _sgd_codecs),
    "Adam": TorchOptimizer(
        "Adam", dict(_ADAM_DEFAULTS, decoupled_weight_decay=False),
        ("amsgrad", "maximize", "decoupled_weight_decay"), _adam_build(False), _adam_codecs),
    "AdamW": TorchOptimizer(
        "AdamW", dict(_ADAM_DEFAULTS, weight_decay=1e-2), ("amsgrad", "maximize"),
        _adam_build(True), _adam_codecs),
    "RMSprop": TorchOptimizer(
        "RMSprop", dict(lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0,
                        centered=False, maximize=False),
        ("centered", "maximize"), _rmsprop_build, _rmsprop_codecs),
    "Adagrad": TorchOptimizer(
        "Adagrad", dict(lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0,
                        eps=1e-10, maximize=False),
        ("initial_accumulator_value", "maximize"), _adagrad_build, _adagrad_codecs),
}

