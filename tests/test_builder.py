"""jaxamp.build_optim_wrapper: PyTorch's optimizers (against numpy references) and paramwise_cfg."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp._src.facade.mmengine import trees
from tests._tracing import trace_counts

RNG = np.random.default_rng(0)
PARAMS = {"a": RNG.normal(size=(3, 2)).astype(np.float32),
          "b": RNG.normal(size=4).astype(np.float32)}
GRADS = [{k: RNG.normal(size=v.shape).astype(np.float32) for k, v in PARAMS.items()}
         for _ in range(5)]


# -------------------------------------------------------------------------------------------------
# PyTorch's update rules, written out in float64 numpy.
# -------------------------------------------------------------------------------------------------


def ref_sgd(p, gs, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
            maximize=False):
  buf = None
  for g in gs:
    g = -g if maximize else g
    g = g + weight_decay * p
    if momentum != 0:
      buf = g.copy() if buf is None else momentum * buf + (1 - dampening) * g
      g = g + momentum * buf if nesterov else buf
    p = p - lr * g
  return p


def ref_adam(p, gs, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False,
             maximize=False, decoupled=False):
  b1, b2 = betas
  m = v = vmax = np.zeros_like(p)
  for t, g in enumerate(gs, start=1):
    g = -g if maximize else g
    if decoupled:
      p = p * (1 - lr * weight_decay)
    else:
      g = g + weight_decay * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    bc1, bc2 = 1 - b1**t, 1 - b2**t
    vmax = np.maximum(vmax, v)
    denom = np.sqrt(vmax if amsgrad else v) / np.sqrt(bc2) + eps
    p = p - lr / bc1 * m / denom
  return p


def ref_rmsprop(p, gs, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0,
                centered=False, maximize=False):
  sq = ga = buf = np.zeros_like(p)
  for g in gs:
    g = -g if maximize else g
    g = g + weight_decay * p
    sq = alpha * sq + (1 - alpha) * g * g
    if centered:
      ga = alpha * ga + (1 - alpha) * g
      avg = np.sqrt(sq - ga * ga) + eps
    else:
      avg = np.sqrt(sq) + eps
    if momentum > 0:
      buf = momentum * buf + g / avg
      p = p - lr * buf
    else:
      p = p - lr * g / avg
  return p


def ref_adagrad(p, gs, lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0,
                eps=1e-10, maximize=False):
  s = np.full_like(p, initial_accumulator_value)
  for t, g in enumerate(gs, start=1):
    g = -g if maximize else g
    g = g + weight_decay * p
    clr = lr / (1 + (t - 1) * lr_decay)
    s = s + g * g
    p = p - clr * g / (np.sqrt(s) + eps)
  return p


REFS = {"SGD": ref_sgd, "Adam": lambda p, gs, decoupled_weight_decay=False, **kw: ref_adam(
    p, gs, **kw, decoupled=decoupled_weight_decay), "AdamW": lambda p, gs, **kw: ref_adam(
    p, gs, **dict(dict(weight_decay=1e-2), **kw), decoupled=True),
        "RMSprop": ref_rmsprop, "Adagrad": ref_adagrad}


@pytest.mark.parametrize("cfg", [
    dict(type="SGD", lr=0.1),
    dict(type="SGD", lr=0.1, momentum=0.9, weight_decay=1e-2),
    dict(type="SGD", lr=0.05, momentum=0.9, dampening=0.3, maximize=True),
    dict(type="SGD", lr=0.05, momentum=0.8, nesterov=True, weight_decay=1e-3),
    dict(type="SGD", lr=0.01, momentum=1.0),
    dict(type="SGD", lr=0.01, weight_decay=1.0),
    dict(type="Adam", lr=0.01),
    dict(type="Adam", lr=0.01, betas=(0.8, 0.99), weight_decay=0.1, amsgrad=True),
    dict(type="Adam", lr=0.01, weight_decay=0.1, maximize=True),
    dict(type="Adam", lr=0.01, betas=(0.0, 0.999)),
    dict(type="Adam", lr=0.01, weight_decay=0.5, decoupled_weight_decay=True),
    dict(type="AdamW", lr=0.01),
    dict(type="AdamW", lr=0.01, weight_decay=0.5, amsgrad=True, eps=1e-6),
    dict(type="RMSprop", lr=0.01),
    dict(type="RMSprop", lr=0.01, alpha=0.9, weight_decay=0.1, momentum=0.5, centered=True),
    dict(type="RMSprop", lr=0.01, weight_decay=0.1, maximize=True),
    dict(type="Adagrad", lr=0.1),
    dict(type="Adagrad", lr=0.1, eps=0.5),
    dict(type="Adagrad", lr=0.1, lr_decay=0.1, weight_decay=0.01, initial_accumulator_value=0.5,
         maximize=True),
])
def test_optimizers_follow_pytorch(cfg):
  wrapper = jaxamp.build_optim_wrapper(PARAMS, dict(optimizer=cfg))
  for g in GRADS:
    wrapper.apply_gradients({k: jnp.asarray(v) for k, v in g.items()})
  kw = {k: v for k, v in cfg.items() if k != "type"}
  for key, p in PARAMS.items():
    expected = REFS[cfg["type"]](p.astype(np.float64), [g[key].astype(np.float64) for g in GRADS],
                                 **kw)
    np.testing.assert_allclose(wrapper.params[key], expected, rtol=2e-6, atol=2e-7)
  assert trace_counts(wrapper) == {"apply": 1}


def test_pytorchs_performance_switches_are_ignored_and_the_keys_after_them_still_apply():
  wrapper = jaxamp.build_optim_wrapper(PARAMS, dict(
      optimizer=dict(type="SGD", foreach=True, lr=0.5, fused=False, momentum=0.9)))
  assert wrapper.get_lr() == {"lr": [0.5]}
  assert wrapper.get_momentum() == {"momentum": [0.9]}


def test_defaults_hyperparameters_and_set_lr_without_recompiling():
  wrapper = jaxamp.build_optim_wrapper(PARAMS, dict(optimizer=dict(type="AdamW", lr=3e-4)))
  assert wrapper.defaults == dict(lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                                  amsgrad=False, maximize=False)
  assert wrapper.get_lr() == {"lr": [3e-4]}
  assert wrapper.get_momentum() == {"momentum": [0.9]}
  group = wrapper.param_groups[0]
  assert group["betas"] == (0.9, 0.999) and group["amsgrad"] is False
  wrapper.apply_gradients({k: jnp.asarray(v) for k, v in GRADS[0].items()})
  group["lr"] = 0.1 * 0.1
  group["betas"] = (0.5, 0.9)
  assert wrapper.get_lr() == {"lr": [0.010000000000000002]}  # the Python value that was set
  assert wrapper.get_momentum() == {"momentum": [0.5]}
  wrapper.apply_gradients({k: jnp.asarray(v) for k, v in GRADS[1].items()})
  assert trace_counts(wrapper) == {"apply": 1}
  with pytest.raises(ValueError, match="fixed at construction"):
    group["amsgrad"] = True
  sgd = jaxamp.build_optim_wrapper(PARAMS, dict(optimizer=dict(type="SGD", lr=0.1)))
  assert sgd.get_momentum() == {"momentum": [0.0]}
  with pytest.raises(ValueError, match="fixed at construction"):
    sgd.param_groups[0]["momentum"] = 0.9  # no momentum buffers were built


def _sgd_with_default_lr(learning_rate=0.1):
  return optax.sgd(learning_rate)


@pytest.mark.parametrize("cfg,err,match", [
    (dict(optimizer=dict(type="Lamb")), ValueError, r"Unknown optimizer type 'Lamb'; accepted: "
     r"\['Adagrad', 'Adam', 'AdamW', 'RMSprop', 'SGD'\]"),
    (dict(optimizer=dict(lr=0.1)), ValueError, "needs a 'type'"),
    (dict(optimizer=dict(type="SGD", lr=0.1, betas=(0.9, 0.9))), TypeError,
     "SGD.__init__\\(\\) got an unexpected keyword argument 'betas'"),
    (dict(optimizer=dict(type="SGD", lr=-1.0)), ValueError, "Invalid learning rate: -1.0"),
    (dict(optimizer=dict(type="SGD", lr=0.1, nesterov=True)), ValueError,
     "Nesterov momentum requires a momentum and zero dampening"),
    (dict(optimizer=dict(type="Adam", betas=(0.9, 1.0))), ValueError,
     "Invalid beta parameter at index 1: 1.0"),
    (dict(optimizer=dict(type="Adam", eps=-1.0)), ValueError, "Invalid epsilon value: -1.0"),
    (dict(optimizer=dict(type="Adam", betas=("x", 0.9))), TypeError,
     r"^betas\[0\] must be a real number"),
    (dict(optimizer=dict(type="Adam", betas=(0.9, "y"))), TypeError,
     r"^betas\[1\] must be a real number"),
    (dict(optimizer=dict(type="Adam", betas=(0.9, 0.99, 0.5))), TypeError,
     "betas must be a pair of numbers"),
    (dict(optimizer=dict(type="Adagrad", initial_accumulator_value="x")), TypeError,
     "^initial_accumulator_value must be a real number"),
    (dict(optimizer=dict(type="Adam", amsgrad="yes")), TypeError, "^amsgrad must be a bool"),
    (dict(optimizer=dict(type="RMSprop", alpha=-0.1)), ValueError, "Invalid alpha value: -0.1"),
    (dict(optimizer=dict(type="Adagrad", lr_decay=-1.0)), ValueError, "Invalid lr_decay value"),
    (dict(optimizer=dict(type="SGD", lr=0.1, weight_decay=-1.0)), ValueError,
     "Invalid weight_decay value: -1.0"),
    (dict(type="FooWrapper", optimizer=dict(type="SGD")), ValueError,
     r"Unknown optim wrapper type 'FooWrapper'; accepted: \['AmpOptimWrapper', 'OptimWrapper'\]"),
    (dict(optimizer=dict(type="SGD"), loss_scale="dynamic"), TypeError,
     "OptimWrapper got unexpected config keys \\['loss_scale'\\]"),
    (dict(type="OptimWrapper"), AssertionError, 'must contain "optimizer" config'),
    (dict(optimizer=optax.sgd(0.1), paramwise_cfg=dict(bias_lr_mult=2.0)), ValueError,
     "config dict"),
    (dict(optimizer=dict(type="SGD", lr=0.1), paramwise_cfg=dict(bias_decay_mult=0.0)),
     ValueError, "base_wd should not be None"),
    (dict(optimizer=dict(type="SGD", lr=0.1),
          paramwise_cfg=dict(custom_keys={"a": dict(decay_mult=0.0)})),
     ValueError, "base_wd should not be None"),
    (dict(optimizer=dict(type="SGD", lr=0.1), paramwise_cfg=dict(bias_mult=2.0)), ValueError,
     "Unknown paramwise_cfg key 'bias_mult'; accepted"),
    (dict(optimizer=dict(type="SGD", lr=0.1), paramwise_cfg=dict(custom_keys=[1])), TypeError,
     "custom_keys must be a dict"),
    (dict(optimizer=dict(type="SGD", lr=0.1),
          paramwise_cfg=dict(custom_keys={"a": dict(lr_mul=2.0)})), ValueError,
     "Unknown key 'lr_mul' in custom_keys\\['a'\\]"),
    (dict(optimizer=dict(type="SGD", lr=0.1), paramwise_cfg=[1]), TypeError,
     "paramwise_cfg should be None or a dict"),
    (dict(optimizer=dict(type="SGD"), constructor="MyConstructor"), KeyError,
     "Unknown constructor"),
    # Doubly invalid: mmengine checks paramwise_cfg before the optimizer (a TypeError).
    (dict(optimizer=dict(lr=0.1), paramwise_cfg=["error"]), TypeError,
     "paramwise_cfg should be None or a dict"),
    (dict(optimizer=dict(type="SGD", lr=0.1, kahan_sum=1)), TypeError,
     "^kahan_sum must be a bool, got 1$"),
    (dict(optimizer=dict(type="SGD", lr=0.1, params=["a"])), ValueError,
     "must not contain 'params'"),
    # An optax factory does not check weight_decay before it is used to scale the groups.
    (dict(optimizer=dict(type=optax.adamw, learning_rate=0.1, weight_decay="0.1")), TypeError,
     "^weight_decay must be a real number, got '0.1' of type str$"),
    # mmengine: every decay multiplier (custom keys' too) needs an explicit weight_decay.
    (dict(optimizer=dict(type="SGD", lr=0.1), paramwise_cfg=dict(norm_decay_mult=0.0)),
     ValueError, "base_wd should not be None"),
    (dict(optimizer=dict(type="SGD", lr=0.1), paramwise_cfg=dict(dwconv_decay_mult=0.0)),
     ValueError, "base_wd should not be None"),
    # Multipliers are refused at once, by their key, rather than as a group's bad lr later.
    (dict(optimizer=dict(type="SGD", lr=0.1),
          paramwise_cfg=dict(custom_keys={"a": dict(lr_mult=-1.0)})), ValueError,
     r"^paramwise_cfg\['custom_keys'\]\['a'\]\['lr_mult'\] must be a finite number >= 0, "
     r"got -1.0$"),
    (dict(optimizer=dict(type="SGD", lr=0.1, weight_decay=0.01),
          paramwise_cfg=dict(custom_keys={"a": dict(decay_mult=-1.0)})), ValueError,
     r"^paramwise_cfg\['custom_keys'\]\['a'\]\['decay_mult'\] must be a finite number >= 0, "
     r"got -1.0$"),
    (dict(optimizer=dict(type="SGD", lr=0.1),
          paramwise_cfg=dict(custom_keys={"a": dict(lr_mult="2")})), TypeError,
     r"^paramwise_cfg\['custom_keys'\]\['a'\]\['lr_mult'\] must be a real number"),
    *[(dict(optimizer=dict(type="SGD", lr=0.1, weight_decay=0.01), paramwise_cfg={key: -1.0}),
       ValueError, rf"^paramwise_cfg\['{key}'\] must be a finite number >= 0, got -1.0$")
      for key in ("bias_lr_mult", "bias_decay_mult", "norm_decay_mult", "dwconv_decay_mult",
                  "flat_decay_mult")],
    (dict(optimizer=dict(type="SGD", lr=0.1), paramwise_cfg=dict(bias_lr_mult=float("nan"))),
     ValueError, r"^paramwise_cfg\['bias_lr_mult'\] must be a finite number, got nan$"),
    # Only wrapper classes (not OptimWrapperDict, which holds several) are wrapper types.
    (dict(type=jaxamp.OptimWrapperDict, optimizer=dict(type="SGD")), ValueError,
     "Unknown optim wrapper type"),
    (dict(type=dict, optimizer=dict(type="SGD")), ValueError, "Unknown optim wrapper type"),
    (dict(type=3, optimizer=dict(type="SGD")), ValueError, "Unknown optim wrapper type 3"),
    # A factory whose learning rate has a default: a multiplier would scale nothing, silently.
    (dict(optimizer=dict(type=_sgd_with_default_lr),
          paramwise_cfg=dict(custom_keys={"a": dict(lr_mult=0.1)})), ValueError,
     r"^paramwise_cfg\['custom_keys'\]\['a'\]\['lr_mult'\] scales the learning rate, but the "
     r"optimizer config has no 'learning_rate'"),
    (dict(optimizer=dict(type=_sgd_with_default_lr), paramwise_cfg=dict(bias_lr_mult=2.0)),
     ValueError, r"^paramwise_cfg\['bias_lr_mult'\] scales the learning rate, but the optimizer "
     r"config has no 'learning_rate'"),
])
def test_config_errors(cfg, err, match):
  original = copy.deepcopy(cfg)
  with pytest.raises(err, match=match):
    jaxamp.build_optim_wrapper(PARAMS, cfg)
  if not any(callable(getattr(v, "init", None)) for v in cfg.values()):
    assert cfg == original


# -------------------------------------------------------------------------------------------------
# paramwise_cfg
# -------------------------------------------------------------------------------------------------


MODEL = {
    "backbone": {"conv": {"kernel": jnp.ones((3, 3, 1, 4)), "bias": jnp.ones(4)},
                 "LayerNorm_0": {"scale": jnp.ones(4), "bias": jnp.ones(4)},
                 "dense": {"kernel": jnp.ones((4, 4)), "bias": jnp.ones(4)}},
    "head": {"dense": {"kernel": jnp.ones((4, 2)), "bias": jnp.ones(2)},
             "bn1": {"scale": jnp.ones(2), "bias": jnp.ones(2)}},
    "pos": jnp.ones(3),
}
PARAMWISE = dict(norm_decay_mult=0.0, bias_decay_mult=0.5, dwconv_decay_mult=0.2,
                 flat_decay_mult=0.3, bias_lr_mult=2.0,
                 custom_keys={"head": dict(lr_mult=0.1), "head.dense": dict(lr_mult=0.5,
                                                                              momentum=0.5)})
# leaf -> (lr, weight_decay, momentum)
EXPECTED = {
    "backbone.conv.kernel": (0.1, 0.01 * 0.2, 0.9),        # depthwise (HWIO, 1 input per group)
    "backbone.conv.bias": (0.2, 0.01 * 0.5, 0.9),          # bias rules come before depthwise
    "backbone.LayerNorm_0.scale": (0.1, 0.0, 0.9),         # norm
    "backbone.LayerNorm_0.bias": (0.1, 0.0, 0.9),          # norm: no bias_lr_mult
    "backbone.dense.kernel": (0.1, 0.01, 0.9),
    "backbone.dense.bias": (0.2, 0.01 * 0.5, 0.9),
    "head.dense.kernel": (0.05, 0.01, 0.5),                # the longest custom key wins
    "head.dense.bias": (0.05, 0.01, 0.5),
    "head.bn1.scale": (0.1 * 0.1, 0.01, 0.9),              # custom keys override the norm rule
    "head.bn1.bias": (0.1 * 0.1, 0.01, 0.9),
    "pos": (0.1, 0.01 * 0.3, 0.9),                         # flat
}


def test_paramwise_rules_and_groups():
  wrapper = jaxamp.build_optim_wrapper(MODEL, dict(
      optimizer=dict(type="SGD", lr=0.1, momentum=0.9, weight_decay=0.01),
      paramwise_cfg=PARAMWISE))
  seen = {}
  for group in wrapper.param_groups:
    for name in group["params"]:
      seen[name] = (group["lr"], group["weight_decay"], group["momentum"])
  assert seen.keys() == EXPECTED.keys()
  for name, values in EXPECTED.items():
    assert seen[name] == pytest.approx(values), name
  groups = wrapper.optimizer.param_groups
  assert len(groups) == len(set(EXPECTED.values()))
  assert [g["lr"] for g in groups] == wrapper.get_lr()["lr"]
  head = next(g for g in groups if "head.dense.kernel" in g["params"])
  assert head["lr_mult"] == 0.5 and head["momentum"] == 0.5
  # One step of SGD (the first momentum step is the gradient itself): p - lr * (g + wd * p).
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), MODEL)
  wrapper.apply_gradients(grads)
  names = trees.param_names(MODEL)
  for name, p in zip(names, jax.tree.leaves(wrapper.params)):
    lr, wd, _ = EXPECTED[name]
    np.testing.assert_allclose(p, 1.0 - lr * (0.5 + wd), rtol=1e-6, err_msg=name)


def test_paramwise_round_trip_and_lr_schedule():
  cfg = dict(optimizer=dict(type="SGD", lr=0.1, momentum=0.9, weight_decay=0.01),
             paramwise_cfg=PARAMWISE)
  a = jaxamp.build_optim_wrapper(MODEL, cfg)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), MODEL)
  a.apply_gradients(grads)
  for group in a.param_groups:  # what an mmengine LR scheduler does
    group["lr"] = group["lr"] * 0.5
  saved = a.state_dict()
  b = jaxamp.build_optim_wrapper(MODEL, cfg)
  b.load_state_dict(saved)
  assert b.get_lr() == a.get_lr()
  b.params = a.params
  a.apply_gradients(grads)
  b.apply_gradients(grads)
  jax.tree.map(np.testing.assert_array_equal, a.params, b.params)
  assert trace_counts(a) == {"apply": 1}


def test_top_level_leaves_and_optax_factory_type():
  params = {"w": jnp.ones(2), "bias": jnp.ones(2)}
  # mmengine matches custom keys against '<module>.<leaf>', which is '.w' at the top level.
  wrapper = jaxamp.build_optim_wrapper(params, dict(
      optimizer=dict(type=optax.sgd, learning_rate=0.1),
      paramwise_cfg=dict(bias_lr_mult=3.0, custom_keys={".w": dict(lr_mult=0.5)})))
  lrs = {n: g["lr"] for g in wrapper.param_groups for n in g["params"]}
  assert lrs == {"bias": pytest.approx(0.3), "w": pytest.approx(0.05)}
  wrapper.apply_gradients({"w": jnp.ones(2), "bias": jnp.ones(2)})
  np.testing.assert_allclose(wrapper.params["w"], 0.95, rtol=1e-6)
  np.testing.assert_allclose(wrapper.params["bias"], 0.7, rtol=1e-6)


def test_amp_from_config_with_flax_nnx_state():
  nnx = pytest.importorskip("flax.nnx")

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.backbone = nnx.Linear(4, 8, rngs=rngs)
      self.norm = nnx.LayerNorm(8, rngs=rngs)
      self.head = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
      return self.head(jax.nn.relu(self.norm(self.backbone(x))))

  graphdef, state = nnx.split(Net(nnx.Rngs(0)), nnx.Param)
  cfg = dict(type="AmpOptimWrapper", optimizer=dict(type="AdamW", lr=1e-2, weight_decay=0.05),
             clip_grad=dict(max_norm=1.0), accumulative_counts=2, loss_scale="dynamic",
             dtype="bfloat16",
             paramwise_cfg=dict(norm_decay_mult=0.0, bias_decay_mult=0.0,
                                custom_keys={"backbone": dict(lr_mult=0.1)}))
  wrapper = jaxamp.build_optim_wrapper(state, cfg)
  assert isinstance(wrapper, jaxamp.AmpOptimWrapper)
  groups = {n: (g["lr"], g["weight_decay"]) for g in wrapper.param_groups for n in g["params"]}
  assert groups == {"backbone.bias": (pytest.approx(1e-3), 0.05),
                    "backbone.kernel": (pytest.approx(1e-3), 0.05),
                    "head.bias": (0.01, 0.0), "head.kernel": (0.01, 0.05),
                    "norm.bias": (0.01, 0.0), "norm.scale": (0.01, 0.0)}

  def loss_fn(params, x, y):
    model = nnx.merge(graphdef, params)
    return jnp.mean((model(x)[:, 0] - y) ** 2)

  x = jnp.asarray(RNG.normal(size=(16, 4)), jnp.float32)
  y = jnp.sum(x, axis=1)
  with jax.numpy_dtype_promotion("standard"):  # flax's LayerNorm mixes bfloat16 and float32
    first = float(loss_fn(state, x, y))
    for _ in range(20):
      wrapper.update_params(loss_fn, x, y)
    assert float(loss_fn(wrapper.params, x, y)) < first
  assert jax.tree.leaves(wrapper.params)[0].dtype == jnp.float32
  assert dict(trace_counts(wrapper)) == {"grad": 1, "fused_acc": 1}


def test_donate_is_accepted_in_the_config():
  params = {"w": jnp.ones((2,), jnp.float32)}
  for kind in ("OptimWrapper", "AmpOptimWrapper"):
    wrapper = jaxamp.build_optim_wrapper(
        params, dict(type=kind, optimizer=dict(type="SGD", lr=0.1), donate=True))
    assert wrapper.donate
  default = jaxamp.build_optim_wrapper(params, dict(optimizer=dict(type="SGD", lr=0.1)))
  assert not default.donate


def test_custom_keys_decay_mult_and_extra_hyperparameters_as_mmengine():
  params = {"body": {"kernel": jnp.ones((2, 2))}, "head": {"kernel": jnp.ones((2, 2))},
            "neck": {"kernel": jnp.ones((2, 2))}}
  wrapper = jaxamp.build_optim_wrapper(params, dict(
      optimizer=dict(type="SGD", lr=0.1, weight_decay=0.01),
      paramwise_cfg=dict(custom_keys={"head": dict(decay_mult=0.5, momentum=0.9),
                                      "neck": dict(lr_mult=0.1)})))
  groups = {n: g for g in wrapper.optimizer.param_groups for n in g["params"]}
  # mmengine: lr = base_lr * lr_mult (1 when absent), weight_decay = base_wd * decay_mult (1 when
  # absent), and every entry of the custom key is copied into the group; the values are the
  # Python products, as PyTorch keeps them.
  assert groups["head.kernel"]["lr"] == 0.1
  assert groups["head.kernel"]["weight_decay"] == 0.01 * 0.5
  assert groups["head.kernel"]["decay_mult"] == 0.5 and groups["head.kernel"]["momentum"] == 0.9
  assert groups["neck.kernel"]["lr"] == 0.1 * 0.1 and groups["neck.kernel"]["weight_decay"] == 0.01
  assert groups["body.kernel"]["momentum"] == 0.0  # the optimizer's default, not set in the cfg
  grads = jax.tree.map(jnp.ones_like, params)
  for _ in range(2):
    wrapper.apply_gradients(grads)
  expected = {"body": ref_sgd(np.ones((2, 2)), [np.ones((2, 2))] * 2, lr=0.1, weight_decay=0.01),
              "head": ref_sgd(np.ones((2, 2)), [np.ones((2, 2))] * 2, lr=0.1, weight_decay=0.005,
                              momentum=0.9),
              "neck": ref_sgd(np.ones((2, 2)), [np.ones((2, 2))] * 2, lr=0.01,
                              weight_decay=0.01)}
  for name, p in expected.items():
    np.testing.assert_allclose(wrapper.params[name]["kernel"], p, rtol=1e-6, err_msg=name)


def test_custom_keys_with_array_or_tuple_values_keep_their_own_groups():
  params = {k: {"kernel": jnp.ones((2, 2))} for k in ("a", "b", "c", "d", "e")}
  # Numpy scalars of equal value share a group; of different values they do not, even with
  # equal bits (an int32 1 and the float32 of the same bits, 1.4e-45).
  momenta = {"a": np.float32(0.5), "b": np.float32(0.8), "c": np.float32(0.8),
             "d": np.int32(1), "e": np.int32(1).view(np.float32)}
  wrapper = jaxamp.build_optim_wrapper(params, dict(
      optimizer=dict(type="SGD", lr=0.1, momentum=0.1),
      paramwise_cfg=dict(custom_keys={k: dict(momentum=m) for k, m in momenta.items()})))
  groups = wrapper.optimizer.param_groups
  assert [g["params"] for g in groups] == [["a.kernel"], ["b.kernel", "c.kernel"], ["d.kernel"],
                                           ["e.kernel"]]
  by_name = {n: g for g in groups for n in g["params"]}
  for name, m in momenta.items():
    assert by_name[f"{name}.kernel"]["momentum"] == pytest.approx(float(m), rel=1e-6), name
  # Tuples (Adam's betas) likewise.
  betas = {"a": (0.5, 0.9), "b": (0.8, 0.99), "c": (0.8, 0.99)}
  adam = jaxamp.build_optim_wrapper({k: params[k] for k in betas}, dict(
      optimizer=dict(type="Adam", lr=0.1),
      paramwise_cfg=dict(custom_keys={k: dict(betas=b) for k, b in betas.items()})))
  assert [(g["params"], g["betas"]) for g in adam.optimizer.param_groups] == [
      (["a.kernel"], (0.5, 0.9)), (["b.kernel", "c.kernel"], (0.8, 0.99))]


def test_kahan_sum_keeps_the_updates_that_bfloat16_parameters_lose():
  # Under standard promotion: PyTorch's SGD, as optax's, adds a float32 lr times bfloat16 grads.
  with jax.numpy_dtype_promotion("standard"):
    params = {"w": jnp.ones(16, jnp.bfloat16)}
    grads = {"w": jnp.ones(16, jnp.bfloat16)}
    lr, steps = 5e-4, 8  # each step is below half a bfloat16 spacing at 1.0 (2**-9)
    runs = {}
    for kahan in (None, False, True):
      optimizer = dict(type="SGD", lr=lr) if kahan is None else dict(type="SGD", lr=lr,
                                                                      kahan_sum=kahan)
      wrapper = jaxamp.build_optim_wrapper(params, dict(optimizer=optimizer))
      for _ in range(steps):
        wrapper.apply_gradients(grads)
      assert wrapper.params["w"].dtype == jnp.bfloat16
      runs[kahan] = np.asarray(wrapper.params["w"], np.float32)
    # Off by default: the run of plain optax on bfloat16 parameters, where every step is lost.
    tx, p = optax.sgd(lr), params
    state = tx.init(p)
    for _ in range(steps):
      updates, state = tx.update(grads, state, p)
      p = optax.apply_updates(p, updates)
    for kahan in (None, False):
      np.testing.assert_array_equal(runs[kahan], np.asarray(p["w"], np.float32))
    assert (runs[None] == 1.0).all()
    # On: the nearest bfloat16 to the float32 sum of the updates, as with a float32 master copy.
    master = np.float32(1.0)
    for _ in range(steps):
      master = np.float32(master - np.float32(lr))
    np.testing.assert_array_equal(runs[True], np.float32(jnp.asarray(master, jnp.bfloat16)))
    assert (runs[True] < 1.0).all()


class _MyWrapper(jaxamp.OptimWrapper):
  pass


class _MyAmpWrapper(jaxamp.AmpOptimWrapper):
  pass


def test_a_wrapper_subclass_as_the_type():
  params = {"w": jnp.ones(2)}
  wrapper = jaxamp.build_optim_wrapper(params, dict(type=_MyWrapper,
                                                    optimizer=dict(type="SGD", lr=0.1)))
  assert type(wrapper) is _MyWrapper
  amp = jaxamp.build_optim_wrapper(params, dict(type=_MyAmpWrapper, loss_scale=8.0,
                                                optimizer=dict(type="SGD", lr=0.1)))
  assert type(amp) is _MyAmpWrapper and amp.get_scale() == 8.0
  with pytest.raises(TypeError, match=r"_MyWrapper got unexpected config keys \['loss_scale'\]"):
    jaxamp.build_optim_wrapper(params, dict(type=_MyWrapper, loss_scale=8.0,
                                            optimizer=dict(type="SGD", lr=0.1)))


def test_an_optax_transformation_as_the_optimizer_with_wrapper_arguments():
  params = {"w": jnp.asarray([1.0, 2.0])}
  wrapper = jaxamp.build_optim_wrapper(params, dict(optimizer=optax.sgd(0.1),
                                                    accumulative_counts=2))

  def loss_fn(p, x):
    return jnp.sum(p["w"] * x)

  xs = [jnp.asarray([1.0, -1.0]), jnp.asarray([3.0, 1.0])]
  wrapper.update_params(loss_fn, xs[0])
  np.testing.assert_array_equal(wrapper.params["w"], params["w"])  # accumulating
  wrapper.update_params(loss_fn, xs[1])
  # mmengine divides each micro-batch's loss by accumulative_counts: one optax.sgd step on the
  # mean gradient.
  np.testing.assert_allclose(wrapper.params["w"], [1.0 - 0.1 * 2.0, 2.0 - 0.1 * 0.0], rtol=1e-6)


def test_optax_factory_decay_rules_against_plain_optax():
  params = {"dense": {"kernel": jnp.full((2, 2), 2.0), "bias": jnp.full(2, 2.0)}}
  grads = {"dense": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}}
  paramwise = dict(bias_decay_mult=0.5)
  labels = {"dense": {"kernel": "k", "bias": "b"}}
  cases = [  # a factory with a learning rate, and one without (decay alone)
      (dict(type=optax.adamw, learning_rate=0.1, weight_decay=0.2),
       {"k": optax.adamw(0.1, weight_decay=0.2), "b": optax.adamw(0.1, weight_decay=0.1)}),
      (dict(type=optax.add_decayed_weights, weight_decay=0.2),
       {"k": optax.add_decayed_weights(0.2), "b": optax.add_decayed_weights(0.1)}),
  ]
  for optimizer, plain in cases:
    wrapper = jaxamp.build_optim_wrapper(params, dict(optimizer=optimizer,
                                                      paramwise_cfg=paramwise))
    groups = {n: g for g in wrapper.optimizer.param_groups for n in g["params"]}
    assert groups["dense.kernel"]["weight_decay"] == pytest.approx(0.2)
    assert groups["dense.bias"]["weight_decay"] == pytest.approx(0.1)
    tx = optax.partition(plain, labels)
    with jax.numpy_dtype_promotion("standard"):  # optax's adamw mixes an int32 count
      wrapper.apply_gradients(grads)
      updates, _ = tx.update(grads, tx.init(params), params)
    expected = optax.apply_updates(params, updates)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), wrapper.params,
                 expected)


def test_a_two_dimensional_leaf_is_never_a_norm_parameter():
  params = {"LayerNorm_0": {"scale": jnp.ones(2), "bias": jnp.ones(2)},
            "norm_proj": {"kernel": jnp.ones((2, 2))}}  # a Dense named after what it feeds
  wrapper = jaxamp.build_optim_wrapper(params, dict(
      optimizer=dict(type="SGD", lr=0.1, weight_decay=0.01),
      paramwise_cfg=dict(norm_decay_mult=0.0)))
  decay = {n: g["weight_decay"] for g in wrapper.optimizer.param_groups for n in g["params"]}
  assert decay == {"LayerNorm_0.scale": 0.0, "LayerNorm_0.bias": 0.0, "norm_proj.kernel": 0.01}


def test_a_bare_depthwise_convolution_at_the_top_level():
  # mmengine's root module is a depthwise Conv2d: dwconv_decay_mult applies to its leaves, as it
  # does to the same convolution one level down.
  cfg = dict(optimizer=dict(type="SGD", lr=0.1, weight_decay=0.01),
             paramwise_cfg=dict(dwconv_decay_mult=0.5))
  for conv in ({"kernel": jnp.ones((3, 3, 1, 4)), "bias": jnp.ones(4)},  # Flax HWIO
               {"weight": jnp.ones((4, 1, 3, 3)), "bias": jnp.ones(4)}):  # PyTorch OIHW
    for params, prefix in ((conv, ""), ({"conv": conv}, "conv.")):
      wrapper = jaxamp.build_optim_wrapper(params, cfg)
      decay = {n: g["weight_decay"] for g in wrapper.optimizer.param_groups for n in g["params"]}
      assert decay == {prefix + name: 0.01 * 0.5 for name in conv}, decay
  # A top level holding a dense kernel is no depthwise convolution.
  wrapper = jaxamp.build_optim_wrapper({"kernel": jnp.ones((4, 4)), "bias": jnp.ones(4)}, cfg)
  assert [g["weight_decay"] for g in wrapper.optimizer.param_groups] == [0.01]


def _sgd_with_lr(lr, momentum=0.0):
  return optax.sgd(lr, momentum)


def test_custom_keys_set_an_optax_factorys_own_arguments():
  params = {"a": jnp.ones(2), "b": jnp.ones(2)}
  wrapper = jaxamp.build_optim_wrapper(params, dict(
      optimizer=dict(type=_sgd_with_lr, lr=0.1),
      paramwise_cfg=dict(custom_keys={".a": dict(lr=0.5)})))
  wrapper.apply_gradients({"a": jnp.ones(2), "b": jnp.ones(2)})
  np.testing.assert_allclose(wrapper.params["a"], 0.5, rtol=1e-6)
  np.testing.assert_allclose(wrapper.params["b"], 0.9, rtol=1e-6)


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad"])
def test_a_torch_optimizer_updated_without_params_names_itself(name):
  # PyTorch's optimizers always hold their params; the optax transformation needs them passed
  # (weight decay reads them), and says which optimizer asked.
  params = {"w": jnp.ones(2, jnp.float32)}
  wrapper = jaxamp.build_optim_wrapper(params, dict(optimizer=dict(type=name, lr=0.1)))
  tx = wrapper.optimizer.transformation
  with pytest.raises(ValueError, match=rf"^{name} needs the params in update"):
    tx.update({"w": jnp.ones(2, jnp.float32)}, tx.init(params))
