"""Bytes per worker per round as the number of workers grows, for each transport, measured beside the simulator.

Run from the repository root (``nice -n 19`` on a shared machine)::

    .venv/bin/python bench/many_workers/run.py                    # exchanges, loopback, runs: about 15 minutes
    .venv/bin/python bench/many_workers/run.py --parts exchange   # the byte table alone, about two minutes

Parts (each writes its key of bench/results/many_workers.json, kept across runs; the Markdown is redrawn
from the whole file):

- ``exchange``: M in-process workers (:class:`eagerloco.comm.inprocess.InProcessGroup`) exchange one outer
  gradient of the tiny model's size, really encoded, for each exchange of :data:`EXCHANGES`; the bytes each
  worker's communicator counted, beside what the simulator charges (:func:`eagerloco.sim.model.exchange_wire_bytes`).
- ``loopback``: the same exchange over a real gloo group of M threads on loopback (one process), timed: the
  seconds from launch until every worker holds the mean, encoding and decoding included (2 shared cores).
- ``runs``: whole ``eagerloco train`` runs of the tiny model (DiLoCo, H = 2, 2 rounds): M = 16 and 32 in-process
  workers and M = 16 worker processes (``eagerloco launch``, gloo on loopback), bytes per worker per round
  from their summaries, and for the processes the seconds per round a worker waited for its exchange.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from loss import loss_markdown  # bench/many_workers/loss.py, beside this script

from eagerloco.codecs import get_codec
from eagerloco.comm.distributed import TorchDistCommunicator
from eagerloco.comm.groups import gloo_group
from eagerloco.comm.inprocess import InProcessGroup
from eagerloco.model import GPT, model_config
from eagerloco.sim.model import Variant, exchange_wire_bytes

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
#: name -> (train's flags, flat in M). SparseLoCo's top 64 of 4096 in 2 bits beside the shared support.
EXCHANGES: dict[str, tuple[list[str], bool]] = {
    "e2m1 allgather": (["--codec", "e2m1"], False),
    "e2m1 reduce-scatter": (["--codec", "e2m1", "--transport", "reduce-scatter"], True),
    "top64 allgather": (["--codec", "2bit", "--topk", "64", "--error-feedback", "0.95"], False),
    "shared64": (["--codec", "2bit", "--topk", "64", "--error-feedback", "0.95", "--transport", "shared-support"],
                 True),
    "shared512": (["--codec", "2bit", "--topk", "512", "--error-feedback", "0.4", "--transport", "shared-support"],
                  True),
    "shared1024": (["--codec", "2bit", "--topk", "1024", "--error-feedback", "0.95", "--transport",
                    "shared-support"], True),
    "fp32 ring": (["--codec", "fp32"], True),
}


def _setting(flags: list[str], name: str, default: str | None = None) -> str | None:
    return flags[flags.index(name) + 1] if name in flags else default


def codec_of(name: str, step: int = 1) -> tuple[Any, str]:
    """(the codec of an exchange of :data:`EXCHANGES`, for the round at ``step``; its transport)."""
    flags = EXCHANGES[name][0]
    topk = _setting(flags, "--topk")
    transport = _setting(flags, "--transport", "allgather")
    c = get_codec(_setting(flags, "--codec"), topk=None if topk is None else int(topk),
                  shared=transport == "shared-support")
    return c.for_step(step), transport


def simulated(name: str, numel: int, workers: int) -> float:
    """The simulator's bytes per worker for one exchange of numel values."""
    flags = EXCHANGES[name][0]
    topk = _setting(flags, "--topk")
    transport = _setting(flags, "--transport", "allgather")
    codec = get_codec(_setting(flags, "--codec"))
    v = Variant(name, name, "diloco", codec.bits, topk=None if topk is None else int(topk),
                shared=transport == "shared-support")
    return exchange_wire_bytes(numel, v, workers, transport="ring" if transport == "shared-support" else transport)


def _grads(numel: int, workers: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(numel, generator=gen) * 1e-3 for _ in range(workers)]


def exchange(name: str, numel: int, workers: int) -> dict[str, Any]:
    """Bytes each in-process worker's communicator counted for one exchange, and the simulator's."""
    group = InProcessGroup(workers)
    c, transport = codec_of(name)
    handles = [group.communicator(m).allreduce_mean([g], c, transport=transport)
               for m, g in enumerate(_grads(numel, workers))]
    for h in handles:
        h.wait()
    sent = {comm.stats.bytes_sent for comm in group.communicators}
    if len(sent) != 1:
        raise AssertionError(f"workers counted different bytes: {sorted(sent)}")
    return {"measured": sent.pop(), "simulated": simulated(name, numel, workers)}


