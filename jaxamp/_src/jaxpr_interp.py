"""Interpreting jaxprs: every internal of JAX that jaxamp relies on, in one place.

:func:`jaxamp.autocast` and the fused selection
(:func:`jaxamp._src.selective_update.select_update`) evaluate jaxprs equation
by equation and bind each primitive again. Doing so needs a few things JAX
does not promise to keep: ``Primitive.get_bind_params``, the equation's context
(``JaxprEqn.ctx``) and source information (its name stack and traceback,
bound again through ``jax.extend.source_info_util.user_context``), and the
parameter names of the primitives with sub-jaxprs (``jit``, ``cond``,
``while``, ``scan``, ``remat``, ``custom_jvp_call``, ``custom_vjp_call``,
``shard_map``). They are read here and nowhere else.

:func:`check` is the guarded entry point: both users call it before they
interpret anything. When a JAX release moves one of these pieces, it raises
:class:`InterpretError` naming the piece and the JAX version, and the
accessors below raise the same error for a parameter that is gone, so that
the next release breaks here, loudly, rather than somewhere inside a trace.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import jax
import jax.extend.core as jex_core

from jaxamp._src import compat

_source_info: Any
try:  # public (jax.extend), though JAX may move it
  from jax.extend import source_info_util as _source_info
except ImportError:  # pragma: no cover -- reported by check()
  _source_info = None

Literal = jex_core.Literal
Var = jex_core.Var
DropVar = compat.DropVar
ClosedJaxpr = jex_core.ClosedJaxpr


class InterpretError(RuntimeError):
  """JAX's internals are not what jaxamp's jaxpr interpretation expects."""


def _fail(what: str) -> InterpretError:
  return InterpretError(f"jax {jax.__version__}: {what}; jaxamp's jaxpr interpretation supports "
                        "jax 0.7.1 to 0.10.2 and the releases `.ci/newest` has checked")


_checked: list = []


def check() -> None:
  """Checks, once, that the internals this module reads exist; raises :class:`InterpretError`."""
  if _checked:
    return
  if not all(callable(getattr(_source_info, name, None))
             for name in ("user_context", "current_name_stack")):
    raise _fail("jax.extend.source_info_util has no user_context or current_name_stack")
  if not callable(getattr(jex_core.Primitive, "get_bind_params", None)):
    raise _fail("jax.extend.core.Primitive has no get_bind_params")
  closed = jax.make_jaxpr(lambda x: x * 2.0)(1.0)
  eqn = closed.jaxpr.eqns[0]
  for owner, attr in ((eqn, "ctx"), (getattr(eqn, "ctx", None), "manager"),
                      (eqn, "source_info"), (getattr(eqn, "source_info", None), "name_stack"),
                      (getattr(eqn, "source_info", None), "traceback")):
    if not hasattr(owner, attr):
      raise _fail(f"a jaxpr equation has no {attr!r} where jaxamp reads it")
  # Bind a small program again, a call with a body included: a release that changes what
  # binding takes fails here, as an InterpretError, not later inside a user's trace.
  probe = jax.make_jaxpr(lambda x: jax.jit(lambda y: y * 2.0)(x) + 1.0)(1.0)
  try:
    if not has_subjaxprs(probe.jaxpr.eqns[0]):
      raise _fail("a jit equation carries no jaxpr among its parameters")
    again = jax.make_jaxpr(lambda x: evaluate(probe, [x], bind_here))(1.0)
  except InterpretError:
    raise
  except Exception as err:  # noqa: BLE001 -- whatever binding raises, it is reported as one error
    raise _fail(f"binding a jaxpr's equations again fails ({type(err).__name__}: {err})") from err
  if again.out_avals != probe.out_avals:
    raise _fail(f"binding a jaxpr's equations again gives {again.out_avals}, not {probe.out_avals}")
  _checked.append(True)


# ----------------------------------------------------------------------------- evaluation


def closed(jaxpr: Any) -> ClosedJaxpr:
  """``jaxpr`` as a closed jaxpr (sub-jaxprs of ``remat`` and calls may be open)."""
  if isinstance(jaxpr, ClosedJaxpr):
    return jaxpr
  return ClosedJaxpr(jaxpr, ())


_entered = threading.local()  # .stacks: the full name stacks of the contexts entered


@contextlib.contextmanager
def context(eqn: Any) -> Iterator[None]:
  """The context ``eqn`` was traced in: its name stack, traceback, mesh and compute type."""
  info = eqn.source_info
  name_stack = _source_info.current_name_stack() + info.name_stack
  # JAX traces the body of a scan, a cond, a jit... with a name stack of its own: the full one
  # is the enclosing equation's, then this one's.
  stacks = _entered.__dict__.setdefault("stacks", [])
  stacks.append(stacks[-1] + info.name_stack if stacks else name_stack)
  try:
    with _source_info.user_context(info.traceback, name_stack=name_stack), eqn.ctx.manager:
      yield
  finally:
    stacks.pop()


def name_stack() -> str:
  """The full name stack of the equation being evaluated (outermost names first), as text."""
  stacks = getattr(_entered, "stacks", None)
  return str(stacks[-1] if stacks else _source_info.current_name_stack())


def bind(eqn: Any, invals: Sequence[Any], params: Optional[dict] = None) -> list:
  """Binds ``eqn``'s primitive on ``invals`` in the equation's context; a list of outputs."""
  with context(eqn):
    return bind_here(eqn, invals, params)


def bind_here(eqn: Any, invals: Sequence[Any], params: Optional[dict] = None) -> list:
  """Binds ``eqn``'s primitive on ``invals`` where :func:`evaluate` has entered its context."""
  params = eqn.params if params is None else params
  subfuns, bind_params = compat.bind_params(eqn.primitive, params)
  out = eqn.primitive.bind(*subfuns, *invals, **bind_params)
  return list(out) if eqn.primitive.multiple_results else [out]


