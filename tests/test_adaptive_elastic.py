"""Adaptive steps under --elastic: a worker leaves, and the token weights and the rounds are renormalised over
the workers present (section 11 of docs/algorithms.md).

The closed forms follow one worker (id 0) of three on a scripted communicator: the others' contributions are
given, and so are the workers whose payloads each mean holds (``Handle.contributors``: an exchange that ran
again among the survivors of a membership change). Speeds 0.5, 1, 0.25 and H = 4 give H_m = 2, 4, 1; worker 1,
the fastest, is gone from round 2 on, so round 2 weighs workers 0 and 2 by 2 and 1 steps, and round 3 (sized by
the speeds the survivors exchanged) gives H_m = 4, -, 2. Worker m's inner gradient is a constant, so its outer
gradient is n_m * eta * g_m whatever the start, and D_r = sum over the workers present of n_m / sum n * Delta_m.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from runs import launch_here
from torch import nn

from eagerloco import checkpoint as ckpt
from eagerloco.adaptive import AdaptiveSteps
from eagerloco.config import OuterConfig
from eagerloco.outer import OuterSync
from testing.scripted import ScriptedCommunicator

ETA = 0.5
START = torch.tensor([1.0, 2.0, 3.0])
G0 = torch.tensor([2.0, -4.0, 8.0])  # worker 0's inner gradient
D1, D2 = torch.tensor([4.0, 1.0, -2.0]), torch.tensor([-6.0, 2.0, 1.0])  # workers 1 and 2: outer gradient a round
SPEEDS = [0.5, 1.0, 0.25]
#: Each worker's steps in each round's window (worker 1's last H_m stays on the books, never weighed).
WINDOWS = [[2, 4, 1], [2, 4, 1], [4, 4, 2]]
#: Exchanges 0, 2, 4 are each round's outer exchange, 1, 3, 5 its speeds; all but the first ran without worker 1.
WITHOUT_1 = {i: [0, 2] for i in range(1, 6)}
PLAIN = {"outer_lr": 1.0, "outer_momentum": 0.0, "outer_nesterov": False}


def _peers(i: int) -> list[list[torch.Tensor]]:
    """The other contributors' payloads of exchange i: each sends M * n_m / sum n times its outer gradient."""
    r = i // 2
    if i % 2:  # speeds: worker 2's, at its index (the scale of the vector does not matter)
        return [[torch.tensor([0.0, 0.0, SPEEDS[2] * 3])]]
    window = WINDOWS[r]
    scale = [3 * n / sum(window) for n in window]
    sent = [[(scale[1] * D1).view(1, 3)]] if r == 0 else []
    return [*sent, [(scale[2] * D2).view(1, 3)]]


def _closed_form(rounds: int) -> torch.Tensor:
    """START - sum_r D_r, D_r the token-weighted mean over the workers whose payloads it holds."""
    x = START.clone()
    for r in range(rounds):
        n = WINDOWS[r]
        present = [0, 1, 2] if r == 0 else [0, 2]
        delta = {0: n[0] * ETA * G0, 1: D1, 2: D2}
        total = sum(n[m] for m in present)
        x -= sum(n[m] / total * delta[m] for m in present)  # type: ignore[misc]
    return x


class _Worker:
    """Worker 0 of three, elastic, on a scripted communicator; ``leave_at``: the tick after which it sees worker 1
    gone (4: before round 2's exchange; 8: after it, which then ran again without worker 1)."""

    def __init__(self, method: str, leave_at: int, **cfg: object) -> None:
        self.model = nn.Sequential(nn.Linear(3, 1, bias=False))
        with torch.no_grad():
            self.model[0].weight.copy_(START.view(1, 3))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=ETA)
        self.comm = ScriptedCommunicator(3, 0, peers=_peers, elastic=True, contributors=WITHOUT_1)
        config = OuterConfig(method=method, inner_steps=4, adaptive_steps=True, worker_speeds=SPEEDS, **PLAIN,
                             **cfg)  # type: ignore[arg-type]
        self.sync = OuterSync(self.model, self.opt, self.comm, config, blocks=[self.model[0]])
        self.leave_at, self.own, self.plans = leave_at, 0, []

    def run(self, ticks: int) -> _Worker:
        adaptive = self.sync.adaptive
        assert adaptive is not None
        for _ in range(ticks):
            if self.sync.step % 4 == 0:
                self.plans.append(list(adaptive.rounds.lengths))
            for _ in range(self.sync.inner_steps_due()):
                self.own += 1
                self.model[0].weight.grad = G0.view(1, 3).clone()
                self.opt.step()
            self.sync.before_inner_step()
            self.sync.after_inner_step()
            if self.sync.step == self.leave_at:
                self.comm.regroup([0, 2])
        return self


