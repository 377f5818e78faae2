"""OuterSync against a scripted communicator: no processes, exact closed forms.

The toy: one linear layer whose loss is ``(w * g).sum()``, so the inner gradient is the constant g
and H inner SGD steps of lr eta move a worker that starts a round at the outer copy by exactly
d = H * eta * g. Its outer gradient is d every round, whatever the parameters, so every expected
outer copy below is a hand-computed sum. The values are small multiples of powers of two (and of
three where a third is taken), so the float results are exact and compared with torch.equal.
Outer optimizer: plain SGD with lr 1, so an outer step subtracts its outer gradient.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from eagerloco.comm.errors import PeerError
from eagerloco.config import OuterConfig
from eagerloco.outer import OuterSync
from testing.scripted import ScriptedCommunicator

H, ETA = 2, 0.5
G = torch.tensor([3.0, 6.0, 12.0])  # the constant inner gradient
D = H * ETA * G  # this worker's outer gradient of every round: (3, 6, 12)
START = torch.tensor([1.0, 2.0, 3.0])


def _worker(method: str, comm: ScriptedCommunicator, **cfg: object) -> tuple[nn.Sequential, OuterSync,
                                                                             torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(3, 1, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(START.view(1, 3))
    inner = torch.optim.SGD(model.parameters(), lr=ETA)
    config = OuterConfig(method=method, inner_steps=H, outer_lr=1.0, outer_momentum=0.0, outer_nesterov=False,
                         **cfg)  # type: ignore[arg-type]
    return model, OuterSync(model, inner, comm, config, blocks=[model[0]]), inner


def _steps(model: nn.Sequential, sync: OuterSync, inner: torch.optim.Optimizer, comm: ScriptedCommunicator,
           n: int) -> None:
    """n inner steps of 1 s of (simulated) compute each, with the outer calls around the optimizer step."""
    for _ in range(n):
        inner.zero_grad()
        (model[0].weight.view(-1) * G).sum().backward()
        sync.before_inner_step()
        inner.step()
        comm.add_compute(1.0)
        sync.after_inner_step()


def _outer(sync: OuterSync) -> torch.Tensor:
    return sync.outer[0][0].detach().view(-1).clone()


def test_preset_means_are_what_the_outer_step_applies_and_every_call_is_recorded() -> None:
    """DiLoCo, blocking: each round's outer step subtracts exactly the mean the communicator returned."""
    m0, m1 = torch.tensor([0.5, -1.0, 2.0]), torch.tensor([4.0, 0.25, -8.0])
    comm = ScriptedCommunicator(num_workers=2, means={0: [m0.view(1, 3)], 1: [m1.view(1, 3)]})
    model, sync, inner = _worker("diloco", comm)
    _steps(model, sync, inner, comm, 2 * H)
    assert torch.equal(_outer(sync), START - m0 - m1)
    assert torch.equal(model[0].weight.detach().view(-1), START - m0 - m1)  # alpha 0: local = outer
    assert [c.index for c in comm.calls] == [0, 1] and comm.waits == [0, 1]
    # What was passed: this worker's outer gradient, outer copy minus local, both rounds.
    assert torch.equal(comm.calls[0].tensors[0].view(-1), D)
    assert torch.equal(comm.calls[1].tensors[0].view(-1), (START - m0) - (START - m0 - D))
    assert all(c.codec.name == "fp32" and c.numel == 3 and c.payload_bytes == 12 for c in comm.calls)
    assert [c.keep_own for c in comm.calls] == [False, False]  # only eager reads its own share back


def test_drain_waits_for_what_is_in_flight_and_apply_counts_every_outer_gradient_once() -> None:
    """Eager with M = 2 and a peer whose outer gradient is P every round; exchanges take 3 s.

    Before the drain (R = 3 rounds): start - R*d/2 - (R-1)*P/2 (the last round's peer share is in
    flight). drain(apply=True) adds the last mean less the own share already applied: every outer
    gradient counted once, start - R*(d+P)/2. The last exchange, launched at t = 7 s, lands at 10 s.
    """
    p = torch.tensor([4.0, -2.0, 8.0])
    rounds = 3
    finals = {}
    for apply in (False, True):
        comm = ScriptedCommunicator(num_workers=2, peers=lambda i: [[p.view(1, 3)]], durations=3.0)
        model, sync, inner = _worker("eager", comm)
        _steps(model, sync, inner, comm, rounds * H)
        before = _outer(sync)
        assert torch.equal(before, START - rounds * D / 2 - (rounds - 1) * p / 2)
        assert [x.launch_step for x in sync.in_flight] == [rounds * H]
        assert comm.waits == [0, 1] and comm.now == 7.0 and comm.stats.blocked_s == 1.0  # #0 landed at 5 s
        sync.drain(apply=apply)
        assert sync.in_flight == [] and comm.waits == [0, 1, 2]
        assert all(c.waited for c in comm.calls)
        assert comm.now == 10.0 and comm.stats.blocked_s == 4.0
        finals[apply] = _outer(sync)
        if apply:
            assert torch.equal(model[0].weight.detach().view(-1), finals[apply])  # merged (alpha 0)
        else:
            assert torch.equal(finals[apply], before)  # waited on, not applied
    assert torch.equal(finals[True], START - rounds * (D + p) / 2)


