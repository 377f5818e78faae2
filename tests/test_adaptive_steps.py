"""Workers of unequal speed (--adaptive-steps, section 11 of docs/algorithms.md): closed forms, no processes.

A tick is an inner step of the fastest worker; worker m runs H_m = max(1, round(H r_m / r_max)) of its own
inner steps over a round's H ticks (``OuterSync.inner_steps_due``), and the exchange is the token-weighted mean
D = sum_m w_m Delta_m. The toys: a linear layer whose loss is ``(w * g_m).sum()``, so worker m's inner gradient
is the constant g_m and n inner SGD steps of lr eta from the outer copy give the outer gradient n * eta * g_m;
with speeds 1, 1/2, 1/4, 1/4 and H = 4 the weights are 1/2, 1/4, 1/8, 1/8 and every value below is a dyadic
fraction, so the closed forms hold exactly (torch.equal).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable

import pytest
import torch
from conftest import seeded_grads
from runs import stop_after_checkpoint
from torch import nn
from toy import Toy

from eagerloco.adaptive import SpeedMeter
from eagerloco.comm.base import Communicator
from eagerloco.comm.inprocess import InProcessGroup
from eagerloco.config import ConfigError, OuterConfig
from eagerloco.outer import OuterSync, after_inner_step_all, before_inner_step_all
from eagerloco.schedule import fragment_offsets, round_lengths, steps_by_tick
from testing.scripted import ScriptedCommunicator

ETA = 0.5
START = torch.tensor([1.0, 2.0, 3.0])
PLAIN = {"outer_lr": 1.0, "outer_momentum": 0.0, "outer_nesterov": False}


def _linear() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(3, 1, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(START.view(1, 3))
    return model


class _Ticks:
    """M workers in one process driven tick by tick, each running its own inner steps of the tick.

    grad(m, n, name, p): worker m's gradient at its n-th own inner step (1, 2, ...). step_time(m): the
    simulated seconds of one of its inner steps (what a measured speed is made of).
    """

    def __init__(self, cfg: OuterConfig, models: list[nn.Module], comms: list[Communicator],
                 grad: Callable[[int, int, str, torch.Tensor], torch.Tensor],
                 step_time: Callable[[int], float] = lambda m: 1.0) -> None:
        self.models, self.comms, self.grad, self.step_time = models, comms, grad, step_time
        self.opts = [torch.optim.SGD(m.parameters(), lr=ETA) for m in models]
        self.syncs = [OuterSync(m, o, c, cfg, blocks=_blocks(m)) for m, o, c in zip(models, self.opts, comms,
                                                                                  strict=True)]
        self.own = [0] * len(models)  # each worker's inner steps so far
        self.plans: list[list[list[int]]] = []  # each round's H_m as each worker sees them

    def tick(self) -> None:
        cfg = self.syncs[0].config
        if self.syncs[0].step % cfg.inner_steps == 0 and self.syncs[0].adaptive is not None:
            self.plans.append([list(s.adaptive.rounds.lengths) for s in self.syncs])  # type: ignore[union-attr]
        for m, (model, opt, sync, comm) in enumerate(zip(self.models, self.opts, self.syncs, self.comms,
                                                         strict=True)):
            for _ in range(sync.inner_steps_due()):
                self.own[m] += 1
                for name, p in model.named_parameters():
                    p.grad = self.grad(m, self.own[m], name, p.detach())
                opt.step()
                comm.add_compute(self.step_time(m))
        before_inner_step_all(self.syncs)
        after_inner_step_all(self.syncs)

    def run(self, ticks: int) -> _Ticks:
        for _ in range(ticks):
            self.tick()
        return self


def _blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.blocks) if isinstance(model, Toy) else [model[0]]


def _inprocess(cfg: OuterConfig, workers: int, grad: Callable, model: nn.Module | None = None,
               step_time: Callable[[int], float] = lambda m: 1.0) -> _Ticks:
    init = model if model is not None else _linear()
    group = InProcessGroup(workers, count_overhead=False)
    return _Ticks(cfg, [copy.deepcopy(init) for _ in range(workers)], group.communicators, grad, step_time)


def _constant(gs: list[torch.Tensor]) -> Callable:
    return lambda m, n, name, p: gs[m].view(p.shape).clone()


def _state(t: _Ticks) -> list[torch.Tensor]:
    out = [x.detach().clone() for s in t.syncs for frag in s.outer for x in frag]
    return out + [p.detach().clone() for m in t.models for p in m.parameters()]


# ---------------------------------------------------------------- the round's arithmetic


def test_round_lengths_follow_the_formula() -> None:
    assert round_lengths(10, [1.0, 0.5, 0.26, 0.25, 0.04, 0.01]) == [10, 5, 3, 3, 1, 1]  # round half up, at least 1
    assert round_lengths(50, [2.0, 2.0]) == [50, 50]
    assert round_lengths(8, [3.0, 1.0, 1.5]) == [8, 3, 4]  # relative to the fastest, whichever it is


@pytest.mark.parametrize("h", [1, 4, 6, 10])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_steps_by_tick_meets_every_fragment_offset_of_the_worker(h: int, p: int) -> None:
    """At fragment q's sync tick round(qH/P) a worker of H_m steps has run round(q H_m / P), its own offset;
    its count never falls and ends at H_m; a worker at H steps at every tick."""
    if p > h:
        return
    for own in range(1, h + 1):
        done = steps_by_tick(h, p, own)
        assert len(done) == h + 1 and done[0] == 0 and done[-1] == own
        assert all(b >= a for a, b in zip(done, done[1:], strict=False))
        for tick, mine in zip(fragment_offsets(h, p), fragment_offsets(own, p), strict=True):
            assert done[tick] == mine, (own, tick)
    assert steps_by_tick(h, p, h) == list(range(h + 1))


def test_the_speed_meter_averages_and_one_slow_step_moves_it_little() -> None:
    meter = SpeedMeter(decay=0.5)
    for _ in range(5):
        meter.add(0.5)
    assert meter.steps_per_s == 2.0
    meter.add(100.0)  # a checkpoint or a page fault: counted as twice the median
    assert meter.steps_per_s == 1 / (0.5 * 0.5 + 0.5 * 1.0)
    fresh = SpeedMeter(decay=0.5)
    fresh.load(meter.state())
    assert fresh.steps_per_s == meter.steps_per_s


# ---------------------------------------------------------------- equal speeds: the method without the flag


METHODS = {
    "diloco": {"method": "diloco"},
    "streaming": {"method": "streaming", "fragments": 2, "overlap_steps": 1, "alpha": 0.5},
    "delayed": {"method": "delayed", "eager_rounds": 2},
    "eager": {"method": "eager"},
    "eager-stale": {"method": "eager", "eager_weighting": "stale_average", "eager_rounds": 2},
    "eager-sparse-ef": {"method": "eager", "topk": 2, "topk_chunk": 4, "codec": "int8", "error_feedback": 0.9},
    "streaming-ef": {"method": "streaming", "fragments": 2, "topk": 1, "topk_chunk": 3, "error_feedback": 0.5},
}


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("speeds", [[1.0, 1.0, 1.0], []], ids=["given", "measured"])
def test_equal_speeds_are_the_method_without_the_flag_bit_for_bit(name: str, speeds: list[float]) -> None:
    """Three workers of equal speed on different data: every outer copy and model, tick by tick, is the one of
    the method without --adaptive-steps (measured: the speeds exchange lands, every H_m is H)."""
    base = {"inner_steps": 4, **METHODS[name]}
    torch.manual_seed(0)
    init = Toy()
    grads = seeded_grads(3)
    plain = _inprocess(OuterConfig(**base), 3, grads, init)
    adaptive = _inprocess(OuterConfig(**base, adaptive_steps=True, worker_speeds=speeds), 3, grads, init)
    for _ in range(6 * 4):
        plain.tick()
        adaptive.tick()
        for a, b in zip(_state(plain), _state(adaptive), strict=True):
            assert torch.equal(a, b)
    assert adaptive.own == plain.own == [24, 24, 24]
    assert all(plan == [[4, 4, 4]] * 3 for plan in adaptive.plans)
    assert [c.stats.bytes_sent for c in plain.comms] == [c.stats.bytes_sent for c in adaptive.comms] or not speeds


# ---------------------------------------------------------------- given speeds: H_m and the weighted mean

SPEEDS = [1.0, 0.5, 0.25, 0.25]
GS = [torch.tensor([4.0, 8.0, -16.0]), torch.tensor([8.0, -8.0, 32.0]), torch.tensor([-16.0, 64.0, 8.0]),
      torch.tensor([32.0, 16.0, -64.0])]


def _weighted(lengths: list[int]) -> torch.Tensor:
    """D = sum_m w_m Delta_m with Delta_m = n_m * eta * g_m, w_m = n_m / sum n."""
    total = sum(lengths)
    return sum((n / total) * (n * ETA * g) for n, g in zip(lengths, GS, strict=True))  # type: ignore[return-value]


def test_given_speeds_run_h_m_steps_and_the_mean_is_token_weighted() -> None:
    """DiLoCo, H = 4, speeds 1, 1/2, 1/4, 1/4: H_m = 4, 2, 1, 1 every round; each round the outer copy (the
    same on every worker) moves by exactly sum_m w_m Delta_m with w = 1/2, 1/4, 1/8, 1/8."""
    cfg = OuterConfig(method="diloco", inner_steps=4, adaptive_steps=True, worker_speeds=SPEEDS, **PLAIN)
    t = _inprocess(cfg, 4, _constant(GS))
    lengths = round_lengths(4, SPEEDS)
    assert lengths == [4, 2, 1, 1]
    for r in range(1, 4):
        t.run(4)
        assert t.own == [n * r for n in lengths]
        expected = START - r * _weighted(lengths)
        for sync in t.syncs:
            assert torch.equal(sync.outer[0][0].view(-1), expected)
    assert t.plans == [[lengths] * 4] * 3
    sizes = {c.stats.bytes_sent for c in t.comms}
    assert sizes == {3 * (2 * 3 * 12 // 4)}  # fp32 ring: 2(M-1)/M of 12 bytes per round, as without the flag


def test_streaming_fragments_weigh_their_own_windows() -> None:
    """Streaming, P = 2, H = 4, speeds 1 and 1/4 (H_m = 4, 1): fragment 1 syncs at tick 2, where the slow worker
    has run round(1/2) = 1 step; each fragment's weights are the workers' steps since its last sync."""
    torch.manual_seed(0)
    cfg = OuterConfig(method="streaming", fragments=2, inner_steps=4, adaptive_steps=True,
                      worker_speeds=[1.0, 0.25], **PLAIN)
    t = _inprocess(cfg, 2, seeded_grads(5), Toy(num_blocks=2))
    windows = []
    for sync in t.syncs:
        original = sync.adaptive.weigh  # type: ignore[union-attr]

        def spy(p: int, original: Callable = original, sync: OuterSync = sync) -> tuple[float, float]:
            windows.append((sync.comm.rank, sync.step, p, list(sync.adaptive.rounds.done)))  # type: ignore[union-attr]
            return original(p)

        sync.adaptive.weigh = spy  # type: ignore[method-assign, union-attr]
    t.run(8)
    # (worker, tick, fragment, each worker's steps so far): fragment 1 at ticks 2 and 6, fragment 0 at 4 and 8.
    assert windows[::2] == [(0, 2, 1, [2, 1]), (0, 4, 0, [4, 1]), (0, 6, 1, [6, 2]), (0, 8, 0, [8, 2])]
    assert t.own == [8, 2]


# ---------------------------------------------------------------- eager and error feedback, one worker scripted


def _one(method: str, comm: ScriptedCommunicator, g: torch.Tensor, **cfg: object) -> _Ticks:
    config = OuterConfig(method=method, inner_steps=3, adaptive_steps=True, worker_speeds=[1.0, 1 / 3], **PLAIN,
                         **cfg)  # type: ignore[arg-type]
    gs = [g, g]
    return _Ticks(config, [_linear()], [comm], lambda m, n, name, p: gs[1].view(p.shape).clone())


@pytest.mark.parametrize("weighting", ["nonlocal", "stale_average"])
def test_eager_weighs_its_own_share_by_its_tokens(weighting: str) -> None:
    """The slow worker (rank 1 of 2, speeds 1 and 1/3, H = 3: H_m = 3 and 1, w = 3/4 and 1/4) sends half its
    outer gradient d (M w_1 = 1/2) and applies d/4 at once; the correction a round later is the others' weighted
    share: nonlocal, the mean less its own (= 3/4 of the peer's P); stale_average, 3/4 of the mean."""
    g = torch.tensor([2.0, -4.0, 8.0])
    d = 1 * ETA * g  # one inner step a round
    peer = torch.tensor([4.0, -8.0, 16.0])  # the peer's outer gradient every round; it sends 3/2 of it
    comm = ScriptedCommunicator(num_workers=2, rank=1, peers=lambda i: [[(1.5 * peer).view(1, 3)]])
    t = _one("eager", comm, g, eager_weighting=weighting)
    rounds = 3
    t.run(3 * rounds)
    assert t.own == [rounds]
    assert all(torch.equal(c.tensors[0].view(-1), 0.5 * d) for c in comm.calls)
    mean = (0.5 * d + 1.5 * peer) / 2
    late = 0.75 * peer if weighting == "nonlocal" else 0.75 * mean
    assert torch.equal(t.syncs[0].outer[0][0].view(-1), START - rounds * d / 4 - (rounds - 1) * late)


def test_error_feedback_keeps_what_it_did_not_send_unweighted() -> None:
    """With error feedback the buffer update is unchanged (e <- beta e + Delta); what is sent is M w_m e, and
    the buffer loses what was sent divided by that factor: nothing is lost, nothing counted twice."""
    g = torch.tensor([2.0, -4.0, 8.0])
    d = ETA * g
    comm = ScriptedCommunicator(num_workers=2, rank=1)
    t = _one("diloco", comm, g, topk=1, topk_chunk=3, error_feedback=1.0)
    t.run(3)
    sent = comm.calls[0].tensors[0].view(-1)
    assert torch.equal(sent, 0.5 * d)  # M w_1 = 1/2 of the buffer, all three values
    kept = t.syncs[0].feedback.buffers[0][0].view(-1)  # type: ignore[union-attr]
    assert torch.equal(kept, torch.tensor([1.0, -2.0, 0.0]))  # the largest (4.0, sent as 2.0) left the buffer


def test_the_hook_api_runs_this_worker_s_share_of_every_tick() -> None:
    """outer_loop(adaptive_steps=True) on the user's own loop, ended on ``outer.ticks``: the slow worker (H_m = 1
    of H = 3) takes one step a round, and sends and applies what the explicit calls do, bit for bit."""
    from eagerloco import outer_loop

    g = torch.tensor([2.0, -4.0, 8.0])
    peers = lambda i: [[torch.tensor([[6.0, -12.0, 24.0]])]]  # noqa: E731
    explicit = ScriptedCommunicator(num_workers=2, rank=1, peers=peers)
    t = _one("eager", explicit, g).run(9)
    hooked = ScriptedCommunicator(num_workers=2, rank=1, peers=peers)
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=ETA)
    steps = 0
    config = OuterConfig(method="eager", inner_steps=3, adaptive_steps=True, worker_speeds=[1.0, 1 / 3], **PLAIN)
    with outer_loop(model, opt, config, peers=hooked, blocks=[model[0]]) as outer:
        while outer.ticks < 9:
            opt.zero_grad()
            (model[0].weight.view(-1) * g).sum().backward()
            opt.step()
            steps += 1
        assert torch.equal(outer.sync.outer[0][0], t.syncs[0].outer[0][0])
    assert steps == t.own[0] == 3
    assert [c.tensors[0].tolist() for c in hooked.calls] == [c.tensors[0].tolist() for c in explicit.calls]


