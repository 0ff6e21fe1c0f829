#!/usr/bin/env bash
# Nsight Systems trace of a few training steps with fastcast's NVTX ranges, and the
# per-range table made from `nsys stats` (bench/nsys_report.py).
# Usage: [PYTHON=python] [RECIPE=current] [STEPS=10] bash profiles/nsys.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RECIPE=${RECIPE:-current}
STEPS=${STEPS:-10}
if ! command -v nsys >/dev/null 2>&1; then
  cat >&2 <<'MSG'
nsys.sh: Nsight Systems (`nsys`) is not on PATH, so no trace can be recorded here.
Install it (it ships with the CUDA toolkit, or as the nsight-systems package) on a
machine with an NVIDIA GPU and run `make nsys` again. On any machine,
`python -m bench.overhead_report` gives the same per-range table from torch.profiler.
MSG
  exit 2
fi
mkdir -p profiles/out
out="profiles/out/nsys_${RECIPE}"
FASTCAST_NVTX=1 nsys profile -t cuda,nvtx --force-overwrite true -o "$out" \
  "$PY" -m bench.nsys_report --run --recipe "$RECIPE" --steps "$STEPS"
"$PY" -m bench.nsys_report "$out.nsys-rep" --recipe "$RECIPE" --steps "$STEPS"