class Env:
  """The values of a jaxpr's variables during one evaluation."""

  def __init__(self) -> None:
    self.values: dict = {}

  def read(self, v: Any) -> Any:
    return v.val if isinstance(v, Literal) else self.values[v]

  def write(self, v: Any, val: Any) -> None:
    if not isinstance(v, DropVar):
      self.values[v] = val


def evaluate(jaxpr: Any, args: Sequence[Any],
             eval_eqn: Callable[[Any, list], Sequence[Any]]) -> list:
  """Evaluates the (closed) ``jaxpr`` on ``args``; ``eval_eqn(eqn, invals)`` runs each equation.

  ``eval_eqn`` runs inside the equation's :func:`context`, so what it binds
  (with :func:`bind_here`, or anything it traces) keeps the equation's name
  stack and source information.
  """
  jaxpr = closed(jaxpr)
  env = Env()
  for v, val in zip(jaxpr.jaxpr.constvars, jaxpr.consts):
    env.write(v, val)
  for v, val in zip(jaxpr.jaxpr.invars, args):
    env.write(v, val)
  for eqn in jaxpr.jaxpr.eqns:
    invals = [env.read(v) for v in eqn.invars]
    with context(eqn):
      outvals = eval_eqn(eqn, invals)
    for v, val in zip(eqn.outvars, outvals):
      env.write(v, val)
  return [env.read(v) for v in jaxpr.jaxpr.outvars]


def has_subjaxprs(eqn: Any) -> bool:
  """Whether ``eqn`` carries a body (a sub-jaxpr or a function to trace) in its parameters."""
  if any(True for _ in compat.jaxprs_in_params(eqn.params)):
    return True
  return any(callable(getattr(p, "call_wrapped", None)) for p in eqn.params.values())


# ----------------------------------------------------------------------------- parameters


def param(eqn: Any, key: str) -> Any:
  """``eqn.params[key]``, or :class:`InterpretError` naming the primitive and the key."""
  try:
    return eqn.params[key]
  except KeyError:
    raise _fail(f"the {eqn.primitive.name!r} equation has no parameter {key!r} (it has "
                f"{sorted(eqn.params)})") from None


def _close_with(jaxpr: Any, consts: Sequence[Any]) -> ClosedJaxpr:
  """A jaxpr whose constant variables take ``consts`` (after its own, if it is closed)."""
  if isinstance(jaxpr, ClosedJaxpr):
    return ClosedJaxpr(jaxpr.jaxpr, [*jaxpr.consts, *consts])
  return ClosedJaxpr(jaxpr, list(consts))


class JitParts(NamedTuple):
  jaxpr: ClosedJaxpr
  name: str
  in_shardings: tuple
  out_shardings: tuple
  donated: tuple
  keep_unused: bool
  inline: bool


def jit_parts(eqn: Any) -> JitParts:
  return JitParts(closed(param(eqn, "jaxpr")), str(param(eqn, "name")),
                  tuple(param(eqn, "in_shardings")), tuple(param(eqn, "out_shardings")),
                  tuple(param(eqn, "donated_invars")), bool(param(eqn, "keep_unused")),
                  bool(param(eqn, "inline")))


def call_jaxpr(eqn: Any) -> ClosedJaxpr:
  """The body of a call primitive (``closed_call``, ``core_call``, ``call``)."""
  for key in ("call_jaxpr", "jaxpr"):
    if key in eqn.params:
      return closed(eqn.params[key])
  raise _fail(f"the {eqn.primitive.name!r} equation has no 'call_jaxpr' or 'jaxpr' parameter")


class RematParts(NamedTuple):
  jaxpr: ClosedJaxpr
  prevent_cse: bool
  policy: Any


def remat_parts(eqn: Any) -> RematParts:
  return RematParts(closed(param(eqn, "jaxpr")), bool(param(eqn, "prevent_cse")),
                    param(eqn, "policy"))


def cond_branches(eqn: Any) -> list:
  return [closed(b) for b in param(eqn, "branches")]


