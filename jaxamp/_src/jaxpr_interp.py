"""Interpreting jaxprs: every internal of JAX that jaxamp relies on, in one place.

:func:`jaxamp.autocast` and the fused selection
(:func:`jaxamp._src.selective_update.select_update`) evaluate jaxprs equation
by equation and bind each primitive again. Doing so needs a few things JAX
does not promise to keep: ``Primitive.get_bind_params``, the equation's context
(``JaxprEqn.ctx``) and source information (its name stack and traceback,
bound again through ``jax.extend.source_info_util.user_context``), and, for
autocast, the bodies of the primitives that carry sub-jaxprs. They are read
here and nowhere else.

**Bodies are replaced, not rebuilt.** An equation with bodies (``cond``,
``while``, ``scan``, a call) is interpreted by giving each sub-jaxpr found
among its parameters a new version, traced with ``jax.make_jaxpr`` at the
types the equation needs, and binding the same primitive again with every
other parameter unchanged (:func:`subjaxprs`, :func:`retrace`,
:func:`with_subjaxprs`). No parameter is read by name, so a release that
renames or regroups them (``scan``'s ``num_consts`` and ``num_carry`` became
``ft_in`` and ``ft_out``) changes nothing here. Where a body keeps its input
and output types (:func:`conform` casts to them exactly, weak types
included), every parameter stays valid by construction; a call's body takes
the types of its arguments (:func:`call_body`), which call primitives allow.
The custom derivative rules and ``shard_map`` are the exceptions: their rules
are functions, not jaxprs, or their body needs its mesh to be traced, so their
parameters are read by name (:func:`custom_jvp_parts`,
:func:`custom_vjp_parts`, :func:`shard_map_parts`).

:func:`check` is the guarded entry point, which both users call before they
interpret (what passed is remembered): it binds a small program again (failing
that, it raises :class:`InterpretError` and neither interprets anything), then
takes each family of primitives that autocast enters through the same
functions on a probe program, and returns the families that failed with the
reason. Autocast runs those at their traced dtypes, with a warning naming them.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._src import compat

_source_info: Any
try:  # public (jax.extend), though JAX may move it
  from jax.extend import source_info_util as _source_info
except ImportError:  # pragma: no cover -- reported by check()
  _source_info = None

_primitives: Any
try:  # the primitives JAX exports by a stable attribute name, whatever it calls them
  import jax.extend.core.primitives as _primitives
except ImportError:  # pragma: no cover -- then only the names spelled below are known
  _primitives = None

_convert: Any
try:  # the conversion that sets a weak type: lax.convert_element_type always makes a strong one
  from jax._src.lax.lax import _convert_element_type as _convert
except ImportError:  # pragma: no cover -- reported by check()
  _convert = None

Literal = jex_core.Literal
Var = jex_core.Var
DropVar = compat.DropVar
ClosedJaxpr = jex_core.ClosedJaxpr  # the same class as Jaxpr from jax 0.12 on


class InterpretError(RuntimeError):
  """JAX's internals are not what jaxamp's jaxpr interpretation expects."""


def _fail(what: str) -> InterpretError:
  return InterpretError(f"jax {jax.__version__}: {what}")


# ----------------------------------------------------------------------------- families


def _names(*attrs: str, also: Sequence[str] = ()) -> frozenset:
  """The names of ``jax.extend.core.primitives.<attr>`` in the installed JAX, and ``also``."""
  found = {getattr(getattr(_primitives, a, None), "name", None) for a in attrs}
  return frozenset(n for n in found | set(also) if isinstance(n, str))


#: The primitives autocast enters, by family. The names come from the installed JAX where it
#: exports the primitive (``closed_call`` is called ``eval_jaxpr`` from jax 0.12 on).
FAMILIES = {
    "call": _names("jit_p", "pjit_p", "closed_call_p", "call_p", "core_call_p"),
    "remat": _names("remat_p", also=("remat2",)),
    "cond": _names("cond_p"),
    "while": _names("while_p"),
    "scan": _names("scan_p"),
    "custom_jvp": _names("custom_jvp_call_p"),
    "custom_vjp": _names("custom_vjp_call_p"),
    "shard_map": _names("shard_map_p", also=("shard_map",)),
}
FAMILY_OF = {name: family for family, names in FAMILIES.items() for name in names}


def family(eqn: Any) -> Optional[str]:
  """The family of ``eqn``'s primitive among :data:`FAMILIES`, or ``None``."""
  return FAMILY_OF.get(eqn.primitive.name)


