"""The shared-support exchange (``--transport shared-support``, section 7 of docs/algorithms.md): K positions of
every chunk drawn alike by every worker from the round's step, the values alone reduce-scattered. The mean
against closed forms, error feedback, every method, and bytes per worker that do not grow with M, in-process
and over real gloo groups of threads."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import plain_sgd_outer, run_inprocess, seeded_grads
from gloo_threads import group, run_ranks
from toy import Toy

from eagerloco.cli import main
from eagerloco.codec_sizes import packed_nbytes, reduce_scatter_wire_bytes, shard_align, sparse_counts, sparse_nbytes
from eagerloco.codecs import SharedSupportCodec, get_codec
from eagerloco.comm.base import flatten
from eagerloco.comm.distributed import TorchDistCommunicator
from eagerloco.comm.inprocess import InProcessGroup
from eagerloco.comm.link import check_exchange_fits
from eagerloco.config import ConfigError, LinkConfig, OuterConfig, TrainConfig
from eagerloco.model import GPT, model_config
from eagerloco.sim.model import Variant, exchange_wire_bytes

NUMEL = 5000  # a partial last chunk of 904 values
CHUNK, K = 1024, 32


def _codec(values: str, step: int = 3) -> SharedSupportCodec:
    c = get_codec(values, topk=K, chunk=CHUNK, shared=True).for_step(step)
    assert isinstance(c, SharedSupportCodec)
    return c


def _inputs(workers: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=g) * (1 + m) for m in range(workers)]


def _exchange(inputs: list[torch.Tensor], codec: SharedSupportCodec) -> tuple[list, InProcessGroup]:
    grp = InProcessGroup(len(inputs))
    handles = [grp.communicator(m).allreduce_mean([x], codec, transport="shared-support")
               for m, x in enumerate(inputs)]
    return handles, grp


def _sequential_mean(values: list[torch.Tensor]) -> torch.Tensor:
    total = values[0].clone()
    for v in values[1:]:
        total += v
    return total / len(values)


def test_support_is_k_of_every_chunk_the_same_for_a_step_and_new_each_step() -> None:
    a, b, c = _codec("2bit", 3).support(NUMEL), _codec("fp32", 3).support(NUMEL), _codec("2bit", 4).support(NUMEL)
    assert torch.equal(a, b)  # the values' format does not move the positions
    assert not torch.equal(a, c)
    assert a.numel() == sparse_counts(NUMEL, CHUNK, K)[0] == 5 * K
    assert bool((a.diff() > 0).all()) and 0 <= int(a[0]) and int(a[-1]) < NUMEL
    assert torch.equal(torch.bincount(a // CHUNK), torch.full((5,), K))
    short = SharedSupportCodec(get_codec("fp32"), CHUNK, K, seed=1).support(CHUNK + 5)  # last chunk keeps all 5
    assert torch.equal(short[-5:], torch.arange(CHUNK, CHUNK + 5))


@pytest.mark.parametrize("values", ["2bit", "e2m1", "int8", "fp32"])
def test_payload_is_the_values_alone_and_decodes_to_them_at_the_support(values: str) -> None:
    c, x = _codec(values), _inputs(1)[0]
    buf = c.pack(x)
    kept = sparse_counts(NUMEL, CHUNK, K)[0]
    assert buf.numel() == c.packed_nbytes(NUMEL) == packed_nbytes(values, kept)
    assert buf.numel() < sparse_nbytes(values, NUMEL, CHUNK, K)  # top-k carries its positions too
    out = c.unpack(buf, NUMEL)
    support = c.support(NUMEL)
    off = torch.ones(NUMEL, dtype=torch.bool)
    off[support] = False
    assert bool((out[off] == 0).all())
    assert torch.equal(out[support], c.values.unpack(c.values.pack(x[support]), kept))


@pytest.mark.parametrize("workers", [2, 3, 5])
def test_every_worker_gets_the_mean_of_what_each_sent(workers: int) -> None:
    """FP32 values: exactly the mean of the M workers' own shares (summed in worker order). 2-bit values:
    that mean at the support, requantized once (the reduce-scatter's second rounding), zero elsewhere."""
    x = _inputs(workers)
    for values in ("fp32", "2bit"):
        c = _codec(values)
        handles, _ = _exchange(x, c)
        means = [h.wait()[0] for h in handles]
        sent = _sequential_mean([h.own[0] for h in handles])
        support = c.support(NUMEL)
        expected = sent if values == "fp32" else c.spread(c.values.unpack(c.values.pack(sent[support]),
                                                                          support.numel()), NUMEL)
        for m in range(workers):
            assert torch.equal(means[m], expected)
        assert torch.equal(handles[0].own[0], c.unpack(c.pack(x[0]), NUMEL))


def test_error_feedback_loses_nothing() -> None:
    """Error feedback 1, outer SGD of lr 1, 2-bit values: after one round each worker's buffer plus what it sent
    is its outer gradient (off the support the buffer keeps it whole), and the outer step is the exchange's
    mean of what the workers sent."""
    workers, h, eta = 3, 2, 0.1
    grads = seeded_grads(3)
    cfg = OuterConfig(method="diloco", inner_steps=h, codec="2bit", topk=2, topk_chunk=8, error_feedback=1.0,
                      transport="shared-support", **plain_sgd_outer(1.0))
    _, syncs, _, init = run_inprocess(cfg, workers, h, grads, inner_lr=eta)
    names = syncs[0].fragment_names[0]
    shapes = dict(init.named_parameters())
    deltas = [torch.cat([(eta * sum(grads(m, s, n, torch.zeros(shapes[n].shape)) for s in range(1, h + 1))).reshape(-1)
                         for n in names]) for m in range(workers)]
    c = SharedSupportCodec(get_codec("2bit"), 8, 2, seed=h)  # launched at step h
    sent = [c.unpack(c.pack(d), d.numel()) for d in deltas]
    support = c.support(deltas[0].numel())
    for m in range(workers):
        buffer = flatten(syncs[m].feedback.buffers[0])
        torch.testing.assert_close(buffer + sent[m], deltas[m], rtol=0, atol=1e-6)
        off = torch.ones_like(buffer, dtype=torch.bool)
        off[support] = False
        torch.testing.assert_close(buffer[off], deltas[m][off], rtol=0, atol=1e-6)
    mean = _sequential_mean([s[support] for s in sent])
    mean = c.spread(c.values.unpack(c.values.pack(mean), support.numel()), deltas[0].numel())
    theta0 = torch.cat([shapes[n].detach().reshape(-1) for n in names])
    for m in range(workers):
        torch.testing.assert_close(flatten(syncs[m].outer[0]), theta0 - mean, rtol=0, atol=1e-6)


@pytest.mark.parametrize("method,extra", [("diloco", {}), ("streaming", {"fragments": 2, "overlap_steps": 1}),
                                          ("delayed", {}), ("eager", {})])
def test_every_method_trains_with_it(method: str, extra: dict) -> None:
    """Every method composes with it, with error feedback: finite outer copies, the same on every worker
    where the method keeps them shared (eager keeps each worker's own share)."""
    cfg = OuterConfig(method=method, inner_steps=4, codec="2bit", topk=2, topk_chunk=8, error_feedback=0.95,
                      transport="shared-support", **extra)
    _, syncs, _, _ = run_inprocess(cfg, 3, 12, seeded_grads(5), model=Toy())
    for frag in range(len(syncs[0].outer)):
        for a, b in zip(syncs[0].outer[frag], syncs[2].outer[frag], strict=True):
            assert bool(a.isfinite().all())
            assert method == "eager" or torch.equal(a, b)
    assert syncs[0].comm.stats.num_syncs > 0


@pytest.mark.parametrize("values", ["2bit", "fp32"])
def test_bytes_per_worker_do_not_grow_with_the_workers_in_process(values: str) -> None:
    numel = 4096 * 64 + 5
    kept = sparse_counts(numel, 4096, 64)[0]
    payload = packed_nbytes(values, kept)
    block = packed_nbytes(values, shard_align(values))
    c = get_codec(values, topk=64, chunk=4096, shared=True).for_step(1)
    for workers in range(2, 17):
        handles, grp = _exchange([torch.randn(numel) for _ in range(workers)], c)
        for h in handles:
            h.wait()
        expected = reduce_scatter_wire_bytes(values, kept, workers)
        for comm in grp.communicators:
            assert comm.stats.bytes_sent == comm.stats.bytes_received == expected
        assert expected <= 2 * payload + 2 * (workers - 1) * block
        variant = Variant("s", "s", "diloco", c.bits, topk=64, topk_chunk=4096, shared=True)
        assert exchange_wire_bytes(numel, variant, workers, transport="shared-support") == expected


def _gloo_exchange(workers: int) -> list[dict]:
    def worker(rank: int, store: dist.Store) -> dict:
        g = group(store, f"ss{workers}", rank, workers)
        out = {}
        with TorchDistCommunicator(g, timeout_s=20) as comm:
            for values in ("2bit", "fp32"):
                h = comm.allreduce_mean([_inputs(workers)[rank]], _codec(values), transport="shared-support")
                out[values] = {"mean": h.wait()[0], "own": h.own[0]}
            out["stats"] = comm.stats.as_dict()
        return out

    return run_ranks(worker, workers)


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_gloo_gives_the_in_process_mean_and_bytes(workers: int) -> None:
    results = _gloo_exchange(workers)
    wire = 0
    for values in ("2bit", "fp32"):
        handles, grp = _exchange(_inputs(workers), _codec(values))
        wire += grp.communicators[0].stats.bytes_sent
        for rank in range(workers):
            assert torch.equal(results[rank][values]["mean"], handles[rank].wait()[0])
            assert torch.equal(results[rank][values]["own"], handles[rank].own[0])
    kept = sparse_counts(NUMEL, CHUNK, K)[0]
    assert wire == sum(reduce_scatter_wire_bytes(v, kept, workers) for v in ("2bit", "fp32"))
    for rank in range(workers):
        assert results[rank]["stats"]["bytes_sent"] == results[rank]["stats"]["bytes_received"] == wire


def test_settings() -> None:
    with pytest.raises(ConfigError, match="--topk"):
        OuterConfig(codec="2bit", transport="shared-support").validate()
    OuterConfig(codec="2bit", topk=64, transport="shared-support").validate()
    cfg = TrainConfig(outer=OuterConfig(codec="2bit", topk=64, transport="shared-support"))
    cfg.runtime.elastic = True
    cfg.workers = 2
    with pytest.raises(ConfigError, match="--elastic"):
        cfg.validate()
    # The timeout check charges the values' reduce-scatter: at M = 32 it fits where all-gathered top-k does not.
    link = LinkConfig(bandwidth_gbps=0.001)
    for transport, fits in (("allgather", False), ("shared-support", True)):
        outer = OuterConfig(codec="2bit", topk=64, transport=transport)
        if fits:
            check_exchange_fits(link, outer, 32, 4_000_000, timeout_s=5.0)
        else:
            with pytest.raises(ConfigError, match="--dist-timeout"):
                check_exchange_fits(link, outer, 32, 4_000_000, timeout_s=5.0)


def test_train_with_shared_support_counts_the_values(tmp_path: Path) -> None:
    """`eagerloco train --transport shared-support` end to end: 4 in-process workers of the tiny model, two
    DiLoCo rounds with error feedback, each worker's bytes those of two reduce-scatters of the kept values."""
    out = tmp_path / "run"
    assert main(["train", "--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "2",
                 "--no-progress", "--out", str(out), "--workers", "4", "--inner-steps", "4", "--steps", "8",
                 "--codec", "2bit", "--topk", "64", "--error-feedback", "0.95", "--transport", "shared-support"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    numel = sum(p.numel() for p in GPT(model_config("tiny")).parameters())
    kept = sparse_counts(numel, 4096, 64)[0]
    assert summary["bytes_sent_per_worker"] == 2 * reduce_scatter_wire_bytes("2bit", kept, 4)
    assert math.isfinite(summary["final_eval_loss"])