# ---------------------------------------------------------------- measured speeds: agreed, a round ahead


def test_measured_speeds_are_agreed_by_every_worker_a_round_ahead() -> None:
    """Three workers whose steps take 1, 2 and 4 s: rounds 1 and 2 run H everywhere (nothing measured has landed
    yet), from round 3 on H_m = 8, 4, 2 on every worker; the speeds exchange is one per round, of M floats."""
    cfg = OuterConfig(method="eager", inner_steps=8, adaptive_steps=True)
    t = _inprocess(cfg, 3, seeded_grads(1), Toy(), step_time=lambda m: float(2**m))
    t.run(8 * 6)
    assert t.plans == [[[8, 8, 8]] * 3] * 2 + [[[8, 4, 2]] * 3] * 4
    assert t.own == [48, 16 + 4 * 4, 16 + 4 * 2]
    assert all(c.stats.num_syncs == 6 for c in t.comms)  # six rounds: six outer syncs (and six speeds)


# ---------------------------------------------------------------- resume


@pytest.mark.parametrize("speeds", [[1.0, 0.5, 0.25], []], ids=["given", "measured"])
def test_state_dict_resumes_bit_for_bit_mid_round(speeds: list[float]) -> None:
    """Eager with k = 2, stopped mid-round (exchanges and the speeds in flight), saved, loaded into new workers:
    the same outer copies, models and rounds as a run never stopped."""
    cfg = OuterConfig(method="eager", inner_steps=4, eager_rounds=2, adaptive_steps=True, worker_speeds=speeds)
    torch.manual_seed(0)
    init = Toy()
    grads, times = seeded_grads(2), (lambda m: float(m + 1))
    whole = _inprocess(cfg, 3, grads, init, times).run(4 * 5 + 2)
    cut = _inprocess(cfg, 3, grads, init, times).run(4 * 3 + 2)
    saved = [(copy.deepcopy(m.state_dict()), s.state_dict(), c.clock(), copy.deepcopy(c.stats))
             for m, s, c in zip(cut.models, cut.syncs, cut.comms, strict=True)]
    group = cut.comms[0].group  # type: ignore[attr-defined]
    link = group.state_dict()
    resumed = _inprocess(cfg, 3, grads, init, times)
    resumed.comms[0].group.load_state_dict(link)  # type: ignore[attr-defined]
    for m, s, c, (model_state, sync_state, clock, stats) in zip(resumed.models, resumed.syncs, resumed.comms, saved,
                                                                strict=True):
        m.load_state_dict(model_state)
        s.load_state_dict(sync_state)
        c.set_clock(clock)
        c.stats = stats
    resumed.own = list(cut.own)
    resumed.run(4 * 2)
    for a, b in zip(_state(whole), _state(resumed), strict=True):
        assert torch.equal(a, b)
    assert [s.adaptive.rounds.state() for s in whole.syncs] == [s.adaptive.rounds.state() for s in resumed.syncs]  # type: ignore[union-attr]


