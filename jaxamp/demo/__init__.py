"""The jaxamp demo: ``python -m jaxamp.demo`` (needs flax and matplotlib: ``pip install 'jaxamp[demo]'``).

Trains a small Flax MLP on a synthetic spirals dataset generated on the fly,
in float16 compute with float32 master parameters, dynamic loss scaling
(:func:`jaxamp.dynamic_loss_scale`), gradient accumulation
(:func:`jaxamp.accumulate_gradients`) and clipping, using
:class:`jaxamp.TrainState`. It shows a progress bar with the loss and the
current scale, prints a summary and writes ``metrics.json`` and
``training.png`` to its output folder (``demo_output/`` by default). The
same command runs on GPU or TPU when JAX sees one.

``python -m jaxamp.demo.underflow`` draws the float16 underflow showcase: a
model whose gradients vanish in float16 without loss scaling.

This package is not imported by ``import jaxamp``.
"""
