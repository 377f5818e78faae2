"""Signals and dead launchers: every process of a run ends within seconds with one line naming the
signal and the newest good checkpoint, leaves no process behind, and the run resumes from there.

Real processes and real signals; every wait is bounded by a generous timeout so that a hang fails
the test instead of stalling the suite.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from jobs import Job, popen
from runs import launch_here, train_here

from eagerloco import checkpoint as ckpt
from eagerloco.cli import main

BASE = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1", "--no-progress",
        "--log-every", "2", "--seed", "7", "--workers", "2", "--checkpoint-every", "2", "--keep-checkpoints", "0"]
_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "EAGERLOCO_WORKERS", "EAGERLOCO_RANKS_PER_WORKER", "EAGERLOCO_REJOIN", "EAGERLOCO_FAULT_KILL",
             "EAGERLOCO_LAUNCHER_PID")
TAG = "EAGERLOCO_TEST_TAG"


def _env(tag: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env.update({TAG: tag, "OMP_NUM_THREADS": "1"})
    return env


def tagged(tag: str) -> list[int]:
    """Processes still alive that carry this test's tag in their environment (orphans, once all ended)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if f"{TAG}={tag}".encode() in (d / "environ").read_bytes().split(b"\0"):
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(d.name))
        except OSError:
            continue
    return found


def _start(cmd: list[str], tag: str, log: Path) -> Job | subprocess.Popen:
    """The command, forked from the tests' job server (tests/jobs.py): ``tagged`` finds what it starts, not itself."""
    with log.open("w") as f:
        return popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(tag))


def _wait_for_checkpoint(p: subprocess.Popen, out: Path, after: int, log: Path, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    root = ckpt.checkpoint_root(out)
    while time.monotonic() < deadline:
        steps = [int(c.name.split("_")[1]) for c in ckpt.list_checkpoints(root)]
        if steps and max(steps) > after:
            return
        assert p.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)
    p.kill()
    raise AssertionError(f"no checkpoint after step {after} within {timeout} s:\n{log.read_text()[-3000:]}")


def _stopped(p: subprocess.Popen, log: Path, timeout: float = 90) -> str:
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError(f"still running {timeout} s after the signal:\n{log.read_text()[-3000:]}") from None
    text = log.read_text()
    assert "Traceback" not in text, text[-4000:]
    return text


def _newest(out: Path) -> int:
    return int(ckpt.list_checkpoints(ckpt.checkpoint_root(out))[-1].name.split("_")[1])


def _steps_logged(out: Path) -> list[int]:
    return [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines() if ln]


@pytest.mark.processes
def test_sigint_sigterm_sighup_stop_an_in_process_run_with_one_line_and_it_resumes(tmp_path: Path) -> None:
    out, tag, steps = tmp_path / "run", uuid.uuid4().hex, 24
    cmd = [sys.executable, "-m", "eagerloco", "train", *BASE, "--steps", str(steps), "--out", str(out)]
    done = 0
    for i, sig in enumerate((signal.SIGINT, signal.SIGTERM, signal.SIGHUP)):
        log = tmp_path / f"{i}.log"
        p = _start(cmd + (["--resume"] if i else []), tag, log)
        _wait_for_checkpoint(p, out, done, log)
        p.send_signal(sig)
        text = _stopped(p, log)
        assert p.returncode == 128 + sig, text[-3000:]
        done = _newest(out)
        lines = [ln for ln in text.splitlines() if "stopped by" in ln]
        assert lines == [f"eagerloco: stopped by {sig.name}; the newest good checkpoint is "
                         f"{ckpt.checkpoint_root(out) / f'step_{done:08d}'} (step {done}): run the same command "
                         "with --resume to continue from it"], text[-3000:]
        assert not (out / ".eagerloco.lock").exists()
    assert tagged(tag) == []
    r = train_here([*BASE, "--steps", str(steps), "--out", str(out), "--resume"])  # the rest, in this process
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert _steps_logged(out) == list(range(2, steps + 1, 2))  # nothing lost, nothing twice
    assert json.loads((out / "summary.json").read_text())["steps"] == steps


