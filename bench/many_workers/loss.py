"""A short loss check at M = 8 on the tiny model: the shared-support exchange against all-gathered SparseLoCo and
FP32 DiLoCo (issue 36, item 2; not the tuned Pareto of item 4).

Run from the repository root: ``.venv/bin/python bench/many_workers/loss.py [--seeds 0,1,2] [--rows a,b]
[--data kjv]`` (what is committed: bench/results/many_workers.md). Each row is an ``eagerloco train`` run (8
in-process workers, Brown or ``--data``, bpe:1024, batch 8 x 64, H = 20); the final eval loss and the bytes each
worker sent are written to bench/results/many_workers_loss.json (keyed ``row/seedN``; ``kjv:row/seedN`` on the
KJV, ``400steps:row/seedN`` for other --steps), which ``run.py --parts none`` folds into bench/results/many_workers.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
SPARSE = ["--codec", "2bit", "--topk-chunk", "4096", "--error-feedback", "0.95", "--outer-optimizer", "average",
          "--outer-lr", "1.5"]
#: name -> (what it is, its flags). Outer lrs are the ones tuned at M = 2 in bench/results/compression/.
ROWS = {
    "diloco-fp32": ("DiLoCo, FP32 on a ring all-reduce, Nesterov, outer lr 0.2", ["--outer-lr", "0.2"]),
    "sparseloco-64": ("SparseLoCo: top 64 of 4096, 2-bit, all-gathered", [*SPARSE, "--topk", "64"]),
    "shared-64": ("shared support: 64 of 4096 drawn per round, 2-bit, reduce-scattered",
                  [*SPARSE, "--topk", "64", "--transport", "shared-support"]),
    "shared-256": ("shared support: 256 of 4096 drawn per round, 2-bit, reduce-scattered",
                   [*SPARSE, "--topk", "256", "--transport", "shared-support"]),
    "shared-1024": ("shared support: 1024 of 4096 drawn per round, 2-bit, reduce-scattered",
                    [*SPARSE, "--topk", "1024", "--transport", "shared-support"]),
    "shared-128": ("shared support: 128 of 4096 drawn per round, 2-bit, reduce-scattered",
                   [*SPARSE, "--topk", "128", "--transport", "shared-support"]),
    "shared-512": ("shared support: 512 of 4096 drawn per round, 2-bit, reduce-scattered",
                   [*SPARSE, "--topk", "512", "--transport", "shared-support"]),
    "guided-512": ("shared support: 512 of 4096, half the largest of the last mean and half drawn, 2-bit",
                   [*SPARSE, "--topk", "512", "--transport", "shared-support", "--support-guided", "0.5"]),
    "guided-1024": ("shared support: 1024 of 4096, half the largest of the last mean and half drawn, 2-bit",
                    [*SPARSE, "--topk", "1024", "--transport", "shared-support", "--support-guided", "0.5"]),
    "guided-256": ("shared support: 256 of 4096, half the largest of the last mean and half drawn, 2-bit",
                   [*SPARSE, "--topk", "256", "--transport", "shared-support", "--support-guided", "0.5"]),
    "guided75-256": ("shared support: 256 of 4096, three quarters the largest of the last mean, the rest drawn",
                     [*SPARSE, "--topk", "256", "--transport", "shared-support", "--support-guided", "0.75"]),
    "guided-128": ("shared support: 128 of 4096, half the largest of the last mean and half drawn, 2-bit",
                   [*SPARSE, "--topk", "128", "--transport", "shared-support", "--support-guided", "0.5"]),
    "eager-sparseloco-64": ("1-outer-step eager, SparseLoCo top 64 of 4096", [*SPARSE, "--topk", "64",
                                                                              "--method", "eager"]),
    "eager-shared-1024": ("1-outer-step eager, shared support 1024 of 4096",
                          [*SPARSE, "--topk", "1024", "--transport", "shared-support", "--method", "eager"]),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--rows", default=",".join(ROWS), help="comma list of the rows to run")
    ap.add_argument("--data", default="brown", help="the corpus (train's --data); rows off Brown are keyed data:row")
    ap.add_argument("--runs", default="/tmp/many_workers_loss", help="where the runs' directories go")
    args = ap.parse_args()
    out_path = RESULTS / "many_workers_loss.json"
    results = json.loads(out_path.read_text()) if out_path.exists() else {}
    # Rows off the defaults are keyed apart: kjv:row, 400steps:row, kjv-400steps:row.
    off = [args.data] if args.data != "brown" else []
    off += [f"{args.steps}steps"] if args.steps != 200 else []
    prefix = f"{'-'.join(off)}:" if off else ""
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name in args.rows.split(","):
            flags = ROWS[name][1]
            key = f"{prefix}{name}/seed{seed}"
            if key in results:
                continue
            run = Path(args.runs) / key.replace(":", "-")
            cmd = [sys.executable, "-m", "eagerloco", "train", "--model", "tiny", "--tokenizer", "bpe:1024",
                   "--batch-size", "8", "--seq-len", "64", "--steps", str(args.steps), "--inner-steps", "20",
                   "--workers", str(args.workers), "--sim-step-time", "0.1", "--seed", str(seed), "--no-progress",
                   "--overwrite", "--data", args.data, "--out", str(run), *flags]
            subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)
            s = json.loads((run / "summary.json").read_text())
            results[key] = {"final_eval_loss": s["final_eval_loss"], "steps": args.steps, "workers": args.workers,
                            "bytes_sent_per_worker": s["bytes_sent_per_worker"], "flags": flags}
            print(key, json.dumps(results[key]), flush=True)
            out_path.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
