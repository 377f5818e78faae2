"""The end of an eager run: every worker ends with the same model, the mean of their outer parameters."""

from __future__ import annotations

import torch
from conftest import plain_sgd_outer, run_inprocess, seeded_grads

from eagerloco.config import OuterConfig


def test_eager_workers_end_with_one_model_the_mean_of_their_outer_parameters() -> None:
    cfg = OuterConfig(method="eager", inner_steps=2, eager_rounds=1, **plain_sgd_outer(0.7))
    models, syncs, _, _ = run_inprocess(cfg, workers=3, steps=8, grads=seeded_grads(1))
    for s in syncs:
        s.drain(apply=True)
    before = [[t.clone() for frag in s.outer for t in frag] for s in syncs]
    assert not all(torch.equal(a, b) for a, b in zip(before[0], before[1], strict=True))  # eager: they differ
    handles = [s.launch_consensus() for s in syncs]  # lockstep: every worker launches, then every one waits
    for s, h in zip(syncs, handles, strict=True):
        s.finish_consensus(h)
    mean = [(a + b + c) / 3 for a, b, c in zip(*before, strict=True)]
    for s, m in zip(syncs, models, strict=True):
        outer = [t for frag in s.outer for t in frag]
        assert all(torch.allclose(o, want, rtol=0, atol=1e-6) for o, want in zip(outer, mean, strict=True))
        assert all(torch.equal(o, first) for o, first in zip(outer, [t for f in syncs[0].outer for t in f],
                                                             strict=True))
        assert all(torch.equal(p, o) for p, o in zip(m.parameters(), s.outer_parameters(), strict=True))


def test_the_other_methods_end_with_one_model_already_and_exchange_nothing_more() -> None:
    cfg = OuterConfig(method="diloco", inner_steps=2, **plain_sgd_outer(0.7))
    _, syncs, group, _ = run_inprocess(cfg, workers=2, steps=4, grads=seeded_grads(2))
    sent = [group.communicator(m).stats.num_syncs for m in range(2)]
    assert [s.launch_consensus() for s in syncs] == [[], []]
    assert [group.communicator(m).stats.num_syncs for m in range(2)] == sent
