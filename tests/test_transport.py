"""The torch.distributed transport (TorchDistCommunicator) on real gloo groups, one thread per worker.

Three workers exchange over gloo groups of their own in this process (tests/gloo_threads.py): every
codec's mean bit for bit against the single-process computation, the byte accounting, schedule
agreement and mismatches, and the emulated link's overlap, blocking and queueing. What needs real
processes (a dead or hung peer, WORLD from init_process_groups, the launcher) is in test_distributed.py.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from dist_worker import CODECS, SHAPES, expected_mean, inputs, rounding_generator
from gloo_threads import context, group, run_ranks
from torch import nn

from eagerloco.codecs import get_codec
from eagerloco.comm.base import flatten, wire_bytes
from eagerloco.comm.distributed import TorchDistCommunicator
from eagerloco.comm.errors import ScheduleMismatchError
from eagerloco.comm.groups import DistContext
from eagerloco.comm.worker import communicator_for
from eagerloco.config import LinkConfig, OuterConfig
from eagerloco.outer import OuterSync

LATENCY_S = 0.5
L = LATENCY_S


def _exact(store: dist.Store, ctx: DistContext) -> dict:
    """Every codec over all workers and over a 2-worker subgroup; then a schedule mismatch."""
    pair = group(store, "pair", ctx.rank, 2) if ctx.rank < 2 else None  # worker 2 is not a member
    results: dict[str, object] = {}
    for label, g in (("all", ctx.outer_group), ("pair", pair)):
        if g is None:
            continue
        # The full group runs in elastic mode (it keeps recent means for survivors and sums on a
        # copy), the pair in the default mode (no copies kept, FP32 summed in place without keep_own).
        elastic = label == "all"
        with TorchDistCommunicator(g, timeout_s=20, store=ctx.store if label == "all" else None,
                                   elastic=elastic) as comm:
            comm.barrier()
            for ci, name in enumerate(CODECS):
                stochastic = name == "e2m1"  # exercises the generator path too
                codec = get_codec(name, stochastic=stochastic)
                gen = rounding_generator(comm.rank) if stochastic else None
                h = comm.allreduce_mean(inputs(comm.rank, ci), codec, gen)
                mean = h.wait()
                kept = comm.recent_result(h.seq)[1]
                assert (kept is not None) == elastic
                before = None if kept is None else kept.clone()
                results[f"{label}/{name}"] = {"mean": [m.clone() for m in mean], "own": h.own,
                                              "payload_bytes": h.payload_bytes}
                # The result is the caller's: writing into it (a foreach optimizer does) leaves the
                # mean an elastic communicator keeps for survivors of a membership change as it was.
                for m in mean:
                    m.mul_(-3.0).add_(1.0)
                results[f"{label}/{name}"]["kept_intact"] = kept is None or torch.equal(kept, before)
                if not stochastic:  # without own (in place for FP32 outside elastic mode): same bits
                    h = comm.allreduce_mean(inputs(comm.rank, ci), codec, keep_own=False)
                    results[f"{label}/{name}"]["mean_no_own"] = h.wait()
                    assert h.own == []
            results[f"{label}/stats"] = comm.stats.as_dict()
            results[f"{label}/workers"] = comm.num_workers
            if label == "all":
                # Worker 0 launches a different size: every worker must get the same clear error.
                n = 10 if comm.rank == 0 else 11
                try:
                    comm.allreduce_mean([torch.ones(n)], get_codec("int8")).wait()
                    results["mismatch"] = "no error"
                except ScheduleMismatchError as e:
                    results["mismatch"] = str(e)
    return results


def _timing(ctx: DistContext) -> dict:
    """Overlap, blocking and queueing on an emulated link of LATENCY_S per exchange."""
    codec = get_codec("e2m1")
    x = [torch.randn(4096)]
    r: dict[str, float | bool] = {}
    comm = communicator_for(ctx, LinkConfig(latency_ms=LATENCY_S * 1e3))
    comm.barrier()
    # Overlap: launch, compute for about the link time, then wait.
    t0 = time.perf_counter()
    h = comm.allreduce_mean(x, codec)
    r["launch_s"] = time.perf_counter() - t0
    r["done_right_after"] = h.done()
    busy_until = t0 + LATENCY_S + 0.1
    while time.perf_counter() < busy_until:  # real compute, holding a core like training would
        torch.mm(torch.randn(64, 64), torch.randn(64, 64))
    b0 = comm.stats.blocked_s
    h.wait()
    r["blocked_overlap_s"] = comm.stats.blocked_s - b0
    comm.barrier()
    # Waiting at once: blocked for the whole link time.
    b0 = comm.stats.blocked_s
    t0 = time.perf_counter()
    comm.allreduce_mean(x, codec).wait()
    r["blocked_immediate_s"] = comm.stats.blocked_s - b0
    r["elapsed_immediate_s"] = time.perf_counter() - t0
    comm.barrier()
    # Queueing: two back to back share the link one after the other.
    t0 = time.perf_counter()
    h1, h2 = comm.allreduce_mean(x, codec), comm.allreduce_mean(x, codec)
    h1.wait()
    r["first_of_two_s"] = time.perf_counter() - t0
    r["second_done_with_first"] = h2.done()
    h2.wait()
    r["second_of_two_s"] = time.perf_counter() - t0
    comm.close()
    # Bandwidth: 0 latency, a payload whose wire bytes take 0.4 s at the configured rate.
    n = 1 << 16
    payload = codec.packed_nbytes(n)
    gbps = payload * 8 / 0.4 / 1e9
    comm = communicator_for(ctx, LinkConfig(bandwidth_gbps=gbps))
    comm.barrier()
    t0 = time.perf_counter()
    comm.allreduce_mean([torch.randn(n)], codec).wait()
    r["bandwidth_s"] = time.perf_counter() - t0
    wire = payload * (comm.num_workers - 1)
    r["bandwidth_expected_s"] = LinkConfig(bandwidth_gbps=gbps).transfer_seconds(wire)
    comm.close()
    return r


class _Net(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, width) for _ in range(2))


def _agreement(ctx: DistContext) -> dict:
    """OuterSync agrees on its schedule once, then its exchanges skip the header round trip (not on
    an emulated link, whose schedule needs the header); different schedules are a clear error."""

    def run(link: LinkConfig | None, width: int = 8) -> dict:
        comm = communicator_for(ctx, link)
        gathers = []
        gather = comm._gather
        comm._gather = lambda buf: (gathers.append(buf.numel()), gather(buf))[1]  # type: ignore[method-assign]
        model = _Net(width)  # the outer parameters compared below are the same whatever the init
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.copy_(torch.linspace(-1, 1, p.numel()).view(p.shape) * (i + 1))
        sync = OuterSync(model, None, comm, OuterConfig(method="diloco", inner_steps=2, codec="fp32"))
        out: dict = {}
        try:
            for _ in range(4):  # an "inner step" that differs by worker, then the outer schedule
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.01 * (comm.rank + 1))
                sync.after_inner_step()
        except ScheduleMismatchError as e:
            out["error"] = str(e)
        out.update(agreed=sync._agreement, gathers=gathers, syncs=comm.stats.num_syncs,
                   outer=[float(t.sum()) for frag in sync.outer for t in frag])
        comm.close(cancel="error" in out)
        return out

    return {"plain": run(None), "emulated": run(LinkConfig(latency_ms=1.0)),
            "mismatch": run(None, width=8 if ctx.rank == 0 else 9)}


@pytest.fixture(scope="module")
def main_run() -> list[dict]:
    """The exactness, timing and agreement scenarios, run once by 3 workers."""

    def worker(rank: int, store: dist.Store) -> dict:
        ctx = context(store, rank, 3)
        return {"exact": _exact(store, ctx), "timing": _timing(ctx), "agreement": _agreement(ctx)}

    return run_ranks(worker, 3)


@pytest.fixture(scope="module")
def exact(main_run: list[dict]) -> dict[int, dict]:
    return {r: main_run[r]["exact"] for r in range(3)}


# --------------------------------------------------------------------------------------------------
# Exact results: every rank's mean equals the single-process mean of the same payloads, bit for bit
# (fp32 beyond 2 workers: up to the all-reduce's summation order)


@pytest.mark.parametrize("label,workers", [("all", 3), ("pair", 2)])
@pytest.mark.parametrize("ci,name", list(enumerate(CODECS)))
def test_mean_is_bit_exact_with_single_process(exact: dict[int, dict], label: str, workers: int,
                                               ci: int, name: str) -> None:
    expected, payloads = expected_mean(name, ci, workers)
    codec = get_codec(name)
    numel = expected.numel()
    for rank in range(workers):
        got = exact[rank][f"{label}/{name}"]
        assert [tuple(t.shape) for t in got["mean"]] == [tuple(s) for s in SHAPES]
        mean = flatten(got["mean"])
        if codec.summable and workers > 2:
            # One all-reduce: its ring adds in another order than worker order (last-bit rounding),
            # but every rank gets the same bits.
            torch.testing.assert_close(mean, expected, rtol=1e-6, atol=1e-7)
            assert torch.equal(mean, flatten(exact[0][f"{label}/{name}"]["mean"])), f"rank {rank} differs from rank 0"
        else:
            assert torch.equal(mean.view(torch.int32), expected.view(torch.int32)), (
                f"rank {rank}: max diff {(mean - expected).abs().max().item():g}"
            )
        assert got["kept_intact"], f"rank {rank}: writing into wait()'s result changed the kept mean"
        if "mean_no_own" in got:
            assert torch.equal(flatten(got["mean_no_own"]), flatten(got["mean"])), f"rank {rank}: keep_own=False"
        own = flatten(got["own"])
        assert torch.equal(own.view(torch.int32), codec.unpack(payloads[rank], numel).view(torch.int32))
        assert got["payload_bytes"] == codec.packed_nbytes(numel)
    if name != "fp32":  # a lossy codec really is lossy: the test would see a wrong transport
        exact_mean = sum(flatten(inputs(w, ci)) for w in range(workers)) / workers
        assert not torch.equal(expected, exact_mean)


@pytest.mark.parametrize("label,workers", [("all", 3), ("pair", 2)])
def test_byte_accounting_is_wire_bytes(exact: dict[int, dict], label: str, workers: int) -> None:
    numel = flatten(inputs(0, 0)).numel()
    codecs = [get_codec(n) for n in CODECS]
    wires = [wire_bytes(c.packed_nbytes(numel), workers, c.summable) for c in codecs]
    # Every deterministic codec also ran a second exchange, without keep_own.
    wires += [w for w, n in zip(wires, CODECS, strict=True) if n != "e2m1"]
    for rank in range(workers):
        st = exact[rank][f"{label}/stats"]
        assert exact[rank][f"{label}/workers"] == workers
        assert st["num_syncs"] == len(wires)
        assert st["bytes_sent"] == sum(wires)
        assert st["bytes_received"] == sum(wires)
        assert st["peak_sync_bytes"] == max(c.packed_nbytes(numel) for c in codecs)


def test_mismatched_exchange_is_a_clear_error_on_every_rank(exact: dict[int, dict]) -> None:
    for rank in range(3):
        msg = exact[rank]["mismatch"]
        assert "10 values" in msg and "11 values" in msg and "same exchanges" in msg, msg


def test_agreed_schedule_skips_the_per_exchange_header(main_run: list[dict]) -> None:
    """OuterSync's exchanges: one agreement (header + schedule digest), then payloads only; on an
    emulated link a header per exchange and no agreement; the outer parameters agree either way."""
    runs = [r["agreement"] for r in main_run]
    header, digest = 5 * 8, 32  # bytes of one header row, of one schedule digest
    for r in runs:
        plain, emulated = r["plain"], r["emulated"]
        assert plain["agreed"] is True and emulated["agreed"] is False, r
        assert plain["syncs"] == emulated["syncs"] == 2, r
        assert plain["gathers"] == [header, digest], r  # no header for the 2 exchanges
        assert emulated["gathers"] == [header, header], r
    for mode in ("plain", "emulated"):
        assert len({tuple(r[mode]["outer"]) for r in runs}) == 1, [r[mode]["outer"] for r in runs]
    assert runs[0]["plain"]["outer"] == runs[0]["emulated"]["outer"]


def test_different_schedules_are_a_clear_error_on_every_rank(main_run: list[dict]) -> None:
    runs = [r["agreement"] for r in main_run]
    for rank, r in enumerate(runs):
        msg = r["mismatch"].get("error", "no error")
        assert "different exchange schedule" in msg and "same settings" in msg, msg
        others = ["worker 1", "worker 2"] if rank == 0 else ["worker 0"]
        assert all(w in msg.split(" run(s)")[0] for w in others), msg
        assert ("[144] values" if rank == 0 else "[162] values") in msg, msg  # its own schedule, in words


# --------------------------------------------------------------------------------------------------
# Background exchange, blocking and the emulated link


@pytest.fixture(scope="module")
def timing(main_run: list[dict]) -> list[dict]:
    return [r["timing"] for r in main_run]


def test_exchange_runs_in_background(timing: list[dict]) -> None:
    for r in timing:
        assert r["launch_s"] < 0.2 * L, r
        assert r["done_right_after"] is False, r
        # Compute of about the link time hid the exchange: little left to wait for.
        assert r["blocked_overlap_s"] < 0.25 * L, r


def test_waiting_at_once_blocks_for_the_link_time(timing: list[dict]) -> None:
    for r in timing:
        assert r["elapsed_immediate_s"] >= L, r
        # blocked_s starts at wait(), after the launch stamp the link counts from: microseconds on an idle machine,
        # tens of milliseconds on a loaded one; waiting at once still blocks for most of the link time.
        assert r["blocked_immediate_s"] >= 0.8 * L, r
        assert r["blocked_immediate_s"] < L + 0.5, r


def test_queued_exchanges_use_the_link_in_turn(timing: list[dict]) -> None:
    for r in timing:
        assert r["first_of_two_s"] >= L, r
        assert r["second_done_with_first"] is False, r
        assert r["second_of_two_s"] >= 2 * L, r


def test_bandwidth_term_of_the_link(timing: list[dict]) -> None:
    for r in timing:
        assert r["bandwidth_s"] >= r["bandwidth_expected_s"], r
        assert r["bandwidth_s"] < r["bandwidth_expected_s"] + 1.0, r
