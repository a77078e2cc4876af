# Helpers of the .ci scripts (sourced): the interpreter that reaches the newest releases, the
# versions a run used, and each run's wall time.

# newest_python MINIMUM: prints the newest Python interpreter found that runs and can create a
# virtual environment, looking on PATH (python3, python3.N) and among pyenv's installed versions
# ($PYENV_ROOT/versions, ~/.pyenv by default). Each candidate is run, not trusted by its name: a
# pyenv shim for a version that is not selected fails, and is passed over. Fails, listing what it
# probed, when none reaches MINIMUM (e.g. 3.12).
newest_python() {
  local minimum=$1 best="" best_key=0 candidate key dir
  local -a dirs candidates=() probed=()
  IFS=: read -ra dirs <<< "$PATH"
  for dir in "${dirs[@]}"; do
    candidates+=("$dir"/python3 "$dir"/python3.[0-9] "$dir"/python3.[0-9][0-9])
  done
  candidates+=("${PYENV_ROOT:-$HOME/.pyenv}"/versions/*/bin/python3)
  for candidate in "${candidates[@]}"; do
    [[ -f "$candidate" && -x "$candidate" ]] || continue
    if key=$("$candidate" -c 'import sys, venv, ensurepip; print("%d%03d" % sys.version_info[:2])' \
             2> /dev/null); then
      probed+=("$candidate: Python ${key:0:1}.$((10#${key:1}))")
      if (( key > best_key )); then best=$candidate best_key=$key; fi
    else
      probed+=("$candidate: does not run")
    fi
  done
  local major=${minimum%%.*} minor=${minimum#*.}
  if (( best_key < major * 1000 + minor )); then
    echo "error: no Python $minimum or newer found; the newest releases of jax need one." >&2
    printf '  probed %s\n' "${probed[@]:-nothing}" >&2
    return 1
  fi
  echo "$best"
}

# versions VENV LABEL: one line with the Python and the releases a run used.
versions() {
  "$1/bin/python" - "$2" <<'PY'
import importlib.metadata as md
import sys

names = ("jax", "jaxlib", "optax", "flax", "equinox", "chex")
found = ", ".join(f"{name} {md.version(name)}" for name in names)
print(f"{sys.argv[1]}: Python {sys.version.split()[0]}, {found}")
PY
}

# children_cpu FILE: writes the CPU seconds (user + system) used so far by the finished children
# of this shell (bash's `times`, run in this shell: a subshell would count its own children).
children_cpu() {
  times > "$1"
  awk 'END { n = split($0, t, " "); s = 0
             for (i = 1; i <= n; i++) { split(t[i], f, "m"); s += f[1] * 60 + f[2] }
             print s }' "$1" > "$1.sum"
}

# timed LABEL COMMAND...: runs COMMAND, then prints and records (in SUMMARY) its wall time, the
# CPU time it used (all its processes), and the last line of its output (pytest's counts);
# returns COMMAND's status.
SUMMARY=()
timed() {
  local label=$1 start=$SECONDS status=0 log cpu_before cpu
  shift
  log=$(mktemp)
  children_cpu "$log.cpu"
  cpu_before=$(< "$log.cpu.sum")
  "$@" 2>&1 | tee "$log" || status=$?
  children_cpu "$log.cpu"
  cpu=$(awk -v a="$cpu_before" -v b="$(< "$log.cpu.sum")" 'BEGIN { printf "%d", b - a }')
  local elapsed=$((SECONDS - start))
  local times
  times=$(printf '%3d min %2d s wall, %3d min %2d s CPU' $((elapsed / 60)) $((elapsed % 60)) \
          $((cpu / 60)) $((cpu % 60)))
  SUMMARY+=("$(printf '%-20s %s  %s' "$label" "$times" \
                "$(tail -n 1 "$log" | sed -e 's/^=* *//' -e 's/ *=*$//')")")
  rm -f "$log" "$log.cpu" "$log.cpu.sum"
  echo "== $label: $times (status $status)"
  return "$status"
}

print_summary() {
  echo
  echo "== wall time and result of each run"
  printf '  %s\n' "${SUMMARY[@]}"
}
