"""mmengine's optimizer wrappers for optax, one concept per module (``docs/design.md`` maps them).

The wrappers (``optim_wrapper``, ``amp_optim_wrapper``, ``optim_wrapper_dict``) use the rooms below
them (counting, clip, param_groups, jit_args, sharding_pins, trees), never the other way round.
"""
