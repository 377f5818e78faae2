"""The multi-process runtime end to end: real processes, gloo on loopback, real files. One rank per
worker here; several ranks per worker (replicated and FSDP) in test_dist_ranks.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from runs import DIST_ENV, launch_here, train_here
from test_docs import always, metrics_tables

from eagerloco import checkpoint as ckpt

BASE = [
    "--model",
    "tiny",
    "--batch-size",
    "2",
    "--seq-len",
    "32",
    "--eval-batches",
    "2",
    "--no-progress",
    "--log-every",
    "4",
    "--seed",
    "3",
]


def launch(
    out: Path, workers: int, args: list[str], ranks: int = 1, timeout: float = 240, kill: str | None = None
) -> subprocess.CompletedProcess:
    """`eagerloco launch` of the trainer, the launcher in this process (tests/runs.py).

    kill: EAGERLOCO_FAULT_KILL ("WORKER:STEP:DELAY_S"), a worker that SIGKILLs itself mid-run."""
    argv = [*BASE, "--workers", str(workers), "--ranks-per-worker", str(ranks), "--out", str(out), *args]
    return launch_here(argv, workers, ranks, env={"EAGERLOCO_FAULT_KILL": kill} if kill else None, timeout=timeout)


def inprocess(out: Path, workers: int, args: list[str]) -> subprocess.CompletedProcess:
    # One thread, like each launched process, so the matrix products add in the same order.
    return train_here([*BASE, "--workers", str(workers), "--out", str(out), *args])


def final_state(out: Path, worker: int) -> dict:
    path = ckpt.list_checkpoints(ckpt.checkpoint_root(out))[-1]
    ckpt.verify(path)
    return ckpt.load_worker_state(path, worker)


METHODS = {
    "dp": ["--method", "dp"],
    "diloco": ["--method", "diloco", "--inner-steps", "4"],
    "streaming": [
        "--method",
        "streaming",
        "--inner-steps",
        "4",
        "--fragments",
        "2",
        "--overlap-steps",
        "1",
        "--alpha",
        "0.5",
    ],
    "delayed": ["--method", "delayed", "--inner-steps", "4"],
    "eager": ["--method", "eager", "--inner-steps", "4", "--eager-rounds", "2"],
}


SHARED = ["--codec", "e2m1", "--steps", "12", "--checkpoint-every", "4"]
# The clean dp and DiLoCo runs also carry test_fixed_step_time_paces_real_processes_and_counts_overruns:
# a step time every step is padded to, and one no real step can meet. Pacing changes the timing only,
# never the numbers the other tests compare (both methods wait for every exchange).
PACE = 0.08
CLEAN_EXTRA = {"dp": ["--sim-step-time", str(PACE)], "diloco": ["--sim-step-time", "1e-9"]}


class _CleanRuns:
    """One uninterrupted 2-worker run per method, made on first use and shared by the tests below."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.output: dict[str, str] = {}

    def get(self, method: str) -> Path:
        out = self.root / method
        if method not in self.output:
            r = launch(out, 2, [*METHODS[method], *SHARED, *CLEAN_EXTRA.get(method, [])])
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
            self.output[method] = r.stdout + r.stderr
        return out


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> _CleanRuns:
    return _CleanRuns(tmp_path_factory.mktemp("clean"))


def assert_same_state(sa: dict, sb: dict, what: str, exact: bool) -> None:
    tol = {"rtol": 0.0, "atol": 0.0} if exact else {"rtol": 1e-6, "atol": 1e-7}
    for k in sa["model"]:
        torch.testing.assert_close(sa["model"][k], sb["model"][k], **tol, msg=f"{what} {k}")
    for fa, fb in zip(sa["sync"]["outer"], sb["sync"]["outer"], strict=True):
        for x, y in zip(fa, fb, strict=True):
            torch.testing.assert_close(x, y, **tol, msg=what)


@pytest.mark.processes
@pytest.mark.parametrize("method", list(METHODS))
def test_multiprocess_equals_inprocess(tmp_path: Path, clean: _CleanRuns, method: str) -> None:
    a, b = clean.get(method), tmp_path / "inproc"
    r = inprocess(b, 2, [*METHODS[method], *SHARED, *CLEAN_EXTRA.get(method, [])])
    assert r.returncode == 0, r.stderr[-3000:]
    for w in range(2):
        assert_same_state(final_state(a, w), final_state(b, w), f"worker {w}", exact=False)
    sa, sb = (json.loads((p / "summary.json").read_text()) for p in (a, b))
    assert sa["runtime"] == "distributed"
    assert sa["bytes_sent_per_worker"] == sb["bytes_sent_per_worker"]  # the same bytes counted
    assert sa["peak_sync_bytes"] == sb["peak_sync_bytes"]
    assert sa["final_eval_loss"] == pytest.approx(sb["final_eval_loss"], rel=1e-5)