def _sync(cfg: OuterConfig) -> OuterSync:
    model = _linear()
    return OuterSync(model, None, ScriptedCommunicator(2), cfg, blocks=[model[0]])


def test_a_checkpoint_of_the_other_setting_is_refused() -> None:
    on, off = (_sync(OuterConfig(adaptive_steps=a, worker_speeds=[1.0, 1.0] if a else [])) for a in (True, False))
    with pytest.raises(ValueError, match="--adaptive-steps on and this run has it off"):
        off.load_state_dict(on.state_dict())
    with pytest.raises(ValueError, match="--adaptive-steps off and this run has it on"):
        on.load_state_dict(off.state_dict())


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize(("kwargs", "text"), [
    ({"worker_speeds": [1.0, 0.0]}, "--worker-speeds must be positive numbers"),
    ({"worker_speeds": [1.0, float("nan")]}, "--worker-speeds must be positive numbers"),
    ({"method": "dp", "adaptive_steps": True}, "--adaptive-steps sizes outer rounds"),
])
def test_bad_settings_name_the_flag(kwargs: dict, text: str) -> None:
    with pytest.raises(ConfigError, match=text):
        OuterConfig(**kwargs).validate()


def test_speeds_for_another_number_of_workers_are_refused() -> None:
    with pytest.raises(ConfigError, match="gives 3 speed\\(s\\) for 2 workers"):
        _sync(OuterConfig(adaptive_steps=True, worker_speeds=[1.0, 1.0, 1.0]))


