"""Op-level automatic mixed precision: ``torch.autocast`` as a jaxpr transformation."""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple, Union

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._src import autocast_ops as ops
from jaxamp._src import policy as policy_lib

_F32 = jnp.dtype(jnp.float32)
_F64 = jnp.dtype(jnp.float64)
_LOW_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
_CACHE_SIZE = 256


# ----------------------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True)
class _Config:
  dtype: jnp.dtype
  overrides: Tuple[Tuple[str, str], ...]

  @functools.cached_property
  def rules(self) -> dict:
    return dict(self.overrides)

  def rule(self, name: str) -> str:
    return self.rules.get(name) or ops.default_rule(name)


def _primitive_name(key: Any) -> str:
  if isinstance(key, str) and key:
    return key
  name = getattr(key, "name", None)
  if isinstance(name, str) and name:
    return name
  raise TypeError(f"overrides keys must be primitive names (such as 'dot_general') or JAX "
                  f"primitives, got {key!r}")


def _make_config(dtype: Any, overrides: Optional[Mapping[Any, str]]) -> _Config:
  dtype = policy_lib.canonical_dtype(dtype, "dtype")
  if dtype not in _LOW_DTYPES:
    raise ValueError(f"dtype must be float16 or bfloat16, got {dtype}; for full precision "
                     "pass enabled=False")
  if overrides is None:
    overrides = {}
  if not isinstance(overrides, Mapping):
    raise TypeError(f"overrides must be a mapping from primitive names to one of {ops.RULES}, "
                    f"got {overrides!r}")
  items = {}
  for key, rule in overrides.items():
    name = _primitive_name(key)
    if rule not in ops.RULES:
      raise ValueError(f"overrides[{name!r}] must be one of {ops.RULES}, got {rule!r}")
    if name in ops.RECURSED and rule != "off":
      raise ValueError(f"overrides[{name!r}] must be 'off' ({name} is recursed into and its "
                       f"own operations follow their rules), got {rule!r}")
    items[name] = rule
  return _Config(dtype, tuple(sorted(items.items())))


# ----------------------------------------------------------------------------- dtype helpers


def _is_float(dtype) -> bool:
  return jax.dtypes.issubdtype(dtype, jnp.floating)


def _cast(x, dtype):
  if jnp.dtype(x.dtype) == jnp.dtype(dtype):
    return x
  return lax.convert_element_type(x, dtype)


def _widest(dtypes: Sequence[jnp.dtype]) -> jnp.dtype:
  """The widest of some floating dtypes, by JAX's promotion (float16 with bfloat16: float32)."""
  with jax.numpy_dtype_promotion("standard"):  # a strict program refuses float16 + bfloat16
    return functools.reduce(jnp.promote_types, dtypes)


def _dtype_of(x):
  dtype = getattr(x, "dtype", None)
  return jax.typeof(x).dtype if dtype is None else dtype


def _promote(vals, weak):
  """Casts the floating ``vals`` of mixed dtypes to their widest; weak scalars follow."""
  floats = [i for i, v in enumerate(vals) if _is_float(_dtype_of(v))]
  if len(floats) < 2:
    return vals
  strong = [i for i in floats if not weak[i]] or floats
  target = _widest([_dtype_of(vals[i]) for i in strong])
  out = list(vals)
  for i in floats:
    if weak[i] and i not in strong:
      out[i] = _cast(vals[i], target)
    elif _dtype_of(vals[i]) != target:
      out[i] = _cast(vals[i], target)
  return out


def _cast_like(vals, dtypes):
  """Casts each floating value to the matching dtype (the dtypes a jaxpr was traced with)."""
  return [_cast(v, d) if _is_float(_dtype_of(v)) and _is_float(d) else v
          for v, d in zip(vals, dtypes)]


# ----------------------------------------------------------------------------- interpreter


def _closed(jaxpr) -> jex.core.ClosedJaxpr:
  if isinstance(jaxpr, jex.core.ClosedJaxpr):
    return jaxpr
  return jex.core.ClosedJaxpr(jaxpr, ())


def _eval_closed(closed, args, cfg: _Config):
  closed = _closed(closed)
  return _eval(closed.jaxpr, closed.consts, args, cfg)


