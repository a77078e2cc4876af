"""8-device tests, in a child process (see tests/_multidevice.py):

The facades, bfloat16 params and autocast on sharded arrays.
"""

from tests import _multidevice


def test_multidevice_facades():
  _multidevice.run("test_multidevice_facades.py")
