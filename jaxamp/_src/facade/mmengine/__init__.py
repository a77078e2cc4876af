"""mmengine's optimizer wrappers for optax, one concept per module.

* :mod:`.optim_wrapper`: ``OptimWrapper`` (accumulation, clipping, the
  jitted steps, the optimizer-holder protocol the scalers step);
* :mod:`.amp_optim_wrapper`: ``AmpOptimWrapper`` (loss scaling, compute dtype);
* :mod:`.optim_wrapper_dict`: ``OptimWrapperDict`` (named wrappers);
* :mod:`.counting`: mmengine's accumulation counters and loss factors;
* :mod:`.clip`: ``clip_grad`` parsing;
* :mod:`.param_groups`: parameter groups (their books, the live
  ``param_groups[i]`` view, saved groups);
* :mod:`.jit_args`: the static/dynamic split of a loss-function call;
* :mod:`.sharding_pins`: outputs kept on the parameters' shardings;
* :mod:`.trees`: leaf names and checks of user pytrees.

Dependencies point down this list's reverse: the wrappers use the rooms
below them, never the other way round.
"""