def loopback(name: str, numel: int, workers: int, repeats: int = 3) -> dict[str, Any]:
    """Seconds of one exchange over a gloo group of M threads (median of ``repeats``), and the bytes counted."""
    store = dist.HashStore()
    grads = _grads(numel, workers)
    times: dict[int, list[float]] = {}
    sent: dict[int, int] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(workers)

    def body(rank: int) -> None:
        try:
            g = gloo_group(dist.PrefixStore(f"{name}/{workers}/", store), rank, workers, 120.0)
            with TorchDistCommunicator(g, timeout_s=120.0) as comm:
                mine = []
                for r in range(repeats):
                    c, transport = codec_of(name, r)
                    start.wait()
                    t0 = time.perf_counter()
                    comm.allreduce_mean([grads[rank]], c, transport=transport).wait()
                    comm.barrier()  # the exchange is done when the last worker holds its mean
                    mine.append(time.perf_counter() - t0)
                times[rank], sent[rank] = mine, comm.stats.bytes_sent // repeats
        except BaseException as e:  # noqa: BLE001 - raised below, in the main thread
            errors.append(e)
            start.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    if errors or len(times) != workers:
        raise RuntimeError(f"loopback {name} at M = {workers} failed: {errors[:1]}")
    per_repeat = [max(times[r][i] for r in range(workers)) for i in range(repeats)]
    return {"seconds": round(statistics.median(per_repeat), 4), "bytes": sent[0]}


def train_run(name: str, workers: int, processes: bool, out: Path) -> dict[str, Any]:
    """One short ``eagerloco train`` run (in-process workers, or worker processes through ``eagerloco launch``):
    bytes per worker per round and, for processes, the seconds per round a worker waited for its exchange."""
    train = ["--model", "tiny", "--tokenizer", "bpe:1024", "--batch-size", "2", "--seq-len", "32", "--steps", "4",
             "--inner-steps", "2", "--eval-batches", "1", "--no-progress", "--overwrite", "--out", str(out),
             *EXCHANGES[name][0]]
    if processes:
        cmd = [sys.executable, "-m", "eagerloco", "launch", "--workers", str(workers), "--", *train]
    else:
        cmd = [sys.executable, "-m", "eagerloco", "train", "--workers", str(workers), *train]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}"
                           f"{proc.stderr[-2000:]}")
    s = json.loads((out / "summary.json").read_text())
    rounds = s["syncs_per_worker"]
    row = {"bytes_per_round": s["bytes_sent_per_worker"] / rounds, "rounds": rounds,
           "simulated": simulated(name, s["num_params"], workers), "real_s": round(time.perf_counter() - t0, 1)}
    if processes:
        row["blocked_s_per_round"] = round(max(w["blocked_s"] for w in s["per_worker"]) / rounds, 4)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="2,4,8,16,32", help="comma list of M (exchange and loopback)")
    ap.add_argument("--parts", default="exchange,loopback,runs", help="comma list of exchange, loopback, runs")
    ap.add_argument("--exchanges", default=",".join(EXCHANGES), help="comma list of the exchanges to measure")
    ap.add_argument("--runs-dir", default="/tmp/many_workers_runs", help="where the train runs write")
    args = ap.parse_args()
    numel = sum(p.numel() for p in GPT(model_config("tiny")).parameters())
    ms = [int(w) for w in args.workers.split(",")]
    path = RESULTS / "many_workers.json"
    out = json.loads(path.read_text()) if path.exists() else {}
    if out.get("params") != numel or "exchange" not in out and "rows" in out:  # an older layout: start afresh
        out = {}
    out.update(model="tiny", params=numel)

    def save() -> None:
        RESULTS.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1) + "\n")
        (RESULTS / "many_workers.md").write_text(markdown(out))

    parts, names = args.parts.split(","), args.exchanges.split(",")
    for part, fn in (("exchange", exchange), ("loopback", loopback)):
        if part in parts:
            table = out.setdefault(part, {})
            for m in ms:
                for name in names:
                    table.setdefault(name, {})[str(m)] = fn(name, numel, m)
                    print(part, m, name, table[name][str(m)], flush=True)
                save()
    if "runs" in parts:
        runs = out.setdefault("runs", {})
        for label, m, processes in (("in-process", 16, False), ("in-process", 32, False), ("processes", 16, True)):
            for name in names:
                key = f"{label} M={m}"
                runs.setdefault(key, {})[name] = train_run(name, m, processes, Path(args.runs_dir) / key / name)
                print(key, name, runs[key][name], flush=True)
                save()
    save()


