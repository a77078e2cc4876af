"""The 8-device soundness battery (tests/multidevice/), in a child process (see tests/_multidevice.py).

The other 8-device files run from the other ``tests/test_multidevice_*.py``
files; this one also checks that every file of tests/multidevice/ runs in
exactly one group.
"""

import pathlib

from tests import _multidevice


def test_every_multidevice_file_runs_in_exactly_one_group():
  files = sorted(p.name for p in _multidevice.DIR.glob("test_*.py"))
  grouped = sorted(name for group in _multidevice.GROUPS.values() for name in group)
  assert grouped == files
  here = pathlib.Path(__file__).resolve().parent
  for wrapper in _multidevice.GROUPS:
    text = (here / wrapper).read_text(encoding="utf-8")
    assert f'_multidevice.run("{wrapper}")' in text, wrapper


def test_multidevice_soundness():
  _multidevice.run("test_multidevice.py")