def _eval(jaxpr, consts, args, cfg: _Config):
  """Evaluates ``jaxpr`` on ``args``, binding each primitive with its autocast dtypes."""
  env: dict = {}

  def read(v):
    return v.val if isinstance(v, jex.core.Literal) else env[v]

  def write(v, val):
    if not isinstance(v, jex.core.DropVar):
      env[v] = val

  for v, val in zip(jaxpr.constvars, consts):
    write(v, val)
  for v, val in zip(jaxpr.invars, args):
    write(v, val)
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    outvals = _eval_eqn(eqn, invals, cfg)
    for v, val in zip(eqn.outvars, outvals):
      write(v, val)
  return [read(v) for v in jaxpr.outvars]


def _bind(eqn, invals, params=None):
  params = eqn.params if params is None else params
  bind_params = eqn.primitive.get_bind_params(params)
  out = eqn.primitive.bind(*invals, **bind_params)
  return list(out) if eqn.primitive.multiple_results else [out]


def _traced_dtypes(eqn):
  return [v.aval.dtype for v in eqn.invars]


def _eval_eqn(eqn, invals, cfg: _Config):
  name = eqn.primitive.name
  rule = cfg.rule(name)
  if name in _RECURSIVE_RULES and cfg.rules.get(name) != "off":
    return _RECURSIVE_RULES[name](eqn, invals, cfg)
  dtypes = [_dtype_of(v) if hasattr(v, "dtype") else None for v in invals]
  if not any(d is not None and _is_float(d) for d in dtypes):
    return _bind(eqn, invals)
  if rule == "low":
    return _eval_low(eqn, invals, cfg)
  if rule == "float32":
    invals = [_cast(v, _F32) if d is not None and _is_float(d) and d.itemsize < 4 else v
              for v, d in zip(invals, dtypes)]
    return _bind(eqn, _promote(invals, _weak(eqn)))
  if rule == "promote":
    return _bind(eqn, _promote(invals, _weak(eqn)))
  return _bind(eqn, _cast_like(invals, _traced_dtypes(eqn)))


def _weak(eqn):
  # A literal is a constant of the program (a Python scalar): it never widens an operation.
  return [isinstance(v, jex.core.Literal) or getattr(v.aval, "weak_type", False)
          for v in eqn.invars]


def _eval_low(eqn, invals, cfg: _Config):
  low = cfg.dtype
  cast = [_cast(v, low) if _is_float(_dtype_of(v)) and _dtype_of(v) != _F64
          and _dtype_of(v).itemsize >= 2 else v for v in invals]
  cast = _promote(cast, [False] * len(cast))
  params = dict(eqn.params)
  if params.get("preferred_element_type") is not None and all(
      _dtype_of(v) == low for v in cast if _is_float(_dtype_of(v))):
    # As jnp.matmul emits for half operands: the accumulation type is the backend's
    # (float32 on GPU, TPU and CPU), and the backward products stay in half precision.
    params["preferred_element_type"] = low
  return _bind(eqn, cast, params)


# ---- sub-jaxprs


def _inline(eqn, invals, cfg):
  jaxpr = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
  return _eval_closed(jaxpr, invals, cfg)


def _checkpoint(eqn, invals, cfg):
  params = eqn.params
  body = functools.partial(_eval_closed, params["jaxpr"], cfg=cfg)
  fn = jax.checkpoint(lambda *a: body(a), prevent_cse=params.get("prevent_cse", True),
                      policy=params.get("policy"))
  return list(fn(*invals))


def _cond(eqn, invals, cfg):
  index, *operands = invals
  out_dtypes = [v.aval.dtype for v in eqn.outvars]

  def branch(closed):
    def run(*ops_):
      return tuple(_cast_like(_eval_closed(closed, ops_, cfg), out_dtypes))
    return run

  return list(lax.switch(index, [branch(b) for b in eqn.params["branches"]], *operands))


def _while(eqn, invals, cfg):
  params = eqn.params
  nc, nb = params["cond_nconsts"], params["body_nconsts"]
  cond_consts, body_consts, init = invals[:nc], invals[nc:nc + nb], invals[nc + nb:]
  carry_dtypes = [v.aval.dtype for v in eqn.outvars]

  def cond_fn(carry):
    return _eval_closed(params["cond_jaxpr"], [*cond_consts, *carry], cfg)[0]

  def body_fn(carry):
    out = _eval_closed(params["body_jaxpr"], [*body_consts, *carry], cfg)
    return tuple(_cast_like(out, carry_dtypes))

  return list(lax.while_loop(cond_fn, body_fn, tuple(_cast_like(init, carry_dtypes))))


