#!/usr/bin/env bash
# One call on a lent GPU machine: the CUDA tests, then run.py's inner, outer and processes parts, each
# cut by its own time limit so that the whole call ends within BUDGET seconds (default 540). Logs and
# results go to $OUT (the device tool's return folder; runs/gpu-out elsewhere). Run from the
# repository root with bench/gpu/data carried (bench/gpu/README.md):
#
#     bash bench/gpu/device_run.sh 540
#
# The machine's python3 holds PyTorch; eagerloco runs from the source tree (PYTHONPATH), not installed.
set -u
BUDGET=${1:-540}
OUT=${OUT:-runs/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
start=$(date +%s)
# Seconds left of the budget, times a share (percent) of it, at least 20.
share() { local left=$((BUDGET - ($(date +%s) - start))); local s=$((left * $1 / 100)); echo $((s < 20 ? 20 : s)); }

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys, torch, tokenizers; print(sys.version.split()[0], torch.__version__, torch.version.cuda, tokenizers.__version__)"
  nproc; } > "$OUT/env.txt" 2>&1

# The CUDA cases of the device tests, and the CPU ones beside them (the same file, under a minute).
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_device.py > "$OUT/test_device.log" 2>&1
echo "test_device rc=$?" >> "$OUT/test_device.log"

# Each part stops starting new measurements at its --budget-s and is killed at the timeout; run.py
# saves after every measurement, so what finished is kept either way.
t=$(share 40); timeout $((t + 40)) python3 bench/gpu/run.py --part inner --budget-s "$t" \
    --inner-steps-run 60 --warm-steps 20 > "$OUT/inner.log" 2>&1
t=$(share 35); timeout $((t + 30)) python3 bench/gpu/run.py --part outer --budget-s "$t" \
    --outer-steps 90 > "$OUT/outer.log" 2>&1
t=$(share 80); timeout $((t + 15)) python3 bench/gpu/run.py --part processes --budget-s "$t" \
    --process-steps 60 > "$OUT/processes.log" 2>&1
cp bench/results/gpu/gpu.json bench/results/gpu/gpu.md "$OUT/" 2>/dev/null
echo "done in $(($(date +%s) - start)) s" >> "$OUT/env.txt"