class WhileParts(NamedTuple):
  cond: ClosedJaxpr
  body: ClosedJaxpr
  cond_nconsts: int
  body_nconsts: int


def while_parts(eqn: Any) -> WhileParts:
  return WhileParts(closed(param(eqn, "cond_jaxpr")), closed(param(eqn, "body_jaxpr")),
                    int(param(eqn, "cond_nconsts")), int(param(eqn, "body_nconsts")))


class ScanParts(NamedTuple):
  jaxpr: ClosedJaxpr
  num_consts: int
  num_carry: int
  length: int
  reverse: bool
  unroll: Any


def scan_parts(eqn: Any) -> ScanParts:
  return ScanParts(closed(param(eqn, "jaxpr")), int(param(eqn, "num_consts")),
                   int(param(eqn, "num_carry")), int(param(eqn, "length")),
                   bool(param(eqn, "reverse")), param(eqn, "unroll"))


class ShardMapParts(NamedTuple):
  jaxpr: ClosedJaxpr
  mesh: Any
  in_specs: tuple
  out_specs: tuple
  axis_names: frozenset
  check_vma: bool


def shard_map_parts(eqn: Any) -> ShardMapParts:
  # The axes this shard_map makes manual: 'newly_manual_axes' on newer releases, 'manual_axes'
  # on the oldest supported (jax 0.7.1).
  key = "manual_axes" if "newly_manual_axes" not in eqn.params else "newly_manual_axes"
  return ShardMapParts(closed(param(eqn, "jaxpr")), param(eqn, "mesh"),
                       tuple(param(eqn, "in_specs")), tuple(param(eqn, "out_specs")),
                       frozenset(param(eqn, key)), bool(param(eqn, "check_vma")))


class CustomJvpParts(NamedTuple):
  call: ClosedJaxpr
  num_consts: int
  jvp: Callable[[Sequence[bool]], tuple]  # in_zeros -> (closed jvp jaxpr, out_zeros)
  symbolic_zeros: bool  # the rule sees symbolic zero tangents (else instantiated zeros)


def custom_jvp_parts(eqn: Any) -> CustomJvpParts:
  """A ``custom_jvp_call``: its function, the count of closed-over values, and its rule.

  ``jvp(in_zeros)`` traces the rule for the tangents that are not zero; the
  jaxpr takes the primals, then those tangents, and returns the primal
  outputs, then the tangents of the outputs not in ``out_zeros``.
  """
  fun = param(eqn, "jvp_jaxpr_fun")

  def jvp(in_zeros: Sequence[bool]) -> tuple:
    jaxpr, consts, out_zeros = fun.call_wrapped(*in_zeros)
    return _close_with(jaxpr, consts), list(out_zeros)

  return CustomJvpParts(closed(param(eqn, "call_jaxpr")), int(param(eqn, "num_consts")), jvp,
                        bool(param(eqn, "symbolic_zeros")))


class CustomVjpParts(NamedTuple):
  call: ClosedJaxpr
  num_consts: int
  fwd: Callable[[Sequence[bool]], ClosedJaxpr]  # perturbed inputs -> fwd jaxpr
  bwd: Callable[..., Sequence[Any]]  # (*residuals, *cotangents) -> flat input cotangents
  res_forwards: Callable[[], list]  # for each residual, the index of the input it is, or None
  symbolic_zeros: bool  # the rules see perturbation flags and symbolic zero cotangents


def custom_vjp_parts(eqn: Any) -> CustomVjpParts:
  """A ``custom_vjp_call``: its function, forward and backward rules.

  ``fwd(perturbed)`` traces the forward rule; its jaxpr takes the inputs and
  returns the residuals that are not inputs themselves, then the primal
  outputs. ``res_forwards()`` (valid after ``fwd``) gives, for each residual
  the backward rule takes, the index of the input it is (or ``None``).
  ``bwd`` returns one cotangent per input, a symbolic zero where there is none
  (see :func:`is_zero`).
  """
  thunk, bwd, out_trees = (param(eqn, "fwd_jaxpr_thunk"), param(eqn, "bwd"),
                           param(eqn, "out_trees"))

  def fwd(perturbed: Sequence[bool]) -> ClosedJaxpr:
    jaxpr, consts = thunk.call_wrapped(*perturbed)
    return _close_with(jaxpr, consts)

  def res_forwards() -> list:
    _, res_tree, forwards = out_trees()
    forwards = list(forwards)
    if len(forwards) != res_tree.num_leaves:
      raise _fail("custom_vjp_call's out_trees gives no input forwarding per residual")
    return forwards

  return CustomVjpParts(closed(param(eqn, "call_jaxpr")), int(param(eqn, "num_consts")), fwd,
                        lambda *args: list(bwd.call_wrapped(*args)), res_forwards,
                        bool(param(eqn, "symbolic_zeros")))


def is_zero(x: Any) -> bool:
  """Whether ``x`` is one of JAX's symbolic zeros (or ``None``) rather than an array."""
  return x is None or type(x).__name__ in ("Zero", "SymbolicZero")