# ----------------------------------------------------------------------------- evaluation


def closed(jaxpr: Any) -> ClosedJaxpr:
  """``jaxpr`` as a closed jaxpr (sub-jaxprs of ``remat`` and calls may be open)."""
  if isinstance(jaxpr, ClosedJaxpr):
    return jaxpr
  return ClosedJaxpr(jaxpr, ())


def in_avals(jaxpr: Any) -> list:
  return [v.aval for v in closed(jaxpr).jaxpr.invars]


def out_avals(jaxpr: Any) -> list:
  return [v.aval for v in closed(jaxpr).jaxpr.outvars]


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


def in_scope(eqn: Any, name: str) -> bool:
  """Whether ``eqn`` was traced inside ``jax.named_scope(name)`` (of its own jaxpr)."""
  stack = getattr(eqn.source_info.name_stack, "stack", ())
  return any(type(s).__name__ == "Scope" and getattr(s, "name", None) == name for s in stack)


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


def as_function(jaxpr: Any) -> Callable[..., list]:
  """``jaxpr`` as a function of its inputs, evaluated as JAX evaluates it."""
  return jex_core.jaxpr_as_fun(closed(jaxpr))


def _bind_all(eqn: Any, invals: list) -> list:
  return bind_here(eqn, invals)


# ----------------------------------------------------------------------------- bodies


def _is_jaxpr(value: Any) -> bool:
  return isinstance(value, (jex_core.Jaxpr, ClosedJaxpr))


def _slots(params: dict) -> list:
  """``(key, index in a tuple or None, jaxpr)`` for each sub-jaxpr among ``params``."""
  found: list = []
  for key, value in params.items():
    if _is_jaxpr(value):
      found.append((key, None, value))
    elif isinstance(value, tuple):  # cond's branches, custom_linear_solve's named tuple
      found.extend((key, i, v) for i, v in enumerate(value) if _is_jaxpr(v))
  return found


def subjaxprs(eqn: Any) -> list:
  """The sub-jaxprs among ``eqn``'s parameters, alone or in a tuple, in parameter order."""
  return [jaxpr for _, _, jaxpr in _slots(eqn.params)]


def has_subjaxprs(eqn: Any) -> bool:
  """Whether ``eqn`` carries a body (a sub-jaxpr or a function to trace) in its parameters."""
  if subjaxprs(eqn):
    return True
  return any(callable(getattr(p, "call_wrapped", None)) for p in eqn.params.values())


def with_subjaxprs(eqn: Any, new: Sequence[Any]) -> dict:
  """``eqn``'s parameters with its sub-jaxprs replaced by ``new`` (in :func:`subjaxprs` order)."""
  params = dict(eqn.params)
  replacements = iter(new)
  for key, index, _ in _slots(eqn.params):
    if index is None:
      params[key] = next(replacements)
    else:
      items = list(params[key])
      items[index] = next(replacements)
      old = params[key]
      params[key] = type(old)(*items) if hasattr(old, "_fields") else type(old)(items)
  return params


def retrace(jaxpr: Any, fn: Callable[..., Sequence[Any]], avals: Sequence[Any]) -> Any:
  """The jaxpr of ``fn`` at ``avals``, of ``jaxpr``'s kind (closed or open) to replace it.

  Raises :class:`InterpretError` when ``jaxpr`` is open and ``fn`` makes
  constants, which an open jaxpr cannot hold.
  """
  new = jax.make_jaxpr(lambda *xs: list(fn(*xs)))(*avals)
  if isinstance(jaxpr, ClosedJaxpr):
    return new
  if new.consts:
    raise _fail("a body interpreted again makes constants, which its open jaxpr cannot hold")
  return new.jaxpr


def same_types(a: Any, b: Any) -> bool:
  """Whether two jaxprs take and return the same types (weak types included)."""
  return in_avals(a) == in_avals(b) and out_avals(a) == out_avals(b)


