"""Stateful facades with the APIs of PyTorch, mmengine and Paddle, over the functional core.

``torch.py`` and ``paddle.py`` (the two ``GradScaler`` classes, sharing ``holder.py``,
``stages.py``, ``scaler_state.py`` and ``scaled_loss.py``), ``mmengine/`` (the optimizer
wrappers), ``torch_optimizers.py`` (PyTorch's update rules as optax transformations, their
hyperparameters in optax's state through ``hyperparam_codecs.py``) and ``builder.py``
(``build_optim_wrapper``). ``errors.py`` holds the exception types that are both the original's
and Python's usual one.
"""