def test_weigh_and_settle_renormalise_over_the_workers_present() -> None:
    """Round 1's window [2, 4, 1] seen without worker 1: the payload keeps its factor M w_m = 6/7 (what it sends
    does not depend on who is present), its own share is 2/3 (eager sends 6/7 and applies it over 9/7), the
    others' weight 1/3; a mean that holds workers 0 and 2 is rescaled by |C| T / (M T_C) = 14/9."""
    comm = ScriptedCommunicator(3, 0, elastic=True)
    adaptive = AdaptiveSteps(OuterConfig(inner_steps=4, adaptive_steps=True, worker_speeds=SPEEDS), comm)
    for _ in range(4):
        adaptive.tick()
    comm.regroup([0, 2])
    weight = adaptive.weigh(0)
    assert weight.window == [2, 4, 1]
    assert (weight.scale, weight.workers, weight.others) == (6 / 7, 9 / 7, 1 / 3)
    assert weight.scale / weight.workers == pytest.approx(2 / 3)
    mean = torch.tensor([9.0, 18.0])
    torch.testing.assert_close(AdaptiveSteps.settle([mean.clone()], [2, 4, 1], [0, 2])[0], torch.tensor([14.0, 28.0]))
    assert torch.equal(AdaptiveSteps.settle([mean.clone()], [2, 4, 1], [0, 1, 2])[0], mean)  # every worker: as is
    assert torch.equal(AdaptiveSteps.settle([mean.clone()], [2, 4, 1], None)[0], mean)


def test_the_steps_trained_count_a_worker_only_while_it_is_present() -> None:
    """The tokens reported: worker 1 trained its round-1 steps (4) and no more, while the rounds keep its steps
    on the books (every survivor's windows must agree); the others count on; a checkpoint carries the count."""
    comm = ScriptedCommunicator(3, 0, elastic=True)
    adaptive = AdaptiveSteps(OuterConfig(inner_steps=4, adaptive_steps=True, worker_speeds=SPEEDS), comm)
    for _ in range(4):
        adaptive.tick()
    comm.regroup([0, 2])
    for _ in range(4):
        adaptive.tick()
    assert adaptive.rounds.done == [4, 8, 2] and adaptive.trained == [4, 4, 2]
    again = AdaptiveSteps(OuterConfig(inner_steps=4, adaptive_steps=True, worker_speeds=SPEEDS), comm)
    again.load_state_dict(adaptive.state_dict())
    assert again.trained == [4, 4, 2]


@pytest.mark.parametrize("leave_at", [4, 8], ids=["seen-before-launch", "rerun-after-launch"])
@pytest.mark.parametrize("method", ["diloco", "eager"])
def test_a_worker_leaves_and_the_weights_are_renormalised_over_the_survivors(method: str, leave_at: int) -> None:
    """Three rounds, worker 1 gone after the first: every outer step is the token-weighted mean over the workers
    whose payloads it holds, weights summing to 1 over them (eager: the own share applied at once is settled
    when the mean lands, so at the end every outer gradient counts once); round 3 is sized by the survivors'
    speeds (worker 0, now the fastest present, runs H). Where the survivor learns of the change does not
    matter: what it sends is the same (DiLoCo: the same numbers, bit for bit)."""
    w = _Worker(method, leave_at).run(12)
    if method == "eager":
        w.sync.drain(apply=True)
    assert w.plans == WINDOWS
    assert w.own == 2 + 2 + 4
    torch.testing.assert_close(w.sync.outer[0][0].view(-1), _closed_form(3), rtol=1e-6, atol=1e-6)
    if method == "diloco":
        other = _Worker(method, 12 - leave_at).run(12)
        assert torch.equal(other.sync.outer[0][0], w.sync.outer[0][0])