def conform(x: Any, aval: Any) -> Any:
  """``x`` cast to ``aval``'s dtype and weak type, if it is floating and differs."""
  x_aval = jax.typeof(x)
  if not (jnp.issubdtype(x_aval.dtype, jnp.floating) and jnp.issubdtype(aval.dtype, jnp.floating)):
    return x
  weak = bool(getattr(aval, "weak_type", False))
  if x_aval.dtype == aval.dtype and bool(getattr(x_aval, "weak_type", False)) == weak:
    return x
  return _convert(x, jnp.dtype(aval.dtype), weak_type=weak)


def retyped(aval: Any, x: Any) -> Any:
  """``aval`` with the dtype and weak type of the value ``x``: its shape, sharding kept."""
  x_aval = jax.typeof(x)
  return aval.update(dtype=x_aval.dtype, weak_type=bool(getattr(x_aval, "weak_type", False)))


def call_body(eqn: Any) -> Any:
  """The body of a call (``jit``, ``remat``...): its one sub-jaxpr, taking the equation's inputs."""
  bodies = subjaxprs(eqn)
  if (len(bodies) != 1 or len(in_avals(bodies[0])) != len(eqn.invars)
      or len(out_avals(bodies[0])) != len(eqn.outvars)):
    raise _fail(f"the {eqn.primitive.name!r} equation carries {len(bodies)} jaxprs, not one "
                "body taking its inputs and giving its outputs")
  return bodies[0]


def enter_call(eqn: Any, invals: Sequence[Any], run: Callable[[Any, Sequence[Any]], list]) -> list:
  """Binds the call ``eqn`` with its body replaced by ``run(body, args)`` at ``invals``' types."""
  body = call_body(eqn)
  avals = [retyped(a, x) for a, x in zip(in_avals(body), invals)]
  new = retrace(body, lambda *xs: run(body, xs), avals)
  return bind_here(eqn, invals, with_subjaxprs(eqn, [new]))


def enter_keeping_types(eqn: Any, invals: Sequence[Any],
                        run: Callable[[Any, Sequence[Any]], list]) -> list:
  """Binds ``eqn`` with each body replaced by ``run(body, args)`` at the body's own types.

  The new bodies take and return exactly the types of the old ones (the
  results of ``run`` are cast to them), and the inputs are cast to the types
  the equation was traced with, so every other parameter stays valid. Raises
  :class:`InterpretError` if a body's types cannot be kept.
  """
  new = []
  for body in subjaxprs(eqn):
    want = out_avals(body)
    fn = lambda *xs, body=body, want=want: [conform(o, a) for o, a in zip(run(body, xs), want)]
    replaced = retrace(body, fn, in_avals(body))
    if not same_types(replaced, body):
      raise _fail(f"a body of the {eqn.primitive.name!r} equation interpreted again takes "
                  f"{in_avals(replaced)} to {out_avals(replaced)}, not {in_avals(body)} to "
                  f"{out_avals(body)}")
    new.append(replaced)
  args = [conform(x, v.aval) for x, v in zip(invals, eqn.invars)]
  return bind_here(eqn, args, with_subjaxprs(eqn, new))


def with_bodies_at(eqn: Any, dtype: Any) -> dict:
  """``eqn``'s parameters with each sub-jaxpr retraced for floating inputs of ``dtype``.

  A primitive of the op lists may carry a body that computes on its element
  type, such as a scatter's combiner (``scatter-add`` adds two scalars): when
  autocast runs it in another dtype, the body follows.
  """
  new = []
  for body in subjaxprs(eqn):
    avals = [a.update(dtype=jnp.dtype(dtype), weak_type=False)
             if jnp.issubdtype(a.dtype, jnp.floating) else a for a in in_avals(body)]
    new.append(retrace(body, lambda *xs, body=body: _identity(body, xs), avals))
  return with_subjaxprs(eqn, new)


class WhileParts(NamedTuple):
  cond: ClosedJaxpr  # (*cond_consts, *carry) -> predicate
  body: ClosedJaxpr  # (*body_consts, *carry) -> carry
  cond_nconsts: int
  body_nconsts: int


