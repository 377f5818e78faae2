"""Why the inner step's MFU is what it is: the bare training step of a preset (bf16 autocast, fused AdamW,
torch.compile, batches already on the GPU) in a few variants, and a kernel profile of the first one.

Each variant runs in a process of its own under a timeout (a compile mode that autotunes can take minutes), so a
slow one costs its own time only. The profile sorts the step's GPU time into matmuls, attention, the optimizer,
compiled (Triton) kernels and the rest, and gives the matmuls' own rate: the share of the step they fill and how
fast they run bound what MFU the step can reach.

    python3 bench/gpu/mfu_profile.py --out runs/mfu --budget-s 200
    python3 bench/gpu/mfu_profile.py --cpu-smoke --out runs/mfu-smoke   # this script's own check, on a CPU
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

#: preset, sequences per step, compile mode, synchronize after every step (as the trainer does, to time it)
VARIANTS = [
    ("100m", 32, "default", True),
    ("100m", 32, "default", False),
    ("100m", 64, "default", False),
    ("35m", 64, "default", False),
    ("100m", 64, "max-autotune-no-cudagraphs", False),
]
#: Kernel families by name, first match wins.
FAMILIES = [
    ("attention", r"flash|fmha|attention|sdpa"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|cublas|sm90_|sm80_|ampere_|hopper"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("compiled (triton)", r"^triton"),
    ("copy and fill", r"memcpy|memset|copy|fill"),
]


def one(preset: str, batch: int, mode: str, sync: bool, steps: int, warm: int, seq: int, vocab: int,
        device: str, profile_dir: str | None) -> dict[str, Any]:
    """Tokens/s and MFU of the bare step; with ``profile_dir``, the kernel profile of a few steps too."""
    import torch

    from eagerloco.device import autocast, inner_optimizer, peak_tflops, synchronize
    from eagerloco.flops import flops_per_token, mfu
    from eagerloco.model import GPT, PRESETS

    dev = torch.device(device)
    cfg = replace(PRESETS[preset], vocab_size=vocab, max_seq_len=seq)
    torch.manual_seed(0)
    model = GPT(cfg).to(dev)
    opt = inner_optimizer(model.parameters(), dev, lr=1e-3)
    forward = torch.compile(model, mode=mode)
    precision = "bf16" if dev.type == "cuda" else "fp32"
    data = torch.randint(0, vocab, (4, batch, seq + 1), device=dev)

    def step(i: int) -> None:
        x = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        with autocast(dev, precision):
            _, loss = forward(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        if sync:
            synchronize(dev)

    t0 = time.perf_counter()
    for i in range(warm):
        step(i)
    synchronize(dev)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(steps):
        step(i)
    synchronize(dev)
    step_s = (time.perf_counter() - t0) / steps
    n = model.num_params()
    per_token = flops_per_token(n, cfg.n_layers, cfg.d_model, seq)
    tokens_s = batch * seq / step_s
    peak = peak_tflops(dev, precision)
    out: dict[str, Any] = {"preset": preset, "params": n, "batch": batch, "seq_len": seq, "mode": mode,
                           "sync_each_step": sync, "warm_s": round(compile_s, 1), "step_ms": round(step_s * 1e3, 2),
                           "tokens_per_s": round(tokens_s), "mfu": mfu(tokens_s, per_token, peak),
                           "peak_memory_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
                           if dev.type == "cuda" else None}
    if profile_dir is not None:
        out["profile"] = kernel_profile(step, steps=5, tokens=batch * seq, matmul_flops=6.0 * n,
                                        trace=Path(profile_dir) / f"trace_{preset}_b{batch}.json")
        out["profile"]["step_ms_while_profiled"] = out["profile"].pop("window_ms") / 5
    return out


def kernel_profile(step: Any, steps: int, tokens: int, matmul_flops: float, trace: Path) -> dict[str, Any]:
    """GPU time by kernel family over ``steps`` steps from torch.profiler's trace, the GPU's busy share of the
    window, and the matmuls' rate (``matmul_flops`` per token: 6 N, the weight matmuls of a step)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if gpu else [ProfilerActivity.CPU]
    if gpu:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for i in range(steps):
            step(i)
        if gpu:
            torch.cuda.synchronize()
        window = time.perf_counter() - t0
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text()).get("traceEvents", [])
    trace.unlink()  # tens of MB; what it says is summed below
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    by_family: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for e in kernels:
        name = e["name"]
        family = next((f for f, pat in FAMILIES if re.search(pat, name, re.IGNORECASE)), "other")
        by_family[family] = by_family.get(family, 0.0) + e["dur"] / 1e3
        by_name[name[:90]] = by_name.get(name[:90], 0.0) + e["dur"] / 1e3
    busy = 0.0  # the union of the kernels' intervals: time the GPU ran anything
    end = -1.0
    for e in sorted(kernels, key=lambda e: e["ts"]):
        s, f = e["ts"], e["ts"] + e["dur"]
        busy += max(0.0, f - max(s, end))
        end = max(end, f)
    total = sum(by_family.values())
    mm = by_family.get("matmul", 0.0)
    return {"window_ms": window * 1e3, "gpu_busy_share": busy / 1e3 / (window * 1e3) if window else None,
            "kernel_ms_per_step": {k: round(v / steps, 3) for k, v in sorted(by_family.items(), key=lambda kv: -kv[1])},
            "kernel_share": {k: round(v / total, 4) for k, v in by_family.items()} if total else {},
            "matmul_tflops": matmul_flops * tokens * steps / (mm / 1e3) / 1e12 if mm else None,
            "top_kernels_ms_per_step": {k: round(v / steps, 3) for k, v in
                                        sorted(by_name.items(), key=lambda kv: -kv[1])[:15]}}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| preset (params) | batch x seq | compile mode | sync each step | step ms | tokens/s | MFU | peak GiB |",
             "|---|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['preset']} | {r['batch']} | {r['mode']} | {r['sync_each_step']} | "
                         f"{r['error']} | | | |")
            continue
        m = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        lines.append(f"| {r['preset']} ({r['params'] / 1e6:.1f}M) | {r['batch']} x {r['seq_len']} | {r['mode']} | "
                     f"{'yes' if r['sync_each_step'] else 'no'} | {r['step_ms']} | {r['tokens_per_s']:,} | {m} | "
                     f"{r['peak_memory_gib']} |")
    for r in rows:
        p = r.get("profile")
        if not p:
            continue
        lines += ["", f"Profile of {r['preset']} at batch {r['batch']} (5 steps): GPU busy "
                  f"{100 * (p['gpu_busy_share'] or 0):.1f}% of the window, matmuls at "
                  f"{p['matmul_tflops'] or 0:.0f} TFLOP/s (6 N per token over their kernel time).", "",
                  "| kernel family | ms per step | share of kernel time |", "|---|---:|---:|"]
        shares = p["kernel_share"]
        lines += [f"| {k} | {v} | {100 * shares.get(k, 0):.1f}% |" for k, v in p["kernel_ms_per_step"].items()]
        lines += ["", "| kernel (top 15) | ms per step |", "|---|---:|"]
        lines += [f"| `{k}` | {v} |" for k, v in p["top_kernels_ms_per_step"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/mfu", help="folder for mfu.json, mfu.md and the trace")
    ap.add_argument("--budget-s", type=float, default=240.0, help="start no variant after this (default 240)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per variant (default 30)")
    ap.add_argument("--warm", type=int, default=10, help="steps before timing, compilation among them (default 10)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192, help="the GPU runs' BPE vocabulary (default 8192)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny preset, small batches, on the CPU")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a variant as JSON: run it here, print its result
    args = ap.parse_args(argv)
    if args.one:
        v = json.loads(args.one)
        print(json.dumps(one(**v)), flush=True)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = [("tiny", 2, "default", True), ("tiny", 4, "default", False)] if args.cpu_smoke else VARIANTS
    seq = 64 if args.cpu_smoke else args.seq_len
    start, rows = time.monotonic(), []
    for i, (preset, batch, mode, sync) in enumerate(variants):
        left = args.budget_s - (time.monotonic() - start)
        if left < 30:
            print(f"mfu_profile: {preset} b{batch} {mode}: skipped, {left:.0f} s left", flush=True)
            continue
        spec = {"preset": preset, "batch": batch, "mode": mode, "sync": sync, "steps": args.steps, "warm": args.warm,
                "seq": seq, "vocab": args.vocab, "device": "cpu" if args.cpu_smoke else "cuda",
                "profile_dir": str(out) if i == 0 else None}
        try:
            done = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True,
                                  text=True, timeout=left)
            row = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else \
                {"error": f"rc {done.returncode}: {done.stderr.strip().splitlines()[-1][:200] if done.stderr else ''}"}
        except subprocess.TimeoutExpired:
            row = {"error": f"timed out after {left:.0f} s"}
        rows.append({"preset": preset, "batch": batch, "mode": mode, "sync_each_step": sync, **row})
        print(f"mfu_profile: {json.dumps(rows[-1])}", flush=True)
        (out / "mfu.json").write_text(json.dumps(rows, indent=1) + "\n")
        (out / "mfu.md").write_text(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
