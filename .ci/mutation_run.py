"""``mutmut run`` with each mutant's tests in order of duration, fastest first.

mutmut's fork-server runner hands a mutant's tests to pytest in no particular order (its
plain fork runner sorts them); with pytest's -x, the first test that fails ends the run,
so running the fastest first makes a killed mutant cheap. The durations are those of the
stats pass.

The mutants listed in .ci/mutation_equivalent.txt are not run: they survive by definition,
the score leaves them out, and each would cost every one of its covering tests.

MUTATION_PENDING=1 runs only the mutants that have no result yet, also when mutant names
or globs are given (mutmut reruns every mutant a name matches); MUTATION_PENDING=survivors runs
those and the survivors of earlier runs (after tests were added for them).

MUTATION_SKIP_CLEAN=1 skips mutmut's clean-test pass: before the mutants, mutmut runs every
test that covers them on the unmutated code. The stats pass of the same run (or of an
earlier run on the same code) has already run those tests and stopped on any failure, so
on a slow machine the second pass can be skipped.
"""

import os
import pathlib
import sys

from mutmut import __main__ as mutmut_main
from mutmut.state import state
from mutmut.workers import isolation

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from mutation_score import SURVIVED, equivalent  # noqa: E402

_submit = isolation.ForkServerRunner.submit
_collect = mutmut_main.collect_source_file_mutation_data


def _submit_fastest_first(self, mutant_name, tests, cpu_time_limit, estimated_time):
  durations = state().duration_by_test
  tests = sorted(tests, key=lambda test: (durations.get(test, 0.0), test))
  return _submit(self, mutant_name, tests, cpu_time_limit, estimated_time)


def _collect_to_run(*, mutant_names):
  mutants, by_path = _collect(mutant_names=mutant_names)
  skip = equivalent()
  pending = os.environ.get("MUTATION_PENDING", "")
  again = {"1": {None}, "survivors": {None, *SURVIVED}}.get(pending)
  return [(data, name, result) for data, name, result in mutants
          if name not in skip and (again is None or result in again)], by_path


isolation.ForkServerRunner.submit = _submit_fastest_first
mutmut_main.collect_source_file_mutation_data = _collect_to_run

if os.environ.get("MUTATION_SKIP_CLEAN") == "1":
  for runner in (isolation.ForkServerRunner, getattr(isolation, "ForkRunner", None)):
    if runner is not None:
      runner.run_clean_tests = lambda self, tests: 0

sys.exit(mutmut_main.cli(["run", *sys.argv[1:]]))
