"""The guided shared support (``--support-guided F``, section 7 of docs/algorithms.md): a share of each chunk's K
positions taken from the largest entries of the last mean every worker received, the rest drawn. The positions
against their definition, the same mean on every worker (in-process and over gloo), error feedback through whole
rounds against a replay, checkpoints, the settings, and the bytes of the random rule."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import plain_sgd_outer, run_inprocess, seeded_grads
from gloo_threads import group, run_ranks

from eagerloco.codec_sizes import reduce_scatter_wire_bytes, sparse_counts
from eagerloco.codecs import SharedSupportCodec, get_codec
from eagerloco.comm.base import flatten
from eagerloco.comm.distributed import TorchDistCommunicator
from eagerloco.comm.inprocess import InProcessGroup
from eagerloco.config import ConfigError, OuterConfig, TrainConfig
from eagerloco.train.agree import agreed_settings

NUMEL = 5000  # a partial last chunk of 904 values
CHUNK, K = 1024, 32


def _guide() -> torch.Tensor:
    """A mean as a shared support leaves it: nonzero at 40 positions of every chunk, zero elsewhere."""
    g = torch.Generator().manual_seed(7)
    guide = torch.zeros(NUMEL)
    for start in range(0, NUMEL, CHUNK):
        length = min(CHUNK, NUMEL - start)
        at = torch.randperm(length, generator=g)[:40] + start
        guide[at] = torch.randn(40, generator=g)
    return guide


def _codec(values: str, guide: torch.Tensor | None, step: int = 3, guided: float = 0.5) -> SharedSupportCodec:
    c = get_codec(values, topk=K, chunk=CHUNK, shared=True, guided=guided).for_step(step, guide)
    assert isinstance(c, SharedSupportCodec)
    return c


def test_the_guide_s_largest_come_first_and_the_rest_is_drawn() -> None:
    guide = _guide()
    support = _codec("2bit", guide).support(NUMEL)
    assert torch.equal(support, _codec("fp32", guide.clone()).support(NUMEL))  # alike wherever the guide is equal
    assert torch.equal(torch.bincount(support // CHUNK), torch.full((5,), K))
    assert bool((support.diff() > 0).all())
    chosen = torch.zeros(NUMEL, dtype=torch.bool)
    chosen[support] = True
    for start in range(0, NUMEL, CHUNK):
        mag = guide[start:start + CHUNK].abs()
        top = mag.topk(K // 2).indices + start
        assert bool(chosen[top].all())  # the 16 largest of the guide
        assert int(chosen[start:start + CHUNK][mag > 0].sum()) < 40  # not merely every nonzero of it
    # The drawn half moves with the step; the guided half does not.
    other = _codec("2bit", guide, step=4).support(NUMEL)
    assert not torch.equal(support, other)
    assert len(set(support.tolist()) & set(other.tolist())) >= 5 * K // 2


def test_without_a_guide_or_a_share_it_is_the_random_rule() -> None:
    random = get_codec("2bit", topk=K, chunk=CHUNK, shared=True).for_step(3).support(NUMEL)
    assert torch.equal(_codec("2bit", None).support(NUMEL), random)  # the first round: no mean yet
    assert torch.equal(_codec("2bit", _guide(), guided=0.0).support(NUMEL), random)
    assert torch.equal(_codec("2bit", torch.zeros(NUMEL)).support(NUMEL), random)  # zeros guide nothing
    with pytest.raises(ValueError, match="guide holds 10 values"):
        _codec("2bit", torch.ones(10)).support(NUMEL)


def _inputs(workers: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(NUMEL, generator=g) * (1 + m) for m in range(workers)]


def test_every_worker_gets_the_mean_of_what_each_sent_and_the_random_rule_s_bytes() -> None:
    """Each worker builds its codec from its own copy of the guide: one mean for all, that of their own shares
    at the guided support (FP32 values: exactly), and the bytes of the random rule at the same K."""
    workers = 4
    x = _inputs(workers)
    grp, random_grp = InProcessGroup(workers), InProcessGroup(workers)
    codecs = [_codec("fp32", _guide()) for _ in range(workers)]
    handles = [grp.communicator(m).allreduce_mean([x[m]], codecs[m], transport="shared-support")
               for m in range(workers)]
    random = [random_grp.communicator(m).allreduce_mean([x[m]], _codec("fp32", None), transport="shared-support")
              for m in range(workers)]
    for h in random:
        h.wait()
    means = [h.wait()[0] for h in handles]
    support = codecs[0].support(NUMEL)
    total = handles[0].own[0].clone()
    for h in handles[1:]:
        total += h.own[0]
    for m in range(workers):
        assert torch.equal(means[m], total / workers)
        assert torch.equal(handles[m].own[0][support], x[m][support])
    kept = sparse_counts(NUMEL, CHUNK, K)[0]
    for comm, random_comm in zip(grp.communicators, random_grp.communicators, strict=True):
        assert comm.stats.bytes_sent == random_comm.stats.bytes_sent == reduce_scatter_wire_bytes("fp32", kept, workers)


def test_gloo_gives_the_in_process_mean() -> None:
    workers = 3

    def worker(rank: int, store: dist.Store) -> torch.Tensor:
        with TorchDistCommunicator(group(store, "guided", rank, workers), timeout_s=20) as comm:
            return comm.allreduce_mean([_inputs(workers)[rank]], _codec("2bit", _guide()),
                                       transport="shared-support").wait()[0]

    grp = InProcessGroup(workers)
    handles = [grp.communicator(m).allreduce_mean([x], _codec("2bit", _guide()), transport="shared-support")
               for m, x in enumerate(_inputs(workers))]
    for rank, mean in enumerate(run_ranks(worker, workers)):
        assert torch.equal(mean, handles[rank].wait()[0])


def test_whole_rounds_against_a_replay_lose_nothing() -> None:
    """Three DiLoCo rounds, FP32 values, error feedback 1, outer SGD of lr 1: every round's support is the one its
    definition gives from the last round's mean, alike on all workers; each worker's buffer plus all it sent is
    all its outer gradients, and the outer copies moved by the sum of the means."""
    workers, h, rounds, eta = 3, 2, 3, 0.1
    grads = seeded_grads(4)
    cfg = OuterConfig(method="diloco", inner_steps=h, codec="fp32", topk=4, topk_chunk=8, error_feedback=1.0,
                      transport="shared-support", support_guided=0.5, **plain_sgd_outer(1.0))
    _, syncs, _, init = run_inprocess(cfg, workers, h * rounds, grads, inner_lr=eta)
    names = syncs[0].fragment_names[0]
    shapes = dict(init.named_parameters())

    def delta(m: int, r: int) -> torch.Tensor:  # the gradients ignore the parameters: the round's outer gradient
        return torch.cat([(eta * sum(grads(m, s, n, torch.zeros(shapes[n].shape))
                                     for s in range(r * h + 1, r * h + h + 1))).reshape(-1) for n in names])

    buffers = [torch.zeros_like(delta(0, 0)) for _ in range(workers)]
    guide, moved = None, torch.zeros_like(buffers[0])
    for r in range(rounds):
        c = SharedSupportCodec(get_codec("fp32"), 8, 4, seed=(r + 1) * h, guided=0.5, guide=guide)
        sent = []
        for m in range(workers):
            buffers[m] += delta(m, r)
            sent.append(c.spread(buffers[m][c.support(buffers[m].numel())], buffers[m].numel()))
            buffers[m] -= sent[m]
        guide = sum(sent[1:], sent[0].clone()) / workers
        moved += guide
    assert guide is not None and int((guide != 0).sum()) == 7 * 4  # 6 chunks of 8 and one of 6, 4 kept of each
    theta0 = torch.cat([shapes[n].detach().reshape(-1) for n in names])
    for m in range(workers):
        torch.testing.assert_close(flatten(syncs[m].feedback.buffers[0]), buffers[m], rtol=0, atol=1e-6)
        torch.testing.assert_close(syncs[m].guides[0], guide, rtol=0, atol=1e-6)
        assert torch.equal(syncs[m].guides[0], syncs[0].guides[0])
        torch.testing.assert_close(flatten(syncs[m].outer[0]), theta0 - moved, rtol=0, atol=1e-6)


@pytest.mark.parametrize("method,extra", [("streaming", {"fragments": 2, "overlap_steps": 1}), ("eager", {})])
def test_other_methods_choose_alike_and_resume_with_their_guides(method: str, extra: dict) -> None:
    """Streaming's fragments and eager's stale means: every worker holds the same guides, and a checkpoint
    carries them (a resumed run chooses the positions the continuing one does)."""
    cfg = OuterConfig(method=method, inner_steps=4, codec="2bit", topk=2, topk_chunk=8, error_feedback=0.95,
                      transport="shared-support", support_guided=0.5, **extra)
    _, syncs, _, _ = run_inprocess(cfg, 3, 16, seeded_grads(5))
    for p, guide in enumerate(syncs[0].guides):
        assert guide is not None and bool(guide.any())
        for s in syncs[1:]:
            assert torch.equal(s.guides[p], guide)
    _, fresh, _, _ = run_inprocess(cfg, 3, 0, seeded_grads(5))
    fresh[0].load_state_dict(syncs[0].state_dict())
    for a, b in zip(fresh[0].guides, syncs[0].guides, strict=True):
        assert torch.equal(a, b)


def test_settings() -> None:
    """Bad shares and a share without the shared support are refused; jobs agree on F before the first exchange."""
    assert agreed_settings(TrainConfig(outer=OuterConfig(codec="2bit", topk=64, transport="shared-support",
                                                         support_guided=0.5)))["--support-guided"] == 0.5
    OuterConfig(codec="2bit", topk=64, transport="shared-support", support_guided=0.5).validate()
    for bad in (1.0, -0.1, float("nan"), True):
        with pytest.raises(ConfigError, match="--support-guided must be a share in"):
            OuterConfig(codec="2bit", topk=64, transport="shared-support", support_guided=bad).validate()
    with pytest.raises(ConfigError, match="--support-guided chooses the positions of --transport shared-support"):
        OuterConfig(codec="2bit", topk=64, support_guided=0.5).validate()
