"""Throughput benchmark: inner-loop tokens/s per CPU preset, and what the outer machinery costs.

Run from the repository root: ``.venv/bin/python bench/throughput/run.py`` (see README.md beside it).

For each CPU preset (tiny, small, base) every method trains the same steps with the trainer
(``eagerloco.train.train``: M = 2 in-process workers, real text, no link emulation, one torch thread),
and a bare loop (the same model, optimizer and batches, no trainer, no outer machinery) gives the
reference speed. Per run:

- inner tokens/s: tokens over the seconds the workers spent in forward, backward and the inner
  optimizer step (``compute_s``), per core;
- outer share: the outer machinery's seconds (``overhead_s``: flatten, encode, mean, outer optimizer,
  merge; in-process the exchange itself is this same work) over the training wall time;
- outside-inner share: everything that is not inner compute (outer machinery, the Python loop,
  metrics lines, the progress bookkeeping) over the training wall time.

Goal (issue): outer share under 2% for every method. Results: bench/results/throughput.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from eagerloco.jsonfiles import finite_json  # noqa: E402

RESULTS = ROOT / "bench" / "results"
GOAL_SHARE = 0.02
#: Steps per run per preset: at least two outer rounds at the default H = 10 and a steady step time,
#: short enough that the whole benchmark takes about 10 minutes on an idle 2-core machine.
DEFAULT_STEPS = {"tiny": 80, "small": 40, "base": 20}


@dataclass(frozen=True)
class Method:
    key: str
    label: str
    outer: dict[str, Any]


METHODS = [
    Method("dp", "data-parallel", {"method": "dp"}),
    Method("diloco", "DiLoCo", {"method": "diloco"}),
    Method("streaming", "Streaming P=2", {"method": "streaming", "fragments": 2}),
    Method("streaming-overlap-4bit", "Streaming P=2, tau=1, 4-bit",
           {"method": "streaming", "fragments": 2, "overlap_steps": 1, "codec": "e2m1"}),
    Method("delayed", "naive delayed", {"method": "delayed"}),
    Method("eager", "eager k=1", {"method": "eager"}),
    Method("eager-2-4bit", "eager k=2, 4-bit", {"method": "eager", "eager_rounds": 2, "codec": "e2m1"}),
]


def base_config(preset: str, steps: int, args: argparse.Namespace, out: Path) -> Any:
    from eagerloco.config import LinkConfig, OuterConfig
    from eagerloco.train import TrainConfig

    return TrainConfig(
        model=preset, data=args.data, steps=steps, batch_size=args.batch_size, seq_len=args.seq_len,
        workers=args.workers, eval_every=0, eval_batches=1, log_every=10, progress=False, out=str(out),
        warmup_steps=min(20, steps // 4), outer=OuterConfig(inner_steps=args.inner_steps), link=LinkConfig(),
    )


def bare_loop(preset: str, steps: int, args: argparse.Namespace) -> dict[str, float]:
    """The same model, AdamW, clipping and batches as the trainer's inner loop, with nothing around it."""
    import torch

    from eagerloco.data import worker_streams
    from eagerloco.train.worker import prepare

    cfg = base_config(preset, steps, args, Path(tempfile.mkdtemp()))
    corpus, tok, model, _ = prepare(cfg)
    stream = worker_streams(corpus, tok, 1, cfg.batch_size, cfg.seq_len, cfg.seed, iid=True)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    batches = [stream.next_batch() for _ in range(steps)]
    times = []
    for x, y in batches:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        float(loss.detach())
        times.append(time.perf_counter() - t0)
    steady = times[min(5, len(times) // 4):]  # first steps pay one-time allocations
    step_s = statistics.median(steady)
    params = sum(p.numel() for p in model.parameters())
    return {"step_s": step_s, "tokens_per_s": cfg.batch_size * cfg.seq_len / step_s, "params": params}


def trainer_run(preset: str, m: Method, steps: int, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    from dataclasses import replace

    from eagerloco.train import train

    cfg = base_config(preset, steps, args, scratch / f"{preset}-{m.key}")
    cfg.outer = replace(cfg.outer, **m.outer)
    load = os.getloadavg()[0]
    s = train(cfg)
    wall = s["real_wall_s"]  # the training loop (M workers one after another), not the final eval
    per = s["per_worker"]
    compute = sum(w["compute_s"] for w in per)
    # In-process, blocked_s is simulated time (a worker's clock waiting for the others' launches),
    # not seconds this process spent: the machinery's real cost is overhead_s.
    outer = sum(w["overhead_s"] for w in per)
    tokens = s["tokens"]
    return {
        "preset": preset, "method": m.key, "label": m.label, "steps": steps, "tokens": tokens,
        "real_wall_s": wall, "compute_s": compute, "outer_s": outer,
        "syncs_per_worker": s["syncs_per_worker"],
        "inner_tokens_per_s": tokens / compute,
        "outer_share": outer / wall, "outside_inner_share": 1.0 - compute / wall,
        "final_train_loss": s["final_train_loss"], "load1_before": load, "load1_after": os.getloadavg()[0],
    }


def markdown(report: dict[str, Any]) -> str:
    env, a = report["environment"], report["settings"]
    lines = [
        "# Throughput benchmark: inner loop per CPU preset, outer machinery per method",
        "",
        f"In-process runtime, {a['workers']} workers, batch {a['batch_size']} x {a['seq_len']} tokens, "
        f"H = {a['inner_steps']}, no link emulation, data {a['data']}, 1 torch thread; torch {env['torch']}, "
        f"{env['cpus']} cores, load average {env['load_start']:.2f} at start, {env['load_end']:.2f} at end; "
        f"{report['elapsed_s']:.0f} s in all.",
        "",
        "## Inner loop",
        "",
        "| preset | parameters | bare loop tokens/s | trainer inner tokens/s (median over methods) | ratio |",
        "|---|---:|---:|---:|---:|",
    ]
    for preset, b in report["bare"].items():
        rows = [r for r in report["runs"] if r["preset"] == preset]
        med = statistics.median(r["inner_tokens_per_s"] for r in rows)
        lines.append(f"| {preset} | {b['params']:,} | {b['tokens_per_s']:,.0f} | {med:,.0f} | "
                     f"{med / b['tokens_per_s']:.2f} |")
    lines += [
        "",
        "## Outer machinery: share of the training wall time",
        "",
        "| preset | method | syncs/worker | outer s | outer share | outside-inner share | goal (< 2%) |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in report["runs"]:
        ok = "pass" if r["outer_share"] < GOAL_SHARE else "**FAIL**"
        lines.append(f"| {r['preset']} | {r['label']} | {r['syncs_per_worker']:g} | {r['outer_s']:.3f} | "
                     f"{100 * r['outer_share']:.2f}% | {100 * r['outside_inner_share']:.2f}% | {ok} |")
    worst = max(report["runs"], key=lambda r: r["outer_share"])
    lines += [
        "",
        f"Worst outer share: {100 * worst['outer_share']:.2f}% ({worst['preset']}, {worst['label']}); "
        f"goal under {100 * GOAL_SHARE:.0f}% for every method: "
        f"**{'met' if worst['outer_share'] < GOAL_SHARE else 'not met'}**.",
        "",
        "- inner tokens/s: tokens / seconds in forward, backward and the inner optimizer step, per core "
        "(the workers run one after another on one thread). The bare loop is the same model, AdamW, "
        "clipping and batches without the trainer: the ratio shows what the trainer's inner loop loses.",
        "- outer s: the outer machinery's seconds summed over workers (`overhead_s`: flatten, encode and "
        "decode, the FP32 mean, the outer optimizer step, the merge; dp: the gradient mean every step). "
        "In-process the exchange is this work; `blocked_s` there is simulated link time, not seconds spent.",
        "- outer share: outer s over the training loop's wall time; outside-inner share: 1 - inner compute / "
        "wall, which adds the Python loop and the metrics lines.",
        "- The multi-process runtime's costs (the collective itself, a peer's skew) are in `bench/results/peer.md`.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", default="tiny,small,base", help="comma list of CPU presets")
    p.add_argument("--methods", default=",".join(m.key for m in METHODS),
                   help=f"comma list of: {', '.join(m.key for m in METHODS)}")
    p.add_argument("--steps", type=int, default=None,
                   help=f"inner steps per run (default per preset: {DEFAULT_STEPS})")
    p.add_argument("--inner-steps", type=int, default=10,
                   help="H (default 10: more syncs per step than the papers' 30-100, so a conservative share)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--data", default="brown")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--render-only", action="store_true", help="rewrite throughput.md from throughput.json")
    args = p.parse_args(argv)
    if args.render_only:
        text = markdown(json.loads((args.out_dir / "throughput.json").read_text()))
        (args.out_dir / "throughput.md").write_text(text)
        print(text)
        return 0
    import torch

    torch.set_num_threads(1)
    by_key = {m.key: m for m in METHODS}
    unknown = [k for k in args.methods.split(",") if k not in by_key]
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; choose from {list(by_key)}")
    methods = [by_key[k] for k in args.methods.split(",")]
    presets = args.presets.split(",")
    t0, load_start = time.perf_counter(), os.getloadavg()[0]
    report: dict[str, Any] = {"bare": {}, "runs": []}
    with tempfile.TemporaryDirectory(prefix="eagerloco-throughput-") as tmp:
        for preset in presets:
            steps = args.steps or DEFAULT_STEPS.get(preset, 40)
            report["bare"][preset] = bare_loop(preset, steps, args)
            print(f"{preset}: bare loop {report['bare'][preset]['tokens_per_s']:,.0f} tokens/s", flush=True)
            for m in methods:
                r = trainer_run(preset, m, steps, args, Path(tmp))
                report["runs"].append(r)
                print(f"  {m.label:32s} inner {r['inner_tokens_per_s']:8,.0f} tokens/s  outer "
                      f"{100 * r['outer_share']:.2f}%  outside inner {100 * r['outside_inner_share']:.2f}%",
                      flush=True)
    report["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    report["environment"] = {
        "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
        "load_start": load_start, "load_end": os.getloadavg()[0], "threads": 1,
    }
    report["elapsed_s"] = time.perf_counter() - t0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "throughput.json").write_text(json.dumps(finite_json(report), indent=1) + "\n")
    text = markdown(report)
    (args.out_dir / "throughput.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
