"""Quorum exchanges (--quorum, docs/algorithms.md section 12): closed forms with the scripted communicator, and
in-process runs, no processes.

The scripted toy is the one of test_outer_scripted: blocks of one linear layer whose loss is ``(w * g).sum()``,
so a worker's outer gradient is n * eta * g after n inner steps, whatever the parameters; outer SGD with lr 1 and
no momentum, alpha 0, so after ``drain(apply=True)`` every method has moved each fragment by minus the sum of
its exchanges' means, each applied exactly once. The scripted peers are workers 0 and 1; this worker is worker 2.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import StalledGroup, plain_sgd_outer
from torch import nn

from eagerloco.comm.base import Contribution, QuorumRule, Window
from eagerloco.comm.inprocess import InProcessGroup
from eagerloco.comm.quorum import LateWindows
from eagerloco.config import ConfigError, Environment, OuterConfig, RuntimeConfig, TrainConfig
from eagerloco.outer import OuterSync
from testing.scripted import ScriptedCommunicator

H, ETA = 2, 0.5
G = torch.tensor([3.0, 6.0, 12.0])
START = torch.tensor([1.0, 2.0, 3.0])
RANK = 2
#: Each method at P = 1 and P = 2 (Streaming, and Streaming with one step of overlap), as OuterConfig settings.
METHODS = {
    "diloco": {"method": "diloco"},
    "streaming": {"method": "streaming", "fragments": 2},
    "overlap": {"method": "streaming", "fragments": 2, "overlap_steps": 1, "inner_steps": 4},
    "delayed": {"method": "delayed"},
    "eager": {"method": "eager"},
    "eager-k2": {"method": "eager", "eager_rounds": 2},
}


def _peer(i: int, w: int) -> torch.Tensor:
    """Peer w's contribution to exchange i: small integers, so sums over 2 or 4 windows are exact."""
    return torch.tensor([float(i + 1 + w), float(2 * w - i), 4.0])


class _Scripted:
    """Worker 2 of three, against scripted peers, on one linear block per fragment."""

    def __init__(self, cfg: dict, late: dict[int, dict[int, int]] | None = None, **outer: object) -> None:
        fragments = int(cfg.get("fragments", 1))
        self.model = nn.Sequential(*[nn.Linear(3, 1, bias=False) for _ in range(fragments)])
        with torch.no_grad():
            for block in self.model:
                block.weight.copy_(START.view(1, 3))
        self.comm = ScriptedCommunicator(num_workers=3, rank=RANK, late=late,
                                         peers=lambda i: [[_peer(i, w).view(1, 3)] for w in (0, 1)])
        self.inner = torch.optim.SGD(self.model.parameters(), lr=ETA)
        config = OuterConfig(**{"inner_steps": H, **plain_sgd_outer(), **cfg, **outer})  # type: ignore[arg-type]
        self.sync = OuterSync(self.model, self.inner, self.comm, config, blocks=list(self.model))

    def run(self, rounds: int) -> _Scripted:
        for _ in range(rounds * self.sync.config.inner_steps):
            self.inner.zero_grad()
            sum((b.weight.view(-1) * G).sum() for b in self.model).backward()
            self.sync.before_inner_step()
            self.inner.step()
            self.comm.add_compute(1.0)
            self.sync.after_inner_step()
        self.sync.drain(apply=True)
        return self

    def own(self, i: int) -> torch.Tensor:
        return self.comm.calls[i].tensors[0].view(-1)

    def steps(self, i: int) -> int:
        """The inner steps of this worker's window in exchange i; the scripted peers' windows span as many."""
        window = self.comm.calls[i].window
        assert window is not None
        return window.steps

    def fragment_of(self, i: int) -> int:
        window = self.comm.calls[i].window
        return 0 if window is None else window.fragment

    def outer(self, fragment: int) -> torch.Tensor:
        return self.sync.outer[fragment][0].view(-1)


