#!/usr/bin/env bash
# One device call: the eager paper's 35M row at H = 30 for 100 outer steps (3000 inner steps, 2 workers of
# 8 x 1024 tokens, 49M tokens), DiLoCo at outer lr 0.7 and eager at its lowered 0.35 (the CPU protocol's
# choice), then data-parallel while the budget lasts. Text: runs/gpudata/text.tar.xz (the offline sources of
# bench/gpu/offline_data.py, packed without a tokenizer: the 8192-token BPE is trained on the device).
# Metrics, summaries and logs go to $OUT; checkpoints stay behind (too large to bring back).
#
#     bash bench/gpu/long_35m.sh 520
set -u
BUDGET=${1:-520}
OUT=${OUT:-runs/gpu-out}
mkdir -p "$OUT" runs/gd
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
start=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - start))); }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys, torch, tokenizers; print(sys.version.split()[0], torch.__version__, torch.version.cuda, tokenizers.__version__)"
  nproc; } > "$OUT/env.txt" 2>&1
tar -xJf runs/gpudata/text.tar.xz -C runs/gd
COMMON=(--model 35m --data runs/gd/text --data-dir runs/gd/cache --tokenizer bpe --workers 2 --inner-steps 30
        --batch-size 8 --seq-len 1024 --steps 3000 --lr 1e-3 --warmup-steps 100 --eval-every 300 --eval-batches 16
        --bandwidth-gbps 2.5 --latency-ms 50 --compile --no-progress --overwrite)
run() {  # name, seconds at most, flags...
  local name=$1 limit=$2; shift 2
  local l; l=$(left); [ "$l" -lt 60 ] && { echo "$name: skipped, $l s left" >> "$OUT/env.txt"; return; }
  [ "$limit" -gt "$l" ] && limit=$l
  local t0; t0=$(date +%s)
  timeout "$limit" python3 -m eagerloco train "${COMMON[@]}" "$@" --out "runs/gd/$name" > "$OUT/$name.log" 2>&1
  echo "$name: rc=$? in $(($(date +%s) - t0)) s" >> "$OUT/env.txt"
  mkdir -p "$OUT/$name"; cp runs/gd/$name/*.json* "$OUT/$name/" 2>/dev/null
}
run diloco 230 --method diloco --outer-lr 0.7
run eager 200 --method eager --outer-lr 0.35
run dp 200 --method dp
echo "done in $(($(date +%s) - start)) s" >> "$OUT/env.txt"
