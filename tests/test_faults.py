"""Fault tolerance: elastic membership (a worker dies, another comes back), stragglers, bad input.

The multi-process tests run real processes on gloo over loopback, kill a worker with SIGKILL at a
chosen inner step (EAGERLOCO_FAULT_KILL, see eagerloco.faults) and guard every spawn with a
timeout, so a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from runs import launch_here

from eagerloco import checkpoint as ckpt
from eagerloco.cli import main
from eagerloco.comm.base import Communicator, ReadyHandle, WorkerStats, flatten
from eagerloco.config import OuterConfig, parse_slow_workers
from eagerloco.outer import OuterSync

BASE = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "2", "--no-progress",
        "--log-every", "2", "--seed", "5", "--dist-timeout", "20"]


def _launch(out: Path, workers: int, args: list[str], kill: str | None = None, timeout: float = 180,
            **launch_kwargs: object) -> subprocess.CompletedProcess:
    """`eagerloco launch --workers M [launch_kwargs] -- ...`, the launcher in this process (tests/runs.py)."""
    argv = [*BASE, "--workers", str(workers), "--out", str(out), *args]
    env = {"EAGERLOCO_FAULT_KILL": kill} if kill else None
    return launch_here(argv, workers, env=env, timeout=timeout, **launch_kwargs)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln]


# --------------------------------------------------------------------------------------------------
# A worker dies and comes back (multi-process)


@pytest.mark.processes
def test_eager_survives_a_killed_worker_which_then_rejoins_from_a_live_peer(tmp_path: Path) -> None:
    """3-worker eager: kill worker 2 at a random inner step; the others go on; the launcher restarts
    it, it is admitted at a round boundary with the current state of a live peer, and all three end
    with the same finite outer parameters."""
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    kill_step, delay = rng.randint(2, 14), round(rng.uniform(0.01, 0.05), 3)
    h, steps = 3, 150
    # Every worker sleeps twice its compute per step: the run lasts long enough (mostly idle) for
    # the restarted process to start and come back.
    slow = [a for w in range(3) for a in ("--slow-worker", f"{w}:3")]
    args = ["--method", "eager", "--inner-steps", str(h), "--steps", str(steps), *slow]
    r = _launch(tmp_path, 3, args, kill=f"2:{kill_step}:{delay}", elastic=True, max_restarts=1)
    where = f"(kill at step {kill_step} + {delay} s, seed {seed})\n" + r.stdout[-6000:] + r.stderr[-3000:]
    assert r.returncode == 0, where
    assert "restarting it to rejoin" in r.stdout, where
    s = json.loads((tmp_path / "summary.json").read_text())
    left = [e for e in s["faults"] if e["event"] == "left"]
    joined = [e for e in s["faults"] if e["event"] == "joined"]
    assert [e["workers"] for e in left] == [[2]] and left[0]["members"] == [0, 1], where
    assert [e["workers"] for e in joined] == [[2]] and joined[0]["members"] == [0, 1, 2], where
    # Never stale: right after joining, the joiner's outer parameters are bit for bit the source's.
    digests = joined[0]["outer_sha256"]
    assert digests["2"] == digests[str(joined[0]["source"])], where
    assert left[0]["step"] <= joined[0]["step"] and joined[0]["step"] % h == 0, where
    # The dead worker's work since its last exchange that reached the model is what was lost.
    # Its last heartbeat: the kill lands `delay` after step kill_step, maybe a step later.
    assert kill_step - 1 <= left[0]["last_seen_step"]["2"] <= kill_step + 1, where
    assert 0 <= s["lost_inner_steps"] <= 3 * h, where
    final = s["final_outer"]
    assert sorted(final) == ["0", "1", "2"], where
    assert len({v["sha256"] for v in final.values()}) == 1 and all(v["finite"] for v in final.values()), where
    assert s["members"] == [0, 1, 2] and s["worker_steps"] < 3 * steps, where
    members = [m["members"] for m in _metrics(tmp_path)]
    assert members[0] == 3 and 2 in members and members[-1] == 3, members
    steps_logged = [m["step"] for m in _metrics(tmp_path)]
    assert steps_logged == sorted(set(steps_logged)) and steps_logged[-1] == steps


@pytest.mark.processes
def test_leader_dies_the_others_finish_and_a_resume_refills_the_group(tmp_path: Path) -> None:
    """4-worker DiLoCo: worker 0 (evaluation, metrics, checkpoint manifest) dies; workers 1-3 go on
    at once (worker 2, not next to 0 in gloo's ring, is not left waiting for the timeout). Their
    checkpoints hold only themselves; resuming from one with all four gives worker 0 a live state."""
    out = tmp_path / "run"
    args = ["--method", "diloco", "--inner-steps", "4", "--steps", "16", "--checkpoint-every", "4",
            "--keep-checkpoints", "0"]
    r = _launch(out, 4, args, kill="0:5:0.01", elastic=True)
    where = r.stdout[-5000:] + r.stderr[-2000:]
    assert r.returncode == 0, where
    s = json.loads((out / "summary.json").read_text())
    assert s["members"] == [1, 2, 3] and sorted(s["final_outer"]) == ["1", "2", "3"], where
    assert len({v["sha256"] for v in s["final_outer"].values()}) == 1, where
    assert all(v["finite"] for v in s["final_outer"].values()), where
    left = s["faults"][0]
    assert left["workers"] == [0] and 4 <= left["last_seen_step"]["0"] <= 6, where  # killed 10 ms after step 5
    assert s["recovery_s"] < 10, where  # --dist-timeout is 20: nobody waited for it
    logged = _metrics(out)
    assert logged[0]["members"] == 4 and logged[-1]["members"] == 3
    steps = [m["step"] for m in logged]  # the new leader took over the file: no duplicate, no partial line
    assert steps == sorted(set(steps)) and steps[-1] == 16
    root = ckpt.checkpoint_root(out)
    by_step = {int(p.name.split("_")[1]): p for p in ckpt.list_checkpoints(root)}
    assert sorted(by_step) == [4, 8, 12, 16]
    assert len(ckpt.verify(by_step[4])["files"]) == 4
    meta8 = ckpt.verify(by_step[8])
    assert [e["file"] for e in meta8["files"]] == ["worker_1.pt", "worker_2.pt", "worker_3.pt"]
    assert meta8["members"] == [1, 2, 3] and not (by_step[8] / "worker_0.pt").exists()
    for step in (12, 16):  # resume from step 8
        shutil.rmtree(by_step[step])
    r = _launch(out, 4, [*args, "--resume"], elastic=True)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["members"] == [0, 1, 2, 3] and s["faults"] == []
    assert len({v["sha256"] for v in s["final_outer"].values()}) == 1
    last = ckpt.list_checkpoints(root)[-1]
    w0, w1 = (ckpt.load_worker_state(last, w) for w in (0, 1))
    for a, b in zip(w0["sync"]["outer"][0], w1["sync"]["outer"][0], strict=True):
        assert torch.equal(a, b)  # DiLoCo: one outer copy, everywhere
    assert w0["stream"]["seed"] != w1["stream"]["seed"]  # each keeps its own data


# --------------------------------------------------------------------------------------------------
# Eager's weights under a changing M (closed form, no processes)


class _ScriptedComm(Communicator):
    """One worker's communicator whose peers are scripted: their outer gradients are given per
    round, and num_workers changes when the test says so."""

    def __init__(self, others: list[list[torch.Tensor]]) -> None:
        self.rank, self.num_workers, self.stats = 0, 1 + len(others), WorkerStats()
        self.others = others  # round -> the other present workers' gradients (flat)
        self.round = 0

    def allreduce_mean(self, tensors, codec, generator=None, *, keep_own=True):  # type: ignore[no-untyped-def]
        own = flatten(tensors)
        peers = self.others[self.round][: self.num_workers - 1]
        self.round += 1
        mean = (own + sum(peers, torch.zeros_like(own))) / self.num_workers
        return ReadyHandle(self, [mean.view(tensors[0].shape)], [own.view(tensors[0].shape)], 0, None)


def test_eager_applies_each_outer_gradient_once_with_the_m_of_its_round() -> None:
    """Membership 3 -> 2 -> 4 across rounds: with plain outer SGD (lr 1) the outer parameters end at
    the start minus the sum over rounds of the mean over the workers present in that round."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 1, bias=False))
    rounds, workers = 5, [3, 3, 2, 2, 4]
    others = [[torch.randn(3) for _ in range(3)] for _ in range(rounds)]
    comm = _ScriptedComm(others)
    cfg = OuterConfig(method="eager", inner_steps=1, outer_lr=1.0, outer_momentum=0.0, outer_nesterov=False)
    sync = OuterSync(model, None, comm, cfg, blocks=[model[0]])
    start = model[0].weight.detach().clone().view(-1)
    expected = start.clone()
    for t in range(rounds):
        comm.num_workers = workers[t]
        step = torch.randn(3)
        with torch.no_grad():
            model[0].weight -= step.view(1, 3)  # the worker's inner progress this round
        own = (start if t == 0 else sync.outer[0][0].detach().view(-1)) - model[0].weight.detach().view(-1)
        own = own.clone()
        sync.after_inner_step()
        expected -= (own + sum(others[t][: workers[t] - 1], torch.zeros(3))) / workers[t]
    sync.drain(apply=True)
    torch.testing.assert_close(sync.outer[0][0].view(-1), expected, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# Stragglers (in-process: simulated time) and bad input


def _inprocess(out: Path, method: str, extra: list[str]) -> dict:
    args = ["train", *BASE[:-2], "--workers", "2", "--method", method, "--inner-steps", "4", "--steps", "16",
            "--sim-step-time", "0.1", "--latency-ms", "50", "--out", str(out), *extra]
    if method == "eager":
        args += ["--eager-rounds", "2"]
    assert main(args) == 0
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_a_straggler_costs_time_not_numbers_and_eager_absorbs_its_lag(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    blocked = {}
    for method in ("dp", "diloco", "eager"):
        clean = _inprocess(tmp_path / f"{method}-clean", method, [])
        slow = _inprocess(tmp_path / f"{method}-slow", method, ["--slow-worker", "1:1.5"])
        assert slow["final_eval_loss"] == clean["final_eval_loss"]  # time only: the same numbers
        fast, lagging = slow["per_worker"]
        assert lagging["compute_s"] == pytest.approx(1.5 * fast["compute_s"])
        assert slow["wall_s"] > clean["wall_s"]
        blocked[method] = fast["blocked_s"] - clean["per_worker"][0]["blocked_s"]
    # dp waits for the straggler every step and DiLoCo every round; eager with 2 rounds in flight
    # lets the fast worker run up to 2 rounds ahead before it has to wait.
    assert blocked["dp"] > 0.05 and blocked["diloco"] > 0.05
    assert blocked["eager"] < 0.5 * blocked["diloco"], blocked


@pytest.mark.parametrize("spec,message", [
    (["5:2"], "worker id must be in 0..1"),
    (["1:0.5"], "FACTOR must be a number from 1 to 1000"),
    (["1:nan"], "FACTOR must be a number from 1 to 1000"),
    (["one"], "expected ID:FACTOR"),
    (["1:2", "1:3"], "given twice"),
])
def test_bad_slow_worker_is_refused_with_the_fix(spec: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_slow_workers(spec, 2)


@pytest.mark.parametrize("argv,message", [
    (["--elastic"], "--elastic needs the multi-process runtime"),
    (["--rejoin"], "--rejoin needs --elastic"),
    (["--slow-worker", "2:1.5"], "worker id must be in 0..1"),
])
def test_fault_flags_are_checked_before_training(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  argv: list[str], message: str) -> None:
    assert main(["train", "--workers", "2", "--steps", "1", "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--max-restarts", "1"], "--max-restarts needs --elastic"),
    (["--elastic", "--ranks-per-worker", "2"], "one rank per worker"),
    (["--elastic", "--max-restarts", "-1"], "--max-restarts must be an integer >= 0"),
    (["--grace-s", "-3"], "--grace-s must be"),
])
def test_bad_launch_flags_are_refused(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(["launch", "--workers", "2", *argv, "--", "--steps", "1"]) == 2
    assert message in capsys.readouterr().err
