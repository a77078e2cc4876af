#!/usr/bin/env bash
# The GPU check: what only an accelerator can tell, in one run that ends within 8 minutes.
#
#   benchmarks/gpu_check.sh LOG_DIR [--small]
#
# Stages, each with its own log (LOG_DIR/NN-name.log) and time budget:
#   1. environment: the device, the versions, the missing test dependencies;
#   2. tests: the GPU-relevant files (soundness, low precision and its excess-precision tests,
#      fp8, autocast programs, conformance), verbose, so that a stage stopped at its budget
#      still shows what passed;
#   3. bench_train_step.py on a 101.7M-parameter LM (width 1024, 8 layers), both regimes
#      (compute- and update-bound) and both half dtypes, with three variants (plain_f16, the
#      baseline; jaxamp; optax's apply_if_finite): compiling dominates, and all the variants
#      did not fit in 75 s on a 100M LM;
#   4. bench_compile.py: compile time of the LM step and of 100 leaves;
#   5. bench_low_precision.py: the memory and step-time figures of bfloat16 parameters;
#   6. bench_fp8_autocast.py --what speed (the fp8 autocast speed).
# A stage still running at its budget is stopped and recorded as such; the budgets add up to
# 7 min 20 s, and each stage also stops at the overall deadline, so the check ends within
# 8 minutes whatever hangs. LOG_DIR/summary.txt: each stage's status and seconds.
#
# It runs the Python of $PYTHON (default python3), with jaxamp from this checkout (nothing is
# installed). Missing test dependencies are installed from $GPU_CHECK_WHEELS (a folder of
# wheels, default .whl/ when present) without the network. pytest-benchmark's plugin turns
# filterwarnings=error into an INTERNALERROR under xdist, so it is disabled (-p no:benchmark).
#
# --small: a CPU-sized run to check the script itself: a 1.8M-parameter LM, fewer rounds, 10
# leaves; of the tests, the excess-precision file runs and the others are only collected (so that
# their imports are checked). GPU_CHECK_TIME_FACTOR (default 1) multiplies every budget and the
# deadline, for a slow or shared machine.
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ $# -lt 1 || $1 == -* ]]; then
  echo "usage: benchmarks/gpu_check.sh LOG_DIR [--small]" >&2
  exit 2
fi
logs=$1
small=false
[[ ${2:-} == --small ]] && small=true
mkdir -p "$logs"
PY=${PYTHON:-python3}
factor=${GPU_CHECK_TIME_FACTOR:-1}
DEADLINE=$((SECONDS + 470 * factor))
summary="$logs/summary.txt"
: > "$summary"
n=0

# stage NAME BUDGET COMMAND...: runs COMMAND with its output in LOG_DIR/NN-NAME.log, stopped at
# BUDGET seconds or at the deadline, whichever comes first.
stage() {
  local name=$1 budget=$(($2 * factor)) start=$SECONDS status
  shift 2
  n=$((n + 1))
  local log
  log=$(printf '%s/%02d-%s.log' "$logs" "$n" "$name")
  local left=$((DEADLINE - SECONDS))
  ((budget > left)) && budget=$left
  if ((budget < 5)); then
    printf '%-14s not run: the deadline was reached\n' "$name" | tee -a "$summary"
    return
  fi
  echo "== $name (budget ${budget} s): $*" | tee "$log"
  # timeout stops the command's whole process group (pytest's workers too); bash -c runs the
  # stages' functions, exported below.
  timeout -k 5 "$budget" bash -c '"$@"' _ "$@" >> "$log" 2>&1
  status=$?
  local seconds=$((SECONDS - start)) outcome
  case $status in
    0) outcome=ok ;;
    124|137) outcome="stopped at its budget of ${budget} s" ;;
    *) outcome="failed (status $status)" ;;
  esac
  local last
  last=$(grep -E '(passed|failed|error)' "$log" | tail -n 1 | sed -e 's/^=* *//' -e 's/ *=*$//')
  if [[ $status -ne 0 && $name == tests ]]; then  # what the verbose lines say so far
    last="$(grep -c ' PASSED' "$log") passed, $(grep -c ' FAILED' "$log") failed, $(grep -c ' SKIPPED' "$log") skipped so far"
  fi
  printf '%-14s %4d s  %s%s\n' "$name" "$seconds" "$outcome" "${last:+  ($last)}" | tee -a "$summary"
}