def test_the_flags_read_a_comma_list_and_combine_with_elastic() -> None:
    from eagerloco.cli import make_parser
    from eagerloco.environment import Environment
    from eagerloco.flags import build_train_config

    def parse(*args: str, env: Environment | None = None):  # noqa: ANN202 - a TrainConfig
        return build_train_config(make_parser().parse_args(["train", "--workers", "2", *args]), env)

    cfg = parse("--adaptive-steps", "--worker-speeds", "1,0.5")
    assert cfg.outer.adaptive_steps and cfg.outer.worker_speeds == [1.0, 0.5]
    assert [cfg.slowdown(m) for m in range(2)] == [1.0, 2.0]
    with pytest.raises(ConfigError, match="gives 3 speed"):
        parse("--worker-speeds", "1,0.5,1")
    launched = Environment(rank=1, world_size=2, master_addr="127.0.0.1", master_port=29500, workers=2,
                           ranks_per_worker=1)
    elastic = parse("--adaptive-steps", "--worker-speeds", "1,0.5", "--elastic", env=launched)
    assert elastic.runtime.kind(launched) == "elastic" and elastic.outer.adaptive_steps  # weights renormalised
    with pytest.raises(ConfigError, match="under --fsdp every rank exchanges its own"):
        parse("--adaptive-steps", "--fsdp")
    with pytest.raises(SystemExit):
        parse("--worker-speeds", "1,fast")


