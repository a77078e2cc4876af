"""fp8 autocast: matrix products and convolutions on float8 operands, scaled per tensor each step.

``jaxamp.autocast(fn, jnp.float8_e4m3fn)`` runs ``fn`` as ``autocast(fn,
jnp.bfloat16)`` does, except for the products its :class:`Fp8Rule` chooses.
Each of those runs as a ``custom_vjp`` (:func:`product`):

- forward: both operands are quantized to float8_e4m3fn, each with its own
  *current* scale (from the largest magnitude of that operand in this call:
  no history, no state), dequantized (a convert and a multiply by the scalar
  inverse scale) and multiplied;
- backward: the output gradient is quantized to float8_e5m2 with its own
  current scale, and both input gradients are the products of the dequantized
  gradient with the saved float8 operands, dequantized again.

Every product's operands are thus ``convert(float8) * broadcast(scalar)``,
the pattern that XLA's GPU compiler rewrites into one cuBLASLt float8 GEMM
taking the two scales (and cuDNN's float8 convolution, forward only), and
the residuals kept for the backward pass are float8.

The scales are powers of two, built with bit operations: quantizing and
dequantizing multiply by them exactly, so the one rounding is the conversion
to float8, on every backend, whatever XLA fuses. A non-finite largest
magnitude makes the scale NaN, and with it the whole product, so a step whose
operands or gradients hold an inf or a NaN has non-finite gradients and is
skipped by ``dynamic_loss_scale`` like any other.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import re
from typing import Any, Callable, NamedTuple, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._src import jaxpr_interp as interp

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)
#: The names ``autocast`` takes for fp8 autocast, besides the dtype itself.
NAMES = ("float8_e4m3fn", "fp8")
PRIMITIVES = ("dot_general", "conv_general_dilated")
_F32 = jnp.dtype(jnp.float32)
_F64 = jnp.dtype(jnp.float64)


class Fp8Site(NamedTuple):
  """A matrix product or convolution, as :class:`Fp8Rule` and its ``exclude`` callables see it.

  The sizes are those of the matrix product it amounts to, ``(m, k) @ (k, n)``
  per batch element.

  Attributes:
    primitive: ``'dot_general'`` or ``'conv_general_dilated'``.
    scope: the names of the ``jax.named_scope`` and Flax modules around it,
      outermost first, joined by ``'/'`` (transformations such as ``jvp(...)``
      removed), e.g. ``'TransformerLM/DecoderLayer_0/MlpBlock_0/Dense_0'``.
    lhs_shape: the shape of the left operand (the input of a convolution).
    rhs_shape: the shape of the right operand (the kernel of a convolution).
    m: the output's size along the left operand's free dimensions (for a
      convolution: batch times output positions).
    n: the output's size along the right operand's free dimensions (for a
      convolution: output features).
    k: the contracted size (for a convolution: input features times window).
  """

  primitive: str
  scope: str
  lhs_shape: Tuple[int, ...]
  rhs_shape: Tuple[int, ...]
  m: int
  n: int
  k: int


Exclusion = Union[str, Callable[[Fp8Site], bool]]


@dataclasses.dataclass(frozen=True)
class Fp8Rule:
  """Which products ``autocast(fn, jnp.float8_e4m3fn)`` runs in float8; the others run in bfloat16.

  A ``dot_general`` or ``conv_general_dilated`` whose operands are floating
  (not float64 and not already float8) is chosen when its sizes ``m``, ``n``
  and ``k`` (see :class:`Fp8Site`) are all at least ``min_dim`` and multiples
  of ``multiple``, and no entry of ``exclude`` matches it. Grouped and
  depthwise convolutions are never chosen.

  Why: quantizing costs a pass over each operand (its largest magnitude) and
  a conversion, against a product that float8 runs about twice as fast. The
  quantization of a ``(m, k)`` activation is paid back by the product's
  ``m * n * k`` work only when ``n`` is large, that of the ``(k, n)`` weight
  only when ``m`` is, and that of the ``(m, n)`` gradient only when ``k`` is:
  by an estimate from an H100's or H200's bandwidth and bfloat16 rate, at
  about a thousand each (not measured). cuBLASLt's float8 GEMMs need
  dimensions that are multiples of 16; XLA pads others, a copy of the
  operand.

  Args:
    min_dim: the smallest ``m``, ``n`` and ``k`` run in float8 (an int >= 1).
    multiple: ``m``, ``n`` and ``k`` must be multiples of it (an int >= 1;
      1 allows any size).
    exclude: products to keep in bfloat16, as TransformerEngine's users keep
      the first and last layers: a sequence whose entries are scope patterns
      or callables. A pattern is one or more ``'/'``-separated names, each
      matched with ``fnmatch`` (``*`` and ``?`` wildcards) against a run of
      consecutive names of the product's scope: ``'head'``,
      ``'Dense_0'``, ``'block_*/attn'``. A callable takes the
      :class:`Fp8Site` and returns True to exclude it, e.g.
      ``lambda site: site.n == vocab_size``. A single string is one pattern.

  Raises:
    TypeError: for a ``min_dim`` or ``multiple`` that is not an int, or an
      ``exclude`` entry that is neither a string nor callable.
    ValueError: for a ``min_dim`` or ``multiple`` below 1, or an empty
      pattern or pattern name.

  Examples:
    >>> import jaxamp
    >>> rule = jaxamp.Fp8Rule(min_dim=16, exclude=("embed", "head"))
    >>> rule.chooses(jaxamp.Fp8Site("dot_general", "model/block_0/mlp", (64, 32), (32, 64),
    ...                             64, 64, 32))
    True
    >>> rule.chooses(jaxamp.Fp8Site("dot_general", "model/head", (64, 32), (32, 64),
    ...                             64, 64, 32))
    False
  """

  min_dim: int = 1024
  multiple: int = 16
  exclude: Tuple[Exclusion, ...] = ()

  def __post_init__(self):
    for name in ("min_dim", "multiple"):
      value = getattr(self, name)
      if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"Fp8Rule's {name} must be an int, got {value!r}")
      if value < 1:
        raise ValueError(f"Fp8Rule's {name} must be >= 1, got {value!r}")
      object.__setattr__(self, name, int(value))
    exclude = self.exclude
    if isinstance(exclude, str) or callable(exclude):
      exclude = (exclude,)
    try:
      exclude = tuple(exclude)
    except TypeError:
      raise TypeError("Fp8Rule's exclude must be a sequence of scope patterns (strings) and "
                      f"callables, got {self.exclude!r}") from None
    for entry in exclude:
      if isinstance(entry, str):
        if not entry or any(not part for part in entry.split("/")):
          raise ValueError("Fp8Rule's exclude patterns must be '/'-separated names, none empty, "
                           f"got {entry!r}")
      elif not callable(entry):
        raise TypeError("Fp8Rule's exclude entries must be scope patterns (strings) or "
                        f"callables taking an Fp8Site, got {entry!r}")
    object.__setattr__(self, "exclude", exclude)

  def chooses(self, site: Fp8Site) -> bool:
    """Whether ``site`` runs in float8 under this rule."""
    sizes = (site.m, site.n, site.k)
    if min(sizes) < self.min_dim or any(s % self.multiple for s in sizes):
      return False
    return not any(_matches(entry, site) for entry in self.exclude)


def _matches(entry: Exclusion, site: Fp8Site) -> bool:
  if not isinstance(entry, str):
    return bool(entry(site))
  pattern, names = entry.split("/"), site.scope.split("/")
  return any(all(fnmatch.fnmatchcase(name, part) for name, part in zip(names[i:], pattern))
             for i in range(len(names) - len(pattern) + 1))


# ----------------------------------------------------------------------------- sites


_TRANSFORM = re.compile(r"[A-Za-z_]\w*\(")


def _scope(name_stack: str) -> str:
  """The name stack without transformations: ``'jvp(autocast_f)/M/Dense_0'`` -> ``'autocast_f/M/Dense_0'``."""
  return _TRANSFORM.sub("", name_stack).replace(")", "")


def _is_candidate_dtype(dtype) -> bool:
  dtype = jnp.dtype(dtype)
  return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize >= 2 and dtype != _F64


def site(eqn: Any) -> Optional[Fp8Site]:
  """The :class:`Fp8Site` of ``eqn``, or None for an equation fp8 autocast never runs in float8.

  Call it inside the equation's context (as the interpreter's rules run), so
  that the scope includes the names around the traced function.
  """
  name = eqn.primitive.name
  if name not in PRIMITIVES or len(eqn.invars) != 2:
    return None
  lhs, rhs = (v.aval for v in eqn.invars)
  if not all(_is_candidate_dtype(a.dtype) for a in (lhs, rhs)):
    return None
  if name == "dot_general":
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    m = math.prod(d for i, d in enumerate(lhs.shape) if i not in (*lc, *lb))
    n = math.prod(d for i, d in enumerate(rhs.shape) if i not in (*rc, *rb))
    k = math.prod(lhs.shape[i] for i in lc)
  else:
    if eqn.params["feature_group_count"] != 1 or eqn.params["batch_group_count"] != 1:
      return None
    _, rhs_spec, out_spec = eqn.params["dimension_numbers"]
    out = eqn.outvars[0].aval.shape
    m = out[out_spec[0]] * math.prod(out[i] for i in out_spec[2:])
    n = rhs.shape[rhs_spec[0]]
    k = rhs.shape[rhs_spec[1]] * math.prod(rhs.shape[i] for i in rhs_spec[2:])
  return Fp8Site(name, _scope(interp.name_stack()), tuple(lhs.shape), tuple(rhs.shape),
                 int(m), int(n), int(k))


# ----------------------------------------------------------------------------- quantization


def _bits(value: float) -> Tuple[int, int]:
  """The biased exponent and the fraction bits of ``value`` as a float32."""
  bits = int(np.float32(value).view(np.int32))
  return bits >> 23, bits & 0x7FFFFF


def scales(amax: jax.Array, fmt: Any) -> Tuple[jax.Array, jax.Array]:
  """``(scale, inverse)``: float32 powers of two, ``amax * scale`` the largest within ``fmt``.

  ``scale`` is the largest power of two with ``amax * scale <= finfo(fmt).max``
  (at most ``2**126``, so that an all-zero operand has a finite one); both are
  NaN when ``amax`` is not finite.
  """
  max_exp, max_frac = _bits(float(jnp.finfo(fmt).max))
  bits = lax.bitcast_convert_type(amax.astype(_F32), jnp.int32)
  exp, frac = (bits >> 23) & 0xFF, bits & 0x7FFFFF
  k = lax.clamp(-126, max_exp - exp - (frac > max_frac).astype(jnp.int32), 126)
  scale = lax.bitcast_convert_type((k + 127) << 23, _F32)
  inverse = lax.bitcast_convert_type((127 - k) << 23, _F32)
  finite = exp < 255
  nan = jnp.asarray(np.nan, _F32)
  return lax.select(finite, scale, nan), lax.select(finite, inverse, nan)


def quantize(x: jax.Array, fmt: Any) -> Tuple[jax.Array, jax.Array]:
  """``(q, inverse)``: ``x`` in float8 ``fmt`` with its current scale, and the float32 inverse."""
  scale, inverse = scales(jnp.max(jnp.abs(x)), fmt)
  return (x.astype(_F32) * scale).astype(fmt), inverse


def dequantize(q: jax.Array, inverse: jax.Array, dtype: Any) -> jax.Array:
  """``convert(q) * broadcast(inverse)`` in ``dtype``: exact, and the operand XLA's GPU rewrite matches."""
  return q.astype(dtype) * lax.broadcast(inverse.astype(dtype), q.shape)


