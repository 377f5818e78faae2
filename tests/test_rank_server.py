"""The rank server of `eagerloco launch`: a forked rank is what a started one is (its own session, its
output, its environment, its exit status), and a launch through it trains bit for bit as one of started
processes. That its ranks end with a killed launcher: tests/test_signals.py, which launches forked ranks."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from runs import DIST_ENV, launch_here

from eagerloco.cli import main
from eagerloco.environment import Environment
from eagerloco.launch.ranks import RankServer, close_rank_server, rank_server, start_keys

pytestmark = pytest.mark.processes


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in Environment.for_child().items() if k not in DIST_ENV}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


@pytest.fixture(scope="module")
def server() -> Iterator[RankServer]:
    s = RankServer(_env())
    yield s
    s.close()
    assert s.process.returncode is not None


def _until(check, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_forked_rank_writes_to_its_pipe_and_reports_its_status(server: RankServer, capsys) -> None:
    argv = ["simulate", "--model", "1b", "--paper", "--bandwidth-gbps", "5"]
    r = server.start(argv, _env())
    out = r.stdout.read().decode()
    assert r.wait(60) == 0 and r.poll() == 0
    assert main(argv) == 0
    here = capsys.readouterr().out

    def timeless(text: str) -> str:  # the one line that says how long the simulation took
        return re.sub(r"in \d+\.\d+ s", "in T s", text)

    assert timeless(out) == timeless(here) and "DiLoCo" in out  # every line the command prints here
    r = server.start(["train", "--steps", "-1"], _env())
    out = r.stdout.read().decode()
    assert r.wait(60) == 2 and "eagerloco: error:" in out and "steps" in out, out


def test_a_forked_rank_has_the_environment_it_was_given(server: RankServer) -> None:
    # The variable is read by the command (eagerloco.environment): an invalid value is named in its error.
    r = server.start(["train", "--model", "micro", "--steps", "1"], _env(EAGERLOCO_WORKERS="three"))
    out = r.stdout.read().decode()
    assert r.wait(60) == 2 and "EAGERLOCO_WORKERS" in out and "three" in out, out


def test_a_forked_rank_has_its_own_session_and_its_killer_is_reported(server: RankServer, tmp_path: Path) -> None:
    r = server.start(["train", "--model", "micro", "--steps", "100000", "--batch-size", "2", "--seq-len", "16",
                      "--out", str(tmp_path / "run"), "--no-progress"], _env())
    _until(lambda: os.getsid(r.pid) == r.pid)
    assert os.getpgid(r.pid) == r.pid and os.getppid() != r.pid
    assert r.poll() is None
    r.kill()
    assert r.wait(30) == -signal.SIGKILL
    r.stdout.close()


def test_a_rank_with_another_interpreter_setting_is_not_forked() -> None:
    assert start_keys({"PYTHONPATH": "x", "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1", "HOME": "/"}) == {
        "PYTHONPATH": "x"}
    first = rank_server(_env())
    assert first is not None and rank_server(_env(HOME="/elsewhere")) is first  # not read when a process starts
    # A test fault is read by the watchers the server installed, in the rank's own environment (test_dist_train
    # kills forked ranks with it).
    assert rank_server(_env(EAGERLOCO_FAULT_KILL="1:3")) is first
    second = rank_server(_env(PYTHONPATH=os.pathsep.join(sys.path)))  # idle: replaced by one with the new setting
    assert second is not None and second is not first
    assert first.process.poll() is not None  # ended before its replacement started
    close_rank_server()
    assert second.process.poll() is not None


def test_a_launch_trains_the_same_forked_as_started(tmp_path: Path) -> None:
    args = ["--model", "micro", "--method", "eager", "--steps", "6", "--inner-steps", "2", "--batch-size", "2",
            "--seq-len", "32", "--eval-batches", "1", "--no-progress"]
    runs = {}
    for fork in (True, False):
        out = tmp_path / str(fork)
        r = launch_here([*args, "--out", str(out)], 2, fork_ranks=fork)
        assert r.returncode == 0, r.stdout[-3000:]
        runs[fork] = json.loads((out / "summary.json").read_text())
    for key in ("final_eval_loss", "bytes_sent_per_worker", "steps"):
        assert runs[True][key] == runs[False][key], key