def _expected(run: _Scripted, means: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    """Every fragment's start less the sum of its exchanges' means (given where they differ from the plain mean)."""
    out = [START.clone() for _ in run.sync.outer]
    for call in run.comm.calls:
        plain = (run.own(call.index) + _peer(call.index, 0) + _peer(call.index, 1)) / 3
        out[run.fragment_of(call.index)] -= means.get(call.index, plain)
    return out


@pytest.mark.parametrize("name", list(METHODS))
def test_a_window_one_exchange_late_is_applied_once_with_its_token_weight(name: str) -> None:
    """Worker 2's first window misses its exchange (Q = 2 of 3): that exchange's mean is the two others', and the
    window is merged into its fragment's next exchange with weight H / 4H, beside the three windows of that one
    (12.3, 12.8): every method ends at the start less the sum of those means, each window counted once."""
    run = _Scripted(METHODS[name], late={0: {RANK: 1}}, quorum=2).run(rounds=3)
    nxt = len(run.sync.outer)  # the fragment's next exchange (P exchanges later)
    n0, n = run.steps(0), run.steps(nxt)  # a Streaming fragment's first window is shorter than H
    means = {0: (_peer(0, 0) + _peer(0, 1)) / 2,
             nxt: (n * (_peer(nxt, 0) + _peer(nxt, 1) + run.own(nxt)) + n0 * run.own(0)) / (3 * n + n0)}
    for got, want in zip([run.outer(f) for f in range(len(run.sync.outer))], _expected(run, means), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    stats = run.comm.stats
    assert (stats.quorum_missed, stats.late_merged, stats.late_dropped) == (1, 1, 0)
    assert run.comm.calls[0].tensors[0].shape == (1, 3)  # the window left once: nothing is sent twice


def test_eager_applies_its_own_share_at_once_and_takes_it_back_when_it_missed() -> None:
    """12.8's eager rows, worker 3 (here worker 2): round 1 moves it by its own share Delta/3; round 2 by
    Delta/3 + [D_1 - Delta/3] with D_1 the two others' mean; the drain by D_2 - Delta/3: in all, D_1 + D_2."""
    run = _Scripted(METHODS["eager"], late={0: {RANK: 1}}, quorum=2)
    d = H * ETA * G  # this worker's outer gradient of every round: (3, 6, 12), a multiple of 3
    run.run(rounds=0)
    history = []
    for _ in range(2):
        for _ in range(H):
            run.inner.zero_grad()
            (run.model[0].weight.view(-1) * G).sum().backward()
            run.inner.step()
            run.sync.after_inner_step()
        history.append(run.outer(0).clone())
    d1 = (_peer(0, 0) + _peer(0, 1)) / 2
    assert torch.equal(history[0], START - d / 3)
    assert torch.equal(history[1], START - d / 3 - (d / 3 + d1 - d / 3))
    run.sync.drain(apply=True)
    d2 = (_peer(1, 0) + _peer(1, 1) + d + d) / 4
    torch.testing.assert_close(run.outer(0), START - d1 - d2, rtol=0, atol=1e-6)
    assert run.comm.agreements[0][1].endswith("QuorumRule(quorum=2, grace=None, max_late=1)")  # agreed by all


@pytest.mark.parametrize("name", list(METHODS))
def test_a_window_staler_than_the_bound_is_dropped_logged_and_counted(name: str, capsys: pytest.CaptureFixture
                                                                      ) -> None:
    """Worker 2's first window reaches the party only after its fragment's next exchange closed: with
    --max-late-rounds 1 it is dropped there (12.4): no mean holds it, one log line names it, the metric counts it."""
    run = _Scripted(METHODS[name], late={0: {RANK: 2}}, quorum=2).run(rounds=3)
    means = {0: (_peer(0, 0) + _peer(0, 1)) / 2}
    for got, want in zip([run.outer(f) for f in range(len(run.sync.outer))], _expected(run, means), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    stats = run.comm.stats
    assert (stats.quorum_missed, stats.late_merged, stats.late_dropped) == (1, 0, 1)
    lines = [line for line in capsys.readouterr().err.splitlines() if "quorum: dropped" in line]
    first = run.comm.calls[0].window
    assert first is not None and len(lines) == 1, lines
    assert f"worker 2's window of fragment {first.fragment} launched at step {first.step} " in lines[0]


def test_a_window_held_across_catch_up_passes_ages_with_each_exchange(capsys: pytest.CaptureFixture) -> None:
    """LateWindows, 12.4: M = 3, Q = 2, S = 2, windows of 4 steps (N = 12, payloads X). Worker 2's window of step 4
    misses (a 9 s stall); its windows of steps 8 and 12 have no steps (catch-up passes) and miss too, held with no
    payload (theirs is zero). Each exchange that closes ages what it holds: the window of step 4 is dropped at step
    12, S exchanges on, with its line; at step 16 worker 2 is on time with 3 steps (payload 3/4 X) and that exchange
    merges its two empty windows with weight 0: (4 x0 + 4 x1 + 3 x2) / 11, each window once."""
    party, rule = LateWindows(), QuorumRule(quorum=2, grace=0.5, max_late=2)
    x0, x1, x2, w, zero = (torch.tensor([float(v)]) for v in (8, 16, 4, 40, 0))
    mean, result = party.close(Window(0, 4, 4, 12, rule), 4.5, [x0, x1, w], [4.0, 4.0, 13.0], [4, 4, 4])
    assert mean is not None and torch.equal(mean, (x0 + x1) / 2)
    for step in (8, 12):
        mean, result = party.close(Window(0, step, 4, 12, rule), step + 0.5, [x0, x1, zero], [step, step, 13.0],
                                   [4, 4, 0])
        assert mean is not None and torch.equal(mean, (x0 + x1) / 2)
        assert result is not None and result.dropped == ([Contribution(2, 4, 4)] if step == 12 else [])
        assert party.held[0][-1].values.numel() == 0  # a window of no steps keeps no payload (it is zero)
    mean, result = party.close(Window(0, 16, 4, 12, rule), 16.0, [x0, x1, x2 * 3 / 4], [16.0, 16.0, 14.0], [4, 4, 3])
    assert mean is not None and torch.equal(mean, (4 * x0 + 4 * x1 + 3 * x2) / 11)
    assert result is not None and result.dropped == [] and party.held == {}
    assert result.merged == [Contribution(2, 8, 0), Contribution(2, 12, 0), Contribution(0, 16, 4),
                             Contribution(1, 16, 4), Contribution(2, 16, 3)]
    lines = [line for line in capsys.readouterr().err.splitlines() if "quorum: dropped" in line]
    assert len(lines) == 1 and "launched at step 4 (4 steps" in lines[0], lines


def test_a_window_that_missed_the_last_exchange_is_dropped_at_the_end_with_a_log_line(capsys: pytest.CaptureFixture
                                                                                      ) -> None:
    """Where the run's end is not known (``outer_loop``), its last exchange closes on the quorum like any."""
    run = _Scripted(METHODS["eager"], late={2: {RANK: 1}}, quorum=2).run(rounds=3)
    assert (run.comm.stats.quorum_missed, run.comm.stats.late_dropped) == (1, 1)
    assert "launched at step 6 missed its exchange, and the run ended before a later one merged it" in \
        capsys.readouterr().err


@pytest.mark.parametrize("name", list(METHODS))
def test_the_run_s_last_exchange_waits_for_every_worker_and_merges_what_is_held(name: str, capsys: pytest.CaptureFixture
                                                                               ) -> None:
    """The run's end known (12.4): each fragment's last exchange closes on every worker, so worker 2's window late
    there is on time, and its window of the exchange before, which reaches the party only after the last one's
    scripted close, is merged into it with its weight: nothing missed at the end, nothing dropped."""
    p = int(METHODS[name].get("fragments", 1))
    rounds = 3
    run = _Scripted(METHODS[name], late={p: {RANK: 2}, 2 * p: {RANK: 1}, 2 * p + 1: {RANK: 1}}, quorum=2)
    run.sync.ends_at(rounds * run.sync.config.inner_steps)
    run.run(rounds=rounds)
    lasts = [i for i in range(len(run.comm.calls)) if i + p >= len(run.comm.calls)]  # each fragment's last exchange
    windows = [run.comm.calls[i].window for i in lasts]
    assert 2 * p in lasts and all(w is not None and w.rule.quorum == 3 for w in windows)
    n1, n = run.steps(p), run.steps(2 * p)
    means = {p: (_peer(p, 0) + _peer(p, 1)) / 2,
             2 * p: (n * (_peer(2 * p, 0) + _peer(2 * p, 1) + run.own(2 * p)) + n1 * run.own(p)) / (3 * n + n1)}
    for got, want in zip([run.outer(f) for f in range(len(run.sync.outer))], _expected(run, means), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert (run.comm.stats.quorum_missed, run.comm.stats.late_merged, run.comm.stats.late_dropped) == (1, 1, 0)
    assert "dropped" not in capsys.readouterr().err


def test_max_late_rounds_zero_drops_what_misses_at_once() -> None:
    run = _Scripted(METHODS["diloco"], late={0: {RANK: 1}}, quorum=2, max_late_rounds=0).run(rounds=2)
    torch.testing.assert_close(run.outer(0), _expected(run, {0: (_peer(0, 0) + _peer(0, 1)) / 2})[0],
                               rtol=0, atol=1e-6)
    assert (run.comm.stats.quorum_missed, run.comm.stats.late_dropped) == (1, 1)


@pytest.mark.parametrize("late, buffer", [({0: {RANK: 2}}, 1.0), ({0: {RANK: 1}}, 0.0)])
def test_error_feedback_keeps_what_no_mean_merged(late: dict, buffer: float) -> None:
    """fp32 with error feedback sends the whole buffer (C = e, the buffer empties). A dropped window's C goes back
    into the buffer when its worker learns of the drop, so the next send carries it; one merged late does not."""
    run = _Scripted(METHODS["diloco"], late=late, quorum=2, error_feedback=1.0).run(rounds=2)
    feedback = run.sync.feedback
    assert feedback is not None
    d = H * ETA * G
    torch.testing.assert_close(feedback.buffers[0][0].view(-1), buffer * run.own(0), rtol=0, atol=0)
    run.run(rounds=1)
    torch.testing.assert_close(run.own(2), d + buffer * run.own(0), rtol=0, atol=0)


def test_the_party_weighs_each_payload_by_the_schedule_it_was_sent_for() -> None:
    """LateWindows, 12.3: M = 2. Exchange 1 (N = 8): worker 0 on time with 4 steps (payload 2*4/8 X = X), worker 1
    late with the 2 steps it ran after a catch-up (payload 2*2/8 X = X/2). Exchange 2 (N = 6, the speeds moved):
    both on time with 3 steps (payload X). The second mean is (3 X0' + 3 X1' + 2 X1) / 8: each payload weighed by
    the N / M of its own exchange, which one factor over the sum could not do."""
    party, rule = LateWindows(), QuorumRule(quorum=1, grace=0.0, max_late=1)
    x0, x1, y0, y1 = (torch.tensor([float(v)]) for v in (8, 16, 4, 40))
    mean, result = party.close(Window(0, 4, 4, 8, rule), 1.0, [x0, x1 / 2], [1.0, 2.0], [4, 2])
    assert mean is not None and result is not None and torch.equal(mean, x0)
    assert result.merged == [Contribution(0, 4, 4)] and result.dropped == [] and result.closes_at == 1.0
    mean, result = party.close(Window(0, 8, 3, 6, rule), 3.0, [y0, y1], [3.0, 3.0], [3, 3])
    assert mean is not None and torch.equal(mean, (3 * y0 + 3 * y1 + 2 * x1) / 8)
    assert result is not None and result.merged == [Contribution(1, 4, 2), Contribution(0, 8, 3), Contribution(1, 8, 3)]
    assert party.close(Window(0, 12, 3, 6, rule), 5.0, [y0, y1], [5.0, 5.0], [3, 3]) == (None, None)
    mean, result = party.close(Window(0, 16, 4, 8, rule), 7.0, [x0, x1 / 2], [7.0, 7.0], [4, 2])  # on time, short
    assert mean is not None and torch.equal(mean, (4 * x0 + 2 * x1) / 6)
    assert result is not None and result.merged == [Contribution(0, 16, 4), Contribution(1, 16, 2)]


def test_settings_are_refused_with_one_line() -> None:
    for kwargs, flag in [({"quorum": 0}, "--quorum"), ({"grace": "soon"}, "--grace"), ({"grace": "-1"}, "--grace"),
                         ({"max_late_rounds": -1}, "--max-late-rounds"), ({"quorum": 2, "method": "dp"}, "--quorum"),
                         ({"quorum": 2, "codec": "fp8", "transport": "reduce-scatter"}, "--transport")]:
        with pytest.raises(ConfigError, match=flag) as info:
            OuterConfig(**kwargs).validate()  # type: ignore[arg-type]
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="more than the 3 workers"):
        _Scripted(METHODS["diloco"], quorum=4)


def test_train_refuses_a_quorum_where_processes_do_not_close_on_one_and_above_the_workers() -> None:
    job = RuntimeConfig(outer_addr="127.0.0.1:29500", worker_id=0)
    elastic = RuntimeConfig(outer_addr="127.0.0.1:29500", worker_id=0, elastic=True)
    for outer, runtime, says in [(OuterConfig(quorum=2, grace="1", codec="fp8"), job, "fp32 payloads only"),
                                 (OuterConfig(quorum=2, grace="1", method="delayed", codec="fp8"), job,
                                  "fp32 payloads only"),
                                 (OuterConfig(quorum=4), RuntimeConfig(), "more than the 3")]:
        cfg = TrainConfig(model="micro", batch_size=2, seq_len=16, workers=3, outer=outer, runtime=runtime)
        with pytest.raises(ConfigError, match=says) as info:
            cfg.validate(Environment.read())
        assert "\n" not in str(info.value)
    TrainConfig(model="micro", batch_size=2, seq_len=16, workers=3, outer=OuterConfig(quorum=3),
                runtime=job).validate(Environment.read())  # Q = M: today's exchanges, on any runtime
    TrainConfig(model="micro", batch_size=2, seq_len=16, workers=3, outer=OuterConfig(quorum=2, grace="1"),
                runtime=elastic).validate(Environment.read())  # with --elastic: L_e the membership's (12.6)
    for method in ("diloco", "streaming", "delayed", "eager"):  # every method with an outer exchange (12.10)
        TrainConfig(model="micro", batch_size=2, seq_len=16, workers=3, outer=OuterConfig(quorum=2, grace="1",
                    method=method), runtime=job).validate(Environment.read())
    TrainConfig(model="micro", batch_size=2, seq_len=16, workers=3, outer=OuterConfig(quorum=2),
                runtime=job).validate(Environment.read())  # --grace auto across jobs: 12.2 at the coordinator


def test_a_runtime_that_needs_every_worker_refuses_a_quorum() -> None:
    class AllOrNothing(ScriptedCommunicator):
        closes_on_quorum = False

    model = nn.Sequential(nn.Linear(3, 1, bias=False))
    with pytest.raises(ConfigError, match="runs in-process or across jobs at a coordinator"):
        OuterSync(model, None, AllOrNothing(num_workers=3), OuterConfig(quorum=2), blocks=[model[0]])


# ---------------------------------------------------------------- in-process


def _inprocess(cfg: OuterConfig, steps: int, stall: dict[int, float] | None = None,
               at: tuple[int, ...] = (3,)) -> tuple[list[nn.Module], list[OuterSync], InProcessGroup]:
    return StalledGroup(cfg, stall=stall, at=at).run(steps).finish()


def _bits(syncs: list[OuterSync], models: list[nn.Module]) -> list[torch.Tensor]:
    return [t.clone() for s in syncs for f in s.outer for t in f] + [p.detach().clone() for m in models
                                                                      for p in m.parameters()]


@pytest.mark.parametrize("name", [*METHODS, "adaptive", "error-feedback"])
def test_q_equal_m_and_a_quorum_nobody_misses_are_today_s_numbers_bit_for_bit(name: str) -> None:
    """12.7: Q = M launches exactly today's exchanges; Q < M where every worker arrives within the grace window
    takes the quorum path (late windows, grace, token weights) and still gives the same bits, clocks included."""
    base = {"inner_steps": 4, **METHODS.get(name, {"method": "eager"}), **plain_sgd_outer(0.7)}
    if name == "adaptive":
        base.update(adaptive_steps=True, worker_speeds=[1.0, 0.5, 1.0])
    if name == "error-feedback":
        base.update(error_feedback=0.9, topk=2, topk_chunk=8, codec="bf16")
    runs = [_inprocess(OuterConfig(**base, **q), steps=12) for q in ({}, {"quorum": 3}, {"quorum": 2, "grace": "5"})]
    today = _bits(runs[0][1], runs[0][0])
    for models, syncs, group in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(today, _bits(syncs, models), strict=True))
        assert [c.clock() for c in group.communicators] == [c.clock() for c in runs[0][2].communicators]
        assert all(c.stats.quorum_missed == 0 for c in group.communicators)


@pytest.mark.parametrize("name", ["diloco", "streaming", "eager", "adaptive"])
def test_a_stalled_worker_does_not_hold_the_others_and_catches_up(name: str) -> None:
    """Worker 2 stalls 3 s once, in its third step (1 s steps, exchanges every 4 or, Streaming, 2 steps).
    All-or-nothing, the others wait the 3 s. With Q = 2 and a 0.5 s grace, its window misses the exchange (the
    others wait the grace there), is merged into the fragment's next one, and worker 2 catches up by skipping
    its next ticks (12.5), so the others wait at most one more grace (Streaming's next exchange comes before the
    skip is done); nothing is dropped and every clock ends earlier than all-or-nothing's."""
    base = {"inner_steps": 4, **METHODS.get(name, {"method": "diloco"}), **plain_sgd_outer(0.7)}
    if name == "adaptive":
        base.update(adaptive_steps=True, worker_speeds=[1.0, 1.0, 1.0])
    _, _, aon = _inprocess(OuterConfig(**base), steps=16, stall={2: 3.0})
    models, syncs, quorum = _inprocess(OuterConfig(**base, quorum=2, grace="0.5"), steps=16, stall={2: 3.0})
    assert all(c.stats.blocked_s == pytest.approx(3.0) for c in aon.communicators[:2])
    assert all(c.stats.blocked_s <= 1.0 for c in quorum.communicators[:2])
    assert max(c.clock() for c in quorum.communicators) < min(c.clock() for c in aon.communicators)
    straggler = quorum.communicators[2].stats
    assert straggler.quorum_missed == straggler.late_merged > 0 and straggler.late_dropped == 0
    assert syncs[2].own_windows is not None and syncs[2].own_windows.skipped == 3  # ceil(2.5 s late / 1 s)
    assert straggler.compute_s == pytest.approx(16.0)  # 13 steps and the stall: the 3 skipped steps not run
    assert all(bool(t.isfinite().all()) for t in _bits(syncs, models))


@pytest.mark.parametrize(("name", "max_late", "missed", "dropped"),
                         [("diloco", 1, 2, 1), ("streaming", 1, 3, 1), ("eager", 1, 3, 2), ("eager", 4, 3, 0)])
def test_a_stall_longer_than_a_round_ages_the_held_window_through_the_catch_up(name: str, max_late: int,
                                                                               missed: int, dropped: int) -> None:
    """Worker 2 stalls 7 s in its third step (rounds of 4 s): its catch-up skips ticks across the next exchange,
    whose window of no steps misses too. Each exchange that closes ages the window it holds (12.4: staleness counts
    the fragment's exchanges), so under S = 1 the window of the stall is dropped there; S = 4 keeps every window
    until the first exchange worker 2 reaches in time, which merges them."""
    base = {"inner_steps": 4, **METHODS[name], **plain_sgd_outer(0.7)}
    models, syncs, group = _inprocess(OuterConfig(**base, quorum=2, grace="0.5", max_late_rounds=max_late), steps=24,
                                      stall={2: 7.0})
    stats = group.communicators[2].stats
    assert (stats.quorum_missed, stats.late_merged, stats.late_dropped) == (missed, missed - dropped, dropped)
    assert syncs[2].own_windows is not None and syncs[2].own_windows.skipped >= 6  # it skipped across an exchange
    if name != "eager":  # every worker applied every mean: the same outer parameters
        assert all(torch.equal(a, b) for s in syncs[1:] for f, g in zip(syncs[0].outer, s.outer, strict=True)
                   for a, b in zip(f, g, strict=True))


@pytest.mark.parametrize("name", ["diloco", "streaming", "eager"])
def test_a_stall_in_the_last_round_is_waited_for_where_the_run_s_end_is_known(name: str) -> None:
    """Worker 2 stalls 3 s in the run's last round (Q = 2, 0.5 s grace). The end unknown, its last window misses
    and is dropped at the end; known (``ends_at``, as ``eagerloco train`` gives it), each fragment's last exchange
    waits for it (12.4), as the run's end does anyway: nothing missed there, nothing dropped."""
    base = {"inner_steps": 4, **METHODS[name], **plain_sgd_outer(0.7)}
    counts = []
    for known in (False, True):
        run = StalledGroup(OuterConfig(**base, quorum=2, grace="0.5"), stall={2: 3.0}, at=(15,))
        for sync in run.syncs if known else ():
            sync.ends_at(16)
        models, syncs, group = run.run(16).finish()
        stats = group.communicators[2].stats
        counts.append((stats.quorum_missed, stats.late_merged, stats.late_dropped))
        assert stats.quorum_missed == stats.late_merged + stats.late_dropped
    assert counts[0][2] >= 1 and counts[1] == (0, 0, 0), counts
    if name != "eager":  # every worker applied every mean: the same outer parameters
        assert all(torch.equal(a, b) for s in syncs[1:] for f, g in zip(syncs[0].outer, s.outer, strict=True)
                   for a, b in zip(f, g, strict=True))


def test_auto_grace_closes_all_or_nothing_while_it_measures_then_at_its_floor() -> None:
    """--grace auto: the first 8 exchanges wait for everyone (12.2), so a 3 s stall in the first round is waited
    for; one in the tenth round is waited for 1% of a round's compute (4 s: 0.04 s), the floor, since equal
    workers arrive together (a spread of zero)."""
    cfg = OuterConfig(method="diloco", inner_steps=4, quorum=2, **plain_sgd_outer(0.7))
    _, _, group = _inprocess(cfg, steps=4 * 12, stall={2: 3.0}, at=(3, 4 * 9 + 3))
    assert all(c.stats.blocked_s == pytest.approx(3.0 + 0.04) for c in group.communicators[:2])
    assert group.communicators[2].stats.quorum_missed == 1


@pytest.mark.parametrize("name", ["eager", "streaming", "error-feedback"])
def test_a_run_resumed_mid_catch_up_gives_the_uninterrupted_numbers(name: str) -> None:
    """A checkpoint while a late window is held by the group, an eager exchange that missed is in flight and the
    straggler has ticks left to skip: the outer states, the group's state through JSON (as a checkpoint's table
    holds it) and the models, loaded into a fresh group, continue to the very numbers of the run never stopped."""
    base = {"inner_steps": 4, **METHODS.get(name, {"method": "eager"}), **plain_sgd_outer(0.7)}
    if name == "error-feedback":
        base.update(error_feedback=0.9, topk=2, topk_chunk=8, codec="bf16")
    cfg = OuterConfig(**base, quorum=2, grace="0.5")
    whole = StalledGroup(cfg, stall={2: 3.0}).run(16).finish()
    first = StalledGroup(cfg, stall={2: 3.0}).run(5)
    saved = ([s.state_dict() for s in first.syncs], json.loads(json.dumps(first.group.state_dict())),
             [copy.deepcopy(m.state_dict()) for m in first.models], [c.clock() for c in first.group.communicators],
             [copy.deepcopy(c.stats) for c in first.group.communicators])
    assert saved[1]["late"] or name == "streaming"  # the late window is held across the checkpoint
    resumed = StalledGroup(cfg, stall={2: 3.0})
    resumed.group.load_state_dict(saved[1])
    states, _, weights_, clocks, stats_ = saved
    for sync, model, comm, state, weights, clock, stats in zip(resumed.syncs, resumed.models,
                                                               resumed.group.communicators, states, weights_,
                                                               clocks, stats_, strict=True):
        model.load_state_dict(weights)
        sync.load_state_dict(state)
        comm.set_clock(clock)
        comm.stats = stats
    resumed.step = 5
    models, syncs, group = resumed.run(11).finish()
    assert all(torch.equal(a, b) for a, b in zip(_bits(whole[1], whole[0]), _bits(syncs, models), strict=True))
    assert [c.clock() for c in group.communicators] == [c.clock() for c in whole[2].communicators]
    assert [c.stats.late_merged for c in group.communicators] == [c.stats.late_merged for c in whole[2].communicators]


@pytest.mark.parametrize("name", ["diloco", "streaming", "eager"])
def test_every_window_of_a_steadily_slower_worker_is_merged_or_dropped_and_most_are_merged(name: str) -> None:
    """Worker 2 at half speed throughout (12.5: adaptive steps are for that; the quorum still loses nothing
    unaccounted): every window that missed is merged late or dropped with a log line, and the catch-up, which
    counts the others' progress at the fastest's pace since the window left, keeps most of them merged."""
    base = {"inner_steps": 4, **METHODS[name], **plain_sgd_outer(0.7)}
    _, _, group = _inprocess(OuterConfig(**base, quorum=2, grace="0.5"), steps=48, stall={2: 1.0},
                             at=tuple(range(1, 49)))
    stats = group.communicators[2].stats
    assert stats.quorum_missed == stats.late_merged + stats.late_dropped > 0
    assert stats.late_merged >= 2 * stats.late_dropped
    assert stats.compute_s < 2 * 48  # it skipped ticks to keep up
