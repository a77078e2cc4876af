"""The checks every conformance model goes through, in float16 and bfloat16.

A model comes as a :class:`Case`: a pure loss of (float32) parameters and a
batch, for the gradient and jaxpr checks, and a trainer written the way its
library's examples write a train step, for the training checks. :func:`check`
runs them all, sharing the compiled functions between the assertions:

- the loss traces under ``jaxamp.autocast``;
- the unscaled gradients of the first (loss-scaled) step are float32 and
  within :data:`GRAD_TOL` (relative L2 error over all leaves) of the float32
  gradients of the loss without autocast (for a model whose backward rule is
  not linear in its cotangent, such as a clip, of the float32 gradients of the
  loss times the first step's scale, divided by it: the rule sees the scaled
  cotangent, as it does under PyTorch's GradScaler);
- every matmul and convolution of the autocast program takes ``dtype`` inputs,
  and every precision-sensitive op (exp, log, sums, square roots) float32 ones
  (in fp8 autocast, ``dtype`` float8_e4m3fn, the products take bfloat16 inputs
  dequantized from float8); those of the regions autocast leaves at their
  traced dtypes (a ``while`` loop whose predicate reads a floating value, an
  ``autocast_disabled`` region) take float32 ones, when the case has such a
  region;
- the jitted step with ``jaxamp.dynamic_loss_scale`` lowers the loss on a
  fixed batch;
- a batch holding a NaN is skipped: parameters, the inner optimizer state and
  the statistics stay bit-identical, while a good step changes the statistics;
- ``jaxamp.skip_report`` names exactly the leaves whose gradients were not
  finite;
- the step was traced once over all those calls.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Protocol

import jax
import jax.numpy as jnp
import numpy as np

import jaxamp
from jaxamp._src import jaxpr_interp
from tests import _optax

#: Relative L2 error of the autocast gradients against float32's, over all leaves. float16 keeps
#: 11 significant bits, bfloat16 8; each matmul rounds its inputs and its output once. fp8
#: autocast rounds the operands to 4 significant bits (e4m3) and the gradients to 3 (e5m2): the
#: conformance models, every product in float8, measure 0.06 to 0.25.
FP8 = jnp.dtype(jnp.float8_e4m3fn)
GRAD_TOL = {jnp.dtype(jnp.float16): 2e-2, jnp.dtype(jnp.bfloat16): 1e-1, FP8: 0.3}
LOW_OPS = ("dot_general", "conv_general_dilated")
MATMUL = ("dot_general",)
CONV = ("dot_general", "conv_general_dilated")
FLOAT32_OPS = ("exp", "log", "log1p", "expm1", "reduce_sum", "sqrt", "rsqrt", "logistic")
TRAIN_STEPS = 6
INIT_SCALE = 2.0**10  # the loss scale of every trainer's first step
#: The steps here compile without XLA's expensive backend passes, to keep the suite fast; the
#: soundness of the skip under XLA's optimizations is tested in tests/test_soundness.py.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


class Trainer(Protocol):
  """A model's train step, as its library's examples write it, with a loss-scaled optimizer."""

  traces: int  # how many times the step function was traced

  def step(self, batch: Any) -> tuple[Any, Any]:
    """Runs one jitted train step; returns the (unscaled) loss and gradients."""

  def snapshot(self) -> dict:
    """``{'params', 'inner_opt_state', 'stats'}`` as plain arrays (copies)."""

  def opt_state(self) -> Any:
    """The optax state (holding the loss-scale state)."""

  def params(self) -> Any:
    """The parameters, with the tree structure the gradients have."""


@dataclasses.dataclass
class Case:
  """One model: a pure loss for the numerics, a trainer for the step."""

  loss: Callable[[Any, Any], jax.Array]  # loss(params, batch), float32 parameters
  params: Any
  batch: Any
  nan_batch: Any
  trainer: Callable[[Any], Trainer]  # trainer(dtype)
  has_stats: bool = False
  low_ops: tuple = MATMUL
  rule_sees_scale: bool = False  # a backward rule not linear in its cotangent (a clip)
  kept: tuple = ()  # regions whose matmuls stay float32: "while", "autocast_disabled"


def sub_jaxprs(value: Any):
  """The jaxprs inside an equation parameter (closed or open, alone or in tuples)."""
  if isinstance(value, jax.extend.core.ClosedJaxpr):
    yield value.jaxpr
  elif isinstance(value, jax.extend.core.Jaxpr):
    yield value
  elif isinstance(value, (tuple, list)):
    for v in value:
      yield from sub_jaxprs(v)


def equations(jaxpr: Any, kept: tuple = (), inside: bool = False):
  """``(eqn, inside)`` for every equation of ``jaxpr`` and of the jaxprs nested in it.

  ``inside`` says whether the equation lies in one of the ``kept`` regions: the
  body of a ``while`` equation, the named scope ``autocast_disabled``.
  """
  for eqn in jaxpr.eqns:
    here = inside or ("autocast_disabled" in kept
                      and jaxpr_interp.in_scope(eqn, "autocast_disabled"))
    yield eqn, here
    for value in eqn.params.values():
      for sub in sub_jaxprs(value):
        yield from equations(sub, kept, here or ("while" in kept and eqn.primitive.name == "while"))


def _float_in_dtypes(eqn: Any) -> set:
  return {jnp.dtype(v.aval.dtype) for v in eqn.invars
          if hasattr(v.aval, "dtype") and jnp.issubdtype(v.aval.dtype, jnp.floating)}


def check_op_dtypes(loss: Callable, params: Any, batch: Any, dtype: Any,
                    low_ops: tuple = MATMUL, kept: tuple = ()) -> None:
  """Matmuls/convolutions in ``dtype``, precision-sensitive ops in float32, in the autocast jaxpr.

  In the ``kept`` regions the matmuls are float32, and there is one at least.
  """
  jaxpr = jax.make_jaxpr(jaxamp.autocast(loss, dtype))(params, batch).jaxpr
  seen = {name: 0 for name in low_ops}
  low = jnp.dtype(jnp.bfloat16) if jnp.dtype(dtype) == FP8 else jnp.dtype(dtype)
  if low != jnp.dtype(dtype):
    assert any(v.aval.dtype == FP8 for e, _ in equations(jaxpr) for v in e.outvars), "no float8"
  in_kept = 0
  for eqn, inside in equations(jaxpr, kept):
    name = eqn.primitive.name
    dtypes = _float_in_dtypes(eqn)
    if name in LOW_OPS and dtypes:
      want = jnp.dtype(jnp.float32) if inside else low
      assert dtypes == {want}, f"{name} ran in {dtypes}: {eqn}"
      if inside:
        in_kept += 1
      else:
        seen[name] = seen.get(name, 0) + 1
    if name in FLOAT32_OPS and dtypes:
      assert dtypes == {jnp.dtype(jnp.float32)}, f"{name} ran in {dtypes}: {eqn}"
  assert all(seen[name] for name in low_ops), f"expected {low_ops} in the program, saw {seen}"
  assert in_kept or not kept, f"no matmul in the regions {kept}"


def _flat(tree: Any) -> np.ndarray:
  return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def _assert_identical(a: Any, b: Any, what: str) -> None:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b), what
  for x, y in zip(la, lb):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), f"{what} changed on a skipped step"


_reference_grads: dict = {}


def check(case: Case, dtype: Any, name: str) -> None:
  """Runs every check on ``case`` in ``dtype`` (see the module notes)."""
  dtype = jnp.dtype(dtype)
  check_op_dtypes(case.loss, case.params, case.batch, dtype, case.low_ops, case.kept)

  # The first step's unscaled gradients: float32, close to float32's.
  trainer = case.trainer(dtype)
  loss, grads = trainer.step(case.batch)
  assert int(jaxamp.skipped_steps(trainer.opt_state())) == 0, "the first step was skipped"
  for g in jax.tree.leaves(grads):
    assert g.dtype == jnp.float32
  if name not in _reference_grads:
    scale = INIT_SCALE if case.rule_sees_scale else 1.0
    scaled = jax.jit(jax.grad(lambda p, b: case.loss(p, b) * scale))(case.params, case.batch)
    _reference_grads[name] = jax.tree.map(lambda g: g / scale, scaled)
  ref = _flat(_reference_grads[name])
  err = np.linalg.norm(_flat(grads) - ref) / np.linalg.norm(ref)
  assert err < GRAD_TOL[dtype], f"relative gradient error {err:.3g} in {dtype}"

  # Training: the loss goes down, a NaN batch is skipped bit-exactly, one trace.
  losses = [float(loss)] + [float(trainer.step(case.batch)[0]) for _ in range(TRAIN_STEPS - 1)]
  assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
  before = trainer.snapshot()
  _, nan_grads = trainer.step(case.nan_batch)
  after = trainer.snapshot()
  for key in ("params", "inner_opt_state", "stats"):
    _assert_identical(before[key], after[key], key)
  assert int(jaxamp.skipped_steps(trainer.opt_state())) == 1

  expected = [jax.tree_util.keystr(p) for p, g in jax.tree_util.tree_leaves_with_path(nan_grads)
              if not np.all(np.isfinite(np.asarray(g)))]
  report = jaxamp.skip_report(trainer.opt_state(), trainer.params())
  assert report and report == expected, (report, expected)

  trainer.step(case.batch)  # a good step again: applied, statistics move
  later = trainer.snapshot()
  assert not np.array_equal(_flat(later["params"]), _flat(after["params"]))
  if case.has_stats:
    assert not np.array_equal(_flat(later["stats"]), _flat(after["stats"])), "stats never update"
  assert trainer.traces == 1, f"the step was traced {trainer.traces} times"


def unscaled(grads: Any, opt_state: Any) -> Any:
  """The gradients of a scaled loss divided by the scale they were scaled by."""
  scale = jaxamp.loss_scale(opt_state)
  return jax.tree.map(lambda g: g / scale.astype(g.dtype), grads)


def inner_opt_state(opt_state: Any) -> Any:
  """The state of the optimizer wrapped by the loss scaler (copied to the host)."""
  return jax.device_get(jaxamp.get_loss_scale_state(opt_state).inner_state)


def nan_like(x: jax.Array, index: Optional[tuple] = None) -> jax.Array:
  """``x`` with one NaN (at ``index``, the first element by default)."""
  index = (0,) * x.ndim if index is None else index
  return x.at[index].set(jnp.nan)


def make_tx(init_scale: float = INIT_SCALE, lr: float = 1e-2) -> Any:
  """The loss-scaled optimizer every conformance trainer uses."""
  return jaxamp.dynamic_loss_scale(_optax.adam(lr), init_scale=init_scale)


class FunctionalTrainer:
  """A pure-JAX train step: ``loss(params, batch, stats) -> (loss, new_stats)``, jitted.

  The statistics returned by the loss are kept on a skipped step with
  ``jaxamp.keep_if_skipped``.
  """

  def __init__(self, loss_with_stats: Callable, params: Any, stats: Any, dtype: Any,
               tx: Any = None):
    self.tx = make_tx() if tx is None else tx
    self._params, self._stats = params, stats
    self._opt_state = self.tx.init(params)
    self.traces = 0
    lossfn = jaxamp.autocast(loss_with_stats, dtype)

    def step(params, stats, opt_state, batch):
      self.traces += 1

      def scaled(p):
        loss, new_stats = lossfn(p, batch, stats)
        return jaxamp.scale_loss(loss, opt_state), (loss, new_stats)

      grads, (loss, new_stats) = jax.grad(scaled, has_aux=True)(params)
      updates, new_opt_state = self.tx.update(grads, opt_state, params)
      params = jax.tree.map(lambda p, u: p + u, params, updates)
      new_stats = jaxamp.keep_if_skipped(new_stats, stats, opt_state, new_opt_state)
      return params, new_stats, new_opt_state, (loss, unscaled(grads, opt_state))

    self._step = jax.jit(step, compiler_options=COMPILER_OPTIONS)

  def step(self, batch: Any) -> tuple[Any, Any]:
    self._params, self._stats, self._opt_state, loss = self._step(
        self._params, self._stats, self._opt_state, batch)
    return loss

  def snapshot(self) -> dict:
    return {"params": jax.device_get(self._params), "stats": jax.device_get(self._stats),
            "inner_opt_state": inner_opt_state(self._opt_state)}

  def opt_state(self) -> Any:
    return self._opt_state

  def params(self) -> Any:
    return self._params