# ---------------------------------------------------------------- the simulator


def _simulate(*flags: str) -> dict:
    import argparse

    from eagerloco.sim.cli import add_arguments, compute
    from eagerloco.sim.config import SimConfig

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return compute(SimConfig.from_args(parser.parse_args(list(flags))).validate())[0]


def test_the_simulator_predicts_each_worker_s_utilization_with_and_without_adaptive_steps() -> None:
    """Without a link limit: a fixed H leaves worker m busy r_m / r_min of the slowest's round (1/4, 1/2, 1); with
    adaptive steps (H_m = 8, 4, 2) every worker computes the whole round. Speeds 1 and 0.35 at H = 10 give H_m = 4,
    4/0.35 = 11.43 fast-steps of compute: that worker paces the round and the fastest computes 10/11.43 of it."""
    report = _simulate("--model", "1b", "--workers", "3", "--worker-speeds", "1,0.5,0.25", "--method", "diloco",
                       "--inner-steps", "8", "--bandwidth-gbps", "inf")
    cus = report["models"][0]["rows"][0]["cu_per_worker"]
    assert cus["fixed"]["inf"] == pytest.approx([0.25, 0.5, 1.0])
    assert cus["adaptive"]["inf"] == pytest.approx([1.0, 1.0, 1.0])
    rounded = _simulate("--model", "1b", "--workers", "2", "--worker-speeds", "1,0.35", "--method", "eager",
                        "--inner-steps", "10", "--bandwidth-gbps", "1e6")
    cus = rounded["models"][0]["rows"][0]["cu_per_worker"]
    assert cus["adaptive"]["1000000.0"] == pytest.approx([10 / (4 / 0.35), 1.0], rel=1e-6)
    assert cus["fixed"]["inf"] == pytest.approx([0.35, 1.0])