def while_parts(eqn: Any) -> WhileParts:
  """A ``while`` equation's predicate and body, told apart by their types, not their names.

  The predicate returns one boolean scalar and the body the carry (the
  equation's outputs); the equation's inputs are the predicate's constants,
  the body's, then the initial carry.
  """
  carry = [v.aval for v in eqn.outvars]
  ins = [v.aval for v in eqn.invars]
  bodies = subjaxprs(eqn)
  for cond, body in ((bodies[0], bodies[-1]), (bodies[-1], bodies[0])) if len(bodies) == 2 else ():
    cond_out, body_out = out_avals(cond), out_avals(body)
    nc, nb = len(in_avals(cond)) - len(carry), len(in_avals(body)) - len(carry)
    if (len(cond_out) == 1 and cond_out[0].shape == () and cond_out[0].dtype == np.bool_
        and body_out == carry and nc >= 0 and nb >= 0 and len(ins) == nc + nb + len(carry)
        and in_avals(cond)[nc:] == carry and in_avals(body)[nb:] == carry
        and ins[:nc] == in_avals(cond)[:nc] and ins[nc:nc + nb] == in_avals(body)[:nb]):
      return WhileParts(closed(cond), closed(body), nc, nb)
  raise _fail(f"the {eqn.primitive.name!r} equation carries no predicate and body of the types "
              "of its carry")


# ----------------------------------------------------------------------------- read by name


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
  bwd: Callable[..., tuple]  # (*residuals, *cotangents) -> (flat input cotangents, logs)
  res_forwards: Callable[[], list]  # for each residual, the index of the input it is, or None
  symbolic_zeros: bool  # the rules see perturbation flags and symbolic zero cotangents


def custom_vjp_parts(eqn: Any) -> CustomVjpParts:
  """A ``custom_vjp_call``: its function, forward and backward rules.

  ``fwd(perturbed)`` traces the forward rule; its jaxpr takes the inputs and
  returns the residuals that are not inputs themselves, then the primal
  outputs. ``res_forwards()`` (valid after ``fwd``) gives, for each residual
  the backward rule takes, the index of the input it is (or ``None``).
  ``bwd`` returns one cotangent per input, a symbolic zero where there is none
  (see :func:`is_zero`), and the rule's logs (``defvjp_with_logs``, from jax
  0.12 on; ``None`` otherwise).
  """
  thunk, bwd, out_trees = (param(eqn, "fwd_jaxpr_thunk"), param(eqn, "bwd"),
                           param(eqn, "out_trees"))
  n_in = len(eqn.invars)

  def fwd(perturbed: Sequence[bool]) -> ClosedJaxpr:
    jaxpr, consts = thunk.call_wrapped(*perturbed)
    return _close_with(jaxpr, consts)

  def res_forwards() -> list:
    _, res_tree, forwards = out_trees()
    forwards = list(forwards)
    if len(forwards) != res_tree.num_leaves:
      raise _fail("custom_vjp_call's out_trees gives no input forwarding per residual")
    return forwards

  def cotangents(*args: Any) -> tuple:
    out, logs = bwd.call_wrapped(*args), None
    # From jax 0.12 on the rule returns (cotangents, logs); the cotangents themselves are
    # arrays or symbolic zeros, never a list, so the two layouts cannot be confused.
    if (isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[0], (tuple, list))
        and (out[1] is None or isinstance(out[1], dict))):
      out, logs = out
    out = list(out)
    if len(out) != n_in or any(isinstance(ct, (tuple, list)) for ct in out):
      raise _fail(f"custom_vjp_call's backward rule returns {len(out)} values for {n_in} inputs")
    return out, logs

  return CustomVjpParts(closed(param(eqn, "call_jaxpr")), int(param(eqn, "num_consts")), fwd,
                        cotangents, res_forwards, bool(param(eqn, "symbolic_zeros")))


def is_zero(x: Any) -> bool:
  """Whether ``x`` is one of JAX's symbolic zeros (or ``None``) rather than an array."""
  return x is None or type(x).__name__ in ("Zero", "SymbolicZero")


# ----------------------------------------------------------------------------- the check


_checked: dict = {}  # "core": True once binding works; "ok": the families that passed


