"""Precision policies: which dtype parameters, computation and outputs use."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Union, cast

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._src import validation

DTypeLike = Union[str, type, np.dtype]

_DTYPE_NAMES = {
    "float32": jnp.float32, "f32": jnp.float32, "fp32": jnp.float32, "full": jnp.float32,
    "single": jnp.float32,
    "float16": jnp.float16, "f16": jnp.float16, "fp16": jnp.float16, "half": jnp.float16,
    "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
    "float64": jnp.float64, "f64": jnp.float64, "fp64": jnp.float64, "double": jnp.float64,
}
_KEYS = {"params": "param_dtype", "param": "param_dtype", "p": "param_dtype",
         "compute": "compute_dtype", "c": "compute_dtype",
         "output": "output_dtype", "o": "output_dtype"}
_ACCEPTED = (
    "'params=float32,compute=float16,output=float32' (keys params|p, compute|c, output|o; "
    f"dtypes {', '.join(sorted(_DTYPE_NAMES))}; keys left out are float32, so 'c=f16' is "
    "enough)")


def _ambiguous(spec: Any, name: str) -> ValueError:
  return ValueError(
      f"A single dtype ({spec!r}) is ambiguous as a policy: jmp's get_policy reads it as that "
      f"dtype everywhere ('params={name},compute={name},output={name}'), and earlier jaxamp "
      f"versions as 'params=float32,compute={name},output=float32'. Write the one you mean, "
      f"e.g. 'params=float32,compute={name},output=float32' (or 'c={name}'), or use "
      f"jaxamp.autocast(fn, {name!r}) for per-operation dtypes, as torch.autocast; accepted: "
      f"{_ACCEPTED}")


def canonical_dtype(dtype: DTypeLike, name: str = "dtype") -> jnp.dtype:
  """Turns a dtype name (``'bf16'``, ``'float16'``...) or a floating dtype into a ``jnp.dtype``."""
  if isinstance(dtype, str):
    key = dtype.strip().lower()
    if key not in _DTYPE_NAMES:
      raise ValueError(f"{name} must be one of {sorted(_DTYPE_NAMES)} or a floating jnp dtype, "
                       f"got {dtype!r}")
    return jnp.dtype(_DTYPE_NAMES[key])
  return cast(jnp.dtype, validation.check_float_dtype(name, dtype))


def _cast_floating(tree: Any, dtype: jnp.dtype) -> Any:
  # These casts choose the dtype the computation runs in; nothing relies on a value having been
  # rounded by them. Where XLA keeps more precision (on a GPU it removes every
  # convert(convert(x: f32) -> f16) -> f32), the computation is more precise, and the gradients
  # and the loss scaler's check read the values the program computed, whatever they are.
  def cast(x):
    if isinstance(x, (jax.Array, np.ndarray, np.generic)) and jnp.issubdtype(x.dtype, jnp.floating):
      return x.astype(dtype)
    return x

  return jax.tree.map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
  """A mixed-precision policy: the dtypes of parameters, computation and outputs.

  Casts touch only floating-point array leaves; integers, booleans and
  non-array leaves pass through unchanged.

  Attributes:
    param_dtype: the dtype of the master parameters (usually float32).
    compute_dtype: the dtype the forward and backward pass run in.
    output_dtype: the dtype of the outputs (usually float32, for the loss).

  Examples:
    >>> import jax.numpy as jnp, jaxamp
    >>> policy = jaxamp.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
    >>> policy.cast_to_compute({'w': jnp.ones(2), 'step': jnp.array(3)})['w'].dtype
    dtype(bfloat16)
  """

  param_dtype: Any = jnp.float32
  compute_dtype: Any = jnp.float32
  output_dtype: Any = jnp.float32

  def __post_init__(self):
    for field in ("param_dtype", "compute_dtype", "output_dtype"):
      object.__setattr__(self, field, canonical_dtype(getattr(self, field), field))

  def cast_to_param(self, tree: Any) -> Any:
    """Casts the floating leaves of ``tree`` to ``param_dtype``."""
    return _cast_floating(tree, self.param_dtype)

  def cast_to_compute(self, tree: Any) -> Any:
    """Casts the floating leaves of ``tree`` to ``compute_dtype``."""
    return _cast_floating(tree, self.compute_dtype)

  def cast_to_output(self, tree: Any) -> Any:
    """Casts the floating leaves of ``tree`` to ``output_dtype``."""
    return _cast_floating(tree, self.output_dtype)

  def __str__(self) -> str:
    return (f"params={self.param_dtype.name},compute={self.compute_dtype.name},"
            f"output={self.output_dtype.name}")


def get_policy(spec: Union[str, Policy]) -> Policy:
  """Parses a policy string such as ``"params=float32,compute=float16,output=float32"``.

  This is jmp-style whole casting; for per-operation dtypes, as
  ``torch.autocast``, see :func:`jaxamp.autocast`.

  Short forms are accepted: ``"p=f32,c=bf16,o=f32"``; keys left out default
  to float32, so ``"c=f16"`` is float32 parameters and outputs with float16
  compute. A :class:`Policy` is returned unchanged.

  A single dtype (``"half"``, ``"bf16"``, ``jnp.float16``) is refused: jmp's
  ``get_policy("half")`` means half precision everywhere (parameters
  included), while the reading natural for mixed precision is float32
  parameters and outputs with half compute. Code ported from jmp would
  silently get the other one, so the error names both and asks for the
  explicit form.

  Args:
    spec: a policy string, a floating dtype or a :class:`Policy`.

  Returns:
    The :class:`Policy`.

  Raises:
    ValueError: for an unknown key, dtype or form, a repeated key, or a
      single dtype; the message lists the accepted forms.
    TypeError: for a ``spec`` that is neither a string, a dtype nor a Policy.

  Examples:
    >>> import jaxamp
    >>> print(jaxamp.get_policy("p=f32,c=bf16,o=f32"))
    params=float32,compute=bfloat16,output=float32
    >>> print(jaxamp.get_policy("c=half"))
    params=float32,compute=float16,output=float32
  """
  if isinstance(spec, Policy):
    return spec
  if not isinstance(spec, str):
    if not isinstance(spec, (type, np.dtype)):
      raise TypeError(f"policy must be a string or a jaxamp.Policy, "
                      f"got {spec!r}; accepted strings: {_ACCEPTED}")
    raise _ambiguous(spec, canonical_dtype(spec, "policy").name)
  text = spec.strip().lower()
  if "=" not in text:
    if text not in _DTYPE_NAMES:
      raise ValueError(f"Unknown policy {spec!r}; accepted: {_ACCEPTED}")
    raise _ambiguous(spec, jnp.dtype(_DTYPE_NAMES[text]).name)
  fields = {}
  for item in text.split(","):
    key, sep, value = (part.strip() for part in item.partition("="))
    if not sep or key not in _KEYS or value not in _DTYPE_NAMES or _KEYS[key] in fields:
      raise ValueError(f"Cannot parse {item!r} in policy {spec!r}; accepted: {_ACCEPTED}")
    fields[_KEYS[key]] = _DTYPE_NAMES[value]
  return Policy(**fields)


def mixed_precision(loss_fn: Callable[..., Any], policy: Union[str, Policy]) -> Callable[..., Any]:
  """Returns the mixed-precision version of ``loss_fn(params, *args, **kwargs)``.

  The floating leaves of the parameters and of the array arguments are cast to
  the policy's compute dtype *inside* the function, and the outputs to its
  output dtype. Differentiated with respect to float32 master parameters, the
  gradients therefore come back in float32 while the forward and backward
  passes run in half precision. Integer leaves (labels, indices) and
  non-array leaves are passed through unchanged; if a floating argument must
  stay in full precision, close over it instead of passing it.

  Every operation then runs in the compute dtype, exponentials, sums and norms
  included; :func:`jaxamp.autocast` keeps those in float32.

  Args:
    loss_fn: a function whose first argument is the (master) parameters.
    policy: a :class:`Policy` or anything :func:`get_policy` accepts.

  Returns:
    A function with the signature of ``loss_fn``.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxamp
    >>> loss = lambda p, x: jnp.sum(p['w'] * x)
    >>> f = jaxamp.mixed_precision(loss, "p=f32,c=f16,o=f32")
    >>> f({'w': jnp.ones(3)}, jnp.ones(3)).dtype
    dtype('float32')
    >>> jax.grad(f)({'w': jnp.ones(3)}, jnp.ones(3))['w'].dtype
    dtype('float32')
  """
  return _MixedPrecision(loss_fn, get_policy(policy))


class _MixedPrecision:
  """``loss_fn`` run under ``policy``; equal to every other wrapping of the same two.

  So a wrapper built anew inside a training loop (as ``with torch.autocast():``
  is entered every iteration) is the same static argument to ``jax.jit`` each
  time, and nothing recompiles.
  """

  def __init__(self, loss_fn: Callable[..., Any], policy: Policy):
    self.loss_fn, self.policy = loss_fn, policy
    functools.update_wrapper(self, loss_fn)

  def __call__(self, params: Any, *args: Any, **kwargs: Any) -> Any:
    params, args, kwargs = self.policy.cast_to_compute((params, args, kwargs))
    return self.policy.cast_to_output(self.loss_fn(params, *args, **kwargs))

  def __eq__(self, other: Any) -> bool:
    return (isinstance(other, _MixedPrecision) and self.loss_fn == other.loss_fn
            and self.policy == other.policy)

  def __hash__(self) -> int:
    return hash((self.loss_fn, self.policy))
