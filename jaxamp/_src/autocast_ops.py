"""The op lists of :func:`jaxamp.autocast`: which JAX primitive runs in which dtype.

The lists follow ``torch.autocast``'s CUDA op lists, mapped to the JAX
primitives those ops lower to. A primitive belongs to one of four rules:

- ``"low"``: floating inputs (other than float64) are cast to the autocast
  dtype; matrix products accumulate in float32 and return the autocast dtype.
- ``"float32"``: 16-bit (and narrower) floating inputs are cast to float32.
- ``"promote"``: floating inputs of different dtypes are cast to the widest of
  them (weakly typed Python scalars do not widen); one dtype runs as it comes.
- ``"off"``: floating inputs are cast back to the dtypes the function was
  traced with, and the primitive runs as if autocast were not there.

Primitives in none of the lists run under ``"off"``; control flow and calls
(``jit``, ``cond``, ``while``, ``scan``, ``checkpoint``, ``custom_jvp_call``,
``custom_vjp_call``, ``shard_map``: the families of
:data:`jaxamp._src.jaxpr_interp.FAMILIES`) are entered. Every name here is the
name of a primitive in each supported JAX release
(``tests/test_autocast_rules.py`` checks them against the installed one).
"""

from __future__ import annotations

RULES = ("low", "float32", "promote", "off")

# torch: matmul, mm, bmm, addmm, addbmm, baddbmm, addmv, addr, mv, linear,
# chain_matmul, multi_dot, the RNN cells (all dot_general in JAX), conv1d/2d/3d
# and conv_transpose1d/2d/3d (conv_general_dilated).
LOW_PRECISION = frozenset({
    "dot_general",
    "conv_general_dilated",
    "ragged_dot_general",
})

# torch: exp, expm1, log, log10, log2, log1p, pow, __pow__, __rpow__, reciprocal,
# __rdiv__, rsqrt, acos, asin, cosh, sinh, tan, erfinv, sum, prod, cumsum,
# cumprod, softplus, softmax, log_softmax, norm, layer_norm, group_norm and the
# losses. The composite ops are made of these primitives in JAX (softmax and
# log_softmax: exp, reduce_sum, log; norms: square or integer_pow, reduce_sum,
# sqrt or rsqrt; losses: log, exp, reduce_sum), so they run in float32 where
# it matters. jnp.reciprocal is integer_pow(x, -1). logistic (sigmoid) and
# sqrt are added: the first saturates and the second sits in every norm.
FLOAT32 = frozenset({
    "exp", "exp2", "expm1", "log", "log1p",
    "pow", "integer_pow", "square", "sqrt", "rsqrt",
    "acos", "asin", "cosh", "sinh", "tan",
    "erf_inv", "logistic", "lgamma", "digamma", "igamma", "igammac", "polygamma", "zeta",
    "regularized_incomplete_beta",
    "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp",
})

# Ops that take several floating operands of one dtype (torch's promote list:
# addcdiv, addcmul, atan2, cross, dot, index_put, scatter_add, tensordot; the
# arithmetic operators promote by torch's ordinary rules), and ops of one
# floating operand that run in whatever dtype it has (activations, movement,
# comparisons, collectives). Both follow their inputs' dtype, the first set
# after casting mixed inputs to the widest.
PROMOTE = frozenset({
    # arithmetic and comparison
    "add", "add_any", "sub", "mul", "div", "rem", "max", "min", "atan2", "nextafter",
    "eq", "ne", "lt", "le", "gt", "ge", "select_n", "clamp", "complex",
    # unary math that torch runs in the input's dtype
    "neg", "abs", "sign", "floor", "ceil", "round", "is_finite", "sin", "cos", "tanh", "atan",
    "asinh", "acosh", "atanh", "erf", "erfc", "cbrt", "real", "imag", "conj",
    "reduce_precision", "stop_gradient",
    # reductions that select rather than accumulate
    "reduce_max", "reduce_min", "argmax", "argmin", "cummax", "cummin",
    "reduce_window_max", "reduce_window_min", "top_k", "sort",
    # data movement
    "reshape", "broadcast_in_dim", "transpose", "squeeze", "slice",
    "dynamic_slice", "dynamic_update_slice", "gather", "scatter", "scatter-add", "scatter-sub",
    "scatter-mul", "scatter-min", "scatter-max", "concatenate", "pad", "rev", "split",
    "copy", "convert_element_type", "select_and_scatter_add", "select_and_gather_add",
    # sharding and collectives
    "sharding_constraint", "reshard", "device_put", "pvary", "psum", "pmax",
    "pmin", "psum_invariant", "all_gather", "all_to_all", "ppermute", "reduce_scatter",
    "optimization_barrier", "name",
})

# Primitives with a body that run at their traced dtypes on purpose, without a warning:
# custom_linear_solve (jnp.linalg.solve, jax.scipy.linalg.cho_solve, solves with a
# custom transpose). A linear solve amplifies its inputs' rounding by the matrix's condition
# number, and its inner product is one JAX asks for at full precision (precision=HIGHEST);
# like the linear algebra primitives, in no list, it keeps the precision it was written in.
TRACED = frozenset({"custom_linear_solve"})


def default_rule(name: str) -> str:
  """The rule of primitive ``name`` when the user gives no override."""
  if name in LOW_PRECISION:
    return "low"
  if name in FLOAT32:
    return "float32"
  if name in PROMOTE:
    return "promote"
  return "off"
