"""Adaptive steps on real processes: two workers at speeds 1 and 0.5, paced by --sim-step-time, agree after
every sync on the rounds and the outer parameters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from runs import launch_here

from eagerloco import checkpoint as ckpt

ARGS = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "2", "--no-progress",
        "--log-every", "4", "--seed", "3", "--method", "diloco", "--inner-steps", "4", "--steps", "16",
        "--checkpoint-every", "4", "--keep-checkpoints", "4", "--sim-step-time", "0.05", "--adaptive-steps"]


@pytest.mark.processes
@pytest.mark.parametrize("speeds", ["given", "measured"])
def test_two_workers_at_unequal_speeds_agree_after_every_sync(tmp_path: Path, speeds: str) -> None:
    """Given: --worker-speeds 1,0.5 paces worker 1 at 0.1 s a step and sizes its rounds at H_m = 2. Measured: the
    same ratio from --slow-worker 1:2 (0.25 and 0.5 s a step), and the rounds from the speeds the workers measure
    and exchange (rounds 1 and 2 at H before the first exchange lands). At every checkpoint (each round's end) both
    workers hold the same rounds and the same outer parameters (DiLoCo: the one mean)."""
    # Measured at a slower pace: the speeds are what the workers time, and 0.05 s a step is shorter than a step's
    # real compute on a busy 2-core machine (the fast worker then measures slower than its pace).
    extra = ["--worker-speeds", "1,0.5"] if speeds == "given" else ["--slow-worker", "1:2", "--sim-step-time", "0.25"]
    r = launch_here([*ARGS, *extra, "--workers", "2", "--out", str(tmp_path)], 2)
    assert r.returncode == 0, r.stdout[-3000:]
    paths = ckpt.list_checkpoints(ckpt.checkpoint_root(tmp_path))
    assert len(paths) == 4
    lengths = []
    for path in paths:
        a, b = (ckpt.load_worker_state(path, w)["sync"] for w in range(2))
        assert a["adaptive"]["rounds"] == b["adaptive"]["rounds"], path
        for fa, fb in zip(a["outer"], b["outer"], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(fa, fb, strict=True)), path
        lengths.append(a["adaptive"]["rounds"]["lengths"])
    # The H_m of the round after each checkpoint's: given from the start; measured from round 3 on.
    assert lengths == ([[4, 2]] * 4 if speeds == "given" else [[4, 4], [4, 2], [4, 2], [4, 2]])
    summary = json.loads((tmp_path / "summary.json").read_text())
    own = [16, 8] if speeds == "given" else [16, 4 + 4 + 2 + 2]
    assert summary["worker_steps"] == own
    assert summary["tokens"] == sum(own) * 2 * 32
