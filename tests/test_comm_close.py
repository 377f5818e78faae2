"""Communicator.close has one signature everywhere: the trainer's dead-peer handler calls
``close(cancel=True)`` on whichever communicator it holds (a worker of several ranks included)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from runs import launch_here

from eagerloco.comm.base import Communicator, WorkerStats
from eagerloco.comm.distributed import TorchDistCommunicator
from eagerloco.comm.groups import DistContext
from eagerloco.comm.inprocess import InProcessCommunicator
from eagerloco.comm.worker import WorkerCommunicator
from testing.scripted import ScriptedCommunicator


def test_every_communicator_closes_with_the_same_signature() -> None:
    expected = inspect.signature(Communicator.close)
    assert list(expected.parameters) == ["self", "cancel"]
    for cls in (InProcessCommunicator, TorchDistCommunicator, WorkerCommunicator, ScriptedCommunicator):
        assert inspect.signature(cls.close) == expected, cls.__name__


def _ctx(rank_in_worker: int) -> DistContext:
    return DistContext(rank=2 + rank_in_worker, world_size=4, worker=1, rank_in_worker=rank_in_worker, workers=2,
                       ranks_per_worker=2, local_rank=rank_in_worker, device=torch.device("cpu"), backend="gloo",
                       timeout_s=5.0)


class _Outer:
    """Stands in for the first rank's TorchDistCommunicator: records how it was closed."""

    def __init__(self) -> None:
        self.stats, self.closed = WorkerStats(), []

    def close(self, cancel: bool = False) -> None:
        self.closed.append(cancel)


def test_a_worker_of_several_ranks_passes_cancel_to_its_outer_communicator() -> None:
    outer = _Outer()
    first = WorkerCommunicator(_ctx(0), outer)  # type: ignore[arg-type]
    first.close(cancel=True)
    first.close()
    assert outer.closed == [True, False]
    WorkerCommunicator(_ctx(1), None).close(cancel=True)  # the other ranks: nothing to release, no error


@pytest.mark.processes
def test_a_killed_worker_of_two_ranks_stops_the_others_with_a_peer_error(tmp_path: Path) -> None:
    """2 workers x 2 ranks, DiLoCo: both ranks of worker 1 kill themselves at step 6. The survivors stop
    with the PeerError naming worker 1 (not a TypeError from close(cancel=True)), no traceback."""
    argv = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "2", "--no-progress",
            "--log-every", "4", "--seed", "3", "--workers", "2", "--ranks-per-worker", "2", "--method", "diloco",
            "--inner-steps", "4", "--steps", "12", "--dist-timeout", "20", "--out", str(tmp_path)]
    r = launch_here(argv, 2, 2, env={"EAGERLOCO_FAULT_KILL": "1:6:0.01"})
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert "unexpected keyword argument 'cancel'" not in out, out[-3000:]
    assert "worker 1" in r.stdout and "Traceback" not in r.stdout, out[-3000:]
    assert not (tmp_path / "summary.json").exists()
