"""8-device tests, in a child process (see tests/_multidevice.py):

Data-parallel and fully sharded steps, and the detection of unreduced gradients.
"""

from tests import _multidevice


def test_multidevice_data_parallel():
  _multidevice.run("test_multidevice_data_parallel.py")
