"""What a run writes: metrics.jsonl, TensorBoard events, summary.json; one path for every runtime, so the
files mean the same whatever carried the exchange."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from eagerloco.config import TrainConfig
from eagerloco.extras import require
from eagerloco.flops import mfu
from eagerloco.jsonfiles import finite_json
from eagerloco.train.rundir import RunManifest
from eagerloco.units import fmt_bytes, text_table

#: Seconds between progress lines when stdout is not a terminal.
PROGRESS_EVERY_S = 30.0


def tensorboard_writer(cfg: TrainConfig, out: Path, manifest: RunManifest | None = None) -> Any:
    """A TensorBoard writer under <out>/tensorboard when --tensorboard is set, else None; the event file it
    creates is listed in ``manifest``."""
    if not cfg.tensorboard:
        return None
    require("tensorboard", "--tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    logdir = out / "tensorboard"
    before = set(os.listdir(logdir)) if logdir.is_dir() else set()
    writer = SummaryWriter(str(logdir))
    if manifest is not None:
        made = sorted(set(os.listdir(logdir)) - before)
        manifest.record({f"tensorboard/{name}": "file" for name in made})
    return writer


class RunOutput:
    """metrics.jsonl (and TensorBoard events) of a run, written by the process that reports (asked at every line:
    an elastic run's reporter can change).

    The first writer rewrites the file up to a resumed ``start_step``; a later one (a new elastic leader)
    keeps the lines before its first and adds, from the records it kept, the steps the file lacks. Lines that
    do not parse (a writer that died mid-line) are dropped; the file is opened at the first line."""

    #: Records a process that does not report keeps for a takeover (the newest ones).
    KEEP_PENDING = 10_000

    def __init__(self, cfg: TrainConfig, start_step: int, is_writer: Callable[[], bool],
                 manifest: RunManifest | None = None) -> None:
        self.cfg = cfg
        self.manifest = manifest
        self.path = Path(cfg.out) / "metrics.jsonl"
        self.start_step = start_step
        self.is_writer = is_writer
        self.f: IO[str] | None = None
        self.tb: Any = None
        self.first = is_writer()  # reports from the start: it (re)writes the file
        self.pending: list[dict[str, Any]] = []  # lines kept while another process reports

    def log(self, rec: dict[str, Any]) -> None:
        """Append one metrics record (a dict with "step") if this process reports, else close the file."""
        if not self.is_writer():
            self.close()
            self.pending.append(finite_json(rec))
            del self.pending[:-self.KEEP_PENDING]
            return
        if self.f is None:
            if self.manifest is not None:
                self.manifest.record({"metrics.jsonl": "file"})
            self.f = self._open(int(rec["step"]))
            if self.tb is None:
                self.tb = tensorboard_writer(self.cfg, Path(self.cfg.out), self.manifest)
        self.f.write(json.dumps(finite_json(rec)) + "\n")
        self.f.flush()
        if self.tb is not None:
            for k, v in rec.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, rec["step"])

    def _open(self, step: int) -> IO[str]:
        keep_upto = self.start_step if self.first else step - 1
        fresh = self.first and not self.start_step
        self.first = False
        kept: dict[int, str] = {}
        torn = 0
        if not fresh and self.path.exists():
            for ln in self.path.read_text(errors="replace").split("\n"):
                try:
                    at = json.loads(ln)["step"] if ln else None
                    if at is not None and at <= keep_upto:
                        kept[int(at)] = ln
                except (ValueError, KeyError, TypeError):
                    torn += 1
        if torn:
            print(f"eagerloco: dropped {torn} unreadable line(s) of {self.path} (a run that stopped mid-line)",
                  file=sys.stderr, flush=True)
        for rec in self.pending:  # steps whose line the previous reporter never wrote
            at = int(rec["step"])
            if self.start_step < at <= keep_upto and at not in kept:
                kept[at] = json.dumps(rec)
        self.pending = []
        f = open(self.path, "w")  # noqa: SIM115 - closed in close()
        for at in sorted(kept):
            f.write(kept[at] + "\n")
        f.flush()
        return f

    def close(self) -> None:
        """Close the metrics file and TensorBoard writer (a later line reopens them)."""
        if self.f is not None:
            self.f.close()
            self.f = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None


class ProgressLines:
    """A run's progress: a bar on a terminal, its figures refreshed every ``log_every`` steps; where there is none (a
    log, `eagerloco launch`) a line every ``every_s`` seconds instead (step, loss, bytes sent, time blocked, pace,
    tokens/s and, where the peak is known, MFU)."""

    def __init__(self, method: str, steps: int, start_step: int, every_s: float | None = None,
                 log_every: int = 1) -> None:
        from tqdm import tqdm

        self.method, self.steps, self.log_every = method, steps, log_every
        self.every_s = PROGRESS_EVERY_S if every_s is None else every_s
        self.t0 = self.last = time.perf_counter()
        self.start_step = start_step
        self.bar: Any = tqdm(total=steps, initial=start_step, desc=method, unit="step", dynamic_ncols=True,
                             leave=False, disable=None)

    def update(self, step: int, loss: float | Callable[[], float], stats: Any, tokens: int | None = None,
               per_token: float = 0.0, peak: float | None = None, devices: int = 1) -> None:
        """After every inner step. ``loss``: the value or a function giving it (read only when it is shown: on a GPU
        reading it waits); ``tokens``: trained so far by all workers."""
        now, bar = time.perf_counter(), not self.bar.disable
        if bar:
            self.bar.update(1)
        due = (step % self.log_every == 0 or step == self.steps) if bar else now - self.last >= self.every_s
        if not due:
            return
        self.last = now
        value = loss() if callable(loss) else loss
        pace = (step - self.start_step) / (now - self.t0)
        per_s = (tokens * (step - self.start_step) / step / (now - self.t0)
                 if tokens is not None and self.start_step < step else None)
        run_mfu = mfu(per_s, per_token, peak, devices) if per_s is not None else None
        if bar:
            shown = {"mfu": f"{run_mfu:.1%}"} if run_mfu is not None else {}
            self.bar.set_postfix(loss=f"{value:.3f}", sent=fmt_bytes(stats.bytes_sent, ".1f", ""),
                                 blocked=f"{stats.blocked_s:.2f}s", tok_s=f"{per_s or 0.0:,.0f}", **shown)
            return
        left = (self.steps - step) / pace if pace > 0 else float("inf")
        rate = ""
        if per_s is not None:
            rate = f"  {per_s:,.0f} tokens/s" + (f"  MFU {run_mfu:.1%}" if run_mfu is not None else "")
        print(f"{self.method}: step {step}/{self.steps}  loss {value:.3f}  sent {fmt_bytes(stats.bytes_sent)}  "
              f"blocked {stats.blocked_s:.2f}s  {pace:.2f} steps/s{rate}, about {left:.0f} s left", flush=True)

    def close(self) -> None:
        self.bar.close()


def accounting(entries: list[tuple[dict[str, Any], float]]) -> dict[str, Any]:
    """The one summary formula from ``entries`` (per worker, ``WorkerStats.as_dict()`` and its wall seconds):
    means of bytes, syncs and times; the largest peak payload and wall; compute utilization; ``per_worker``."""
    n = len(entries)
    stats = [s for s, _ in entries]
    walls = [w for _, w in entries]
    compute = sum(s["compute_s"] for s in stats)

    def mean(key: str) -> float:
        total: float = sum(s[key] for s in stats)
        return total / n

    return {
        "bytes_sent_per_worker": mean("bytes_sent"),
        "bytes_received_per_worker": mean("bytes_received"),
        "peak_sync_bytes": max(s["peak_sync_bytes"] for s in stats),
        "syncs_per_worker": mean("num_syncs"),
        "compute_s": compute / n,
        "overhead_s": mean("overhead_s"),
        "blocked_s": mean("blocked_s"),
        "drain_s": mean("drain_s"),
        "wall_s": max(walls),
        "compute_utilization": compute / sum(walls) if sum(walls) > 0 else 1.0,
        "per_worker": stats,
    }


def add_throughput(summary: dict[str, Any], devices: int = 1) -> None:
    """Add ``tokens_per_s`` (all workers' tokens over the loop's wall time), ``inner_tokens_per_s`` (one
    worker's over its inner compute seconds), ``mfu`` and ``inner_mfu`` (the same in model FLOPs over the
    peak of ``devices`` accelerators, resp. one; None where the peak is unknown)."""
    per_token, peak = summary["flops_per_token"], summary["peak_tflops"]
    wall, compute = summary["real_wall_s"], summary["compute_s"]
    rate = summary["tokens"] / wall if wall > 0 else float("nan")
    inner = summary["tokens"] / summary["workers"] / compute if compute > 0 else float("nan")
    summary.update(
        devices=devices, tokens_per_s=rate, inner_tokens_per_s=inner,
        mfu=mfu(rate, per_token, peak, devices), inner_mfu=mfu(inner, per_token, peak, 1),
    )


def per_worker(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One accounting entry per worker from those of its link-using ranks: under FSDP the ranks move shards
    at once, so bytes and peak payload add up, times are averaged, a step slow on any rank was slow."""
    by_worker: dict[int, list[dict[str, Any]]] = {}
    for e in entries:
        by_worker.setdefault(e["worker"], []).append(e)
    merged = []
    for w in sorted(by_worker):
        group = by_worker[w]
        if len(group) == 1:
            merged.append(group[0])
            continue
        stats = [e["stats"] for e in group]
        one = dict(stats[0])
        for k in ("bytes_sent", "bytes_received", "peak_sync_bytes"):
            one[k] = sum(s[k] for s in stats)
        for k in ("compute_s", "overhead_s", "blocked_s", "drain_s"):
            one[k] = sum(s[k] for s in stats) / len(stats)
        one["num_syncs"] = max(s["num_syncs"] for s in stats)
        one["slow_steps"] = max(int(s.get("slow_steps", 0)) for s in stats)
        merged.append({"outer": True, "worker": w, "stats": one, "wall": max(e["wall"] for e in group)})
    return merged


