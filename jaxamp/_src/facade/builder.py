"""``build_optim_wrapper``: mmengine-style config dicts to optimizer wrappers.

The optimizer comes from :mod:`.torch_optimizers` (PyTorch's names, rules
and checks) or from an optax factory given as the ``type``, built through
``optax.inject_hyperparams`` so that its hyperparameters can be read and set
(``get_lr()``, ``param_groups[i]['lr'] = ...``). ``paramwise_cfg`` splits
the parameters into groups over their pytree paths (mmengine's
``DefaultOptimWrapperConstructor`` rules, here) with ``optax.partition``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp._src import outside
from jaxamp._src import validation
from jaxamp._src.facade.errors import AssertionValueError
from jaxamp._src.facade.mmengine import trees
from jaxamp._src.facade.mmengine.amp_optim_wrapper import AmpOptimWrapper
from jaxamp._src.facade.mmengine.param_groups import GroupSpec
from jaxamp._src.facade.mmengine.optim_wrapper import OptimWrapper
from jaxamp._src.facade.mmengine.optim_wrapper import describe_groups
from jaxamp._src.facade.mmengine.optim_wrapper import install_group_specs
from jaxamp._src.facade.mmengine.optim_wrapper_dict import OptimWrapperDict
from jaxamp._src.facade.torch_optimizers import TORCH_OPTIMIZERS
from jaxamp._src.facade.torch_optimizers import TorchOptimizer
from jaxamp._src.low_precision import low_precision_params


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
      for key in ("lr_mult", "decay_mult"):
        if key in entry:
          outside.hyperparam(f"paramwise_cfg['custom_keys'][{name!r}][{key!r}]", entry[key],
                             key=key)
      if base_wd is None and "decay_mult" in entry:
        raise ValueError("base_wd should not be None")
  if base_wd is None and any(k in paramwise for k in ("bias_decay_mult", "norm_decay_mult",
                                                      "dwconv_decay_mult")):
    raise ValueError("base_wd should not be None")
  for key in ("bias_lr_mult", "bias_decay_mult", "norm_decay_mult", "dwconv_decay_mult",
              "flat_decay_mult", "dcn_offset_lr_mult"):
    if paramwise.get(key) is not None:
      outside.hyperparam(f"paramwise_cfg[{key!r}]", paramwise[key], key="lr_mult")
  return paramwise


def _hashable(value: Any) -> Any:
  if isinstance(value, (jax.Array, np.ndarray, np.generic)):
    array = np.asarray(value)
    return ("array", str(array.dtype), array.shape, array.tobytes())
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
  if base_lr is None:  # a multiplier would scale nothing: refused, as a missing base_wd is
    lr_mults = [f"['custom_keys'][{k!r}]['lr_mult']"
                for k, entry in paramwise.get("custom_keys", {}).items() if "lr_mult" in entry]
    if paramwise.get("bias_lr_mult") is not None:
      lr_mults.append("['bias_lr_mult']")
    if lr_mults:
      raise ValueError(f"paramwise_cfg{lr_mults[0]} scales the learning rate, but the optimizer "
                       f"config has no {lr_key!r}: give it explicitly")
  paths = jax.tree_util.tree_flatten_with_path(params)[0]
  modules: Dict[str, List[Tuple[str, Tuple[int, ...]]]] = {}
  infos = []
  for path, leaf in paths:
    parts = trees.path_parts(path)
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
    is_dwconv = _is_dwconv_module(modules[prefix])  # the top level too, as mmengine's root
    matched = next((k for k in sorted_keys if k in full), None)
    if matched is not None:
      entry = custom[matched]
      if base_lr is not None:
        group[lr_key] = base_lr * float(entry.get("lr_mult", 1.0))
      if base_wd is not None:
        group[wd_key] = base_wd * float(entry.get("decay_mult", 1.0))
      for k, v in entry.items():  # the optimizer's own names ('lr' is PyTorch's lr_key)
        group[k] = v
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
      return OptimWrapper
    if kind == "AmpOptimWrapper":
      return AmpOptimWrapper
  elif (isinstance(kind, type) and issubclass(kind, OptimWrapper)
        and not issubclass(kind, OptimWrapperDict)):
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
    return kind  # an optax factory: its arguments keep their optax names, it checks them
  raise ValueError(f"Unknown optimizer type {kind!r}; accepted: {sorted(TORCH_OPTIMIZERS)} or "
                   "an optax factory such as optax.adamw")


def _check_injected(cfg: Mapping[str, Any]) -> None:
  """The floating arguments of an optax factory, checked as ``inject_hyperparams`` stores them.

  A float is stored as a JAX array of its canonical dtype (a Python float as
  a float32 without ``jax_enable_x64``): it must be finite there, and in the
  range :data:`jaxamp._src.outside.RANGES` gives its name (``learning_rate``
  not negative, ``b1`` in ``[0, 1)``...), as a later write must.
  """
  for key, value in cfg.items():
    if isinstance(value, (bool, np.bool_)) or not (
        isinstance(value, float) or (validation.is_array(value) and np.ndim(value) == 0
                                     and jnp.issubdtype(jnp.result_type(value), jnp.floating))):
      continue  # schedules, masks, flags and integers: the factory checks them
    dtype = jax.dtypes.canonicalize_dtype(np.asarray(value).dtype)
    outside.hyperparam(key, value, dtype=dtype)


def _build_optimizer(params: Any, optimizer_cfg: Mapping[str, Any], paramwise_cfg: Any):
  """Returns ``(transformation, groups, defaults, torch_like)`` (groups: ``GroupSpec``s if torch_like)."""
  if not isinstance(optimizer_cfg, Mapping):
    raise TypeError(f"optimizer must be a config dict or an optax transformation, got "
                    f"{optimizer_cfg!r}")
  cfg = dict(optimizer_cfg)
  kind = _optimizer_kind(cfg)
  cfg.pop("type")
  kahan_sum = validation.check_bool("kahan_sum", cfg.pop("kahan_sum", False))
  if "params" in cfg:
    raise ValueError("The optimizer config must not contain 'params': the parameters are the "
                     "first argument of build_optim_wrapper")
  torch_like = isinstance(kind, TorchOptimizer)
  lr_key, wd_key = ("lr", "weight_decay") if torch_like else ("learning_rate", "weight_decay")
  base = kind.resolve(cfg) if torch_like else dict(cfg)
  base_lr = base.get(lr_key)
  base_wd = cfg.get(wd_key)  # mmengine: only an explicit weight_decay enables the decay rules
  hp_keys = list(kind.defaults) if torch_like else list(cfg)
  paramwise = _check_paramwise(
      paramwise_cfg, None if base_wd is None else validation.check_real(wd_key, base_wd), hp_keys)
  if paramwise:
    overrides, labels = paramwise_groups(
        params, paramwise, None if base_lr is None else float(base_lr),
        None if base_wd is None else float(base_wd), lr_key, wd_key)
  else:
    overrides, labels = [{}], [0] * len(jax.tree.leaves(params))
  names = trees.param_names(params)
  transforms: List[optax.GradientTransformation] = []
  specs: List[Any] = []  # GroupSpec (torch_like), else (names, extras, config)
  for index, override in enumerate(overrides):
    hp = {k: v for k, v in override.items() if k not in ("lr_mult", "decay_mult")}
    extras = {k: v for k, v in override.items() if k in ("lr_mult", "decay_mult")}
    group_cfg = kind.resolve(dict(cfg, **hp)) if torch_like else dict(cfg, **hp)
    if not torch_like:
      _check_injected(group_cfg)
    transforms.append(kind.build(group_cfg) if torch_like
                      else optax.inject_hyperparams(kind)(**group_cfg))
    group_names = [n for n, label in zip(names, labels) if label == index]
    if torch_like:
      codecs = kind.codecs(group_cfg)
      fixed = {k: group_cfg[k] for k in kind.defaults if k not in codecs}
      mirror = {k: group_cfg[k] for k in codecs}
      specs.append(GroupSpec(group_names, codecs, fixed, extras, mirror))
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
  if kahan_sum:  # optimi's option: bfloat16 parameters updated with Kahan summation
    tx = low_precision_params(tx, "kahan")
  defaults = base if torch_like else dict(cfg)
  return tx, specs, defaults, torch_like


def build_optim_wrapper(params: Any, cfg: Mapping[str, Any]) -> OptimWrapper:
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

  ``kahan_sum=True`` in the optimizer config (optimi's option, for any
  optimizer type) trains bfloat16 parameters without a float32 master copy:
  the optimizer is wrapped in ``jaxamp.low_precision_params(..., "kahan")``,
  so that updates smaller than bfloat16 can add to a parameter are kept in
  a compensation buffer instead of being lost. Unlike optimi it is off
  unless asked for; float32 parameters pass through it untouched.

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
    leaves. The top-level leaves form a module too (mmengine's root module:
    ``params`` may be a single depthwise convolution's).
  * *flat*: one-dimensional leaves; ``flat_decay_mult`` applies.
  * The decay rules are tried in mmengine's order (norm, bias, depthwise,
    flat) and need an explicit ``weight_decay`` in the optimizer config
    (``ValueError('base_wd should not be None')`` otherwise). Likewise
    ``bias_lr_mult`` and a custom key's ``lr_mult`` need the learning rate
    in the optimizer config (``ValueError`` otherwise): an optax factory's
    default ``learning_rate`` is not read.
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
    {'base_lr': [0.1], 'lr': [0.010000000000000002, 0.1, 0.1]}
    >>> [(g['params'], g['weight_decay']) for g in wrapper.optimizer.param_groups]
    [(['backbone.bias', 'backbone.kernel'], 0.0001), (['head.bias'], 0.0), (['head.kernel'], 0.0001)]
  """
  if not isinstance(cfg, Mapping):
    raise TypeError(f"optim_wrapper cfg should be a dict, but got {type(cfg)}")
  cfg = dict(cfg)
  constructor = cfg.pop("constructor", None)
  if constructor not in (None, "DefaultOptimWrapperConstructor"):
    # mmengine's registry raises KeyError for a name it does not hold.
    raise KeyError(f"Unknown constructor {constructor!r}; accepted: "
                   "['DefaultOptimWrapperConstructor']")
  if "optimizer" not in cfg:
    raise AssertionValueError('`optim_wrapper_cfg` must contain "optimizer" config')
  optimizer_cfg = cfg.pop("optimizer")
  paramwise_cfg = cfg.pop("paramwise_cfg", None)
  if paramwise_cfg is not None and not isinstance(paramwise_cfg, Mapping):
    # Checked first, as mmengine's constructor does (a TypeError before any optimizer error).
    raise TypeError(f"paramwise_cfg should be None or a dict, but got {type(paramwise_cfg)}")
  wrapper_cls = _wrapper_class(cfg.pop("type", "OptimWrapper"))
  accepted = (_WRAPPER_KEYS["AmpOptimWrapper"] if issubclass(wrapper_cls, AmpOptimWrapper)
              else _WRAPPER_KEYS["OptimWrapper"])
  unknown = sorted(set(cfg) - set(accepted))
  if unknown:
    raise TypeError(f"{wrapper_cls.__name__} got unexpected config keys {unknown}; accepted: "
                    f"{sorted(accepted)} and {list(_META_KEYS)}")
  if validation.is_gradient_transformation(optimizer_cfg):
    if paramwise_cfg:
      raise ValueError("paramwise_cfg needs the optimizer as a config dict (each group is built "
                       "with its own hyperparameters), got an optax transformation")
    return wrapper_cls(optimizer_cfg, params, **cfg)
  params = trees.check_params(params)
  tx, specs, defaults, torch_like = _build_optimizer(params, optimizer_cfg, paramwise_cfg)
  wrapper = wrapper_cls(tx, params, **cfg)
  if torch_like:
    install_group_specs(wrapper, specs, defaults)
  else:
    describe_groups(wrapper, [(names, extras) for names, extras, _ in specs])
  return wrapper