@pytest.mark.processes
def test_launcher_stopped_by_a_signal_or_killed_takes_every_rank_with_it(tmp_path: Path) -> None:
    """SIGINT and SIGHUP to `eagerloco launch`: forwarded, every rank says so in one line; SIGKILL to
    it: the kernel stops the ranks (PR_SET_PDEATHSIG). No process is left, and the run resumes."""
    out, tag, steps = tmp_path / "run", uuid.uuid4().hex, 24
    cmd = [sys.executable, "-m", "eagerloco", "launch", "--workers", "2", "--", *BASE, "--steps", str(steps),
           "--dist-timeout", "30", "--out", str(out)]
    done = 0
    for i, sig in enumerate((signal.SIGINT, signal.SIGHUP, signal.SIGKILL)):
        log = tmp_path / f"{i}.log"
        p = _start(cmd + (["--resume"] if i else []), tag, log)
        _wait_for_checkpoint(p, out, done, log)
        p.send_signal(sig)
        text = _stopped(p, log)
        deadline = time.monotonic() + 60
        while tagged(tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert tagged(tag) == [], text[-3000:]  # no orphan, even when the launcher was killed
        done = _newest(out)
        if sig == signal.SIGKILL:
            continue
        assert p.returncode == 128 + sig, text[-3000:]
        for rank in (0, 1):
            mine = [ln for ln in text.splitlines() if ln.startswith(f"[rank {rank}] ") and "stopped by" in ln]
            assert len(mine) == 1 and f"stopped by {sig.name}" in mine[0] and "--resume" in mine[0], text[-3000:]
    # The rest, the launcher in this process (tests/runs.py).
    r = launch_here([*cmd[cmd.index("--") + 1:], "--resume"], 2, env={TAG: tag}, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert _steps_logged(out) == list(range(2, steps + 1, 2))
    assert json.loads((out / "summary.json").read_text())["steps"] == steps


def test_a_rendezvous_port_in_use_is_named_with_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["launch", "--workers", "2", "--master-port", str(port), "--", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"--master-port {port} cannot be used" in err and "leave --master-port out" in err
    assert err.count("\n") == 1, err


@pytest.mark.processes
def test_an_evaluation_longer_than_the_dist_timeout_loses_nothing(tmp_path: Path) -> None:
    """Rank 0 (the elastic leader) evaluates, mid-run and final, for longer than --dist-timeout: the
    others wait for it outside the collective timeout, and the run ends with its summary and every
    eval line (elastic: with nobody declared dead). A plain and an elastic run at once: both mostly wait."""
    runs = {}
    for elastic in (False, True):
        out, tag = tmp_path / f"run-{elastic}", uuid.uuid4().hex
        cmd = [sys.executable, "-m", "eagerloco", "launch", "--workers", "2", *(["--elastic"] if elastic else []),
               "--", *BASE, "--steps", "8", "--method", "diloco", "--inner-steps", "2", "--eval-every", "4",
               "--dist-timeout", "4", "--out", str(out)]
        env = {**_env(tag), "EAGERLOCO_FAULT_EVAL_DELAY": "9"}
        runs[elastic] = (out, tag, popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    for elastic, (out, tag, p) in runs.items():
        text, _ = p.communicate(timeout=600)
        assert p.returncode == 0, f"(elastic: {elastic})\n{text[-6000:]}"
        assert "Traceback" not in text
        s = json.loads((out / "summary.json").read_text())
        assert s["steps"] == 8 and s["final_eval_loss"] == s["final_eval_loss"]  # written, and a number
        lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
        assert [ln["step"] for ln in lines] == [2, 4, 6, 8] and "eval_loss" in lines[1]
        if elastic:
            assert s["faults"] == [] and s["members"] == [0, 1], s["faults"]
        assert tagged(tag) == []


def _pid_of_rank(tag: str, rank: int) -> int | None:
    for pid in tagged(tag):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"EAGERLOCO_LAUNCHER_PID=" + str(os.getppid()).encode() not in env:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"train" in cmdline:
                return pid
    return None


@pytest.mark.processes
def test_a_dead_or_frozen_inner_rank_is_named_by_its_global_rank(tmp_path: Path) -> None:
    """2 workers x 2 ranks, checkpoints every step: global rank 1 (worker 0's second rank, no link
    of its own) is frozen in one run and killed in another. Its worker's first rank names it, nobody
    prints a traceback, every process ends, and the newest checkpoint is intact. The second run trains
    while the first waits out its --dist-timeout."""
    runs = {}
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        out, tag, log = tmp_path / sig.name, uuid.uuid4().hex, tmp_path / f"{sig.name}.log"
        # --spawn-ranks: the victim is found by its environment in /proc, which a forked rank shares with its server.
        cmd = [sys.executable, "-m", "eagerloco", "launch", "--spawn-ranks", "--workers", "2", "--ranks-per-worker",
               "2", "--grace-s", "60", "--", *BASE, "--ranks-per-worker", "2", "--checkpoint-every", "1", "--steps",
               "400", "--dist-timeout", "15", "--out", str(out)]
        p = _start(cmd, tag, log)
        _wait_for_checkpoint(p, out, 2, log)
        pid = _pid_of_rank(tag, 1)
        assert pid is not None
        os.kill(pid, sig)
        runs[sig] = (out, tag, log, p)
    for sig, (out, tag, log, p) in runs.items():
        text = _stopped(p, log, timeout=240)
        assert p.returncode != 0, sig.name
        assert "global rank 1 (worker 0)" in text and ("killed by signal 9" in text or "frozen" in text), text[-4000:]
        assert "global rank 0 " not in text.replace("global rank 0 stopped", ""), text[-4000:]  # no misattribution
        deadline = time.monotonic() + 30
        while tagged(tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert tagged(tag) == [], sig.name
        ckpt.verify(ckpt.list_checkpoints(ckpt.checkpoint_root(out))[-1])
