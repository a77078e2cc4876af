"""Two processes joined by jax.distributed over loopback take the same decisions.

tests/multihost/worker.py runs in 2 processes of 2 CPU devices each; process 1
alone holds the overflowing row of step BAD_STEP.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

_WORKER = pathlib.Path(__file__).resolve().parent.parent / "multihost" / "worker.py"
_TIMEOUT_S = 120
NUM_PROCESSES, STEPS, BAD_STEP, INIT_SCALE = 2, 4, 2, 1024.0
WAYS = ("jit_data_parallel", "jit_fsdp", "shard_map")


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("multihost")
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # each process sets its own device count
  env["JAX_PLATFORMS"] = "cpu"
  port = _free_port()
  outs = [tmp / f"process_{i}.json" for i in range(NUM_PROCESSES)]
  procs = [subprocess.Popen([sys.executable, str(_WORKER), str(i), str(NUM_PROCESSES), str(port),
                             str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True) for i, out in enumerate(outs)]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=_TIMEOUT_S)[0])
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    logs = [p.communicate()[0] for p in procs]
    pytest.fail(f"the processes did not finish in {_TIMEOUT_S} s:\n" + "\n".join(logs))
  for i, p in enumerate(procs):
    assert p.returncode == 0, f"process {i} failed:\n{logs[i]}"
  return [json.loads(out.read_text()) for out in outs]


def test_each_process_is_one_of_two(results):
  assert [r["process_index"] for r in results] == [0, 1]


@pytest.mark.parametrize("way", WAYS)
def test_both_processes_take_the_same_decisions(results, way):
  first, second = (r[way] for r in results)
  assert first["trace"] == second["trace"]
  expected = [[INIT_SCALE, False]] * STEPS
  expected[BAD_STEP:] = [[INIT_SCALE / 2, True]] + [[INIT_SCALE / 2, False]] * (STEPS - BAD_STEP - 1)
  assert first["trace"] == expected  # the overflow of one process skipped the step of both


@pytest.mark.parametrize("way", WAYS)
def test_both_processes_end_with_the_same_params(results, way):
  first, second = (r[way]["params"] for r in results)
  assert first == second  # bit for bit
  reference = results[0]["one_device"]
  assert reference["trace"] == results[0][way]["trace"]
  for name, value in first.items():
    np.testing.assert_allclose(value, reference["params"][name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("way", WAYS)
def test_optimizer_state_follows_the_params(results, way):
  assert all(r[way]["state_follows_params"] for r in results)
  assert all(r["fsdp_params_sharded"] for r in results)
