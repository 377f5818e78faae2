"""What the separate-jobs chaos benchmark (bench/chaos_jobs) found, each case as a test of real processes:
a worker waiting for the others when the coordinator goes for good, a coordinator that never starts, a
worker 0 killed mid-run. Every one must end in one line, without a traceback or C++ stack frames."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from jobs import popen
from test_hooks_jobs import coordinators, free_ports, job_env, wait_all

from eagerloco.comm.errors import PEER_EXIT_CODE, PeerError
from eagerloco.comm.rendezvous import CoordinatorClient, wait_for_workers

pytestmark = pytest.mark.processes  # every check here needs separate jobs
ROOT = Path(__file__).resolve().parents[1]
FAST = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1", "--no-progress",
        "--method", "diloco", "--inner-steps", "2"]
CRASH_MARKS = ("Traceback", "frame #", "terminate called")

# A coordinator, in a process of its own: worker 0 joined (3 workers), then it waits to be killed.
HOST_STORE = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=30))
store.add("eagerloco/join/0", 1)
store.set("eagerloco/size/0", "3")
print("ready", flush=True)
time.sleep(120)
"""


def _train(port: int, worker: int, out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "eagerloco", "train", *FAST, *args, "--outer-addr", f"127.0.0.1:{port}",
            "--worker-id", str(worker), "--workers", "2", "--out", str(out)]


def test_a_worker_waiting_for_the_others_stops_with_a_peer_error_when_the_coordinator_is_gone_for_good() -> None:
    """The coordinator stopped while worker 1 waited for worker 2, and did not come back within the timeout:
    worker 1 is cut off from the run and stops with one line (a worker that still reached it would go on)."""
    port = free_ports(1)[0]
    host = subprocess.Popen([sys.executable, "-c", HOST_STORE, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None and host.stdout.readline().strip() == "ready"
        client = CoordinatorClient("127.0.0.1", port, 3.0, "worker 1")
        threading.Timer(1.0, host.kill).start()
        t0 = time.monotonic()
        with pytest.raises(PeerError, match=r"^worker 1 lost the coordinator at 127.0.0.1:\d+ for \d+ s "
                                            r"\(--dist-timeout 3\): stopping, since the workers that still reach "
                                            r"it go on without this one") as e:
            wait_for_workers(client, 1, 3, 30.0, "h:1")
        assert time.monotonic() - t0 < 15, "it must not wait for the rendezvous' timeout once the coordinator is gone"
        assert e.value.workers == []
    finally:
        host.kill()
        host.wait()


def test_a_job_whose_coordinator_never_starts_ends_in_one_line_without_cpp_frames(tmp_path: Path) -> None:
    """The store's client retried connecting and logged each failure with C++ stack frames; one still
    retrying when the job exited could abort it ("terminate called", exit -6)."""
    port = free_ports(1)[0]  # nobody listens there
    t0 = time.monotonic()
    done = subprocess.run(_train(port, 1, tmp_path / "w1", "--steps", "2", "--dist-timeout", "3"), env=job_env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    out = done.stdout + done.stderr
    assert done.returncode == PEER_EXIT_CODE, out
    assert not any(mark in out for mark in CRASH_MARKS), out
    assert "[c10d]" not in out, out
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"eagerloco: error: worker 1 cannot reach the coordinator at 127.0.0.1:{port}: "
                           "no answer within 3 s"), out
    assert took < 3 + 15, took


def test_worker_0_killed_mid_run_leaves_one_line_and_no_cpp_frames_in_the_others_output(tmp_path: Path) -> None:
    """After worker 0 (once the store's host) died, each store call of worker 1 logged a C++ warning with the
    error's stack frames before the run's one line naming worker 0."""
    port = coordinators(1)[0]
    procs = []
    for w in range(2):
        env = {**job_env(), **({"EAGERLOCO_FAULT_KILL": "0:3:0.05"} if w == 0 else {})}
        procs.append(popen(_train(port, w, tmp_path / f"w{w}", "--steps", "12", "--dist-timeout", "5"),
                           env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    killed, survivor = wait_all(procs, 180)
    assert killed.returncode == -9, killed.stdout[-3000:]
    assert survivor.returncode == PEER_EXIT_CODE, survivor.stdout[-3000:]
    assert not any(mark in survivor.stdout for mark in CRASH_MARKS), survivor.stdout[-3000:]
    last = survivor.stdout.strip().splitlines()[-1]
    assert last.startswith("eagerloco: error: ") and "worker 0" in last, survivor.stdout[-3000:]
