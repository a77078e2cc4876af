"""Conformance: models of every family train under fp8 autocast with dynamic loss scaling.

The models and trainers of the other conformance files, unmodified, through
the checks of ``_harness`` with ``dtype=jnp.float8_e4m3fn``: every product
on bfloat16 operands dequantized from float8, precision-sensitive ops in
float32, gradients within ``GRAD_TOL`` of float32's, the loss going down, a
NaN batch skipped bit-identically, one trace. The models are small, so the
default rule (sizes of at least 1024) is replaced by one that chooses every
product.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import jaxamp
from jaxamp._src import fp8_autocast
from tests.conformance import _harness
from tests.conformance import test_equinox, test_flax_linen, test_flax_nnx, test_pure_jax

CASES = {
    "equinox/mlp_filter_custom_vjp": test_equinox.CASES["mlp_filter_custom_vjp"],
    "equinox/cnn_batchnorm_state": test_equinox.CASES["cnn_batchnorm_state"],
    "jax/attention_embeddings_dropout_stats":
        test_pure_jax.CASES["attention_embeddings_dropout_stats"],
    "jax/fori_loop_checkpoint_policy_named_scope":
        test_pure_jax.CASES["fori_loop_checkpoint_policy_named_scope"],
    "linen/transformer_lm": test_flax_linen.CASES["transformer_lm"],
    "linen/resnet_batchnorm_train_state": test_flax_linen.CASES["resnet_batchnorm_train_state"],
    "nnx/cnn_batchnorm_dropout": test_flax_nnx.CASES["cnn_batchnorm_dropout"],
    "nnx/scan_remat_stack": test_flax_nnx.CASES["scan_remat_stack"],
}


@pytest.fixture(autouse=True)
def every_product_in_float8(monkeypatch):
  every = jaxamp.Fp8Rule(min_dim=1, multiple=1)
  monkeypatch.setattr(fp8_autocast, "check_rule", lambda fp8: every if fp8 is None else fp8)


@pytest.mark.parametrize("name", sorted(CASES))
def test_model_trains_under_fp8_autocast(name):
  _harness.check(CASES[name](), jnp.float8_e4m3fn, name)
