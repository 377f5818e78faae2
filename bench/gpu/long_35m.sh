#!/usr/bin/env bash
# One device call: the eager paper's 35M row at H = 30 (2 workers of 8 x 1024 tokens), STEPS inner steps (default
# 5100 = 170 outer steps, the paper's count; 84M tokens a run): DiLoCo at outer lr 0.5 and eager at its lowered
# 0.35 (the best of each at 100 outer steps, long_35m/README.md), Streaming P = 2 with 1 step of overlap in 4-bit,
# and data-parallel, all four at once on the one GPU (each alone is launch-bound at this batch, the GPU half idle).
# Text: runs/gpudata/text.tar.xz (the offline sources of bench/gpu/offline_data.py, packed without a tokenizer:
# the 8192-token BPE is trained on the device, once, before the runs). RUNS names which of the four (default all;
# four at once reached 3430 steps in 290 s on an H200, two at once 3300 steps in 175 s). Metrics, summaries and logs
# go to $OUT as one long_35m.tgz (the device tool brings back 8 files at most); checkpoints every 300 steps stay
# behind, so that a second call on the still-warm machine can go on with RESUME=1.
#
#     bash bench/gpu/long_35m.sh 330 5100
#     RUNS="diloco_lr0.5 eager_lr0.35" bash bench/gpu/long_35m.sh 300 5100
set -u
BUDGET=${1:-330}
STEPS=${2:-5100}
RUNS=${RUNS:-diloco_lr0.5 eager_lr0.35 streaming_4bit dp}
FRESH=--overwrite; [ "${RESUME:-0}" = 1 ] && FRESH=--resume
OUT=${OUT:-runs/gpu-out}
mkdir -p "$OUT" runs/gd
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
start=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys, torch, tokenizers; print(sys.version.split()[0], torch.__version__, torch.version.cuda, tokenizers.__version__)"
  nproc; } > "$OUT/env.txt" 2>&1
tar -xJf runs/gpudata/text.tar.xz -C runs/gd
COMMON=(--model 35m --data runs/gd/text --data-dir runs/gd/cache --tokenizer bpe --workers 2 --inner-steps 30
        --batch-size 8 --seq-len 1024 --steps "$STEPS" --lr 1e-3 --warmup-steps 100 --eval-every 300
        --eval-batches 16 --bandwidth-gbps 2.5 --latency-ms 50 --compile --no-progress --checkpoint-every 300)
run() {  # name, flags...: in the background, killed at the budget; what it wrote so far comes back
  local name=$1; shift
  case " $RUNS " in *" $name "*) ;; *) return ;; esac
  ( t0=$(date +%s)
    timeout $((BUDGET - ($(date +%s) - start))) python3 -m eagerloco train "${COMMON[@]}" "$@" $FRESH \
        --out "runs/gd/$name" > "runs/gd/$name.log" 2>&1
    echo "$name: rc=$? in $(($(date +%s) - t0)) s" >> "$OUT/env.txt" ) &
}
# The tokenizer and token cache first, once: four runs building them at once would race for the cache's lock.
timeout 120 python3 -m eagerloco train "${COMMON[@]}" --steps 1 --method dp --overwrite --out runs/gd/warm \
    > runs/gd/warm.log 2>&1; echo "cache: rc=$? at $(($(date +%s) - start)) s" >> "$OUT/env.txt"
run diloco_lr0.5 --method diloco --outer-lr 0.5
run eager_lr0.35 --method eager --outer-lr 0.35
run streaming_4bit --method streaming --fragments 2 --overlap-steps 1 --codec e2m1 --outer-lr 0.5
run dp --method dp
wait
echo "done in $(($(date +%s) - start)) s" >> "$OUT/env.txt"
tar czf "$OUT/long_35m.tgz" runs/gd/*.log runs/gd/*/metrics.jsonl runs/gd/*/summary.json 2>/dev/null
