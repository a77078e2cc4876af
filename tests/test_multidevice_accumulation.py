"""8-device tests, in a child process (see tests/_multidevice.py):

Accumulation (in-step and across micro-steps) on sharded params, and two processes joined by
jax.distributed.
"""

from tests import _multidevice


def test_multidevice_accumulation():
  _multidevice.run("test_multidevice_accumulation.py")