def aggregate(summary: dict[str, Any], workers: list[dict[str, Any]]) -> None:
    """Replace one process's accounting in ``summary`` by that of ``workers`` (one
    ``{"stats": WorkerStats.as_dict(), "wall": seconds}`` per worker)."""
    summary.update(accounting([(e["stats"], e["wall"]) for e in workers]))
    summary["slow_steps"] = sum(int(e["stats"].get("slow_steps", 0)) for e in workers)  # each warned at its first


def format_table(summaries: list[dict[str, Any]]) -> str:
    """The table `eagerloco train` prints: method, eval loss, bytes, peak, blocked time (the mean, and each
    worker's when there are several), compute utilization, tokens/s and MFU."""
    head: tuple[str, ...] = (
        "method", "eval loss", "bytes sent/worker", "peak sync", "blocked s", "CU (link)", "tokens/s", "MFU"
    )
    each = any(len(s.get("per_worker") or []) > 1 for s in summaries)  # a mean would hide who waited
    if each:
        head = (*head[:5], "blocked s by worker", *head[5:])
    rows = []
    for s in summaries:
        row: tuple[str, ...] = (
            s.get("label", s["method"]),
            f"{s['final_eval_loss']:.4f}",
            fmt_bytes(s["bytes_sent_per_worker"]),
            fmt_bytes(s["peak_sync_bytes"]),
            f"{s['blocked_s']:.2f}",
            f"{s['compute_utilization']:.3f}",
            f"{s['tokens_per_s']:,.0f}" if s.get("tokens_per_s") is not None else "n/a",
            f"{s['mfu']:.1%}" if s.get("mfu") is not None else "n/a",
        )
        if each:
            by = " / ".join(f"{w['blocked_s']:.2f}" for w in s.get("per_worker") or [])
            row = (*row[:5], by or "-", *row[5:])
        rows.append(row)
    return text_table(list(head), [list(r) for r in rows], right=())
