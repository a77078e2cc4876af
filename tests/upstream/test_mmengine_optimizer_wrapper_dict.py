"""mmengine's tests/test_optim/test_optimizer/test_optimizer_wrapper_dict.py, ported to jaxamp.

``nn.Linear(1, 1)`` becomes a ``{'weight': (1, 1), 'bias': (1,)}`` pytree,
``SGD(..., lr, momentum)`` an injected ``optax.sgd``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp


def _linear(seed):
  rng = np.random.default_rng(seed)
  return {"weight": jnp.asarray(rng.uniform(-1, 1, (1, 1)), jnp.float32),
          "bias": jnp.asarray(rng.uniform(-1, 1, (1,)), jnp.float32)}


def _sgd(lr, momentum=None):
  return optax.inject_hyperparams(optax.sgd)(learning_rate=lr, momentum=momentum)


def _forward_sum(p, x):
  return jnp.sum(x @ p["weight"].T + p["bias"][None, :])


def _tree_equal(a, b):
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  return ta == tb and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


class TestOptimWrapperDict:

  def setup_method(self):
    self.model1 = _linear(1)
    self.model2 = _linear(2)
    self.optim1 = _sgd(0.1, momentum=0.8)
    self.optim2 = _sgd(0.2, momentum=0.9)
    self.optim_wrapper1 = jaxamp.OptimWrapper(self.optim1, self.model1)
    self.optim_wrapper2 = jaxamp.OptimWrapper(self.optim2, self.model2)
    self.optimizers_wrappers = dict(optim1=self.optim_wrapper1, optim2=self.optim_wrapper2)

  def test_init(self):
    optim_wrapper_dict = jaxamp.OptimWrapperDict(**self.optimizers_wrappers)
    assert optim_wrapper_dict.optim_wrappers == self.optimizers_wrappers
    with pytest.raises(AssertionError, match="`OptimWrapperDict` only accept"):
      jaxamp.OptimWrapperDict(**dict(optim1=self.optim1, optim2=self.optim2))

  def test_update_params(self):
    optim_wrapper_dict = jaxamp.OptimWrapperDict(**self.optimizers_wrappers)
    with pytest.raises(NotImplementedError, match="`update_params` should be called"):
      optim_wrapper_dict.update_params(1)

  def test_backward(self):
    optim_wrapper_dict = jaxamp.OptimWrapperDict(**self.optimizers_wrappers)
    with pytest.raises(NotImplementedError, match="`backward` should be called"):
      optim_wrapper_dict.backward(1)

  def test_step(self):
    optim_wrapper_dict = jaxamp.OptimWrapperDict(**self.optimizers_wrappers)
    with pytest.raises(NotImplementedError, match="`step` should be called"):
      optim_wrapper_dict.step()

  def test_zero_grad(self):
    # Test clear all grad
    optim_wrapper_dict = jaxamp.OptimWrapperDict(**self.optimizers_wrappers)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 1)), jnp.float32)
    self.optim_wrapper1.backward(_forward_sum, x)
    self.optim_wrapper2.backward(_forward_sum, x)
    assert bool((self.optim_wrapper1.grads["weight"] != 0).any())
    assert bool((self.optim_wrapper2.grads["weight"] != 0).any())
    optim_wrapper_dict.zero_grad()
    # PyTorch >= 2.0: set_to_none.
    assert self.optim_wrapper1.grads is None
    assert self.optim_wrapper2.grads is None

  def test_optim_context(self):
    optim_wrapper_dict = jaxamp.OptimWrapperDict(**self.optimizers_wrappers)
    with pytest.raises(NotImplementedError, match="`optim_context` should be called"):
      with optim_wrapper_dict.optim_context(self.model1):
        pass

  def test_initialize_count_status(self):
    # Test `initialize_count_status` can be called.
    optim_wrapper_dict = jaxamp.OptimWrapperDict(**self.optimizers_wrappers)
    optim_wrapper_dict.initialize_count_status(self.model1, 1, 1)

  def test_param_groups(self):
    optim_wrapper_dict = jaxamp.OptimWrapperDict(**self.optimizers_wrappers)
    assert ([dict(g) for g in optim_wrapper_dict.param_groups["optim1"]]
            == [dict(g) for g in self.optim_wrapper1.optimizer.param_groups])
    assert ([dict(g) for g in optim_wrapper_dict.param_groups["optim2"]]
            == [dict(g) for g in self.optim_wrapper2.optimizer.param_groups])

  def test_get_lr(self):
    optim_wrapper_dict = jaxamp.OptimWrapperDict(**self.optimizers_wrappers)
    lr = optim_wrapper_dict.get_lr()
    assert lr["optim1.lr"] == [0.1]
    assert lr["optim2.lr"] == [0.2]

  def test_get_momentum(self):
    optim_wrapper_dict = jaxamp.OptimWrapperDict(**self.optimizers_wrappers)
    momentum = optim_wrapper_dict.get_momentum()
    assert momentum["optim1.momentum"] == [0.8]
    assert momentum["optim2.momentum"] == [0.9]

  def test_state_dict(self):
    optim_wrapper_dict = jaxamp.OptimWrapperDict(**self.optimizers_wrappers)
    state_dict = optim_wrapper_dict.state_dict()
    assert _tree_equal(state_dict["optim1"], self.optim_wrapper1.state_dict())
    assert _tree_equal(state_dict["optim2"], self.optim_wrapper2.state_dict())

  def test_load_state_dict(self):
    # Test OptimWrapperDict can load from saved state dict.
    model1 = _linear(3)
    model2 = _linear(4)
    optim1 = _sgd(0.1, momentum=0.8)
    optim2 = _sgd(0.1, momentum=0.9)
    optim_wrapper_load1 = jaxamp.OptimWrapper(optim1, model1)
    optim_wrapper_load2 = jaxamp.OptimWrapper(optim2, model2)

    optim_wrapper_dict_save = jaxamp.OptimWrapperDict(**self.optimizers_wrappers)
    optim_wrapper_dict_load = jaxamp.OptimWrapperDict(optim1=optim_wrapper_load1,
                                                      optim2=optim_wrapper_load2)
    state_dict = optim_wrapper_dict_save.state_dict()
    optim_wrapper_dict_load.load_state_dict(state_dict)

    assert _tree_equal(optim_wrapper_dict_load.state_dict(), optim_wrapper_dict_save.state_dict())

  def test_items(self):
    optim_wrapper_dict = jaxamp.OptimWrapperDict(**self.optimizers_wrappers)
    assert list(optim_wrapper_dict.items()) == list(self.optimizers_wrappers.items())

  def test_values(self):
    optim_wrapper_dict = jaxamp.OptimWrapperDict(**self.optimizers_wrappers)
    assert list(optim_wrapper_dict.values()) == list(self.optimizers_wrappers.values())

  def test_keys(self):
    optim_wrapper_dict = jaxamp.OptimWrapperDict(**self.optimizers_wrappers)
    assert list(optim_wrapper_dict.keys()) == list(self.optimizers_wrappers.keys())

  def test_getitem(self):
    optim_wrapper_dict = jaxamp.OptimWrapperDict(**self.optimizers_wrappers)
    assert self.optimizers_wrappers["optim1"] is optim_wrapper_dict["optim1"]
    assert self.optimizers_wrappers["optim2"] is optim_wrapper_dict["optim2"]

  def test_len(self):
    optim_wrapper_dict = jaxamp.OptimWrapperDict(**self.optimizers_wrappers)
    assert len(optim_wrapper_dict) == 2

  def test_contain(self):
    optim_wrapper_dict = jaxamp.OptimWrapperDict(**self.optimizers_wrappers)
    assert "optim1" in optim_wrapper_dict

  def test_repr(self):
    optim_wrapper_dict = jaxamp.OptimWrapperDict(**self.optimizers_wrappers)
    desc = repr(optim_wrapper_dict)
    assert "name: optim1" in desc
