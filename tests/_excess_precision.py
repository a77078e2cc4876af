"""A program as XLA's GPU compiler runs it by default: chains of float conversions collapsed.

With ``xla_allow_excess_precision`` on (the default), XLA's GPU pipeline runs the pass
SimplifyFPConversions after its float normalization: every chain of two or more conversions
to floating types, ``A -> B -> ... -> D``, becomes the one conversion ``A -> D``, and a chain
that ends in its first dtype disappears. ``convert(convert(x: f32) -> bf16) -> f32`` is then
``x`` itself, unrounded. XLA:CPU's default pipeline does not run the pass, so on a CPU the
suite sees every rounding that a GPU may skip. :func:`collapse_conversions` rewrites a
function's program as the pass would, so that the CPU computes what the GPU does.

As XLA, the rewrite follows chains through calls (XLA inlines ``jit`` and custom rules' primal
computations before the pass) but not into or out of the bodies of loops and conditionals, which
stay computations of their own; inside them it rewrites each body by itself. (XLA may also unroll
a short loop, putting its iterations in one computation: a test of that unrolls the loop itself.)
A rounding that survives it is a ``lax.reduce_precision``, a bitcast, or a value that every reader
takes in its rounded dtype.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core

# Primitives whose computation XLA inlines into the caller's before the pass runs; the value
# they compute is their primal computation's (the rewritten program is evaluated, never
# differentiated).
_INLINED = ("pjit", "jit", "closed_call", "core_call", "remat", "checkpoint", "custom_jvp_call",
            "custom_vjp_call", "custom_vjp_call_jaxpr")


def _is_float(dtype: Any) -> bool:
  return jnp.issubdtype(dtype, jnp.floating)


def _sub_jaxpr(eqn: Any) -> core.ClosedJaxpr:
  """The computation of a call-like equation, closed."""
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    found = eqn.params.get(key)
    if isinstance(found, core.ClosedJaxpr):
      return found
    if isinstance(found, core.Jaxpr):
      return core.ClosedJaxpr(found, ())
  raise NotImplementedError(f"collapse_conversions: no computation found in {eqn.primitive}")


class _Rewriter:
  """Evaluates jaxprs with conversion chains collapsed, counting the conversions removed."""

  def __init__(self):
    self.collapsed = 0

  def evaluate(self, jaxpr: core.Jaxpr, consts: list, args: list, sources: list) -> tuple:
    """``(outputs, sources)``: a value's source is the operand of the conversion chain that
    produced it (None where it was not produced by a conversion to a float type)."""
    env: dict = {}
    source: dict = {}

    def read(var):
      return var.val if isinstance(var, core.Literal) else env[var]

    for var, value in zip(jaxpr.constvars, consts):
      env[var] = value
    for var, value, src in zip(jaxpr.invars, args, sources):
      env[var] = value
      if src is not None:
        source[var] = src
    for eqn in jaxpr.eqns:
      values = [read(v) for v in eqn.invars]
      in_sources = [None if isinstance(v, core.Literal) else source.get(v) for v in eqn.invars]
      name = eqn.primitive.name
      if name == "convert_element_type" and _is_float(eqn.params["new_dtype"]):
        out, out_source = self._convert(eqn, values[0], in_sources[0])
        outs, out_sources = [out], [out_source]
      elif name in _INLINED:
        closed = _sub_jaxpr(eqn)
        outs, out_sources = self.evaluate(closed.jaxpr, closed.consts, values, in_sources)
      else:
        params = {k: self._rewrite_param(v) for k, v in eqn.params.items()}
        outs = eqn.primitive.bind(*values, **params)
        outs = list(outs) if eqn.primitive.multiple_results else [outs]
        out_sources = [None] * len(outs)
      for var, value, src in zip(eqn.outvars, outs, out_sources):
        env[var] = value
        if src is not None:
          source[var] = src
    return ([read(v) for v in jaxpr.outvars],
            [None if isinstance(v, core.Literal) else source.get(v) for v in jaxpr.outvars])

  def _convert(self, eqn: Any, x: Any, src: Any) -> tuple:
    dtype = jnp.dtype(eqn.params["new_dtype"])
    if jnp.result_type(x) == dtype:  # no conversion in XLA's program: the chain goes on through
      return eqn.primitive.bind(x, **eqn.params), src
    if src is None:  # the first conversion of a chain
      return eqn.primitive.bind(x, **eqn.params), x
    self.collapsed += 1
    if jnp.result_type(src) == dtype:
      return src, src
    return lax.convert_element_type(src, dtype), src

  def _rewrite_param(self, value: Any) -> Any:
    # Open jaxprs among the parameters (a scatter's or a reduction's combiner) stay as they are.
    if isinstance(value, core.ClosedJaxpr):
      return self.rewrite(value)
    if isinstance(value, tuple) and value and all(isinstance(v, core.ClosedJaxpr) for v in value):
      return tuple(self.rewrite(v) for v in value)
    return value

  def rewrite(self, closed: core.ClosedJaxpr) -> core.ClosedJaxpr:
    """A loop body or a branch, rewritten by itself (XLA's pass stops at its boundary)."""
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type)
             for a in closed.in_avals]
    return jax.make_jaxpr(lambda *args: self.evaluate(
        closed.jaxpr, closed.consts, list(args), [None] * len(args))[0])(*specs)


def collapse_conversions(fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` with every chain of float conversions collapsed, as XLA's GPU pipeline compiles it.

  The returned function traces ``fn`` and evaluates its program with the chains collapsed (jit it
  to compile that program); after each call, its attribute ``collapsed`` holds the number of
  conversions the rewrite removed.

  Examples:
    >>> import jax.numpy as jnp
    >>> round_trip = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
    >>> x = jnp.float32(1.001)
    >>> float(round_trip(x)), float(collapse_conversions(round_trip)(x))
    (1.0, 1.0010000467300415)
  """

  def collapsed(*args: Any) -> Any:
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    rewriter = _Rewriter()
    leaves = jax.tree.leaves(args)
    outs, _ = rewriter.evaluate(closed.jaxpr, closed.consts, leaves, [None] * len(leaves))
    collapsed.collapsed = rewriter.collapsed
    return jax.tree.unflatten(jax.tree.structure(shapes), outs)

  collapsed.collapsed = 0
  return collapsed