@pytest.mark.processes
@pytest.mark.parametrize("method", list(METHODS))
def test_resume_after_a_killed_worker_gives_the_uninterrupted_numbers(
    tmp_path: Path, clean: _CleanRuns, method: str
) -> None:
    """Without --elastic: worker 1 is killed mid-step 6; worker 0 stops with a PeerError naming it;
    the last checkpoint (step 4) is intact; resuming from it ends bit for bit where a run that was
    never interrupted ends."""
    args = [*METHODS[method], *SHARED]
    r = launch(tmp_path, 2, args, kill="1:6:0.01")
    assert r.returncode != 0, r.stdout[-3000:]
    assert "worker 1" in r.stdout and "Traceback" not in r.stdout, r.stdout[-3000:]
    assert not (tmp_path / "summary.json").exists()
    path, meta = ckpt.latest_valid(ckpt.checkpoint_root(tmp_path))
    assert meta["step"] == 4 and len(meta["files"]) == 2, path
    r = launch(tmp_path, 2, [*args, "--resume"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ref = clean.get(method)
    for w in range(2):
        a, b = final_state(ref, w), final_state(tmp_path, w)
        assert_same_state(a, b, f"worker {w}", exact=True)
        for x, y in zip(a["sync"]["outer_opts"], b["sync"]["outer_opts"], strict=True):
            for sx, sy in zip(x["state"].values(), y["state"].values(), strict=True):
                for k in sx:
                    torch.testing.assert_close(sx[k], sy[k], rtol=0, atol=0)
    sa, sb = (json.loads((p / "summary.json").read_text()) for p in (ref, tmp_path))
    assert sa["final_eval_loss"] == sb["final_eval_loss"]


@pytest.mark.processes
def test_overlap_is_real_on_an_emulated_link(tmp_path: Path) -> None:
    """A full exchange takes ~0.3 s: DiLoCo waits it out every round, eager hides it behind the next round's 10
    inner steps, paced to 0.06 s each so that the round outlasts the link however fast this machine's cores are."""
    n_bytes = 820_352 * 4  # tiny preset, fp32
    bw = n_bytes * 8 / 0.3 / 1e9  # M = 2: the ring sends one payload's worth per worker
    common = [
        "--inner-steps",
        "10",
        "--steps",
        "30",
        "--batch-size",
        "8",
        "--seq-len",
        "64",
        "--bandwidth-gbps",
        f"{bw:.6f}",
        "--latency-ms",
        "5",
        "--sim-step-time",
        "0.06",
    ]
    out = {}
    for method in ("diloco", "eager"):
        r = launch(tmp_path / method, 2, ["--method", method, *common])
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        out[method] = json.loads((tmp_path / method / "summary.json").read_text())
    link_time = 0.005 + n_bytes * 8 / (bw * 1e9)
    rounds = 3
    assert out["diloco"]["blocked_s"] >= 0.95 * rounds * link_time
    # Eager launches each exchange a whole round (10 steps) before it must land.
    assert out["eager"]["blocked_s"] < 0.25 * out["diloco"]["blocked_s"], (out["eager"], out["diloco"])
    assert out["eager"]["compute_utilization"] > out["diloco"]["compute_utilization"]


@pytest.mark.processes
def test_fixed_step_time_paces_real_processes_and_counts_overruns(clean: _CleanRuns) -> None:
    """--sim-step-time on real processes: every step lasts at least that long and counts as compute;
    a step time no real step can meet is reported step by step and warned about (the clean dp and
    DiLoCo runs, see CLEAN_EXTRA)."""
    steps = 12
    s = json.loads((clean.get("dp") / "summary.json").read_text())  # paced at PACE
    for w in s["per_worker"]:
        assert w["compute_s"] >= steps * PACE  # the padding sleeps at least the rest of each step
        assert w["slow_steps"] <= steps
    assert s["real_wall_s"] >= steps * PACE
    assert s["slow_steps"] == sum(w["slow_steps"] for w in s["per_worker"])

    s = json.loads((clean.get("diloco") / "summary.json").read_text())  # a step time of 1 ns
    assert [w["slow_steps"] for w in s["per_worker"]] == [steps, steps]
    assert s["slow_steps"] == 2 * steps
    assert "s of real compute, more than the" in clean.output["diloco"]


def _pid_of_rank(marker: str, rank: int, deadline: float) -> int:
    while time.time() < deadline:
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                cmd = (d / "cmdline").read_bytes().decode(errors="replace")
                env = (d / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker in cmd and f"RANK={rank}".encode() in env and "launch" not in cmd:
                return int(d.name)
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} never started")


@pytest.mark.processes
def test_killed_worker_makes_the_others_stop_with_a_clear_error(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "eagerloco",
        "launch",
        "--spawn-ranks",  # the victim is found by its command line in /proc, which a forked rank shares with its server
        "--workers",
        "3",
        "--grace-s",
        "60",
        "--",
        *BASE,
        "--workers",
        "3",
        "--method",
        "eager",
        "--inner-steps",
        "3",
        "--steps",
        "100000",
        "--dist-timeout",
        "20",
        "--out",
        str(out),
    ]
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    victim = _pid_of_rank(str(out), 2, time.time() + 60)
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
        assert p.poll() is None
        time.sleep(0.05)
    t0 = time.time()
    os.kill(victim, signal.SIGKILL)
    output, _ = p.communicate(timeout=120)
    assert p.returncode != 0
    assert time.time() - t0 < 20 + 30  # within the timeout (plus diagnosis)
    for rank in (0, 1):
        lines = [ln for ln in output.splitlines() if ln.startswith(f"[rank {rank}]") and "error" in ln]
        assert any("worker 2" in ln for ln in lines), output[-4000:]


@pytest.mark.processes
def test_a_launched_run_writes_the_documented_keys(clean: _CleanRuns) -> None:
    """A launched run writes the keys of docs/reference/metrics.md: those always written and those of launched
    runs, in summary.json, its per-worker entries and metrics.jsonl."""
    tables = metrics_tables()
    out = clean.get("diloco")
    summary = json.loads((out / "summary.json").read_text())
    launched = {k for k, when in tables["summary.json"].items() if when.startswith("launched runs")}
    assert set(summary) == always(tables["summary.json"]) | launched
    for worker in summary["per_worker"]:
        assert set(worker) == set(tables["per_worker"])
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert set().union(*lines) == always(tables["metrics.jsonl"])
