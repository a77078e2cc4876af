"""``mutmut run``, amended to take about an hour for every mutant on 2 cores.

- The fork server imports jaxamp's mutated copy once, and freezes what it imported out of the
  garbage collector's way (``_warm_up``): a mutant's process starts in about half the time.
- A mutant's tests run likeliest killer first, stopping at the first failure (pytest's -x): the
  tests that killed earlier mutants of the same function, then those that killed a mutant of
  the same module, then the rest, each group fastest first. Each mutant's process appends its
  function and its first failing test to ``mutants/killers.tsv``, read back as the run goes:
  mutmut runs a function's mutants one after another, so the history builds up within a run,
  and it carries over to the next. The order changes how soon a mutant is killed, not whether
  it is: a surviving mutant runs every covering test.
- The stats pass times each test with its set-up, and credits the functions that run at import
  to the tests of their module rather than to the first test (``_run_stats``).

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

import collections
import gc
import os
import pathlib
import sys
import time

from mutmut import __main__ as mutmut_main
from mutmut.mutation.trampoline import set_mutant_under_test
from mutmut.runners.harness import PytestRunner
from mutmut.state import state
from mutmut.utils.file_utils import change_cwd
from mutmut.utils.format_utils import mangled_name_from_mutant_name
from mutmut.workers import isolation

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from mutation_score import SURVIVED, equivalent  # noqa: E402

_KILLERS = pathlib.Path("mutants/killers.tsv").absolute()
_import_time = set()  # the functions of jaxamp that run while it is imported


class _KillRecorder:
  """A pytest plugin that appends the mutant's function and its first failing test."""

  def __init__(self, function):
    self.function = function

  def pytest_runtest_logreport(self, report):
    if report.failed:
      with open(_KILLERS, "a", encoding="utf-8") as f:  # one short append: the processes do not mix
        f.write(f"{self.function}\t{report.nodeid}\n")


def _warm_up(self):
  """In the fork server: the usual imports, then jaxamp's mutated copy, then ``gc.freeze()``.

  The trampolines mutmut puts in every function look the mutant up at each call, so jaxamp
  imported here runs each mutant all the same, except in the functions that run while it is
  imported: those are recorded, and a mutant of one of them imports jaxamp afresh
  (``_run_tests``). Freezing what is imported keeps it out of the garbage collections pytest
  makes as it ends, which otherwise traversed all of it in each mutant's process.
  """
  _warm_up_imports(self)
  before = os.environ.get("MUTANT_UNDER_TEST")
  set_mutant_under_test("stats")  # the trampolines record each function called
  try:
    import jaxamp  # noqa: PLC0415
  finally:
    set_mutant_under_test(before)
    if before is None:
      os.environ.pop("MUTANT_UNDER_TEST", None)
  _import_time.update(state()._stats)  # noqa: SLF001 -- mutmut's record of the calls
  state()._stats.clear()  # noqa: SLF001
  if not jaxamp.__file__.startswith(str(pathlib.Path("mutants").absolute())):
    raise RuntimeError(f"the fork server imported jaxamp from {jaxamp.__file__}, not from mutants/")
  from jax._src import xla_bridge  # noqa: PLC0415

  if xla_bridge.backends_are_initialized():
    raise RuntimeError("importing jaxamp started an XLA backend: no process can be forked from it safely")
  gc.freeze()


def _run_tests(self, *, mutant_name, tests):
  """In a mutant's process: its tests, noting the first that fails."""
  plugins = []
  if mutant_name is not None:  # None: mutmut's check that a failing trampoline fails the tests
    function = mangled_name_from_mutant_name(mutant_name)
    plugins.append(_KillRecorder(function))
    if function in _import_time:  # import jaxamp again, with the mutant on
      for name in [name for name in sys.modules if name == "jaxamp" or name.startswith("jaxamp.")]:
        del sys.modules[name]
  with change_cwd("mutants"):
    return int(self.execute_pytest(self._pytest_args_regular_run(tests), plugins=plugins))


