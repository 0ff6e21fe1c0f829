#!/usr/bin/env bash
# CPU flamegraphs of the training-step benchmark, one per recipe, with py-spy.
# Usage: bash profiles/record.sh [recipe ...]   (default: current delayed)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
mkdir -p profiles/out
recipes=("$@")
[ ${#recipes[@]} -gt 0 ] || recipes=(current delayed)
for recipe in "${recipes[@]}"; do
  .venv/bin/py-spy record --rate 250 --output "profiles/out/train_step_${recipe}.svg" -- \
    "$PY" -m bench.train_step --recipes "$recipe" --steps 100
  echo "wrote profiles/out/train_step_${recipe}.svg"
done
