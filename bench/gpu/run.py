"""GPU benchmark: inner-loop tokens/s and MFU, the outer machinery's share, processes on one GPU, and
the eager paper's 35M comparison. Run on a CUDA machine from the repository root (README.md beside it):

    python bench/gpu/run.py --part inner        # 35M and 100M, bf16, compile on/off, M = 1 and 2
    python bench/gpu/run.py --part outer        # outer machinery's share of wall time per method
    python bench/gpu/run.py --part processes    # 2 worker processes on the one GPU, gloo / NCCL outer
    python bench/gpu/run.py --part compare35m   # the 35M comparison; rerun until it says "done"
    python bench/gpu/run.py --render-only       # rewrite the Markdown from the JSON

Every part appends to bench/results/gpu/gpu.json (one entry per measurement, keyed, so a part that is
rerun replaces its own entries) and rewrites bench/results/gpu/gpu.md. Each part stops by itself
before --budget-s (default 540 s, under a 10-minute command limit): what is done is kept, and
rerunning the part continues (finished measurements are skipped, the comparison's runs resume from
their checkpoints). Without CUDA it says so and exits 0 without writing anything.

Data: the offline text built by bench/gpu/offline_data.py (carried to the device as
bench/gpu/data/offline_text.tar.xz, unpacked here on first use), tokenized with its 8192-token BPE.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from eagerloco.jsonfiles import finite_json  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "gpu"
DATA = ROOT / "bench" / "gpu" / "data"
SCRATCH = ROOT / "runs" / "gpu"
GOAL_MFU_100M = 0.40
GOAL_OUTER_SHARE = 0.02
#: The 35M comparison: data-parallel, DiLoCo H = 30, Streaming P = 2 with 1-inner-step overlap in FP4,
#: 1-outer-step naive delayed and eager, 2-outer-steps eager (the issue's list).
COMPARE_GRID = ["dp", "no-overlap", "streaming-2-overlap-1-4bit", "delayed-1", "eager-1", "eager-2"]
#: Paper numbers at 35M (C4, 700M tokens): eval loss by method.
PAPER_35M = {"dp": 3.51, "no-overlap": 3.54, "streaming-2-overlap-1-4bit": 3.53, "eager-1": 3.62}
METHODS = {
    "dp": {"method": "dp"},
    "diloco": {"method": "diloco"},
    "streaming-2-overlap-1-4bit": {"method": "streaming", "fragments": 2, "overlap_steps": 1, "codec": "e2m1"},
    "delayed-1": {"method": "delayed"},
    "eager-1": {"method": "eager"},
    "eager-2-4bit": {"method": "eager", "eager_rounds": 2, "codec": "e2m1"},
}


# -- data and settings -------------------------------------------------------------------------------


def data_args() -> list[str]:
    """The offline text (unpacked from its archive once) and its BPE tokenizer, as train flags."""
    text = DATA / "text"
    if not text.is_dir():
        archive = DATA / "offline_text.tar.xz"
        if not archive.is_file():
            raise SystemExit(f"no offline text at {text} or {archive}: run `python bench/gpu/offline_data.py` on a "
                             "machine with the package cache and carry bench/gpu/data/offline_text.tar.xz")
        with tarfile.open(archive) as tar:
            tar.extractall(DATA, filter="data")
    return ["--data", str(text), "--data-dir", str(DATA / "cache"), "--tokenizer", "bpe"]


def base_config(args: argparse.Namespace, preset: str, **kw: Any) -> Any:
    from eagerloco.config import LinkConfig, OuterConfig, TrainConfig

    d = data_args()
    outer = OuterConfig(**{"inner_steps": args.inner_steps, **kw.pop("outer", {})})
    return TrainConfig(model=preset, data=d[1], data_dir=d[3], tokenizer="bpe", seq_len=args.seq_len,
                       batch_size=args.batch_size, lr=1e-3, warmup_steps=10, eval_batches=2, log_every=10,
                       progress=False, outer=outer, link=LinkConfig(),
                       **({"device": "cpu", "precision": "fp32"} if args.cpu_smoke else {"precision": "bf16"}), **kw)


# -- results file ---------------------------------------------------------------------------------------


def load() -> dict[str, Any]:
    path = RESULTS / "gpu.json"
    return json.loads(path.read_text()) if path.is_file() else {"entries": {}}


def save(report: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gpu.json").write_text(json.dumps(finite_json(report), indent=2) + "\n")
    (RESULTS / "gpu.md").write_text(markdown(report))


def environment() -> dict[str, Any]:
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "device": name,
            "devices": torch.cuda.device_count(), "host_cpus": os.cpu_count(), "python": platform.python_version()}


def steady(out: Path, warm: int) -> dict[str, float]:
    """Steady-state rates from metrics.jsonl, leaving out the first ``warm`` steps (compilation, allocator
    warm-up): real tokens/s over the wall clock and per worker over its inner compute seconds."""
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "tokens_per_s" in r]
    a = next((r for r in recs if r["step"] >= warm), recs[0])
    b = recs[-1]
    real = b["tokens"] / b["tokens_per_s"] - a["tokens"] / a["tokens_per_s"]
    toks = b["tokens"] - a["tokens"]
    return {"tokens_per_s": toks / real if real > 0 else float("nan"),
            "inner_compute_s": b["compute_s"] - a["compute_s"], "tokens": toks}


# -- parts --------------------------------------------------------------------------------------------------


def part_inner(args: argparse.Namespace, report: dict[str, Any], deadline: float) -> None:
    from eagerloco.flops import mfu
    from eagerloco.train import train

    # One worker first (the MFU goal is one worker's), the larger preset first: a budget cut short keeps
    # the measurements that matter most.
    for workers in (1, 2):
        for preset in args.presets:
            for compiled in (False, True):
                key = f"inner/{preset}/{'compile' if compiled else 'eager'}/M{workers}"
                if key in report["entries"] or time.time() > deadline:
                    continue
                out = SCRATCH / key.replace("/", "-")
                cfg = base_config(args, preset, compile=compiled, workers=workers, steps=args.inner_steps_run,
                                  out=str(out), overwrite=True, outer={"method": "diloco", "inner_steps": 30})
                t0 = time.time()
                s = train(cfg)
                st = steady(out, args.warm_steps)
                per_worker = st["tokens"] / workers / st["inner_compute_s"]
                report["entries"][key] = {
                    "part": "inner", "preset": preset, "compile": compiled, "workers": workers,
                    "params": s["num_params"], "flops_per_token": s["flops_per_token"], "peak_tflops": s["peak_tflops"],
                    "batch": f"{cfg.batch_size} x {cfg.seq_len}", "steps": cfg.steps,
                    "tokens_per_s": st["tokens_per_s"], "inner_tokens_per_s": per_worker,
                    "mfu": mfu(st["tokens_per_s"], s["flops_per_token"], s["peak_tflops"]),
                    "inner_mfu": mfu(per_worker, s["flops_per_token"], s["peak_tflops"]),
                    "run_mfu_with_warmup": s["mfu"], "seconds": time.time() - t0,
                }
                save(report)
                print(key, json.dumps(finite_json(report["entries"][key])), flush=True)


def part_outer(args: argparse.Namespace, report: dict[str, Any], deadline: float) -> None:
    from eagerloco.train import train

    for name, outer in METHODS.items():
        key = f"outer/{args.outer_preset}/{name}"
        if key in report["entries"] or time.time() > deadline:
            continue
        out = SCRATCH / key.replace("/", "-")
        cfg = base_config(args, args.outer_preset, workers=2, steps=args.outer_steps, out=str(out), overwrite=True,
                          outer={**outer, "inner_steps": args.inner_steps})
        s = train(cfg)
        per = s["per_worker"]
        outer_s = sum(w["overhead_s"] for w in per)
        report["entries"][key] = {
            "part": "outer", "method": name, "steps": cfg.steps, "inner_steps": args.inner_steps,
            "real_wall_s": s["real_wall_s"], "outer_s": outer_s, "outer_share": outer_s / s["real_wall_s"],
            "tokens_per_s": s["tokens_per_s"], "mfu": s["mfu"], "syncs_per_worker": s["syncs_per_worker"],
        }
        save(report)
        print(key, json.dumps(finite_json(report["entries"][key])), flush=True)


def part_processes(args: argparse.Namespace, report: dict[str, Any], deadline: float) -> None:
    """2 worker processes on the one GPU over an emulated link: eager's compute utilization against
    DiLoCo's, with a gloo and an NCCL outer group. NCCL refuses two ranks on one device in some
    versions ("Duplicate GPU detected"): that is recorded as the entry's error, and the gloo-inner
    variant still measures the gloo outer path from device memory."""
    variants = [("nccl", "gloo"), ("nccl", "nccl"), ("gloo", "gloo")]
    for inner, outer_backend in variants:
        for method in ("diloco", "eager"):
            key = f"processes/{args.outer_preset}/{method}/inner-{inner}/outer-{outer_backend}"
            if key in report["entries"] or time.time() > deadline:
                continue
            out = SCRATCH / key.replace("/", "-")
            cmd = [sys.executable, "-m", "eagerloco", "launch", "--workers", "2", "--", "--model", args.outer_preset,
                   *data_args(), "--method", method, "--inner-steps", str(args.inner_steps),
                   "--steps", str(args.process_steps), "--batch-size", str(args.batch_size), "--seq-len",
                   str(args.seq_len), "--lr", "1e-3", "--warmup-steps", "10", "--eval-batches", "2",
                   "--bandwidth-gbps", str(args.bandwidth_gbps), "--latency-ms", "50", "--backend", inner,
                   "--outer-backend", outer_backend, "--out", str(out), "--overwrite", "--no-progress",
                   *(["--device", "cpu", "--precision", "fp32"] if args.cpu_smoke else [])]
            t0 = time.time()
            try:
                done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                                      timeout=max(30, deadline - time.time()))
                rc, tail = done.returncode, (done.stdout + done.stderr)[-1500:]
            except subprocess.TimeoutExpired:
                rc, tail = 124, "timed out (the part's budget)"
            entry: dict[str, Any] = {"part": "processes", "method": method, "inner_backend": inner,
                                     "outer_backend": outer_backend, "rc": rc, "seconds": time.time() - t0,
                                     "command": " ".join(cmd[1:])}
            if rc == 0:
                s = json.loads((out / "summary.json").read_text())
                entry.update({k: s.get(k) for k in ("compute_utilization", "blocked_s", "wall_s", "tokens_per_s",
                                                     "mfu", "bytes_sent_per_worker", "final_eval_loss")})
            else:
                entry["error"] = tail
            report["entries"][key] = entry
            save(report)
            print(key, rc, flush=True)


def compare_argv(args: argparse.Namespace) -> list[str]:
    return ["--grid", ",".join(COMPARE_GRID), "--model", args.compare_preset, *data_args(), "--workers", "2",
            "--inner-steps", "30", "--batch-size", str(args.compare_batch), "--seq-len", str(args.seq_len),
            "--tokens", str(args.compare_tokens), "--lr", "1e-3", "--warmup-steps", "100", "--eval-every",
            str(args.compare_eval_every), "--eval-batches", "16", "--bandwidth-gbps", str(args.bandwidth_gbps),
            "--latency-ms", "50", "--out", str(RESULTS / "compare_35m"), "--no-progress"]


def part_compare35m(args: argparse.Namespace, report: dict[str, Any], deadline: float) -> None:
    """Each run of the grid is trained by `eagerloco train` with checkpoints, resumed when a part was cut
    short; once all are there, `eagerloco compare` with the same settings reuses them and writes the
    report (bench/results/gpu/compare_35m/report.md)."""
    from eagerloco.cli import main as eagerloco_main
    from eagerloco.lab.compare.cli import add_arguments
    from eagerloco.lab.compare.grid import resolve_grid
    from eagerloco.lab.compare.runner import build_base_config, cached_summary, plan_runs

    p = argparse.ArgumentParser()
    add_arguments(p)
    cargs = p.parse_args(compare_argv(args))
    base, out = build_base_config(cargs)
    plans = plan_runs(base, resolve_grid(cargs.grid), out, base.outer.outer_lr / 2)  # as compare does
    pending = [pl for pl in plans if cached_summary(pl) is None]
    for pl in pending:
        left = deadline - time.time()
        if left < 60:
            break
        cfg = replace(pl.cfg, checkpoint_every=args.checkpoint_every, keep_checkpoints=1, progress=False,
                      resume=(pl.run_dir / "checkpoints").is_dir(), overwrite=False)
        toml = pl.run_dir.with_suffix(".toml")
        pl.run_dir.parent.mkdir(parents=True, exist_ok=True)
        toml.write_text(to_toml({k: v for k, v in asdict(cfg).items() if k != "tokens"}))  # steps are resolved
        cmd = [sys.executable, "-m", "eagerloco", "train", "--config", str(toml)]
        print(f"compare35m: {pl.run_dir.name} ({'resuming' if cfg.resume else 'starting'}, {left:.0f} s left)",
              flush=True)
        try:
            subprocess.run(cmd, cwd=ROOT, timeout=left - 30, check=False)
        except subprocess.TimeoutExpired:
            print(f"compare35m: {pl.run_dir.name} stopped at the budget; rerun the part to resume it", flush=True)
            break
    pending = [pl for pl in plans if cached_summary(pl) is None]
    if pending:
        report["entries"]["compare35m/status"] = {"part": "compare35m", "done": False,
                                                  "pending": [pl.run_dir.name for pl in pending]}
        save(report)
        print(f"compare35m: not done ({len(pending)} run(s) left); rerun `--part compare35m`", flush=True)
        return
    rc = eagerloco_main(["compare", *compare_argv(args)])
    summary = json.loads((RESULTS / "compare_35m" / "summary.json").read_text())
    report["entries"]["compare35m/status"] = {
        "part": "compare35m", "done": rc == 0, "command": "python -m eagerloco compare " + " ".join(compare_argv(args)),
        "runs": {r["name"]: {"final_eval_loss": r.get("final_eval_loss"), "mfu": r.get("mfu"),
                             "tokens_per_s": r.get("tokens_per_s"), "compute_utilization": r.get("compute_utilization")}
                 for r in summary["runs"]},
        "manifest": json.loads((DATA / "manifest.json").read_text()) if (DATA / "manifest.json").is_file() else None,
    }
    save(report)
    print("compare35m: done; report in", RESULTS / "compare_35m" / "report.md", flush=True)


def to_toml(cfg: dict[str, Any]) -> str:
    """A TrainConfig as the TOML `eagerloco train --config` reads (top level, [outer], [link])."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, float):
            return "inf" if v == float("inf") else repr(v)
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(v)

    top = [f"{k} = {value(v)}" for k, v in cfg.items() if v is not None and not isinstance(v, dict)]
    tables = [f"\n[{k}]\n" + "\n".join(f"{a} = {value(b)}" for a, b in v.items() if b is not None)
              for k, v in cfg.items() if isinstance(v, dict)]
    return "\n".join(top) + "\n" + "\n".join(tables) + "\n"


