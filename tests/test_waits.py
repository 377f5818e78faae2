"""Waits at a rendezvous: bounded by the timeout, saying what they wait for, and ended by Ctrl-C."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from jobs import Job, popen
from runs import launch_here
from test_hooks_jobs import coordinators, free_ports, job_env

from eagerloco.comm.errors import PeerError
from eagerloco.comm.rendezvous import bounded, wait_for_workers
from eagerloco.config import ConfigError
from eagerloco.train.rundir import LOCK_NAME

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1", "--no-progress",
        "--steps", "2", "--inner-steps", "2"]


def test_a_call_that_never_returns_is_given_up_on_and_the_wait_says_what_it_waits_for(
        capsys: pytest.CaptureFixture[str]) -> None:
    never = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="worker 1: waiting for worker 0: no answer within 0.4 s"):
        bounded(never.wait, 0.4, "worker 1: waiting for worker 0", report_every_s=0.15, slack_s=0.0)
    assert time.monotonic() - t0 < 2.0
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(ln.startswith("eagerloco: worker 1: waiting for worker 0 (") for ln in lines)
    assert bounded(lambda: 7, 1.0, "x") == 7
    with pytest.raises(ValueError, match="bad"):
        bounded(lambda: (_ for _ in ()).throw(ValueError("bad")), 1.0, "x")


def test_missing_workers_are_named_within_the_timeout_and_a_different_count_at_once(
        capsys: pytest.CaptureFixture[str]) -> None:
    store = dist.HashStore()
    store.add("eagerloco/join/0", 1)
    store.set("eagerloco/size/0", "3")
    with pytest.raises(PeerError, match=r"worker 0: worker 1, worker 2 did not join the outer rendezvous at "
                                        r"h:1 within 0.4 s") as e:
        wait_for_workers(store, 0, 3, 0.4, "h:1", report_every_s=0.15)
    assert e.value.workers == [1, 2]
    assert "eagerloco: worker 0: waiting for worker 1, worker 2 at h:1 (" in capsys.readouterr().err
    store.add("eagerloco/join/1", 1)
    store.set("eagerloco/size/1", "2")  # worker 1 thinks there are 2 workers
    with pytest.raises(ConfigError, match="started with different --workers: worker 0 with 3, worker 1 with 2"):
        wait_for_workers(store, 0, 3, 30.0, "h:1")


def _job(port: int, timeout: float, out: Path) -> Job | subprocess.Popen:
    return popen([sys.executable, "-m", "eagerloco", "train", *FAST, "--outer-addr", f"127.0.0.1:{port}",
                  "--worker-id", "1", "--workers", "2", "--dist-timeout", str(timeout), "--out", str(out)],
                 env=job_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.processes
def test_a_listener_that_never_answers_ends_the_job_within_the_timeout_with_one_line(tmp_path: Path) -> None:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections (the kernel does) and never says a word
    try:
        t0 = time.monotonic()
        p = _job(silent.getsockname()[1], 4, tmp_path)
        out, err = p.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        silent.close()
    assert p.returncode == 3, out + err
    # The timeout plus a start-up (torch's import) that takes 30 s on 2 loaded cores; it was minutes (see above).
    assert took < 4 + 45, took
    last = err.strip().splitlines()[-1]
    assert last.startswith("eagerloco: error: worker 1 cannot reach the coordinator at 127.0.0.1:"), err
    assert "Traceback" not in err and "frame #" not in err, err


@pytest.mark.processes
def test_ctrl_c_while_waiting_for_worker_0_ends_the_job_at_once(tmp_path: Path) -> None:
    p = _job(free_ports(1)[0], 300, tmp_path)  # no coordinator ever listens there
    time.sleep(5)  # started, waiting at the rendezvous (or still starting: either way one line, at once)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert time.monotonic() - t0 < 10, err
    assert p.returncode == 128 + signal.SIGINT, out + err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("eagerloco: stopped by SIGINT"), err


@pytest.mark.processes
def test_separate_jobs_wait_for_an_evaluation_that_outlasts_the_timeout(tmp_path: Path) -> None:
    """Worker 0's evaluations take 6 s more (EAGERLOCO_FAULT_EVAL_DELAY), past a 3 s --dist-timeout: worker 1
    waits on its heartbeat instead of declaring it dead, and both finish."""
    from test_hooks_jobs import wait_all

    port = coordinators(1)[0]
    procs = []
    for w in range(2):
        env = {**job_env(), **({"EAGERLOCO_FAULT_EVAL_DELAY": "6"} if w == 0 else {})}
        procs.append(popen(
            [sys.executable, "-m", "eagerloco", "train", *FAST[:-4], "--steps", "4", "--inner-steps", "2",
             "--eval-every", "2", "--dist-timeout", "3", "--outer-addr", f"127.0.0.1:{port}", "--worker-id", str(w),
             "--workers", "2", "--out", str(tmp_path / f"w{w}")],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for w, done in enumerate(wait_all(procs, 180)):
        assert done.returncode == 0, f"worker {w}:\n{done.stdout[-3000:]}"
        assert (tmp_path / f"w{w}" / "summary.json").is_file()


def _rank(rank: int, port: int, timeout: float, out: Path) -> Job | subprocess.Popen:
    """Rank ``rank`` of a 2-rank run whose other rank never comes (nobody hosts MASTER_PORT for rank 1)."""
    env = {**job_env(), "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return popen([sys.executable, "-m", "eagerloco", "train", *FAST, "--workers", "2", "--dist-timeout", str(timeout),
                  "--out", str(out)], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.processes
def test_a_rank_whose_peers_never_come_ends_within_the_timeout_or_at_once_on_sigterm(tmp_path: Path) -> None:
    """Under a launcher's variables the rendezvous (init_process_group) was a wait in C++: no line until its
    own timeout, SIGTERM ignored (a launch rank was killed after the grace), C++ frames from the store's
    client. Rank 0 hosts the store and waits for rank 1; a rank 1 waits for a rank 0 that never listens."""
    p0, p1 = free_ports(2)
    t0 = time.monotonic()
    alone = [_rank(0, p0, 4, tmp_path / "r0"), _rank(1, p1, 4, tmp_path / "r1")]
    silent = socket.socket()  # "rank 0's store" for a third process: it accepts and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    silent.settimeout(120)
    term = _rank(1, silent.getsockname()[1], 300, tmp_path / "r1-term")
    try:
        silent.accept()  # the rank reached the rendezvous (past start-up, where SIGTERM's default would end it)
        time.sleep(1)
        t1 = time.monotonic()
        term.send_signal(signal.SIGTERM)
        _, err = term.communicate(timeout=60)
    finally:
        silent.close()
    assert time.monotonic() - t1 < 15, err  # at once against the 300 s wait (exit itself is slow on a busy machine)
    assert term.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1].startswith("eagerloco: stopped by SIGTERM"), err
    assert "Traceback" not in err and "frame #" not in err, err
    for rank, p in enumerate(alone):
        _, err = p.communicate(timeout=120)
        assert p.returncode == 3, err
        assert time.monotonic() - t0 < 4 + 25, err  # the timeout, start-up on a busy machine, the slack
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"eagerloco: error: rank {rank}: the run's "), err
        assert "MASTER_ADDR and MASTER_PORT" in last, err
        assert "Traceback" not in err and "frame #" not in err, err


@pytest.mark.processes
def test_a_launch_into_a_directory_another_run_holds_ends_every_rank_with_one_line(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (out / LOCK_NAME).write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname()}))
        t0 = time.monotonic()
        r = launch_here([*FAST, "--out", str(out), "--dist-timeout", "5"], workers=2, timeout=120)
        took = time.monotonic() - t0
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode == 2, r.stdout
    assert took < 5 + 20, r.stdout  # rank 1 waited for rank 0 until the launcher's grace ended (30 s), then killed
    lines = r.stdout.splitlines()
    assert any(ln.startswith("[rank 0] eagerloco: error: ") and f"in use by another run (process {holder.pid}" in ln
               for ln in lines), r.stdout
    assert any(ln.startswith("[rank 1] eagerloco: error: ") for ln in lines), r.stdout
    assert "Traceback" not in r.stdout and "frame #" not in r.stdout, r.stdout
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == holder.pid  # the holder's lock is left alone