def _kb(x: float) -> str:
    return f"{x / 1e3:,.1f}"


def markdown(out: dict[str, Any]) -> str:
    lines = [
        "# Bytes per worker per round as the workers grow",
        "",
        f"One DiLoCo round (one exchange) of the tiny model's outer gradient ({out['params']:,} values) per worker, "
        "for each transport: e2m1 all-gathered (each worker receives the M-1 others' payloads) and through the "
        "reduce-scatter (`--transport reduce-scatter`); SparseLoCo's 2-bit top 64 of 4096 all-gathered and the "
        "shared support of 64, 512 or 1024 of 4096 in 2 bits (`--transport shared-support`: positions drawn alike, "
        "values reduce-scattered); FP32 on a ring all-reduce. Generated by `bench/many_workers/run.py` on 2 shared CPU "
        "cores.",
    ]
    ex = out.get("exchange", {})
    if ex:
        names = [n for n in EXCHANGES if n in ex]
        ms = sorted({int(m) for t in ex.values() for m in t})
        lines += ["", "## Bytes per worker, measured (in-process communicator's count) and simulated, kB", "",
                  "| M | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for m in ms:
            cells = []
            for n in names:
                r = ex[n].get(str(m))
                cells.append("" if r is None else f"{_kb(r['measured'])} ({_kb(r['simulated'])})")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lo, hi = str(ms[0]), str(ms[-1])
        growth = {n: ex[n][hi]["measured"] / ex[n][lo]["measured"] for n in names if lo in ex[n] and hi in ex[n]}
        same = all(r["measured"] == r["simulated"] for t in ex.values() for r in t.values())
        flat = [n for n in growth if EXCHANGES[n][1]]
        lines += ["", f"Growth from M = {lo} to M = {hi}: " + ", ".join(f"{n} {g:.2f}x" for n, g in growth.items())
                  + ". Simulated in brackets" + ("; every measured value equals it" if same else "") + ". The goal "
                  "(issue 36), the flat transports within 2x: met by "
                  + (", ".join(n for n in flat if growth[n] <= 2) or "none") + "; missed by "
                  + (", ".join(n for n in flat if growth[n] > 2) or "none") + ". They tend to 2 payloads, the ring "
                  "all-reduce's 2(M-1)/M, plus at most one scale block of padding per shard (the tiny model's 12,864 "
                  "kept values of 64 of 4096 make 32 shards of 402, padded to 416)."]
    lb = out.get("loopback", {})
    if lb:
        names = [n for n in EXCHANGES if n in lb]
        ms = sorted({int(m) for t in lb.values() for m in t})
        lines += ["", "## Seconds per exchange over gloo on loopback (M threads in one process)", "",
                  "Launch to the last worker holding the mean, encoding, sums and decoding included, median of 3; "
                  "M threads share 2 CPU cores with other work, so the time grows with M's compute as much as "
                  "with the bytes.", "", "| M | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for m in ms:
            lines.append(f"| {m} | " + " | ".join(f"{lb[n][str(m)]['seconds']:.3f}" if str(m) in lb[n] else ""
                                                  for n in names) + " |")
    runs = out.get("runs", {})
    if runs:
        lines += ["", "## Whole training runs (tiny model, DiLoCo, H = 2, 2 rounds)", "",
                  "Bytes per worker per round from each run's summary (simulated in brackets), kB; for worker "
                  "processes (`eagerloco launch`, gloo on loopback) also the seconds per round the slowest worker "
                  "waited for its exchange.", "", "| run | " + " | ".join(EXCHANGES) + " |",
                  "|---|" + "---|" * len(EXCHANGES)]
        for key, row in runs.items():
            cells = []
            for n in EXCHANGES:
                r = row.get(n)
                if r is None:
                    cells.append("")
                    continue
                wait = f", {r['blocked_s_per_round']:.2f} s" if "blocked_s_per_round" in r else ""
                cells.append(f"{_kb(r['bytes_per_round'])} ({_kb(r['simulated'])}){wait}")
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
    loss = RESULTS / "many_workers_loss.json"
    if loss.exists():
        lines += loss_markdown(json.loads(loss.read_text()))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
