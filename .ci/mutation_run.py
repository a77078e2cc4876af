"""``mutmut run`` with the clean-test pass skipped when MUTATION_SKIP_CLEAN=1.

Before the mutants, mutmut runs every test that covers them on the unmutated code. The
stats pass of the same run (or of an earlier run on the same code) has already run those
tests and stopped on any failure, so on a slow machine the second pass can be skipped.
"""

import os
import sys

from mutmut.__main__ import cli
from mutmut.workers import isolation

if os.environ.get("MUTATION_SKIP_CLEAN") == "1":
  for runner in (isolation.ForkServerRunner, getattr(isolation, "ForkRunner", None)):
    if runner is not None:
      runner.run_clean_tests = lambda self, tests: 0

sys.exit(cli(["run", *sys.argv[1:]]))
