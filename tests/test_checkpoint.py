"""Checkpoints: atomic, verified, and a resumed run equals one never interrupted."""

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
from jobs import Job, popen
from runs import stop_after_checkpoint, train_here

from eagerloco import checkpoint as ckpt

ARGS = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "2", "--no-progress",
        "--workers", "2", "--inner-steps", "6", "--log-every", "3", "--sim-step-time", "0.05",
        "--bandwidth-gbps", "0.002", "--latency-ms", "20"]


def _states() -> dict[int, dict]:
    return {m: {"w": torch.arange(1000, dtype=torch.float32) * (m + 1), "step": 5} for m in range(2)}


def save(root: Path, step: int, states: dict[int, dict], meta: dict, keep: int = 2) -> Path:
    """Every worker's state written and published as a run does it (the trainer's save, in one process)."""
    stage = ckpt.staging_dir(root, step)
    entries = [ckpt.write_worker_state(stage, m, s) for m, s in sorted(states.items())]
    return ckpt.publish(root, step, entries, meta, keep)


def test_save_and_verify_round_trip(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    path = save(root, 5, _states(), {"config": {"x": 1}})
    meta = ckpt.verify(path)
    assert meta["step"] == 5 and meta["config"] == {"x": 1}
    assert torch.equal(ckpt.load_worker_state(path, 1)["w"], torch.arange(1000.0) * 2)
    assert not any(p.name.startswith(".partial") for p in root.iterdir())  # staged files were moved


def test_keeps_only_the_newest(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        save(root, step, _states(), {}, keep=2)
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step_00000003", "step_00000004"]


@pytest.mark.parametrize("fraction", [i / 10 for i in range(10)])
def test_truncated_checkpoint_is_refused_and_the_previous_used(tmp_path: Path, fraction: float) -> None:
    root = tmp_path / "checkpoints"
    save(root, 1, _states(), {})
    newest = save(root, 2, _states(), {})
    f = newest / "worker_1.pt"
    data = f.read_bytes()
    f.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(ckpt.CheckpointError, match="worker_1.pt is truncated"):
        ckpt.verify(newest)
    path, meta = ckpt.latest_valid(root, log=open(os.devnull, "w"))
    assert meta["step"] == 1 and path.name == "step_00000001"


def test_flipped_byte_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    path = save(root, 1, _states(), {})
    f = path / "worker_0.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="SHA-256"):
        ckpt.verify(path)
    with pytest.raises(ckpt.CheckpointError, match="no usable checkpoint"):
        ckpt.latest_valid(root, log=open(os.devnull, "w"))


def test_missing_or_corrupt_meta(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    path = save(root, 1, _states(), {})
    (path / "meta.json").write_text("{not json")
    with pytest.raises(ckpt.CheckpointError, match="meta.json is unreadable"):
        ckpt.verify(path)
    (path / "meta.json").unlink()
    with pytest.raises(ckpt.CheckpointError, match="meta.json is missing"):
        ckpt.verify(path)


def _train(out: Path, *extra: str) -> Job | subprocess.Popen:
    """A run in a process of its own (one thread, as in this process), for the test that kills it."""
    cmd = [sys.executable, "-m", "eagerloco", "train", *ARGS, "--out", str(out), *extra]
    return popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _result(out: Path) -> tuple[dict, list[dict]]:
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, metrics


@pytest.mark.processes
@pytest.mark.parametrize("method", ["eager", "streaming"])
def test_killed_run_resumes_to_the_same_numbers(tmp_path: Path, method: str) -> None:
    """SIGKILL mid-run, exchanges in flight: resuming (in this process) from the newest checkpoint the
    killed process left ends where a run never interrupted (in this process too) ends."""
    extra = ["--method", method, "--steps", "24", "--checkpoint-every", "6"]
    if method == "streaming":
        extra += ["--fragments", "2", "--overlap-steps", "1", "--alpha", "0.5", "--codec", "e2m1"]
    else:
        extra += ["--eager-rounds", "2", "--codec", "int4", "--stochastic-rounding"]
    clean = tmp_path / "clean"
    r = train_here([*ARGS, "--out", str(clean), *extra])
    assert r.returncode == 0, r.stderr[-3000:]
    killed = tmp_path / "killed"
    p = _train(killed, *extra)
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "step_00000012").exists():  # mid-run, exchanges in flight
        assert p.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.005)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    assert not (killed / "summary.json").exists()
    r = train_here([*ARGS, "--out", str(killed), *extra, "--resume"])
    assert r.returncode == 0, r.stderr[-3000:]
    a, am = _result(clean)
    b, bm = _result(killed)
    assert a["final_eval_loss"] == b["final_eval_loss"]
    assert [m["loss"] for m in am] == [m["loss"] for m in bm]
    for key in ("bytes_sent_per_worker", "peak_sync_bytes", "blocked_s", "wall_s", "compute_utilization"):
        assert a[key] == pytest.approx(b[key], rel=1e-12), key


def test_resume_with_changed_settings_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    r = train_here([*ARGS, "--out", str(out), "--method", "diloco", "--steps", "12", "--checkpoint-every", "6"])
    assert r.returncode == 0, r.stderr[-3000:]
    r = train_here([*ARGS, "--out", str(out), "--method", "eager", "--steps", "12", "--resume"])
    assert r.returncode == 2
    assert "different settings" in r.stderr and "method" in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dp", "diloco", "delayed"])
def test_interrupted_run_resumes_to_the_same_numbers_every_method(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """The methods the SIGKILL test above leaves out, in this process (cheaper): stop the run right
    after the step-12 checkpoint, resume, and compare with a run never interrupted."""
    from eagerloco.cli import make_parser
    from eagerloco.flags import build_train_config
    from eagerloco.train import train

    extra = ["--method", method, "--steps", "18", "--checkpoint-every", "6"]
    if method == "delayed":
        extra += ["--eager-rounds", "2", "--codec", "int8"]

    def cfg(out: Path, *more: str):  # noqa: ANN202 - a TrainConfig
        return build_train_config(make_parser().parse_args(["train", *ARGS, *extra, "--out", str(out), *more]))

    train(cfg(tmp_path / "clean"))
    stop_after_checkpoint(monkeypatch, 12, lambda: train(cfg(tmp_path / "cut")))
    assert not (tmp_path / "cut" / "summary.json").exists()
    train(cfg(tmp_path / "cut", "--resume"))
    a, am = _result(tmp_path / "clean")
    b, bm = _result(tmp_path / "cut")
    assert a["final_eval_loss"] == b["final_eval_loss"]
    assert [m["loss"] for m in am] == [m["loss"] for m in bm]
    last = [ckpt.list_checkpoints(ckpt.checkpoint_root(tmp_path / run))[-1] for run in ("clean", "cut")]
    for m in range(2):
        sa, sb = (ckpt.load_worker_state(p, m) for p in last)
        for k in sa["model"]:
            assert torch.equal(sa["model"][k], sb["model"][k]), (m, k)
        for fa, fb in zip(sa["sync"]["outer"], sb["sync"]["outer"], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(fa, fb, strict=True)), m
