"""A worker killed mid-run, through the framework callbacks: each worker its own job (the examples).

Without ``--elastic`` the survivor stops with one line naming the dead worker (exit status 3, no
traceback); with it, the survivor re-forms the outer group alone and finishes the run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from jobs import popen
from test_hooks_jobs import coordinators, job_env, wait_all

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.processes


def run_killed_pair(example: str, out: Path, kill: str, args: list[str]) -> list[subprocess.CompletedProcess]:
    """Both workers of a run, worker ``kill``'s WORKER:STEP SIGKILLing itself (EAGERLOCO_FAULT_KILL)."""
    port = coordinators(1)[0]
    env = {**job_env(), "EAGERLOCO_FAULT_KILL": kill}
    procs = [popen([sys.executable, str(ROOT / "examples" / example), "--outer-addr", f"127.0.0.1:{port}",
                    "--worker-id", str(w), "--workers", "2", "--out", str(out / f"w{w}"), *args],
                   env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for w in range(2)]
    return wait_all(procs, 180)


def test_hf_trainer_a_killed_worker_stops_the_other_with_one_line_naming_it(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    done = run_killed_pair("hf_trainer.py", tmp_path, "1:3", ["--method", "diloco", "--inner-steps", "2",
                                                               "--steps", "8", "--save-steps", "8"])
    assert done[1].returncode == -9, done[1].stdout[-3000:]  # SIGKILL
    survivor = done[0]
    assert survivor.returncode == 3, survivor.stdout[-3000:]
    assert "Traceback" not in survivor.stdout and "frame #" not in survivor.stdout, survivor.stdout[-3000:]
    last = survivor.stdout.strip().splitlines()[-1]
    assert last.startswith("eagerloco: error: outer exchange") and "worker 1 is gone" in last, last


def test_lightning_elastic_the_survivor_finishes_alone_when_a_worker_is_killed(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    done = run_killed_pair("lightning_module.py", tmp_path, "1:3", ["--method", "diloco", "--inner-steps", "2",
                                                                     "--epochs", "1", "--elastic"])
    assert done[1].returncode == -9, done[1].stdout[-3000:]
    assert done[0].returncode == 0, done[0].stdout[-3000:]
    assert "eagerloco: worker 0: lost 1; continuing with workers [0]" in done[0].stdout
    ckpt = torch.load(tmp_path / "w0" / "checkpoints" / "epoch=0.ckpt", weights_only=False)
    state = ckpt["callbacks"]["OuterLoopCallback"]
    assert ckpt["global_step"] == 8 and state["workers"] == 1 and state["sync"]["step"] == 8
    # 4 syncs (H = 2): the first with both workers (bytes on the wire), the later ones alone (none).
    assert state["stats"]["num_syncs"] == 4 and state["stats"]["bytes_sent"] > 0
    assert all(torch.isfinite(t).all() for t in state["sync"]["outer"][0])
