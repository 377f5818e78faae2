"""The Hugging Face Trainer callback with real processes: two workers, each its own job, one of them
a torchrun job of two ranks whose Trainer runs DDP inside the worker (examples/hf_trainer.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from jobs import popen
from test_hooks_jobs import coordinators, job_env, wait_all

from eagerloco.comm.base import wire_bytes

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "hf_trainer.py"


@pytest.fixture(autouse=True)
def _needs_transformers() -> None:
    # At setup, not at import: collecting the suite (and the tiers that skip these) stays fast.
    pytest.importorskip("transformers")


def load_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file  # comes with transformers

    return load_file(path)


def run_pair(out: Path, args: list[str], ranks: tuple[int, int] = (1, 1), resume: str | None = None,
             timeout: float = 400) -> None:
    """Both workers of one run, each its own job (torchrun when it has several ranks); resume: the
    checkpoint folder name each worker resumes from, under its own --out."""
    port = coordinators(1)[0]
    procs = []
    for w, r in enumerate(ranks):
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={r}"]
                    if r > 1 else [sys.executable])
        cmd = [*launcher, str(EXAMPLE), "--outer-addr", f"127.0.0.1:{port}", "--worker-id", str(w),
               "--workers", "2", "--out", str(out / f"w{w}"), *args]
        if resume:
            cmd += ["--resume", str(out / f"w{w}" / resume)]
        procs.append(popen(cmd, env=job_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for w, done in enumerate(wait_all(procs, timeout)):
        assert done.returncode == 0, f"worker {w}:\n{done.stdout[-5000:]}"


def outer_state(out: Path, w: int, step: int) -> dict:
    return torch.load(out / f"w{w}" / f"checkpoint-{step}" / f"eagerloco_outer_worker{w}.pt", weights_only=False)


def test_diloco_two_jobs_one_with_ddp_inside(tmp_path: Path) -> None:
    run_pair(tmp_path, ["--method", "diloco", "--inner-steps", "4", "--steps", "8", "--save-steps", "4"],
             ranks=(2, 1))
    n = sum(t.numel() for t in load_file(tmp_path / "w1" / "checkpoint-4" / "model.safetensors").values())
    for step, syncs in ((4, 1), (8, 2)):
        s0, s1 = outer_state(tmp_path, 0, step), outer_state(tmp_path, 1, step)
        # After every blocking DiLoCo sync both workers hold the same outer parameters, and models.
        for a, b in zip(s0["sync"]["outer"][0], s1["sync"]["outer"][0], strict=True):
            assert torch.equal(a, b)
        m0 = load_file(tmp_path / "w0" / f"checkpoint-{step}" / "model.safetensors")
        m1 = load_file(tmp_path / "w1" / f"checkpoint-{step}" / "model.safetensors")
        assert all(torch.equal(m0[k], m1[k]) for k in m0)
        # One FP32 all-reduce of the whole model per sync, counted once per worker (its first rank).
        assert s0["stats"]["bytes_sent"] == s1["stats"]["bytes_sent"] == syncs * wire_bytes(4 * n, 2, True)
        assert s0["stats"]["num_syncs"] == syncs
    history = json.loads((tmp_path / "w0" / "checkpoint-8" / "trainer_state.json").read_text())["log_history"]
    logged = [h for h in history if "loss" in h]
    assert [h["bytes_sent"] for h in logged] == [wire_bytes(4 * n, 2, True) * k for k in (1, 2)]
    assert all(0 < h["compute_utilization"] <= 1 and h["blocked_s"] >= 0 for h in logged)


def test_eager_resumed_from_the_trainers_checkpoint_gives_the_uninterrupted_numbers(tmp_path: Path) -> None:
    common = ["--method", "eager", "--inner-steps", "2", "--steps", "8", "--save-steps", "4"]
    run_pair(tmp_path / "full", common)
    for w in range(2):  # the interrupted run: its checkpoint at step 4, then a fresh pair of jobs
        shutil.copytree(tmp_path / "full" / f"w{w}" / "checkpoint-4", tmp_path / "resumed" / f"w{w}" / "checkpoint-4")
    run_pair(tmp_path / "resumed", common, resume="checkpoint-4")
    for w in range(2):
        a = load_file(tmp_path / "full" / f"w{w}" / "checkpoint-8" / "model.safetensors")
        b = load_file(tmp_path / "resumed" / f"w{w}" / "checkpoint-8" / "model.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a), f"worker {w}"
        sa, sb = outer_state(tmp_path / "full", w, 8), outer_state(tmp_path / "resumed", w, 8)
        for fa, fb in zip(sa["sync"]["outer"], sb["sync"]["outer"], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(fa, fb, strict=True))
        assert sa["stats"]["bytes_sent"] == sb["stats"]["bytes_sent"] > 0
    # Eager: each worker mixes its own fresh outer gradient in, so the workers' outer copies differ.
    s0, s1 = outer_state(tmp_path / "full", 0, 8), outer_state(tmp_path / "full", 1, 8)
    assert not all(torch.equal(a, b) for a, b in zip(s0["sync"]["outer"][0], s1["sync"]["outer"][0], strict=True))

