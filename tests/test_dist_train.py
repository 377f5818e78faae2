"""The multi-process runtime end to end: real processes, gloo on loopback, real files."""

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


class _CleanRuns:
    """One uninterrupted 2-worker run per method, made on first use and shared by the tests below."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: set[str] = set()

    def get(self, method: str) -> Path:
        out = self.root / method
        if method not in self.done:
            r = launch(out, 2, [*METHODS[method], *SHARED])
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
            self.done.add(method)
        return out


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> _CleanRuns:
    return _CleanRuns(tmp_path_factory.mktemp("clean"))


def _assert_same_state(sa: dict, sb: dict, what: str, exact: bool) -> None:
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
    r = inprocess(b, 2, [*METHODS[method], *SHARED])
    assert r.returncode == 0, r.stderr[-3000:]
    for w in range(2):
        _assert_same_state(final_state(a, w), final_state(b, w), f"worker {w}", exact=False)
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
        _assert_same_state(a, b, f"worker {w}", exact=True)
        for x, y in zip(a["sync"]["outer_opts"], b["sync"]["outer_opts"], strict=True):
            for sx, sy in zip(x["state"].values(), y["state"].values(), strict=True):
                for k in sx:
                    torch.testing.assert_close(sx[k], sy[k], rtol=0, atol=0)
    sa, sb = (json.loads((p / "summary.json").read_text()) for p in (ref, tmp_path))
    assert sa["final_eval_loss"] == sb["final_eval_loss"]


@pytest.mark.processes
def test_overlap_is_real_on_an_emulated_link(tmp_path: Path) -> None:
    """A full exchange takes ~0.3 s (several inner steps): DiLoCo waits it out every round, eager hides it."""
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
def test_fixed_step_time_paces_real_processes_and_counts_overruns(tmp_path: Path) -> None:
    """--sim-step-time on real processes: every step lasts at least that long and counts as compute;
    a step time no real step can meet is reported step by step and warned about."""
    steps, pace = 6, 0.08
    args = ["--method", "diloco", "--inner-steps", "3", "--steps", str(steps)]
    r = launch(tmp_path / "paced", 2, [*args, "--sim-step-time", str(pace)])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads((tmp_path / "paced" / "summary.json").read_text())
    for w in s["per_worker"]:
        assert w["compute_s"] >= steps * pace  # the padding sleeps at least the rest of each step
        assert w["slow_steps"] <= steps
    assert s["real_wall_s"] >= steps * pace
    assert s["slow_steps"] == sum(w["slow_steps"] for w in s["per_worker"])

    r = launch(tmp_path / "overrun", 2, [*args, "--sim-step-time", "1e-9"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads((tmp_path / "overrun" / "summary.json").read_text())
    assert [w["slow_steps"] for w in s["per_worker"]] == [steps, steps]
    assert s["slow_steps"] == 2 * steps
    assert "took longer than --sim-step-time" in r.stdout + r.stderr


@pytest.mark.processes
def test_two_ranks_per_worker_stay_identical_and_count_one_exchange(tmp_path: Path) -> None:
    args = ["--method", "diloco", "--inner-steps", "4", "--steps", "10", "--checkpoint-every", "10"]  # mid-round
    r = launch(tmp_path, 2, args, ranks=2)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    path = ckpt.list_checkpoints(ckpt.checkpoint_root(tmp_path))[-1]
    ranks = [ckpt.load_worker_state(path, rank) for rank in range(4)]
    for w in range(2):
        first, second = ranks[2 * w], ranks[2 * w + 1]
        for k in first["model"]:
            assert torch.equal(first["model"][k], second["model"][k]), k
        assert first["stream"]["num_tokens"] == second["stream"]["num_tokens"]
        assert first["stream"]["seed"] != second["stream"]["seed"]  # each rank draws its own batches
    assert not torch.equal(ranks[0]["model"]["blocks.0.attn.qkv.weight"], ranks[2]["model"]["blocks.0.attn.qkv.weight"])
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["syncs_per_worker"] == 2  # one outer exchange per worker and round, not one per rank
    n = s["num_params"]
    assert s["bytes_sent_per_worker"] == 2 * 4 * n  # M = 2 ring: one fp32 payload per exchange
    assert len(s["per_worker"]) == 2


def _full(shards: list[torch.Tensor]) -> torch.Tensor:
    """A parameter from its FSDP shards (dim 0 split over the worker's ranks)."""
    return torch.cat(shards) if shards[0].dim() else shards[0]


@pytest.mark.processes
def test_fsdp_shards_each_worker_and_exchanges_shards_with_the_replicated_numbers(tmp_path: Path) -> None:
    """--fsdp: each of a worker's 2 ranks holds half of every parameter and exchanges that half; the
    run ends bit for bit where the replicated run (2 ranks per worker, data-parallel) ends, with the
    same bytes on the link. No gradient clipping: its norm is summed over shards in another order."""
    args = [*METHODS["streaming"], "--steps", "10", "--checkpoint-every", "10", "--grad-clip", "0"]
    runs = {}
    for name, extra in (("fsdp", ["--fsdp"]), ("ddp", [])):
        r = launch(tmp_path / name, 2, [*args, *extra], ranks=2)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        path = ckpt.list_checkpoints(ckpt.checkpoint_root(tmp_path / name))[-1]
        runs[name] = [ckpt.load_worker_state(path, rank) for rank in range(4)]
    for w in range(2):
        first, second = runs["fsdp"][2 * w], runs["fsdp"][2 * w + 1]
        ref = runs["ddp"][2 * w]
        for k, full in ref["model"].items():
            if full.dim():  # a shard each: half the rows (the rank's own part of the parameter)
                assert first["model"][k].shape[0] == (full.shape[0] + 1) // 2, k
                assert not torch.equal(first["model"][k], second["model"][k][: first["model"][k].shape[0]]), k
            assert torch.equal(_full([first["model"][k], second["model"][k]]), full), k
        for fa, fb, fr in zip(first["sync"]["outer"], second["sync"]["outer"], ref["sync"]["outer"], strict=True):
            for a, b, c in zip(fa, fb, fr, strict=True):
                assert torch.equal(_full([a, b]), c)
        ranks_sent = [runs["fsdp"][2 * w + i]["stats"]["bytes_sent"] for i in range(2)]
        assert sum(ranks_sent) == ref["stats"]["bytes_sent"] and min(ranks_sent) > 0
    sf, sd = (json.loads((tmp_path / n / "summary.json").read_text()) for n in ("fsdp", "ddp"))
    assert sf["fsdp"] is True and sd["fsdp"] is False
    for k in ("bytes_sent_per_worker", "peak_sync_bytes", "syncs_per_worker", "num_params"):
        assert sf[k] == sd[k], k
    assert sf["final_eval_loss"] == sd["final_eval_loss"]
    assert len(sf["per_worker"]) == 2


@pytest.mark.processes
def test_fsdp_ranks_share_the_workers_emulated_link(tmp_path: Path) -> None:
    """Each of a worker's 2 ranks sends half the payload over half the link's bandwidth, so a DiLoCo
    round blocks for the whole payload's link time, as with one rank sending it all."""
    n_bytes = 820_352 * 4  # tiny preset, fp32
    link_time = 0.3
    bw = n_bytes * 8 / link_time / 1e9  # M = 2: the ring sends one payload's worth per worker
    args = ["--method", "diloco", "--inner-steps", "4", "--steps", "8", "--bandwidth-gbps", f"{bw:.6f}", "--fsdp"]
    r = launch(tmp_path, 2, args, ranks=2)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["bytes_sent_per_worker"] == 2 * n_bytes
    assert s["blocked_s"] >= 0.95 * 2 * link_time, s["blocked_s"]  # 2 rounds; the full link would halve it


@pytest.mark.processes
def test_fsdp_resume_after_a_killed_worker_gives_the_uninterrupted_numbers(tmp_path: Path) -> None:
    """Sharded checkpoints: every rank writes its shards; after worker 1 dies the others stop naming it,
    and resuming (4-bit eager, two rounds in flight) ends bit for bit where an uninterrupted run ends.
    Resuming with another layout is refused."""
    args = [*METHODS["eager"], *SHARED, "--fsdp"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    r = launch(ref, 2, args, ranks=2)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = launch(run, 2, args, ranks=2, kill="1:6:0.01")
    assert r.returncode != 0 and "worker 1" in r.stdout and "Traceback" not in r.stdout, r.stdout[-3000:]
    path, meta = ckpt.latest_valid(ckpt.checkpoint_root(run))
    assert meta["step"] == 4 and meta["fsdp"] is True and len(meta["files"]) == 4, path
    r = launch(run, 2, [*METHODS["eager"], *SHARED, "--resume"], ranks=2)  # without --fsdp
    assert r.returncode != 0 and "--ranks-per-worker 2 --fsdp" in r.stdout + r.stderr, r.stdout[-3000:]
    r = launch(run, 2, [*args, "--resume"], ranks=2)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for rank in range(4):
        a, b = final_state(ref, rank), final_state(run, rank)
        _assert_same_state(a, b, f"rank {rank}", exact=True)
        for x, y in zip(a["opt"]["state"].values(), b["opt"]["state"].values(), strict=True):
            for k in x:
                assert torch.equal(x[k], y[k]), k
    sa, sb = (json.loads((p / "summary.json").read_text()) for p in (ref, run))
    assert sa["final_eval_loss"] == sb["final_eval_loss"]


@pytest.mark.processes
def test_fsdp_needs_several_ranks_per_worker(tmp_path: Path) -> None:
    r = launch(tmp_path, 2, [*METHODS["diloco"], "--steps", "2", "--fsdp"], ranks=1)
    assert r.returncode != 0
    assert "--fsdp shards each worker's model over its ranks" in r.stdout + r.stderr, r.stdout[-2000:]
    r = inprocess(tmp_path / "inproc", 2, ["--steps", "2", "--fsdp"])
    assert r.returncode != 0 and "--fsdp needs several processes" in r.stderr, r.stderr[-2000:]


def test_sharded_accounting_adds_a_workers_shards() -> None:
    """Each rank of a sharded worker moves its shard at the same time: bytes and the peak payload add
    up, times are the mean over the worker's ranks, syncs are counted once."""
    from eagerloco.train.outputs import per_worker as _per_worker

    def entry(worker: int, sent: int, peak: int, compute: float, slow: int) -> dict:
        stats = {"bytes_sent": sent, "bytes_received": sent, "peak_sync_bytes": peak, "num_syncs": 3,
                 "compute_s": compute, "overhead_s": compute / 4, "blocked_s": 1.0, "drain_s": 0.5,
                 "slow_steps": slow}
        return {"outer": True, "worker": worker, "stats": stats, "wall": compute + 1}

    merged = _per_worker([entry(1, 30, 7, 4.0, 0), entry(0, 10, 5, 2.0, 1), entry(0, 12, 6, 4.0, 0),
                          entry(1, 30, 7, 2.0, 2)])
    assert [m["worker"] for m in merged] == [0, 1]
    s0 = merged[0]["stats"]
    assert (s0["bytes_sent"], s0["bytes_received"], s0["peak_sync_bytes"], s0["num_syncs"]) == (22, 22, 11, 3)
    assert (s0["compute_s"], s0["overhead_s"], s0["blocked_s"], s0["slow_steps"]) == (3.0, 0.75, 1.0, 1)
    assert merged[0]["wall"] == 5.0 and merged[1]["stats"]["slow_steps"] == 2
    one = entry(2, 1, 1, 1.0, 0)
    assert _per_worker([one]) == [one]  # a worker with one link-using rank: its entry as it is


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
