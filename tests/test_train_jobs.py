"""`eagerloco train --outer-addr HOST:PORT --worker-id I --workers M`: our own trainer, one job per worker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from jobs import popen
from test_hooks_jobs import coordinators, free_ports, job_env, wait_all

from eagerloco.cli import main
from eagerloco.comm.base import wire_bytes

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1", "--no-progress",
        "--log-every", "4", "--dist-timeout", "30"]


@pytest.mark.processes
def test_two_jobs_agree_after_every_blocking_diloco_sync_and_count_the_bytes(tmp_path: Path) -> None:
    port = coordinators(1)[0]
    args = [*FAST, "--method", "diloco", "--inner-steps", "4", "--steps", "8", "--checkpoint-every", "4"]
    procs = [popen([sys.executable, "-m", "eagerloco", "train", *args, "--outer-addr", f"127.0.0.1:{port}",
                    "--worker-id", str(w), "--workers", "2", "--out", str(tmp_path / f"w{w}")],
                   env=job_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for w in range(2)]
    for w, done in enumerate(wait_all(procs, 180)):
        assert done.returncode == 0, f"worker {w}:\n{done.stdout[-4000:]}"
    for step in (4, 8):
        s0, s1 = (torch.load(tmp_path / f"w{w}" / "checkpoints" / f"step_{step:08d}" / f"worker_{w}.pt",
                             weights_only=False) for w in range(2))
        for a, b in zip(s0["sync"]["outer"][0], s1["sync"]["outer"][0], strict=True):
            assert torch.equal(a, b), f"step {step}"
        assert all(torch.equal(s0["model"][k], s1["model"][k]) for k in s0["model"])
    n = sum(t.numel() for t in s0["sync"]["outer"][0])
    for w in range(2):
        summary = json.loads((tmp_path / f"w{w}" / "summary.json").read_text())
        assert summary["runtime"] == "job" and summary["worker"] == w and summary["workers"] == 2
        assert summary["bytes_sent_per_worker"] == 2 * wire_bytes(4 * n, 2, True)  # two FP32 all-reduces


def test_a_worker_id_without_an_outer_address_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", *FAST, "--worker-id", "1", "--steps", "1"]) == 2
    assert "--worker-id needs --outer-addr HOST:PORT" in capsys.readouterr().err
    assert main(["train", *FAST, "--outer-addr", "nohost", "--worker-id", "0", "--steps", "1"]) == 2
    assert "--outer-addr must be host:port" in capsys.readouterr().err


@pytest.mark.processes
def test_launch_forwards_the_outer_rendezvous_and_starts_only_this_workers_process(tmp_path: Path) -> None:
    from eagerloco.lab.launch import KernelShaping
    from eagerloco.launch import launch

    log = tmp_path / "log.txt"
    show = "import os, sys; print('ARGS', sys.argv[1:], os.environ['WORLD_SIZE'])"
    with log.open("w") as f:
        rc = launch(["--steps", "3"], 2, outer_addr="10.0.0.1:29600", worker_id=1,
                    command=[sys.executable, "-c", show], out=f)
    assert rc == 0, log.read_text()
    lines = [ln for ln in log.read_text().splitlines() if "ARGS" in ln]
    assert lines == ["[rank 0] ARGS ['--steps', '3', '--outer-addr', '10.0.0.1:29600', '--worker-id', '1', "
                     "'--workers', '2'] 1"]
    with pytest.raises(ValueError, match="shapes the links between jobs on this machine: give every job --outer"):
        launch([], 2, outer_addr="10.0.0.1:29600", worker_id=0, shaping=KernelShaping(1.0))
    with pytest.raises(ValueError, match="--outer-addr and --worker-id go together"):
        launch([], 2, worker_id=0)


def test_elastic_is_accepted_with_an_outer_address_and_an_absent_coordinator_is_named(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    port = free_ports(1)[0]  # nobody listens there: no coordinator
    argv = ["train", *FAST, "--steps", "2", "--elastic", "--outer-addr", f"127.0.0.1:{port}", "--worker-id", "1",
            "--workers", "2", "--dist-timeout", "1", "--out", str(tmp_path / "w1")]
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert f"worker 1 cannot reach the coordinator at 127.0.0.1:{port}" in err, err