def _scan(eqn, invals, cfg):
  params = eqn.params
  n_consts, n_carry = params["num_consts"], params["num_carry"]
  consts, init, xs = (invals[:n_consts], invals[n_consts:n_consts + n_carry],
                      invals[n_consts + n_carry:])
  carry_dtypes = [v.aval.dtype for v in eqn.outvars[:n_carry]]

  def body(carry, x):
    out = _eval_closed(params["jaxpr"], [*consts, *carry, *x], cfg)
    return tuple(_cast_like(out[:n_carry], carry_dtypes)), tuple(out[n_carry:])

  carry, ys = lax.scan(body, tuple(_cast_like(init, carry_dtypes)), tuple(xs),
                       length=params["length"], reverse=params["reverse"],
                       unroll=params["unroll"])
  return [*carry, *ys]


def _all_float(avals) -> bool:
  return all(_is_float(a.dtype) for a in avals)


def _custom_jvp(eqn, invals, cfg):
  params = eqn.params
  call = _closed(params["call_jaxpr"])
  if params["num_consts"] or not _all_float([*call.in_avals, *call.out_avals]):
    return _bind(eqn, _cast_like(invals, _traced_dtypes(eqn)))
  jvp_jaxpr_fun = params["jvp_jaxpr_fun"]
  n = len(invals)

  @jax.custom_jvp
  def fn(*xs):
    return tuple(_eval_closed(call, xs, cfg))

  @fn.defjvp
  def fn_jvp(primals, tangents):
    outs = fn(*primals)
    jvp_jaxpr, jvp_consts, out_zeros = jvp_jaxpr_fun.call_wrapped(*([False] * n))
    res = _eval(_closed(jvp_jaxpr).jaxpr, [*_closed(jvp_jaxpr).consts, *jvp_consts],
                [*primals, *tangents], cfg)
    nz = iter(res[len(out_zeros):])
    tangents_out = tuple(jnp.zeros_like(o) if zero else _cast(next(nz), _dtype_of(o))
                         for o, zero in zip(outs, out_zeros))
    return outs, tangents_out

  return list(fn(*invals))


def _custom_vjp(eqn, invals, cfg):
  params = eqn.params
  call = _closed(params["call_jaxpr"])
  if params["num_consts"] or not _all_float([*call.in_avals, *call.out_avals]):
    return _bind(eqn, _cast_like(invals, _traced_dtypes(eqn)))
  n_in, n_out = len(invals), len(call.out_avals)
  fwd_jaxpr, fwd_consts = params["fwd_jaxpr_thunk"].call_wrapped(*([True] * n_in))
  fwd_jaxpr = _closed(fwd_jaxpr)
  n_res = len(fwd_jaxpr.out_avals) - n_out
  res_dtypes = [a.dtype for a in fwd_jaxpr.out_avals[:n_res]]
  out_dtypes = [a.dtype for a in call.out_avals]
  in_avals = [(jnp.shape(v), _dtype_of(v)) for v in invals]
  bwd = params["bwd"]

  def run_fwd(xs):
    outs = _eval(fwd_jaxpr.jaxpr, [*fwd_jaxpr.consts, *fwd_consts], xs, cfg)
    return tuple(_cast_like(outs[:n_res], res_dtypes)), tuple(outs[n_res:])

  @jax.custom_vjp
  def fn(*xs):
    return run_fwd(xs)[1]

  def fn_fwd(*xs):
    res, outs = run_fwd(xs)
    return outs, res

  def fn_bwd(res, cts):
    cts_in = bwd.call_wrapped(*res, *_cast_like(cts, out_dtypes))
    grads = []
    for ct, (shape, dtype) in zip(cts_in, in_avals):
      if ct is None or not hasattr(ct, "dtype") or type(ct).__name__ in ("Zero", "SymbolicZero"):
        grads.append(jnp.zeros(shape, dtype))
      else:
        grads.append(_cast(ct, dtype))
    return tuple(grads)

  fn.defvjp(fn_fwd, fn_bwd)
  return list(fn(*invals))