@pytest.mark.parametrize(("speeds", "text"), [("1,0.5", "gives 2 speed\\(s\\) for --workers 3"),
                                              ("1,0,1", "must be positive"), ("1,fast,1", "takes numbers")])
def test_the_simulator_refuses_bad_speeds(speeds: str, text: str) -> None:
    from eagerloco.config import ConfigError

    with pytest.raises(ConfigError, match=text):
        _simulate("--workers", "3", "--worker-speeds", speeds)


# ---------------------------------------------------------------- the trainer


@pytest.mark.slow
@pytest.mark.parametrize("speeds", [["--worker-speeds", "1,0.5"], ["--slow-worker", "1:2"]], ids=["given", "measured"])
def test_an_interrupted_in_process_run_resumes_to_the_same_numbers(tmp_path, monkeypatch, speeds) -> None:  # noqa: ANN001
    """`eagerloco train --adaptive-steps` in this process, stopped right after the step-12 checkpoint (mid-run:
    exchanges and speeds in flight under eager k = 2), resumed: the same losses and final state as a run never
    stopped; the slow worker ran fewer steps and the tokens count them."""
    from eagerloco.cli import make_parser
    from eagerloco.flags import build_train_config
    from eagerloco.train import train

    args = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "2", "--no-progress",
            "--workers", "2", "--inner-steps", "4", "--log-every", "2", "--sim-step-time", "0.05", "--steps", "24",
            "--checkpoint-every", "6", "--method", "eager", "--eager-rounds", "2", "--adaptive-steps", *speeds]

    def cfg(out, *more):  # noqa: ANN001, ANN202
        return build_train_config(make_parser().parse_args(["train", *args, "--out", str(out), *more]))

    clean = train(cfg(tmp_path / "clean"))
    stop_after_checkpoint(monkeypatch, 12, lambda: train(cfg(tmp_path / "cut")))
    resumed = train(cfg(tmp_path / "cut", "--resume"))
    assert clean is not None and resumed is not None
    assert clean["final_eval_loss"] == resumed["final_eval_loss"]
    assert clean["worker_steps"] == resumed["worker_steps"]
    expected = [24, 12] if speeds[0] == "--worker-speeds" else [24, 8 + 8]  # measured: rounds 3 on at H_m = 2
    assert clean["worker_steps"] == expected and clean["tokens"] == sum(expected) * 2 * 32
    lines = [json.loads(x) for x in (tmp_path / "clean" / "metrics.jsonl").read_text().splitlines()]
    again = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [x["loss"] for x in lines] == [x["loss"] for x in again]