# ----------------------------------------------------------------------------- the product


def product(eqn: Any, invals: list, params: dict, low: Any) -> list:
  """Binds ``eqn`` (a chosen product) on float8 operands, with float8 gradients; a list of one.

  ``params`` are the parameters the bfloat16 rule binds it with (their
  ``preferred_element_type`` is the output's dtype), ``low`` the dtype the
  operands are dequantized to. The gradients take the dtypes of ``invals``.
  """
  dtypes = [jnp.dtype(x.dtype) for x in invals]

  def bind(x, y):
    return interp.bind_here(eqn, [x, y], params)[0]

  def forward(x, y):
    (qx, ix), (qy, iy) = quantize(x, E4M3), quantize(y, E4M3)
    return bind(dequantize(qx, ix, low), dequantize(qy, iy, low)), (qx, ix, qy, iy)

  def backward(residuals, g):
    qx, ix, qy, iy = residuals
    with interp.context(eqn):
      x, y = dequantize(qx, ix, low), dequantize(qy, iy, low)
      g = dequantize(*quantize(g, E5M2), g.dtype)
      gx, = jax.linear_transpose(lambda x_: bind(x_, y), x)(g)
      gy, = jax.linear_transpose(lambda y_: bind(x, y_), y)(g)
    return gx.astype(dtypes[0]), gy.astype(dtypes[1])

  @jax.custom_vjp
  def fp8(x, y):
    return forward(x, y)[0]

  fp8.defvjp(forward, backward)
  return [fp8(*invals)]


# ----------------------------------------------------------------------------- configuration


def requested(dtype: Any) -> bool:
  """Whether ``dtype`` (as given to ``autocast``) asks for fp8 autocast."""
  if isinstance(dtype, str):
    return dtype.strip().lower() in NAMES
  try:
    return jnp.dtype(dtype) == E4M3
  except TypeError:
    return False


def check_rule(fp8: Any) -> Fp8Rule:
  """``fp8`` as given to ``autocast`` (None: the default rule); TypeError for anything else."""
  if fp8 is None:
    return Fp8Rule()
  if not isinstance(fp8, Fp8Rule):
    raise TypeError(f"fp8 must be a jaxamp.Fp8Rule, got {fp8!r}")
  return fp8
