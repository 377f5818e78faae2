"""Dense codecs through a reduce-scatter (``--transport reduce-scatter``, section 7 of docs/algorithms.md):
the mean against closed forms, error feedback, and bytes per worker that do not grow with M, in-process
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
from eagerloco.codec_sizes import CODEC_NAMES, packed_nbytes, reduce_scatter_wire_bytes, shard_align
from eagerloco.codecs import get_codec
from eagerloco.comm.base import flatten, wire_bytes
from eagerloco.comm.distributed import TorchDistCommunicator
from eagerloco.comm.inprocess import InProcessGroup
from eagerloco.comm.link import check_exchange_fits
from eagerloco.config import ConfigError, LinkConfig, OuterConfig, TrainConfig
from eagerloco.model import GPT, model_config
from eagerloco.sim.model import ModelSpec, Variant, exchange_wire_bytes, traffic

DENSE = [n for n in CODEC_NAMES if n != "fp32"]
NUMEL = 1000  # not a multiple of the block: a partial block, and padding in the last shard


def _inputs(workers: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=g) * (1 + m) for m in range(workers)]


def _means(inputs: list[torch.Tensor], codec: str, transport: str) -> tuple[list[torch.Tensor], InProcessGroup]:
    """Every worker's mean of one in-process exchange of the inputs (one per worker)."""
    grp = InProcessGroup(len(inputs))
    c = get_codec(codec)
    handles = [grp.communicator(m).allreduce_mean([x], c, transport=transport) for m, x in enumerate(inputs)]
    return [h.wait()[0] for h in handles], grp


def _requantize(codec: str, x: torch.Tensor) -> torch.Tensor:
    c = get_codec(codec)
    return c.unpack(c.pack(x), x.numel())


@pytest.mark.parametrize("codec", DENSE)
def test_one_worker_gives_the_allgather_result_exactly(codec: str) -> None:
    x = _inputs(1)
    gathered, _ = _means(x, codec, "allgather")
    scattered, grp = _means(x, codec, "reduce-scatter")
    assert torch.equal(scattered[0], gathered[0])
    assert torch.equal(scattered[0], _requantize(codec, x[0]))
    assert grp.communicators[0].stats.bytes_sent == 0


@pytest.mark.parametrize("codec", ["bf16", "fp8", "e2m1", "e3m0", "int4", "2bit"])
@pytest.mark.parametrize("workers", [2, 4, 8])
def test_identical_inputs_give_the_allgather_result_exactly_where_requantizing_changes_nothing(
        codec: str, workers: int) -> None:
    """M identical inputs: the FP32 mean of M equal values is the value itself for M a power of two, and
    these codecs map their own grid onto itself, so the second rounding changes nothing."""
    x = _inputs(1)[0]
    q = _requantize(codec, x)
    assert torch.equal(_requantize(codec, q), q)  # the premise: no second rounding occurs
    gathered, _ = _means([x] * workers, codec, "allgather")
    scattered, _ = _means([x] * workers, codec, "reduce-scatter")
    for m in range(workers):
        assert torch.equal(scattered[m], gathered[m])
        assert torch.equal(scattered[m], q)


@pytest.mark.parametrize("codec", DENSE)
@pytest.mark.parametrize("workers", [2, 3, 5])
def test_mean_is_the_allgather_mean_rounded_once_more(codec: str, workers: int) -> None:
    """Closed form: Q(sum_m Q(x_m) / M), summed in FP32 in worker order, shard by shard; the shards are whole
    scale blocks, so it is the whole vector requantized. Every worker gets the same bits."""
    x = _inputs(workers)
    gathered, _ = _means(x, codec, "allgather")
    scattered, _ = _means(x, codec, "reduce-scatter")
    expected = _requantize(codec, gathered[0])
    for m in range(workers):
        assert torch.equal(scattered[m], expected)
    if workers == 3:  # the second rounding really happens
        assert not torch.equal(scattered[0], gathered[0])


