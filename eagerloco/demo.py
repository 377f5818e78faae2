"""`eagerloco demo`: a short comparison of the methods on the default data (the `make demo` job)."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from eagerloco.config import LinkConfig, OuterConfig
from eagerloco.train import TrainConfig, train

#: (label, outer settings) of the demo grid; every run shares model, data, seed and link.
DEMO_GRID: list[tuple[str, dict[str, Any]]] = [
    ("data-parallel", {"method": "dp"}),
    ("diloco", {"method": "diloco"}),
    ("diloco tau=1", {"method": "diloco", "overlap_steps": 1}),
    ("streaming P=2 e2m1 tau=1", {"method": "streaming", "fragments": 2, "overlap_steps": 1, "codec": "e2m1"}),
    ("naive delayed", {"method": "delayed"}),
    ("eager", {"method": "eager"}),
]


def demo_configs(steps: int, out: Path, data_dir: str | None) -> list[tuple[str, TrainConfig]]:
    """The demo's runs: 2 workers, H = 20, a link on which one fp32 model exchange takes ~2.5 s."""
    base = TrainConfig(
        model="tiny", steps=steps, workers=2, batch_size=8, seq_len=128, lr=3e-3, warmup_steps=20,
        eval_batches=16, log_every=10, data_dir=data_dir, progress=True,
        link=LinkConfig(bandwidth_gbps=0.01, latency_ms=50.0),
    )
    runs = []
    for label, outer in DEMO_GRID:
        cfg = replace(base, outer=OuterConfig(inner_steps=20, **outer), out=str(out / label.replace(" ", "_")))
        runs.append((label, cfg))
    return runs


def run_demo(args: argparse.Namespace) -> int:
    from eagerloco.cli import format_table

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summaries = []
    t0 = time.perf_counter()
    for label, cfg in demo_configs(args.steps, out, args.data_dir):
        print(f"[{len(summaries) + 1}/{len(DEMO_GRID)}] {label}", flush=True)
        s = train(cfg)
        s["label"] = label
        summaries.append(s)
    table = format_table(summaries)
    link = summaries[0]
    print(
        f"\n{args.steps} inner steps x 2 workers, tiny GPT on the Brown Corpus, simulated link "
        f"{link['bandwidth_gbps']} Gbit/s + {link['latency_ms']} ms ({time.perf_counter() - t0:.0f} s)\n"
    )
    print(table)
    (out / "table.md").write_text(table + "\n")
    (out / "summaries.json").write_text(json.dumps([{k: v for k, v in s.items() if k != "config"}
                                                    for s in summaries], indent=2, default=str))
    print(f"\nper-run metrics under {out}/, table in {out / 'table.md'}")
    return 0