def check() -> dict:
  """Checks what this module reads of JAX; returns ``{family: reason}`` of the families that fail.

  Raises :class:`InterpretError` when binding an equation again fails, which
  every use needs. Each family of :data:`FAMILIES` is then taken through the
  functions autocast uses for it, on a probe program built with JAX's public
  API: the bodies replaced, the rules traced and called, the equation bound
  again, and its output types compared. A family that fails is returned with
  the reason, and is not entered. What passes is not checked again; a family
  that failed is, at the next call (a failure may come of the context the
  call is made in, such as a mesh).
  """
  if "core" not in _checked:
    _check_core()
    _checked["core"] = True
  ok = _checked.setdefault("ok", set())
  failed = {}
  for name, probe in _PROBES.items():
    if name in ok:
      continue
    try:
      probe()
      ok.add(name)
    except Exception as err:  # noqa: BLE001 -- each failure disables its family, with the reason
      failed[name] = f"{type(err).__name__}: {err}"
  return failed


def _check_core() -> None:
  if not all(callable(getattr(_source_info, name, None))
             for name in ("user_context", "current_name_stack")):
    raise _fail("jax.extend.source_info_util has no user_context or current_name_stack")
  if not callable(getattr(jex_core.Primitive, "get_bind_params", None)):
    raise _fail("jax.extend.core.Primitive has no get_bind_params")
  closed_probe = jax.make_jaxpr(lambda x: x * 2.0)(1.0)
  eqn = closed_probe.jaxpr.eqns[0]
  for owner, attr in ((eqn, "ctx"), (getattr(eqn, "ctx", None), "manager"),
                      (eqn, "source_info"), (getattr(eqn, "source_info", None), "name_stack"),
                      (getattr(eqn, "source_info", None), "traceback")):
    if not hasattr(owner, attr):
      raise _fail(f"a jaxpr equation has no {attr!r} where jaxamp reads it")
  # Bind a small program again: a release that changes what binding takes fails here, as an
  # InterpretError, not later inside a user's trace.
  try:
    again = jax.make_jaxpr(lambda x: evaluate(closed_probe, [x], _bind_all))(1.0)
  except Exception as err:  # noqa: BLE001 -- whatever binding raises, it is reported as one error
    raise _fail(f"binding a jaxpr's equations again fails ({type(err).__name__}: {err})") from err
  if again.out_avals != closed_probe.out_avals:
    raise _fail(f"binding a jaxpr's equations again gives {again.out_avals}, not "
                f"{closed_probe.out_avals}")
  # Opt-out regions are read from the name stack: without it they would be silently ignored.
  scoped = jax.make_jaxpr(_in_check_scope)(1.0).jaxpr.eqns[0]
  if not in_scope(scoped, "jaxamp_check") or in_scope(eqn, "jaxamp_check"):
    raise _fail("an equation's name stack does not say which named scopes it was traced in")


def _in_check_scope(x: Any) -> Any:
  with jax.named_scope("jaxamp_check"):
    return jnp.sin(x)


def _probe_eqn(fn: Callable[..., Any], *args: Any, family_name: str) -> Any:
  """The first equation of ``family_name`` in the jaxpr of ``fn(*args)``."""
  for eqn in jax.make_jaxpr(fn)(*args).jaxpr.eqns:
    if family(eqn) == family_name:
      return eqn
  raise _fail(f"no equation of the {family_name!r} family in a program made to have one")


def _identity(jaxpr: Any, args: Sequence[Any]) -> list:
  return evaluate(jaxpr, args, _bind_all)


def _half(jaxpr: Any, args: Sequence[Any]) -> list:
  """The body evaluated on float16 values: a call's types follow its arguments'."""
  return _identity(jaxpr, [lax.convert_element_type(x, jnp.float16)
                           if jnp.issubdtype(jax.typeof(x).dtype, jnp.floating) else x
                           for x in args])


def _expect(fn: Callable[..., Any], args: Sequence[Any], want: Sequence[Any], what: str) -> None:
  """Checks the shapes and dtypes of what ``fn(*args)`` returns, by tracing it."""
  got = [(a.shape, jnp.dtype(a.dtype)) for a in jax.make_jaxpr(fn)(*args).out_avals]
  wanted = [(tuple(a.shape), jnp.dtype(a.dtype)) for a in want]
  if got != wanted:
    raise _fail(f"{what} gives {got}, not {wanted}")


