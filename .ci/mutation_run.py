"""``mutmut run`` with each mutant's tests in order of duration, fastest first.

mutmut's fork-server runner hands a mutant's tests to pytest in no particular order (its
plain fork runner sorts them); with pytest's -x, the first test that fails ends the run,
so running the fastest first makes a killed mutant cheap. The durations are those of the
stats pass.

MUTATION_SKIP_CLEAN=1 skips mutmut's clean-test pass: before the mutants, mutmut runs every
test that covers them on the unmutated code. The stats pass of the same run (or of an
earlier run on the same code) has already run those tests and stopped on any failure, so
on a slow machine the second pass can be skipped.
"""

import os
import sys

from mutmut.__main__ import cli
from mutmut.state import state
from mutmut.workers import isolation

_submit = isolation.ForkServerRunner.submit


def _submit_fastest_first(self, mutant_name, tests, cpu_time_limit, estimated_time):
  durations = state().duration_by_test
  tests = sorted(tests, key=lambda test: (durations.get(test, 0.0), test))
  return _submit(self, mutant_name, tests, cpu_time_limit, estimated_time)


isolation.ForkServerRunner.submit = _submit_fastest_first

if os.environ.get("MUTATION_SKIP_CLEAN") == "1":
  for runner in (isolation.ForkServerRunner, getattr(isolation, "ForkRunner", None)):
    if runner is not None:
      runner.run_clean_tests = lambda self, tests: 0

sys.exit(cli(["run", *sys.argv[1:]]))
