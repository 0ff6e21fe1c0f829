#!/usr/bin/env bash
# CPU profile of the training-step benchmark with py-spy: a flamegraph (SVG) and a
# speedscope JSON per recipe, in profiles/out/.
# Usage: [PYTHON=python] bash profiles/record.sh [recipe ...]   (default: current)
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
mkdir -p profiles/out
recipes=("$@")
[ ${#recipes[@]} -gt 0 ] || recipes=(current)
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for recipe in "${recipes[@]}"; do
  for format in flamegraph speedscope; do
    case $format in
      flamegraph) out="profiles/out/train_step_${recipe}.svg" ;;
      speedscope) out="profiles/out/train_step_${recipe}.speedscope.json" ;;
    esac
    if ! "$SPY" record --rate 250 --format "$format" --output "$out" -- \
        "$PY" -m bench.train_step --recipes "$recipe" --steps "$STEPS" >"$log" 2>&1; then
      cat "$log" >&2
      if grep -qiE "permission denied|operation not permitted|ptrace|EPERM" "$log"; then
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
    tail -n 3 "$log"
    echo "wrote $out"
  done
done