_X = jax.ShapeDtypeStruct((2, 2), jnp.float32)
_X16 = jax.ShapeDtypeStruct((2, 2), jnp.float16)


def _check_call(name: str, fn: Callable[..., Any]) -> None:
  eqn = _probe_eqn(fn, _X, family_name=name)
  _expect(lambda x: enter_call(eqn, [x], _half), [_X], [_X16], f"a {name} entered at float16")


def _check_keeping_types(name: str, fn: Callable[..., Any]) -> None:
  eqn = _probe_eqn(fn, _X, family_name=name)
  if name == "while":
    while_parts(eqn)
  avals = [v.aval for v in eqn.invars]
  _expect(lambda *xs: enter_keeping_types(eqn, xs, _half), avals,
          [v.aval for v in eqn.outvars], f"a {name} entered")


def _check_custom_jvp() -> None:
  @jax.custom_jvp
  def f(x):
    return jnp.sin(x)

  f.defjvp(lambda primals, tangents: (f(primals[0]), tangents[0] * 2.0))
  parts = custom_jvp_parts(_probe_eqn(f, _X, family_name="custom_jvp"))
  jvp, out_zeros = parts.jvp([False])
  _expect(lambda p, t: _identity(jvp, [p, t]), [_X, _X], [_X, _X], "a custom_jvp rule")
  if out_zeros != [False] or parts.num_consts:
    raise _fail(f"a custom_jvp rule gives the zero tangents {out_zeros}")


def _check_custom_vjp() -> None:
  @jax.custom_vjp
  def f(x, y):
    return jnp.sin(x) * y

  f.defvjp(lambda x, y: (f(x, y), (jnp.cos(x), y)), lambda r, g: (r[0] * r[1] * g, None))
  parts = custom_vjp_parts(_probe_eqn(f, _X, _X, family_name="custom_vjp"))
  fwd = parts.fwd([True, True])
  forwards = parts.res_forwards()
  if forwards != [None, 1] or parts.num_consts:
    raise _fail(f"a custom_vjp forward rule forwards its residuals as {forwards}")

  def rules(x, y):
    res, out = _identity(fwd, [x, y])
    cts, logs = parts.bwd(res, y, out)
    if logs is not None:
      raise _fail(f"a custom_vjp backward rule without logs gives the logs {logs}")
    return [ct for ct in cts if not is_zero(ct)]

  _expect(rules, [_X, _X], [_X], "a custom_vjp rule")


def _check_shard_map() -> None:
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("jaxamp_check",))
  spec = jax.sharding.PartitionSpec()
  fn = jax.shard_map(lambda a: jnp.sin(a) * a, mesh=mesh, in_specs=(spec,), out_specs=spec)
  parts = shard_map_parts(_probe_eqn(fn, _X, family_name="shard_map"))
  again = jax.shard_map(lambda a: tuple(_half(parts.jaxpr, [a])), mesh=parts.mesh,
                        in_specs=parts.in_specs, out_specs=parts.out_specs,
                        axis_names=set(parts.axis_names), check_vma=parts.check_vma)
  _expect(again, [_X], [_X16], "a shard_map entered at float16")


def _scan(x: jax.Array) -> jax.Array:
  # A weakly typed carry too: a body's results are cast back to weak types.
  body = lambda c, y: ((jnp.sin(c[0]) * y, c[1] + c[1]), jnp.sum(c[0]))
  return lax.scan(body, (x, 1.0), jnp.ones((3, 2, 2)))[0][0]


def _while(x: jax.Array) -> jax.Array:
  return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.sin(c[1])), (0, x))[1]


_PROBES: dict = {
    "call": lambda: _check_call("call", jax.jit(lambda a: jnp.sin(a) * a)),
    "remat": lambda: _check_call("remat", jax.checkpoint(lambda a: jnp.sin(a) * a)),
    "cond": lambda: _check_keeping_types(
        "cond", lambda a: lax.cond(jnp.sum(a) > 0, jnp.sin, jnp.cos, a)),
    "while": lambda: _check_keeping_types("while", _while),
    "scan": lambda: _check_keeping_types("scan", _scan),
    "custom_jvp": _check_custom_jvp,
    "custom_vjp": _check_custom_vjp,
    "shard_map": _check_shard_map,
}
