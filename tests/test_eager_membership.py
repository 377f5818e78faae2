"""Eager across a membership change, in closed form: a joiner that takes a member's state applies that member's
pending correction once, and every worker's outer gradient counts once with the M of its round."""

from __future__ import annotations

import torch

from eagerloco.comm.base import Communicator, ReadyHandle, WorkerStats, flatten
from eagerloco.config import OuterConfig
from eagerloco.outer import OuterSync


class _Comm(Communicator):
    """One worker's communicator whose round means are given (the members' outer gradients and the scripted
    others', over the M of the round); num_workers is set by the test."""

    def __init__(self, means: list[torch.Tensor], first_round: int = 0) -> None:
        self.rank, self.num_workers, self.stats = 0, 1, WorkerStats()
        self.means, self.round = means, first_round

    def allreduce_mean(self, tensors, codec, generator=None, *, keep_own=True):  # type: ignore[no-untyped-def]
        own = flatten(tensors)
        mean = self.means[self.round]
        self.round += 1
        return ReadyHandle(self, [mean.view(tensors[0].shape)], [own.view(tensors[0].shape)], 0, None)


def _worker(comm: _Comm) -> tuple[torch.nn.Sequential, OuterSync]:
    model = torch.nn.Sequential(torch.nn.Linear(3, 1, bias=False))
    cfg = OuterConfig(method="eager", inner_steps=1, outer_lr=1.0, outer_momentum=0.0, outer_nesterov=False)
    return model, OuterSync(model, None, comm, cfg, blocks=[model[0]])


def test_a_joiner_applies_its_source_s_pending_correction_once_and_counts_from_its_first_round() -> None:
    """Rounds 0-2: worker S with two others (M = 3); S hands its state to J at the end of round 2, whose exchange
    is still in flight; rounds 3-4: S, J and two others (M = 4). With plain outer SGD (lr 1) both end, after
    draining, at the start minus the sum of the rounds' means: S's round-2 share is corrected once on J too
    (J's outer copy holds it), and J's own gradients count from round 3."""
    torch.manual_seed(0)
    own_s = [torch.randn(3) for _ in range(5)]
    own_j = {r: torch.randn(3) for r in (3, 4)}
    others = [torch.randn(2, 3) for _ in range(5)]
    means = [(own_s[r] + others[r].sum(0)) / 3 for r in range(3)]
    means += [(own_s[r] + own_j[r] + others[r].sum(0)) / 4 for r in (3, 4)]

    s_comm = _Comm(means)
    s_model, s = _worker(s_comm)
    start = s_model[0].weight.detach().clone().view(-1)
    j_comm = _Comm(means, first_round=3)
    j_model, j = _worker(j_comm)

    def round_(model: torch.nn.Sequential, sync: OuterSync, step: torch.Tensor) -> None:
        with torch.no_grad():
            model[0].weight -= step.view(1, 3)  # the inner progress of the round: Delta = step exactly
        sync.after_inner_step()

    s_comm.num_workers = 3
    for r in range(3):
        round_(s_model, s, own_s[r])
    j_model.load_state_dict(s_model.state_dict())  # the handover, as comm/elastic.py sends it
    j.load_state_dict(s.state_dict())
    assert len(j.in_flight) == 1 and j.in_flight[0].workers == 3  # round 2's exchange, its M with it
    s_comm.num_workers = j_comm.num_workers = 4
    for r in (3, 4):
        round_(s_model, s, own_s[r])
        round_(j_model, j, own_j[r])
    expected = start - sum(means, torch.zeros(3))
    for sync in (s, j):
        sync.drain(apply=True)
        torch.testing.assert_close(sync.outer[0][0].view(-1), expected, rtol=1e-6, atol=1e-6)
