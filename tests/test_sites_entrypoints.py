"""Sites that come and go, through every library entry point: a worker of an elastic run started through
``connect(elastic=True)``, the Hugging Face or Lightning callback, or the torchft port is killed mid-run (kill -9);
the other goes on alone, and the same command started again rejoins the run at a round boundary with a live
worker's state (its digest checked) and ends with the other's outer parameters."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from jobs import popen
from test_hooks_jobs import assert_exited_0, coordinators, job_env, wait_all

from eagerloco.comm.connect import connect
from eagerloco.comm.rendezvous import STARTED_KEY
from eagerloco.config import ConfigError

HERE = Path(__file__).resolve().parent
STEPS = 60  # a kill at step 10, the survivor alone until the restarted worker is back (0.2 s a step), the rest fast


def _needs(framework: str) -> pytest.MarkDecorator:
    """Skipped without the framework: only the jobs import it (Lightning's import alone takes seconds)."""
    return pytest.mark.skipif(importlib.util.find_spec(framework) is None, reason=f"{framework} is not installed")


def _job(entry: str, out: Path, port: int, w: int, env: dict[str, str] | None = None, *extra: str) -> Any:
    return popen([sys.executable, str(HERE / "rejoin_job.py"), entry, str(out), str(w), "2", str(port), str(STEPS),
                  *extra],
                 env={**job_env(), **(env or {})}, cwd=HERE.parent, stdout=subprocess.PIPE,
                 stderr=subprocess.STDOUT, text=True)


def _killed_and_back(entry: str, out: Path, wrong_settings: bool = False) -> None:
    port = coordinators(1)[0]
    first = _job(entry, out, port, 1, {"EAGERLOCO_FAULT_KILL": "1:10"})
    survivor = _job(entry, out, port, 0)
    killed = wait_all([first], 120)[0]
    assert killed.returncode == -9, killed.stdout[-3000:]
    if wrong_settings:  # refused with one line before it asks to join; the run goes on
        wrong = wait_all([_job(entry, out, port, 1, None, "0.5")], 120)[0]
        assert wrong.returncode == 2, wrong.stdout[-3000:]
        assert wrong.stdout.strip().splitlines()[-1] == (
            "eagerloco: error: the workers disagree on settings that must match: outer_lr (worker 1: 0.5, the run: "
            "0.7). Start worker 1 with the run's settings to join it"), wrong.stdout[-3000:]
    back, survivor_done = wait_all([_job(entry, out, port, 1), survivor], 180)
    assert survivor_done.returncode == 0, survivor_done.stdout[-3000:]
    assert back.returncode == 0, back.stdout[-3000:]
    assert "worker 0: lost 1; continuing with workers [0]" in survivor_done.stdout, survivor_done.stdout[-3000:]
    assert "worker 0: workers [1] joined at step" in survivor_done.stdout, survivor_done.stdout[-3000:]
    assert "worker 1: joined at step" in back.stdout and "checked); members [0, 1]" in back.stdout, back.stdout
    ends = [json.loads((out / f"{entry}_{w}.json").read_text()) for w in range(2)]
    assert ends[0]["joined_at"] is None and 10 < ends[1]["joined_at"] < STEPS, ends
    assert [e["ticks"] for e in ends] == [STEPS, STEPS] and [e["workers"] for e in ends] == [2, 2], ends
    assert ends[0]["digest"] == ends[1]["digest"], ends
    assert ends[0]["lr"] == ends[1]["lr"], ends  # the learning-rate schedule's position too


@pytest.mark.processes
@pytest.mark.slow
def test_hook_api_a_killed_worker_restarted_rejoins_with_the_others_outer_parameters_and_other_settings_are_refused(
        tmp_path: Path) -> None:
    _killed_and_back("hooks", tmp_path, wrong_settings=True)


@pytest.mark.processes
@pytest.mark.slow
def test_torchft_port_a_killed_worker_restarted_rejoins_with_the_others_outer_parameters(tmp_path: Path) -> None:
    _killed_and_back("torchft", tmp_path)


@pytest.mark.processes
@pytest.mark.slow
@_needs("transformers")
def test_hf_callback_a_killed_worker_restarted_rejoins_with_the_others_outer_parameters(tmp_path: Path) -> None:
    _killed_and_back("hf", tmp_path)


@pytest.mark.processes
@pytest.mark.slow
@_needs("pytorch_lightning")
def test_lightning_callback_a_killed_worker_restarted_rejoins_with_the_others_outer_parameters(tmp_path: Path) -> None:
    _killed_and_back("lightning", tmp_path)


@pytest.mark.processes
@pytest.mark.slow
def test_hook_api_a_third_worker_joins_a_running_two_worker_run(tmp_path: Path) -> None:
    port = coordinators(1)[0]
    first = [_job("hooks", tmp_path, port, w, None, "0.7", "3") for w in range(2)]
    # A new worker id is admitted only into a run under way: wait for its start at the coordinator.
    dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120)).wait([STARTED_KEY])
    third = _job("hooks", tmp_path, port, 2, None, "0.7", "3")
    done = wait_all([*first, third], 180)
    assert_exited_0(done)
    assert "worker 0: workers [2] joined at step" in done[0].stdout, done[0].stdout[-3000:]
    assert "checked); members [0, 1, 2]" in done[2].stdout, done[2].stdout[-3000:]
    ends = [json.loads((tmp_path / f"hooks_{w}.json").read_text()) for w in range(3)]
    assert [e["workers"] for e in ends] == [3, 3, 3] and ends[2]["joined_at"] > 0, ends
    assert ends[0]["digest"] == ends[1]["digest"] == ends[2]["digest"], ends


def test_elastic_without_a_coordinator_is_refused_with_one_line_naming_the_way() -> None:
    with pytest.raises(ConfigError, match=r"^elastic=True needs each worker as its own job: pass outer_addr="):
        connect(elastic=True)