def _grid(codec: str) -> torch.Tensor:
    """Every value the codec can decode at scale 1, sorted: a payload of scales 1.0 whose code bytes take
    every value 0..255 (so every code, in every position of a byte)."""
    c = get_codec(codec)
    n = 256 * (8 // c.bits)
    blocks = -(-n // c.block_size)
    one = torch.tensor([1.0], dtype=torch.bfloat16).view(torch.uint8).repeat(blocks)
    return c.unpack(torch.cat([one, torch.arange(256, dtype=torch.uint8)]), n).unique()


@pytest.mark.parametrize("codec", ["int8", "int4", "2bit", "e2m1", "fp8"])
def test_second_rounding_is_within_one_quantization_step(codec: str) -> None:
    """|reduce-scatter - all-gather| is at most one grid step of its block: the largest gap between two
    neighbouring grid values times the requantized block's scale."""
    c = get_codec(codec)
    x = _inputs(3)
    gathered, _ = _means(x, codec, "allgather")
    scattered, _ = _means(x, codec, "reduce-scatter")
    widest = float(_grid(codec).diff().max())
    scales = c.block_scales(c.pack(gathered[0]), NUMEL).repeat_interleave(c.block_size)[:NUMEL]
    assert bool(((scattered[0] - gathered[0]).abs() <= widest * scales).all())


@pytest.mark.parametrize("codec", ["e2m1", "int8"])
def test_own_is_the_first_quantization_of_the_whole_vector(codec: str) -> None:
    x = _inputs(4)
    grp = InProcessGroup(4)
    handles = [grp.communicator(m).allreduce_mean([t], get_codec(codec), transport="reduce-scatter")
               for m, t in enumerate(x)]
    for h, t in zip(handles, x, strict=True):
        assert torch.equal(h.own[0], _requantize(codec, t))
        h.wait()


def test_error_feedback_keeps_what_the_first_rounding_lost() -> None:
    """Dense int4 with error feedback (beta 1) and outer SGD of lr 1: after one round each worker's buffer is
    Delta_m - Q(Delta_m) (nothing lost at the worker), and the outer step is the reduce-scatter's mean,
    Q(sum_m Q(Delta_m) / M): the second rounding is not fed back."""
    workers, h, eta = 3, 2, 0.1
    grads = seeded_grads(3)
    cfg = OuterConfig(method="diloco", inner_steps=h, codec="int4", error_feedback=1.0, transport="reduce-scatter",
                      **plain_sgd_outer(1.0))
    _, syncs, _, init = run_inprocess(cfg, workers, h, grads, inner_lr=eta)
    names = syncs[0].fragment_names[0]
    shapes = dict(init.named_parameters())
    deltas = [torch.cat([(eta * sum(grads(m, s, n, torch.zeros(shapes[n].shape)) for s in range(1, h + 1))).reshape(-1)
                         for n in names]) for m in range(workers)]
    sent = [_requantize("int4", d) for d in deltas]
    for m in range(workers):
        torch.testing.assert_close(flatten(syncs[m].feedback.buffers[0]), deltas[m] - sent[m], rtol=0, atol=1e-6)
    total = sent[0].clone()
    for s in sent[1:]:
        total += s
    mean = _requantize("int4", total / workers)
    theta0 = torch.cat([shapes[n].detach().reshape(-1) for n in names])
    for m in range(workers):
        torch.testing.assert_close(flatten(syncs[m].outer[0]), theta0 - mean, rtol=0, atol=1e-6)


@pytest.mark.parametrize("codec", ["e2m1", "int8", "bf16"])
def test_bytes_per_worker_do_not_grow_with_the_workers_in_process(codec: str) -> None:
    numel = 4096 * 8 + 5
    payload = packed_nbytes(codec, numel)
    block = packed_nbytes(codec, shard_align(codec))
    for workers in range(2, 17):
        grp = InProcessGroup(workers)
        c = get_codec(codec)
        handles = [grp.communicator(m).allreduce_mean([torch.randn(numel)], c, transport="reduce-scatter")
                   for m in range(workers)]
        for h in handles:
            h.wait()
        expected = reduce_scatter_wire_bytes(codec, numel, workers)
        for comm in grp.communicators:
            assert comm.stats.bytes_sent == comm.stats.bytes_received == expected
        # 2(M-1)/M of the payload, plus at most one block of padding per shard; all-gathered it is M-1 payloads.
        assert expected <= 2 * payload + 2 * (workers - 1) * block
        assert wire_bytes(payload, workers, False) == (workers - 1) * payload
        # The simulator charges what the communicator counts.
        assert exchange_wire_bytes(numel, Variant(codec, codec, "diloco", get_codec(codec).bits), workers,
                                   transport="reduce-scatter") == expected


def test_stochastic_first_rounding_gives_every_worker_the_same_mean() -> None:
    grp = InProcessGroup(3)
    c = get_codec("e2m1", stochastic=True)
    handles = [grp.communicator(m).allreduce_mean([x], c, torch.Generator().manual_seed(m), transport="reduce-scatter")
               for m, x in enumerate(_inputs(3))]
    means = [h.wait()[0] for h in handles]
    assert all(torch.equal(means[0], m) for m in means[1:])


def test_fp32_keeps_its_all_reduce() -> None:
    x = _inputs(3)
    gathered, g1 = _means(x, "fp32", "allgather")
    scattered, g2 = _means(x, "fp32", "reduce-scatter")
    assert torch.equal(gathered[0], scattered[0])
    assert g1.communicators[0].stats.bytes_sent == g2.communicators[0].stats.bytes_sent


def test_settings_refuse_what_cannot_be_reduce_scattered() -> None:
    with pytest.raises(ConfigError, match="--transport"):
        OuterConfig(codec="2bit", topk=64, transport="reduce-scatter").validate()
    with pytest.raises(ConfigError, match="--transport"):
        OuterConfig(transport="ring").validate()
    cfg = TrainConfig(outer=OuterConfig(codec="e2m1", transport="reduce-scatter"))
    cfg.runtime.elastic = True
    cfg.workers = 2
    with pytest.raises(ConfigError, match="--elastic"):
        cfg.validate()


# --------------------------------------------------------------------------------------------------
# Over real gloo groups, one thread per worker


def _gloo_exchange(workers: int) -> list[dict]:
    def worker(rank: int, store: dist.Store) -> dict:
        g = group(store, f"rs{workers}", rank, workers)
        out = {}
        with TorchDistCommunicator(g, timeout_s=20) as comm:
            for codec in ("e2m1", "int8"):
                x = _inputs(workers)[rank]
                h = comm.allreduce_mean([x], get_codec(codec), transport="reduce-scatter")
                out[codec] = {"mean": h.wait()[0], "own": h.own[0]}
            out["stats"] = comm.stats.as_dict()
        return out

    return run_ranks(worker, workers)


@pytest.mark.parametrize("workers", [2, 4])
def test_gloo_gives_the_in_process_mean_and_bytes(workers: int) -> None:
    results = _gloo_exchange(workers)
    wire = 0
    for codec in ("e2m1", "int8"):
        expected, grp = _means(_inputs(workers), codec, "reduce-scatter")
        wire += reduce_scatter_wire_bytes(codec, NUMEL, workers)
        assert grp.communicators[0].stats.bytes_sent == reduce_scatter_wire_bytes(codec, NUMEL, workers)
        for rank in range(workers):
            assert torch.equal(results[rank][codec]["mean"], expected[rank])
            assert torch.equal(results[rank][codec]["own"], _requantize(codec, _inputs(workers)[rank]))
    for rank in range(workers):
        assert results[rank]["stats"]["bytes_sent"] == results[rank]["stats"]["bytes_received"] == wire


def test_toy_model_trains_with_reduce_scatter() -> None:
    """A whole run on the toy model: every worker ends with the same outer parameters."""
    cfg = OuterConfig(method="diloco", inner_steps=2, codec="e2m1", transport="reduce-scatter")
    _, syncs, _, _ = run_inprocess(cfg, 3, 6, seeded_grads(5), model=Toy())
    for a, b in zip(syncs[0].outer[0], syncs[2].outer[0], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("workers", [2, 8, 32])
def test_simulator_charges_a_round_what_the_communicator_counts(workers: int) -> None:
    """`simulate --transport reduce-scatter`: a DiLoCo round of the tiny model's size costs each worker what
    the in-process communicator counts for that exchange; all-gathered, M-1 payloads."""
    numel = 820_352
    model = ModelSpec("tiny", numel, 4, 0.1)
    variant = Variant("diloco", "DiLoCo e2m1", "diloco", 4)
    rs = traffic(model, variant, workers, 10, 1, transport="reduce-scatter")
    assert rs.transfers == [reduce_scatter_wire_bytes("e2m1", numel, workers)]
    ag = traffic(model, variant, workers, 10, 1, transport="allgather")
    assert ag.transfers == [(workers - 1) * packed_nbytes("e2m1", numel)]


def test_train_with_transport_reduce_scatter_counts_the_shards(tmp_path: Path) -> None:
    """`eagerloco train --transport reduce-scatter` end to end: 4 in-process workers of the tiny model, two
    DiLoCo rounds, each worker's bytes those of two reduce-scatter exchanges of the whole model."""
    out = tmp_path / "run"
    assert main(["train", "--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "2",
                 "--no-progress", "--out", str(out), "--workers", "4", "--inner-steps", "4", "--steps", "8",
                 "--codec", "e2m1", "--transport", "reduce-scatter"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    numel = sum(p.numel() for p in GPT(model_config("tiny")).parameters())
    assert summary["syncs_per_worker"] == 2
    assert summary["bytes_sent_per_worker"] == 2 * reduce_scatter_wire_bytes("e2m1", numel, 4)
    assert math.isfinite(summary["final_eval_loss"])


def test_the_timeout_check_counts_the_shards() -> None:
    """At M = 32 an all-gathered exchange of 1e6 e2m1 values takes 31 payloads on the link, the reduce-scatter
    about 2: a link and timeout between the two refuse the first only."""
    link = LinkConfig(bandwidth_gbps=0.01)  # 14 s for 31 payloads of 0.56 MB, 0.9 s for the shards
    numel = 1_000_000
    for transport, fits in (("allgather", False), ("reduce-scatter", True)):
        outer = OuterConfig(codec="e2m1", transport=transport)
        if fits:
            check_exchange_fits(link, outer, 32, numel, timeout_s=5.0)
        else:
            with pytest.raises(ConfigError, match="--dist-timeout"):
                check_exchange_fits(link, outer, 32, numel, timeout_s=5.0)
