"""The Lightning callback with real processes: two workers, each its own job (examples/lightning_module.py)."""

from __future__ import annotations

import csv
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
EXAMPLE = ROOT / "examples" / "lightning_module.py"
STEPS_PER_EPOCH = 8  # 32 windows, batches of 4


@pytest.fixture(autouse=True)
def _needs_lightning() -> None:
    # At setup, not at import: collecting the suite (and the tiers that skip these) stays fast.
    pytest.importorskip("pytorch_lightning")


def run_pair(out: Path, args: list[str], resume: str | None = None, timeout: float = 400) -> None:
    port = coordinators(1)[0]
    procs = []
    for w in range(2):
        cmd = [sys.executable, str(EXAMPLE), "--outer-addr", f"127.0.0.1:{port}", "--worker-id", str(w),
               "--workers", "2", "--out", str(out / f"w{w}"), *args]
        if resume:
            cmd += ["--resume", resume.format(w=w)]
        procs.append(popen(cmd, env=job_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for w, done in enumerate(wait_all(procs, timeout)):
        assert done.returncode == 0, f"worker {w}:\n{done.stdout[-5000:]}"


def ckpt(out: Path, w: int, epoch: int) -> dict:
    return torch.load(out / f"w{w}" / "checkpoints" / f"epoch={epoch}.ckpt", weights_only=False)


def test_diloco_two_jobs_identical_after_every_sync_and_counted(tmp_path: Path) -> None:
    run_pair(tmp_path, ["--method", "diloco", "--inner-steps", "4", "--epochs", "2"])
    for epoch in (0, 1):  # an epoch is 8 steps: it ends on a sync (H = 4)
        c0, c1 = ckpt(tmp_path, 0, epoch), ckpt(tmp_path, 1, epoch)
        s0, s1 = c0["callbacks"]["OuterLoopCallback"], c1["callbacks"]["OuterLoopCallback"]
        for a, b in zip(s0["sync"]["outer"][0], s1["sync"]["outer"][0], strict=True):
            assert torch.equal(a, b)
        assert all(torch.equal(c0["state_dict"][k], c1["state_dict"][k]) for k in c0["state_dict"])
        n = sum(t.numel() for t in s0["sync"]["outer"][0])
        syncs = (epoch + 1) * STEPS_PER_EPOCH // 4
        assert s0["stats"]["bytes_sent"] == s1["stats"]["bytes_sent"] == syncs * wire_bytes(4 * n, 2, True)
    rows = list(csv.DictReader((tmp_path / "w0" / "logs" / "version_0" / "metrics.csv").open()))
    logged = {int(r["step"]): float(r["outer/bytes_sent"]) for r in rows if r.get("outer/bytes_sent")}
    assert logged[15] == 4 * wire_bytes(4 * n, 2, True) and logged[3] == wire_bytes(4 * n, 2, True)


def test_eager_resumed_from_a_lightning_checkpoint_gives_the_uninterrupted_numbers(tmp_path: Path) -> None:
    common = ["--method", "eager", "--inner-steps", "2", "--epochs", "2"]
    run_pair(tmp_path / "full", common)
    run_pair(tmp_path / "resumed", common, resume=str(tmp_path / "full" / "w{w}" / "checkpoints" / "epoch=0.ckpt"))
    for w in range(2):
        a, b = ckpt(tmp_path / "full", w, 1), ckpt(tmp_path / "resumed", w, 1)
        assert a["global_step"] == b["global_step"] == 2 * STEPS_PER_EPOCH
        assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"]), f"worker {w}"
        sa, sb = a["callbacks"]["OuterLoopCallback"], b["callbacks"]["OuterLoopCallback"]
        for fa, fb in zip(sa["sync"]["outer"], sb["sync"]["outer"], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(fa, fb, strict=True))
        assert sa["stats"]["bytes_sent"] == sb["stats"]["bytes_sent"] > 0