def _run_stats(self, *, tests):
  """mutmut's stats pass, with two corrections.

  - Durations: mutmut times the call alone, but a test that uses a module-scoped fixture (a
    model trained once for the module's tests) pays for it in the process of any mutant it runs
    first in. Each test's duration here adds its set-up and teardown, and the set-up of every
    wider-scoped fixture it uses that an earlier test paid for.
  - What runs at import: mutmut credits the functions that run while the tests import jaxamp
    to the first test alone (whatever it tests). Here they are credited to every test that
    reaches a function of their module, the tests of what they build.
  """
  import pytest  # noqa: PLC0415 -- only in the stats pass's own process

  durations = state().duration_by_test

  class Amendments:
    def __init__(self):
      self.imported = set()
      self.current = None
      self.cost = {}  # a wider-scoped fixture's set-up, the longest seen
      self.paid = collections.defaultdict(set)  # the tests whose set-up ran it
      self.uses = {}

    def pytest_collection_finish(self):
      self.imported = set(state()._stats)  # noqa: SLF001 -- what ran before the first test
      state()._stats.clear()  # noqa: SLF001

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
      self.current = item.nodeid
      self.uses[item.nodeid] = item.fixturenames

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
      start = time.perf_counter()
      try:
        return (yield)
      finally:
        if fixturedef.scope != "function":
          name = fixturedef.argname
          self.cost[name] = max(self.cost.get(name, 0.0), time.perf_counter() - start)
          self.paid[name].add(self.current)

    def pytest_runtest_logreport(self, report):
      if report.when != "call":
        durations[report.nodeid] += report.duration

    def pytest_sessionfinish(self):
      for test, names in self.uses.items():
        durations[test] += sum(self.cost[name] for name in names
                               if name in self.cost and test not in self.paid[name])
      reached = state().tests_by_mangled_function_name
      for function in self.imported:
        module = function.rpartition(".")[0]
        near = [tests for name, tests in reached.items() if name.rpartition(".")[0] == module]
        reached[function] = set().union(*near) or set(self.uses)

  execute = self.execute_pytest
  self.execute_pytest = lambda params, plugins=(): execute(params, plugins=[*plugins, Amendments()])
  try:
    return _stats(self, tests=tests)
  finally:
    del self.execute_pytest


class _Killers:
  """Which tests killed mutants, per function and per module, read as the file grows."""

  def __init__(self):
    self.by_function = collections.defaultdict(set)
    self.by_module = collections.defaultdict(set)
    self.read = 0

  def update(self):
    if not _KILLERS.exists():
      return
    with open(_KILLERS, "rb") as f:
      f.seek(self.read)
      for line in f:
        if not line.endswith(b"\n"):  # still being written
          break
        self.read += len(line)
        function, test = line.decode().rstrip("\n").split("\t")
        self.by_function[function].add(test)
        self.by_module[function.rpartition(".")[0]].add(test)


_killers = _Killers()
_stats = PytestRunner.run_stats
_warm_up_imports = PytestRunner.warm_up
_submit = isolation.ForkServerRunner.submit
_collect = mutmut_main.collect_source_file_mutation_data


def _submit_likeliest_first(self, mutant_name, tests, cpu_time_limit, estimated_time):
  _killers.update()
  function = mangled_name_from_mutant_name(mutant_name)
  killed_here = _killers.by_function[function]
  killed_nearby = _killers.by_module[function.rpartition(".")[0]]
  durations = state().duration_by_test
  tests = sorted(tests, key=lambda test: (test not in killed_here, test not in killed_nearby,
                                          durations.get(test, 0.0), test))
  return _submit(self, mutant_name, tests, cpu_time_limit, estimated_time)


def _collect_to_run(*, mutant_names):
  mutants, by_path = _collect(mutant_names=mutant_names)
  skip = equivalent()
  pending = os.environ.get("MUTATION_PENDING", "")
  again = {"1": {None}, "survivors": {None, *SURVIVED}}.get(pending)
  return [(data, name, result) for data, name, result in mutants
          if name not in skip and (again is None or result in again)], by_path


if __name__ == "__main__":
  PytestRunner.warm_up = _warm_up
  PytestRunner.run_stats = _run_stats
  PytestRunner.run_tests = _run_tests
  isolation.ForkServerRunner.submit = _submit_likeliest_first
  mutmut_main.collect_source_file_mutation_data = _collect_to_run

  if os.environ.get("MUTATION_SKIP_CLEAN") == "1":
    for runner in (isolation.ForkServerRunner, getattr(isolation, "ForkRunner", None)):
      if runner is not None:
        runner.run_clean_tests = lambda self, tests: 0

  sys.exit(mutmut_main.cli(["run", *sys.argv[1:]]))