def _shard_map(eqn, invals, cfg):
  params = eqn.params
  body = params["jaxpr"]

  def run(*xs):
    return tuple(_eval_closed(body, xs, cfg))

  fn = jax.shard_map(run, mesh=params["mesh"], in_specs=tuple(params["in_specs"]),
                     out_specs=tuple(params["out_specs"]),
                     axis_names=set(params["newly_manual_axes"]),
                     check_vma=params["check_vma"])
  return list(fn(*invals))


_RECURSIVE_RULES = {
    "jit": _inline, "pjit": _inline, "closed_call": _inline, "core_call": _inline,
    "call": _inline,
    "remat": _checkpoint, "remat2": _checkpoint, "checkpoint": _checkpoint,
    "cond": _cond, "while": _while, "scan": _scan,
    "custom_jvp_call": _custom_jvp, "custom_vjp_call": _custom_vjp,
    "shard_map": _shard_map,
}


# ----------------------------------------------------------------------------- tracing and cache


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


class _Traced:
  """One trace of ``fn``: its jaxpr, output tree, and the jitted autocast evaluation."""

  def __init__(self, closed, out_tree, cfg: _Config, name: str):
    self.out_tree = out_tree

    def run(*flat):
      return _eval_closed(closed, flat, cfg)

    run.__name__ = f"autocast_{name}"
    self.run = jax.jit(run)


_cache: "collections.OrderedDict[Any, _Traced]" = collections.OrderedDict()
_cache_lock = threading.Lock()


def _trace(fn, cfg, name, dynamic, static, treedef):
  """Traces ``fn`` at the given arguments; returns a :class:`_Traced` and whether to cache it."""
  out_box = []

  def flat_fn(*dyn):
    it = iter(dyn)
    merged = [next(it) if is_dyn else value for is_dyn, value in static]
    args, kwargs = jax.tree.unflatten(treedef, merged)
    out = fn(*args, **kwargs)
    out_leaves, out_tree = jax.tree.flatten(out)
    out_box.append(out_tree)
    return out_leaves

  closed = jax.make_jaxpr(flat_fn)(*dynamic)
  tracers = any(isinstance(c, jax.core.Tracer) for c in closed.consts)
  return _Traced(closed, out_box[-1], cfg, name), not tracers


class _Autocast:
  """The function returned by :func:`autocast` (equal for equal ``fn`` and options)."""

  def __init__(self, fn: Callable[..., Any], cfg: _Config, enabled: bool):
    self._fn = fn
    self._cfg = cfg
    self._enabled = enabled
    functools.update_wrapper(self, fn)

  def __eq__(self, other):
    return (type(other) is _Autocast and self._fn == other._fn and self._cfg == other._cfg
            and self._enabled == other._enabled)

  def __hash__(self):
    return hash((_Autocast, self._fn, self._cfg, self._enabled))

  def __repr__(self):
    return (f"autocast({self._fn!r}, dtype={self._cfg.dtype.name}, enabled={self._enabled}"
            f"{', overrides=' + repr(dict(self._cfg.overrides)) if self._cfg.overrides else ''})")

  def __get__(self, obj, objtype=None):
    if obj is None:
      return self
    return functools.partial(self, obj)

  def __call__(self, *args, **kwargs):
    if not self._enabled:
      return self._fn(*args, **kwargs)
    leaves, treedef = jax.tree.flatten((args, kwargs))
    static = [(True, None) if _is_array(x) or isinstance(x, jax.core.Tracer) else (False, x)
              for x in leaves]
    dynamic = [x for x, (is_dyn, _) in zip(leaves, static) if is_dyn]
    key = None
    try:
      key = (self._fn, self._cfg, treedef,
             tuple(jax.typeof(x) if is_dyn else ("static", type(x), x)
                   for x, (is_dyn, _) in zip(leaves, static)))
      hash(key)
    except TypeError:
      key = None
    traced = None
    if key is not None:
      with _cache_lock:
        traced = _cache.get(key)
        if traced is not None:
          _cache.move_to_end(key)
    if traced is None:
      name = getattr(self._fn, "__name__", type(self._fn).__name__)
      traced, cacheable = _trace(self._fn, self._cfg, name, dynamic, static, treedef)
      if key is not None and cacheable:
        with _cache_lock:
          _cache[key] = traced
          while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return jax.tree.unflatten(traced.out_tree, traced.run(*dynamic))