@pytest.mark.parametrize("weighting", ["nonlocal", "stale_average"])
def test_eager_weights_an_exchange_by_the_workers_present_at_its_launch(weighting: str) -> None:
    """Membership 3 -> 2 between launching round 1's exchange and applying it (round 2).

    Round 1 applies d/3. Round 2's update is d/2 (fresh, M = 2) plus, for round 1's mean D1 (over 3),
    nonlocal: D1 - d/3 (the own share it applied, with the M it applied it with), or
    stale_average: (3-1)/3 * D1. Using today's M = 2 for the correction would be off by d/6.
    """
    peers = [[torch.tensor([6.0, 0.0, -3.0]), torch.tensor([0.0, 3.0, 9.0])],  # round 1: two peers (M = 3)
             [torch.tensor([-4.0, 8.0, 2.0])],  # round 2: one peer (M = 2)
             [torch.tensor([2.0, 2.0, 4.0])]]  # round 3
    comm = ScriptedCommunicator(num_workers=3, peers=lambda i: [[t.view(1, 3)] for t in peers[i]])
    model, sync, inner = _worker("eager", comm, eager_weighting=weighting)
    means = [(D + sum(ps, torch.zeros(3))) / (1 + len(ps)) for ps in peers]  # D1, D2, D3
    _steps(model, sync, inner, comm, H)
    assert torch.equal(_outer(sync), START - D / 3)
    comm.num_workers = 2  # a worker left: round 2 and later have M = 2
    _steps(model, sync, inner, comm, H)
    if weighting == "nonlocal":
        expected = START - D / 3 - (D / 2 + means[0] - D / 3)
    else:
        expected = START - D / 3 - (D / 2 + means[0] * (2 / 3))
    assert torch.allclose(_outer(sync), expected, rtol=0, atol=1e-6)
    _steps(model, sync, inner, comm, H)
    sync.drain(apply=True)
    assert [c.num_workers for c in comm.calls] == [3, 2, 2]
    if weighting == "nonlocal":  # every outer gradient exactly once, with its round's M
        assert torch.allclose(_outer(sync), START - means[0] - means[1] - means[2], rtol=0, atol=1e-6)
    else:  # the own stale share counts again: d/M_t fresh plus (M_t-1)/M_t of each mean
        counted = sum((D / m + means[t] * ((m - 1) / m) for t, m in enumerate((3, 2, 2))), torch.zeros(3))
        assert torch.allclose(_outer(sync), START - counted, rtol=0, atol=1e-6)


def test_a_peer_error_at_wait_propagates_and_leaves_the_outer_state_of_the_last_good_round() -> None:
    """DiLoCo: round 2's exchange fails at wait. The same PeerError reaches the caller; the outer
    copy and outer-optimizer state are those after round 1; the local parameters keep their inner
    progress (no merge with a mean that never came); the failed exchange is not left to be waited
    on again, so drain() and state_dict() go through."""
    error = PeerError("worker 1 is gone", [1])
    comm = ScriptedCommunicator(num_workers=2, fail={1: error})
    model, sync, inner = _worker("diloco", comm)
    _steps(model, sync, inner, comm, H)
    after_round_1 = _outer(sync)
    assert torch.equal(after_round_1, START - D)
    opt_state = sync.outer_opts[0].state_dict()
    _steps(model, sync, inner, comm, H - 1)
    with pytest.raises(PeerError) as raised:
        _steps(model, sync, inner, comm, 1)
    assert raised.value is error and raised.value.workers == [1]
    assert torch.equal(_outer(sync), after_round_1)
    assert sync.outer_opts[0].state_dict() == opt_state
    assert torch.equal(model[0].weight.detach().view(-1), after_round_1 - D)  # H inner steps, not merged
    assert sync.step == 2 * H and sync.in_flight == [] and comm.waits == [0, 1]
    sync.drain(apply=True)
    assert comm.waits == [0, 1] and torch.equal(_outer(sync), after_round_1)
    state = sync.state_dict()
    assert state["step"] == 2 * H and state["in_flight"] == []
    assert torch.equal(state["outer"][0][0].view(-1), after_round_1)


def test_a_peer_error_at_eager_wait_applies_nothing_of_the_round() -> None:
    """Eager: the exchange of round 1, waited at the end of round 2, fails. Round 2 applies nothing
    (not even its own fresh share: the update is one step); the fresh exchange stays in flight."""
    comm = ScriptedCommunicator(num_workers=2, fail=[0])
    model, sync, inner = _worker("eager", comm)
    _steps(model, sync, inner, comm, H)
    assert torch.equal(_outer(sync), START - D / 2)
    with pytest.raises(PeerError, match="scripted failure of exchange #0"):
        _steps(model, sync, inner, comm, H)
    assert torch.equal(_outer(sync), START - D / 2)
    assert [x.launch_step for x in sync.in_flight] == [2 * H] and comm.waits == [0]