def test_eager_applies_its_own_share_over_the_workers_it_sees() -> None:
    """Eager, round 2 launched after worker 0 saw worker 1 leave: its own share is 2/3 of its outer gradient (its
    2 steps of the 3 present), not 2/7; a round later the mean (workers 0 and 2) replaces that proxy."""
    w = _Worker("eager", 4).run(8)
    launched = w.sync.in_flight[-1]
    assert launched.window == [2, 4, 1] and launched.workers == pytest.approx(9 / 7)
    mine = 2 * ETA * G0  # its outer gradient in rounds 1 and 2
    first = (2 * mine + 4 * D1 + D2) / 7  # round 1's mean, all three; landed at tick 8
    own_1, own_2 = 2 / 7 * mine, 2 / 3 * mine
    expected = START - own_1 - (first - own_1) - own_2
    torch.testing.assert_close(w.sync.outer[0][0].view(-1), expected, rtol=1e-6, atol=1e-6)


def test_a_checkpoint_after_the_change_resumes_to_the_same_numbers() -> None:
    """Eager, saved at tick 10 (the exchange of round 2 and the survivors' speeds in flight, with the workers
    their means hold), loaded into a new worker: the run ends as one never stopped, bit for bit."""
    whole = _Worker("eager", 4).run(12)
    whole.sync.drain(apply=True)
    cut = _Worker("eager", 4).run(10)
    state = cut.sync.state_dict()
    assert [x["contributors"] for x in state["in_flight"]] == [[0, 2]]
    assert state["adaptive"]["pending"]["contributors"] == [0, 2]
    resumed = _Worker("eager", 4)
    resumed.comm.regroup([0, 2])
    resumed.comm.calls = list(cut.comm.calls)  # the exchange numbering goes on
    resumed.model.load_state_dict(cut.model.state_dict())
    resumed.sync.load_state_dict(state)
    resumed.own = cut.own
    resumed.run(2)
    resumed.sync.drain(apply=True)
    assert torch.equal(resumed.sync.outer[0][0], whole.sync.outer[0][0])
    assert resumed.sync.adaptive.rounds.state() == whole.sync.adaptive.rounds.state()  # type: ignore[union-attr]


def test_a_rejoining_worker_measures_its_own_speed() -> None:
    """A worker that takes another's state (it rejoins) forgets the speed measured there."""
    comm = ScriptedCommunicator(3, 0, elastic=True)
    adaptive = AdaptiveSteps(OuterConfig(inner_steps=4, adaptive_steps=True), comm)
    comm.add_compute(2.0)
    adaptive.tick()
    comm.add_compute(2.0)
    adaptive.tick()
    assert adaptive.meter.steps_per_s == 0.5
    adaptive.forget_speed()
    assert adaptive.meter.steps_per_s == 0.0 and adaptive.compute_mark is None


# ---------------------------------------------------------------- processes

ARGS = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "2", "--no-progress",
        "--log-every", "4", "--seed", "3", "--method", "diloco", "--inner-steps", "4", "--steps", "24",
        "--checkpoint-every", "4", "--keep-checkpoints", "0", "--sim-step-time", "0.05", "--dist-timeout", "20",
        "--adaptive-steps", "--worker-speeds", "1,0.5,1", "--elastic"]


@pytest.mark.processes
def test_three_elastic_workers_at_unequal_speeds_lose_one_and_the_survivors_agree(tmp_path: Path) -> None:
    """Speeds 1, 0.5, 1 (H_m = 4, 2, 4), worker 2 killed at step 6: workers 0 and 1 go on, weigh each exchange by
    their own steps, and hold the same rounds and outer parameters at every checkpoint after it and at the end."""
    r = launch_here([*ARGS, "--workers", "3", "--out", str(tmp_path)], 3, env={"EAGERLOCO_FAULT_KILL": "2:6:0.01"},
                    timeout=240, elastic=True)
    where = r.stdout[-6000:]
    assert r.returncode == 0, where
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["members"] == [0, 1] and [e["workers"] for e in s["faults"]] == [[2]], where
    final = s["final_outer"]
    assert sorted(final) == ["0", "1"] and len({v["sha256"] for v in final.values()}) == 1, where
    assert all(v["finite"] for v in final.values()), where
    paths = ckpt.list_checkpoints(ckpt.checkpoint_root(tmp_path))
    late = [p for p in paths if ckpt.verify(p)["members"] == [0, 1]]
    assert late and int(late[-1].name.split("_")[1]) == 24, where
    for path in late:
        a, b = (ckpt.load_worker_state(path, w)["sync"] for w in (0, 1))
        assert a["adaptive"]["rounds"] == b["adaptive"]["rounds"], path
        assert a["adaptive"]["rounds"]["lengths"] == [4, 2, 4], path  # the fastest present still runs H
        for fa, fb in zip(a["outer"], b["outer"], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(fa, fb, strict=True)), path