def autocast(fn: Callable[..., Any], dtype: Any = jnp.float16, *, enabled: bool = True,
             overrides: Optional[Mapping[Union[str, Any], str]] = None) -> Callable[..., Any]:
  """Returns ``fn`` running each operation in the dtype ``torch.autocast`` would choose.

  ``fn`` is traced to a jaxpr once per input structure, shape and dtype (and
  per value of its non-array arguments, which are static), and the jaxpr is
  evaluated with per-operation dtypes:

  - **low precision** (``dot_general``, ``conv_general_dilated``): floating
    inputs other than float64 are cast to ``dtype``; products accumulate in
    float32 and return ``dtype``;
  - **float32** (``exp``, ``log``, ``log1p``, ``expm1``, ``pow``,
    ``integer_pow``, ``square``, ``sqrt``, ``rsqrt``, ``logistic``,
    ``erf_inv``, ``reduce_sum``, ``cumsum``, ...): 16-bit inputs are cast to
    float32, so softmax, log-softmax, norms, means and losses reduce in
    float32;
  - **promote** (arithmetic, comparisons, selections, data movement,
    activations): inputs of mixed floating dtypes are cast to the widest, and
    an op of one dtype runs in it;
  - any other primitive runs at the dtypes ``fn`` was traced with.

  The casts happen at the operation, so float32 parameters stay float32
  everywhere else and ``jax.grad`` returns float32 gradients for them; the
  backward pass follows the same per-operation dtypes. The outputs keep the
  dtype of the operation that produced them (a loss reduced by ``jnp.sum`` or
  ``jnp.mean`` is float32; logits from a final matmul are ``dtype``). Integer,
  boolean and key values are never cast.

  ``jit``, ``checkpoint``, ``cond``, ``while_loop``, ``scan``, ``shard_map``
  and ``custom_jvp``/``custom_vjp`` functions are recursed into. The outputs
  of ``cond`` and the carries of loops keep their traced dtypes. A
  ``custom_jvp`` rule is autocast like the function; a ``custom_vjp``'s
  forward pass is autocast and its backward rule runs as written, on
  residuals and cotangents cast to the dtypes it was traced with.

  Args:
    fn: the function to transform; its array arguments (pytrees of them) are
      traced, every other leaf is static and must be hashable to be cached.
    dtype: the low-precision dtype, ``float16`` (the default, as
      ``torch.autocast("cuda")``) or ``bfloat16``, or its name.
    enabled: ``False`` returns a function that calls ``fn`` unchanged.
    overrides: ``{primitive name or primitive: rule}`` with a rule among
      ``'low'``, ``'float32'``, ``'promote'`` and ``'off'`` (the traced
      dtypes), replacing the default list of that primitive.

  Returns:
    A function with the signature of ``fn``. Two calls of ``autocast`` with
    equal ``fn`` and options return equal functions, so a loss function
    wrapped anew each step does not make ``jax.jit`` compile again.

  Raises:
    ValueError: for a ``dtype`` other than float16 or bfloat16, or an
      unknown rule in ``overrides``.
    TypeError: for a ``dtype`` or ``overrides`` key that is not one.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxamp
    >>> def loss(w, x):
    ...   return jnp.mean(jax.nn.log_softmax(x @ w))
    >>> f = jaxamp.autocast(loss)
    >>> w, x = jnp.ones((3, 4)), jnp.ones((2, 3))
    >>> f(w, x).dtype
    dtype('float32')
    >>> jax.grad(f)(w, x).dtype
    dtype('float32')
    >>> jaxamp.autocast(lambda w, x: x @ w, "bf16")(w, x).dtype
    dtype(bfloat16)
  """
  if not callable(fn):
    raise TypeError(f"fn must be callable, got {fn!r}")
  if not isinstance(enabled, (bool, np.bool_)):
    raise TypeError(f"enabled must be a bool, got {enabled!r}")
  cfg = _make_config(dtype, overrides)
  return _Autocast(fn, cfg, bool(enabled))