# -- report ---------------------------------------------------------------------------------------------------


def _pct(x: Any) -> str:
    return f"{100 * x:.1f}%" if isinstance(x, (int, float)) else "n/a"


def _num(x: Any) -> str:
    return f"{x:,.0f}" if isinstance(x, (int, float)) else "n/a"


def markdown(report: dict[str, Any]) -> str:
    env = report.get("environment", {})
    e = report["entries"]
    lines = ["# GPU benchmark", "",
             f"{env.get('device', '?')}, torch {env.get('torch', '?')} (CUDA {env.get('cuda', '?')}); "
             f"data: the offline text of bench/gpu/offline_data.py, 8192-token BPE. Command: "
             f"`{report.get('command', 'python bench/gpu/run.py')}`.", "",
             "## Inner loop (bf16 autocast, fused AdamW, FlashAttention through SDPA)", "",
             "Steady state after the first steps (compilation); tokens/s of the run on the one GPU; inner: one "
             "worker's tokens over its compute seconds. MFU: 6N + 12 L d T FLOPs per token over the GPU's bf16 "
             f"peak. Goal: MFU >= {GOAL_MFU_100M:.0%} for 100M with compile.", "",
             "| preset | params | compile | M | batch | tokens/s | MFU | inner tokens/s | inner MFU |",
             "|---|---:|---|---:|---|---:|---:|---:|---:|"]
    for r in (e[k] for k in sorted(e)):
        if r.get("part") == "inner":
            lines.append(f"| {r['preset']} | {r['params']:,} | {'yes' if r['compile'] else 'no'} | {r['workers']} | "
                         f"{r['batch']} | {_num(r['tokens_per_s'])} | {_pct(r['mfu'])} | "
                         f"{_num(r['inner_tokens_per_s'])} | {_pct(r['inner_mfu'])} |")
    lines += ["", "## Outer machinery's share of wall time (35M, M = 2 in-process, no link emulation)", "",
              f"Goal: under {GOAL_OUTER_SHARE:.0%} for every method.", "",
              "| method | steps | outer s | wall s | outer share | tokens/s | MFU |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for r in (e[k] for k in sorted(e)):
        if r.get("part") == "outer":
            lines.append(f"| {r['method']} | {r['steps']} | {r['outer_s']:.2f} | {r['real_wall_s']:.1f} | "
                         f"{_pct(r['outer_share'])} | {_num(r['tokens_per_s'])} | {_pct(r['mfu'])} |")
    lines += ["", "## Two worker processes on the one GPU, emulated link", "",
              "| method | inner | outer | CU (link) | blocked s | tokens/s | MFU | eval loss | note |",
              "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in (e[k] for k in sorted(e)):
        if r.get("part") == "processes":
            errors = [ln.split("error:", 1)[1].strip() for ln in r.get("error", "").splitlines() if "error:" in ln]
            note = "" if r["rc"] == 0 else (errors or ["failed"])[0][:110]
            cu = r.get("compute_utilization")
            lines.append(f"| {r['method']} | {r['inner_backend']} | {r['outer_backend']} | "
                         f"{cu:.3f} | {r.get('blocked_s', 0):.2f} | " if isinstance(cu, float) else
                         f"| {r['method']} | {r['inner_backend']} | {r['outer_backend']} | n/a | n/a | ")
            loss = r.get("final_eval_loss")
            lines[-1] += (f"{_num(r.get('tokens_per_s'))} | {_pct(r.get('mfu'))} | "
                          f"{f'{loss:.4f}' if isinstance(loss, float) else 'n/a'} | {note} |")
    st = e.get("compare35m/status")
    lines += ["", "## The eager paper's comparison at 35M", ""]
    if not st or not st.get("done"):
        lines.append("Not run yet (or not finished: rerun `--part compare35m`).")
    else:
        lines += [f"`{st['command']}`; report: `compare_35m/report.md`.", "",
                  "| run | eval loss | Δ vs DiLoCo | paper (C4, 700M tokens) | paper Δ | MFU |",
                  "|---|---:|---:|---:|---:|---:|"]
        ref = st["runs"].get("no-overlap", {}).get("final_eval_loss")
        for name, r in st["runs"].items():
            loss = r.get("final_eval_loss")
            paper = PAPER_35M.get(name)
            d = f"{loss - ref:+.3f}" if isinstance(loss, float) and isinstance(ref, float) else "n/a"
            pd = f"{paper - PAPER_35M['no-overlap']:+.2f}" if paper is not None else "n/a"
            lines.append(f"| {name} | {loss if loss is None else f'{loss:.4f}'} | {d} | "
                         f"{paper if paper is not None else 'n/a'} | {pd} | {_pct(r.get('mfu'))} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("inner", "outer", "processes", "compare35m", "all"), default="all")
    ap.add_argument("--render-only", action="store_true", help="rewrite gpu.md from gpu.json")
    ap.add_argument("--redo", action="store_true", help="measure again what the part has already measured")
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop starting work after this (default 540)")
    ap.add_argument("--presets", default="100m,35m", type=lambda v: [x for x in v.split(",") if x],
                    help="the inner part's model presets (default 100m,35m)")
    ap.add_argument("--outer-preset", default="35m", help="the outer and processes parts' preset (default 35m)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run the parts on the CPU (give a tiny preset and small sizes): a check of this script "
                         "before device time is spent on it; writes under runs/gpu-smoke, not bench/results")
    ap.add_argument("--batch-size", type=int, default=32, help="sequences per worker per step (default 32)")
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    ap.add_argument("--inner-steps", type=int, default=30, help="H (default 30)")
    ap.add_argument("--inner-steps-run", type=int, default=80, help="steps per inner-loop run (default 80)")
    ap.add_argument("--warm-steps", type=int, default=30, help="steps left out of steady-state rates (default 30)")
    ap.add_argument("--outer-steps", type=int, default=120, help="steps per outer-share run (default 120)")
    ap.add_argument("--process-steps", type=int, default=90, help="steps per multi-process run (default 90)")
    ap.add_argument("--bandwidth-gbps", type=float, default=2.5,
                    help="emulated link (default 2.5: a 35M fp32 exchange takes about a quarter of a round)")
    ap.add_argument("--compare-preset", default="35m", help="35M comparison: the model preset (default 35m)")
    ap.add_argument("--compare-batch", type=int, default=64, help="35M comparison: sequences per worker (64)")
    ap.add_argument("--compare-tokens", type=int, default=120_000_000,
                    help="35M comparison: token budget per run over both workers (default 120M)")
    ap.add_argument("--compare-eval-every", type=int, default=200)
    ap.add_argument("--checkpoint-every", type=int, default=200)
    ap.add_argument("--results", default=None, metavar="DIR",
                    help="where gpu.json and gpu.md go (default bench/results/gpu); one directory per device kind, "
                         "since the parts skip what the file already holds")
    args = ap.parse_args(argv)
    global RESULTS, SCRATCH
    if args.cpu_smoke:  # keep the smoke run's numbers out of the committed results
        RESULTS, SCRATCH = ROOT / "runs" / "gpu-smoke", ROOT / "runs" / "gpu-smoke" / "runs"
    if args.results:
        RESULTS = Path(args.results).resolve()
    report = load()
    if args.render_only:
        save(report)
        return 0
    import torch

    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("bench/gpu: no CUDA device here; nothing was measured. Run this on a GPU machine (see "
              "bench/gpu/README.md).", file=sys.stderr)
        return 0
    report["environment"] = environment()
    report["command"] = "python bench/gpu/run.py " + " ".join(argv if argv is not None else sys.argv[1:])
    deadline = time.time() + args.budget_s
    parts = ["inner", "outer", "processes", "compare35m"] if args.part == "all" else [args.part]
    if args.redo:
        report["entries"] = {k: v for k, v in report["entries"].items() if v.get("part") not in parts}
    for part in parts:
        {"inner": part_inner, "outer": part_outer, "processes": part_processes,
         "compare35m": part_compare35m}[part](args, report, deadline)
    save(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