environment() {
  "$PY" - <<'PY'
import importlib.metadata as md
import importlib.util
import os
import sys

import jax

print("device:", jax.devices(), jax.default_backend())
print("python", sys.version.split()[0])
for name in ("jax", "jaxlib", "flax", "optax", "chex", "equinox", "pytest", "pytest-xdist",
             "pytest-timeout", "hypothesis", "numpy"):
  try:
    print(f"  {name} {md.version(name)}")
  except md.PackageNotFoundError:
    print(f"  {name}: not installed")
print("XLA_FLAGS:", os.environ.get("XLA_FLAGS", ""))
missing = [m for m in ("hypothesis", "flax", "equinox", "chex", "xdist")
           if importlib.util.find_spec(m) is None]
print("missing:", " ".join(missing) or "none")
PY
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
    --format=csv
  local wheels=${GPU_CHECK_WHEELS:-.whl}
  if ! "$PY" -c "import hypothesis" 2> /dev/null && [[ -d $wheels ]]; then
    "$PY" -m pip install -q --no-index --find-links "$wheels" hypothesis
  fi
}

tests() {
  local files=(tests/test_low_precision.py tests/test_excess_precision.py tests/test_soundness.py
               tests/test_fp8.py tests/test_autocast_programs.py tests/conformance)
  local options=(-o addopts="" -p no:benchmark -p no:cacheprovider --import-mode=importlib)
  if $small; then
    "$PY" -m pytest "${options[@]}" --co -q "${files[@]}" | tail -n 1 &&
      "$PY" -m pytest "${options[@]}" -n 2 -v -rfE tests/test_excess_precision.py
    return
  fi
  "$PY" -c "import pytest_timeout" 2> /dev/null && options+=(--timeout 150)
  XLA_PYTHON_CLIENT_PREALLOCATE=false "$PY" -m pytest "${options[@]}" -n 4 --dist loadfile -v \
    -rfE "${files[@]}"
}

train_step() {
  local size=(--width 1024 --layers 8) rounds=(--rounds 7 --inner 3) status=0
  $small && size=(--width 256 --layers 2) rounds=(--rounds 3 --inner 2)
  for dtype in float16 bfloat16; do
    for regime in compute update; do
      "$PY" benchmarks/bench_train_step.py --regime "$regime" --dtype "$dtype" "${size[@]}" \
        "${rounds[@]}" --variants plain_f16 jaxamp apply_if_finite || status=$?
    done
  done
  return "$status"
}

export PY small factor
export -f environment tests train_step
stage environment 30 environment
stage tests 180 tests
stage train_step 120 train_step
if $small; then
  stage compile 45 "$PY" benchmarks/bench_compile.py --leaves 10 --lm --repeats 1 --wall \
    --variants plain jaxamp apply_if_finite
else
  stage compile 45 "$PY" benchmarks/bench_compile.py --leaves 100 --lm --repeats 2 --wall \
    --variants plain jaxamp apply_if_finite
fi
low_precision() {
  "$PY" benchmarks/bench_low_precision.py --what memory &&
    "$PY" benchmarks/bench_low_precision.py --what time --rounds "$($small && echo 3 || echo 7)"
}
export -f low_precision
stage low_precision 45 low_precision
# ---- The fp8 autocast speed: a transformer block in fp8 against bfloat16 autocast, and the
# cuBLASLt float8 GEMMs of its compiled program. ----
fp8_speed=(--what speed --d 4096 --seq 2048 --rounds 5 --inner 2)
$small && fp8_speed=(--what speed --d 256 --seq 128 --rounds 2 --inner 1)
stage fp8_autocast 40 "$PY" benchmarks/bench_fp8_autocast.py "${fp8_speed[@]}"
echo "== done in $SECONDS s; logs in $logs" | tee -a "$summary"
