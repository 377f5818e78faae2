"""Sites that come and go: separate `eagerloco train --outer-addr --elastic` jobs meeting at a coordinator no
worker hosts (`eagerloco coordinator`). Worker 0 dies and comes back, the coordinator restarts, a worker cut
off from the coordinator stops while the others go on."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from jobs import popen
from test_hooks_jobs import assert_exited_0, coordinators, free_ports, job_env, wait_all

pytestmark = pytest.mark.processes
ROOT = Path(__file__).resolve().parents[1]
# DiLoCo rounds of 4 steps of at least 0.1 s each (--sim-step-time pads a step to it, so a worker left alone does not
# race to the end while another one starts) and 0.1 s on the emulated link: a run of 64 steps lasts long enough for a
# restarted worker to come back before the end, on a loaded machine too.
ARGS = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1", "--no-progress",
        "--log-every", "8", "--method", "diloco", "--inner-steps", "4", "--latency-ms", "100", "--sim-step-time",
        "0.1", "--steps", "64", "--checkpoint-every", "8", "--elastic", "--dist-timeout", "20"]


def _job(port: int, w: int, out: Path, *extra: str, env: dict[str, str] | None = None) -> Any:
    return popen([sys.executable, "-m", "eagerloco", "train", *ARGS, *extra, "--outer-addr", f"127.0.0.1:{port}",
                  "--worker-id", str(w), "--workers", "2", "--out", str(out)],
                 env={**job_env(), **(env or {})}, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                 text=True)


def _outer(out: Path, w: int, step: int) -> list[torch.Tensor]:
    state = torch.load(out / "checkpoints" / f"step_{step:08d}" / f"worker_{w}.pt", weights_only=False)
    return list(state["sync"]["outer"][0])


def _same_final_outer(tmp_path: Path, steps: int = 64) -> None:
    a, b = (_outer(tmp_path / f"w{w}", w, steps) for w in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    s0, s1 = (json.loads((tmp_path / f"w{w}" / "summary.json").read_text()) for w in range(2))
    assert s0["final_eval_loss"] == s1["final_eval_loss"]


def test_worker_0_killed_the_other_goes_on_and_worker_0_rejoins_with_the_same_outer_parameters(tmp_path: Path) -> None:
    port = coordinators(1)[0]
    first = _job(port, 0, tmp_path / "w0", env={"EAGERLOCO_FAULT_KILL": "0:10"})
    other = _job(port, 1, tmp_path / "w1")
    killed = wait_all([first], 240)[0]
    assert killed.returncode == -9, killed.stdout[-3000:]
    # A joiner with another setting is refused with one line, before it asks to join; the one with the run's settings,
    # started beside it, joins.
    refused = _job(port, 0, tmp_path / "w0-wrong", "--outer-lr", "0.5")
    back = _job(port, 0, tmp_path / "w0", "--resume")
    wrong = wait_all([refused], 120)[0]
    assert wrong.returncode == 2, wrong.stdout[-3000:]
    last = wrong.stdout.strip().splitlines()[-1]
    assert last.startswith("eagerloco: error: the workers disagree on settings that must match: --outer-lr (worker 0: "
                           "0.5, the run: 0.7). Start worker 0 with the run's settings to join it"), wrong.stdout
    back, survivor = wait_all([back, other], 300)
    assert survivor.returncode == 0, survivor.stdout[-3000:]
    assert back.returncode == 0, back.stdout[-3000:]
    assert "worker 1: lost 0; continuing with workers [1]" in survivor.stdout, survivor.stdout[-3000:]
    assert "worker 1: workers [0] joined at step" in survivor.stdout, survivor.stdout[-3000:]
    assert "worker 0: joined at step" in back.stdout and "checked); members [0, 1]" in back.stdout, back.stdout
    _same_final_outer(tmp_path)
    # Tokens are the members' inner steps: two workers to the loss, one to the join, two to the end.
    lost = int(re.search(r"continuing with workers \[1\] \(epoch 1, step (\d+)", survivor.stdout)[1])
    joined = int(re.search(r"workers \[0\] joined at step (\d+)", survivor.stdout)[1])
    steps = 2 * lost + (joined - lost) + 2 * (64 - joined)
    for w in range(2):
        summary = json.loads((tmp_path / f"w{w}" / "summary.json").read_text())
        assert (summary["worker_steps"], summary["tokens"]) == (steps, steps * 2 * 32), (w, lost, joined)


def test_the_coordinator_killed_and_restarted_mid_run_the_run_goes_on(tmp_path: Path) -> None:
    port = free_ports(1)[0]

    def coordinator() -> Any:
        p = popen([sys.executable, "-m", "eagerloco", "coordinator", "--host", "127.0.0.1", "--port", str(port)],
                  env=job_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return p
            except OSError:
                time.sleep(0.2)
        raise AssertionError("the coordinator did not listen")

    c = coordinator()
    jobs = [_job(port, w, tmp_path / f"w{w}", "--steps", "48") for w in range(2)]
    try:
        ckpt = tmp_path / "w0" / "checkpoints" / "step_00000016"
        deadline = time.monotonic() + 200
        while not ckpt.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ckpt.exists() and all(j.poll() is None for j in jobs)
        c.kill()
        c.wait()
        time.sleep(2)
        c = coordinator()
        for w, done in enumerate(wait_all(jobs, 300)):
            assert done.returncode == 0, f"worker {w}:\n{done.stdout[-3000:]}"
    finally:
        c.terminate()
        c.wait(30)
    _same_final_outer(tmp_path, 48)


class _Cut:
    """A TCP relay from a port of its own to the coordinator, that the test cuts: the worker behind it loses
    the coordinator, while its gloo connections to the other workers (direct) stay."""

    def __init__(self, target: int) -> None:
        self.target, self.socks, self.cut = target, [], False
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.cut:
            try:
                a, _ = self.server.accept()
            except OSError:
                return
            b = socket.create_connection(("127.0.0.1", self.target))
            self.socks += [a, b]
            for x, y in ((a, b), (b, a)):
                threading.Thread(target=self._pipe, args=(x, y), daemon=True).start()

    @staticmethod
    def _pipe(x: socket.socket, y: socket.socket) -> None:
        try:
            while data := x.recv(65536):
                y.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.cut = True
        self.server.close()
        for s in self.socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass


def test_a_partition_only_the_side_that_reaches_the_coordinator_goes_on(tmp_path: Path) -> None:
    port = coordinators(1)[0]
    relay = _Cut(port)
    near = popen([sys.executable, "-m", "eagerloco", "train", *ARGS, "--outer-addr", f"127.0.0.1:{port}",
                  "--worker-id", "0", "--workers", "2", "--out", str(tmp_path / "w0")],
                 env=job_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    far = popen([sys.executable, "-m", "eagerloco", "train", *ARGS[:-2], "--dist-timeout", "5", "--outer-addr",
                 f"127.0.0.1:{relay.port}", "--worker-id", "1", "--workers", "2", "--out", str(tmp_path / "w1")],
                env=job_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ckpt = tmp_path / "w1" / "checkpoints" / "step_00000016"
        deadline = time.monotonic() + 200
        while not ckpt.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ckpt.exists()
        relay.close()
        on, cut = wait_all([near, far], 300)
    finally:
        relay.close()
    assert cut.returncode == 3, cut.stdout[-3000:]
    last = cut.stdout.strip().splitlines()[-1]
    assert last.startswith("eagerloco: error: worker 1 lost the coordinator at 127.0.0.1:"), cut.stdout[-3000:]
    assert on.returncode == 0, on.stdout[-3000:]
    assert "worker 0: lost 1; continuing with workers [0]" in on.stdout, on.stdout[-3000:]


def _wait_for(path: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {path} within {timeout:g} s")


def test_a_third_worker_joins_a_running_two_worker_run(tmp_path: Path) -> None:
    port = coordinators(1)[0]
    jobs = [_job(port, w, tmp_path / f"w{w}") for w in range(2)]
    _wait_for(tmp_path / "w0" / "metrics.jsonl", '"step": 8', 200)
    third = popen([sys.executable, "-m", "eagerloco", "train", *ARGS, "--outer-addr",
                   f"127.0.0.1:{port}", "--worker-id", "2", "--workers", "2", "--out", str(tmp_path / "w2")],
                  env=job_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    done = wait_all([*jobs, third], 300)
    assert_exited_0(done)
    assert "worker 0: workers [2] joined at step" in done[0].stdout, done[0].stdout[-3000:]
    assert "members [0, 1, 2]" in done[2].stdout, done[2].stdout[-3000:]
    outer = [_outer(tmp_path / f"w{w}", w, 64) for w in range(3)]
    for other in outer[1:]:
        assert all(torch.equal(x, y) for x, y in zip(outer[0], other, strict=True))


@pytest.mark.slow
def test_a_worker_leaves_and_rejoins_three_times(tmp_path: Path) -> None:
    port = coordinators(1)[0]
    args = ("--steps", "128")
    w0 = _job(port, 0, tmp_path / "w0", *args)
    first = _job(port, 1, tmp_path / "w1", *args, env={"EAGERLOCO_FAULT_KILL": "1:10"})
    assert wait_all([first], 240)[0].returncode == -9
    for time_ in range(3):
        log = tmp_path / f"w1-{time_}.log"
        with log.open("w") as f:
            back = popen([sys.executable, "-m", "eagerloco", "train", *ARGS, *args, "--resume", "--outer-addr",
                          f"127.0.0.1:{port}", "--worker-id", "1", "--workers", "2", "--out", str(tmp_path / "w1")],
                         env=job_env(), cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True)
        if time_ == 2:
            break
        _wait_for(log, "worker 1: joined at step", 200)
        time.sleep(1.0)
        back.kill()
        back.wait()
    survivor = wait_all([w0], 400)[0]
    assert back.wait(60) == 0, log.read_text()[-3000:]
    assert survivor.returncode == 0, survivor.stdout[-3000:]
    assert survivor.stdout.count("worker 0: lost 1; continuing with workers [0]") == 3, survivor.stdout[-4000:]
    assert survivor.stdout.count("worker 0: workers [1] joined at step") == 3, survivor.stdout[-4000:]
    a, b = (_outer(tmp_path / f"w{w}", w, 128) for w in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
