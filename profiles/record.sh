#!/usr/bin/env bash
# CPU profile of the training step in its steady state (bench/steady_state.py: warm-up
# steps first, not sampled) with py-spy: a flamegraph (SVG) and a speedscope JSON per
# recipe, in profiles/out/.
# Usage: [PYTHON=python] [STEPS=100] [OUT=profiles/out] bash profiles/record.sh [recipe ...]
# (default recipe: current)
# PYTHON: the interpreter to profile (default: python3 on PATH; `make profile` passes the
# project's .venv). py-spy is taken from beside it, else from PATH.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STEPS=${STEPS:-100}
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "record.sh: no interpreter '$PY' (set PYTHON=/path/to/python)" >&2
  exit 2
fi
SPY="$(dirname "$(command -v "$PY")")/py-spy"
[ -x "$SPY" ] || SPY=$(command -v py-spy || true)
if [ -z "$SPY" ]; then
  echo "record.sh: py-spy is not installed (pip install py-spy, or the [bench] extra)" >&2
  exit 2
fi
OUT=${OUT:-profiles/out}
mkdir -p "$OUT"
recipes=("$@")
[ ${#recipes[@]} -gt 0 ] || recipes=(current)
work=$(mktemp -d)
target=""
cleanup() {
  [ -n "$target" ] && kill "$target" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
log="$work/target.log"
spylog="$work/py-spy.log"
# The steady state only: bench.steady_state warms up (imports, the kernel library, plans)
# before it says it is ready; py-spy attaches then, and the profiled steps start once it
# has (the first samples of a run are otherwise imports and the kernel build).
for recipe in "${recipes[@]}"; do
  for format in flamegraph speedscope; do
    case $format in
      flamegraph) out="$OUT/train_step_${recipe}.svg" ;;
      speedscope) out="$OUT/train_step_${recipe}.speedscope.json" ;;
    esac
    rm -f "$work/ready" "$work/go"
    "$PY" -m bench.steady_state --recipe "$recipe" --steps "$STEPS" \
      --ready "$work/ready" --go "$work/go" >"$log" 2>&1 &
    target=$!
    while [ ! -e "$work/ready" ]; do
      if ! kill -0 "$target" 2>/dev/null; then
        cat "$log" >&2
        echo "record.sh: the training step stopped before its warm-up ended (output above)" >&2
        exit 1
      fi
      sleep 0.2
    done
    "$SPY" record --rate 250 --format "$format" --output "$out" --pid "$target" \
      >"$spylog" 2>&1 &
    spy=$!
    sleep 1  # py-spy attached: the profiled steps may start
    touch "$work/go"
    spy_rc=0
    wait "$spy" || spy_rc=$?
    if [ "$spy_rc" -ne 0 ]; then
      cat "$spylog" >&2
      if grep -qiE "permission denied|operation not permitted|ptrace|EPERM" "$spylog"; then
        cat >&2 <<'MSG'

record.sh: py-spy may not trace processes here (ptrace is not permitted). Either
  - run as root / with sudo, or
  - allow ptrace: `sudo sysctl kernel.yama.ptrace_scope=0`, or
  - in a container, start it with `--cap-add SYS_PTRACE`.
Without py-spy, `python -m bench.overhead_report` gives the per-range CPU times
(torch.profiler, no extra permission needed).
MSG
        exit 3
      fi
      echo "record.sh: py-spy failed (output above)" >&2
      exit 1
    fi
    target_rc=0
    wait "$target" || target_rc=$?
    target=""
    if [ "$target_rc" -ne 0 ]; then
      cat "$log" >&2
      echo "record.sh: the training step failed (output above)" >&2
      exit 1
    fi
    tail -n 1 "$log"
    echo "wrote $out"
  done
done
