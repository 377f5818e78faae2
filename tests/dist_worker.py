"""One process of a multi-process test of the torch.distributed transport (see test_distributed.py).

Usage: python tests/dist_worker.py SCENARIO OUTDIR [ARGS...]; the environment carries torchrun's
variables. Each scenario writes what it measured to OUTDIR/<scenario>_<rank>.json (or .pt) and the
test asserts on it, so a wrong value fails the test with the numbers in the message.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from eagerloco.codecs import get_codec
from eagerloco.comm.distributed import TorchDistCommunicator
from eagerloco.comm.errors import PeerError, ScheduleMismatchError
from eagerloco.comm.groups import DistContext, init_process_groups
from eagerloco.comm.worker import communicator_for
from eagerloco.config import ConfigError, LinkConfig

CODECS = ("fp32", "int8", "e2m1")
SHAPES = ((37, 5), (101,))  # odd sizes: partial last block, odd count of 4-bit codes
LATENCY_S = 0.5


def inputs(worker: int, codec_index: int) -> list[torch.Tensor]:
    """Worker w's tensors for one exchange; the test rebuilds them to compute the expected mean."""
    g = torch.Generator().manual_seed(1000 * worker + codec_index)
    return [torch.randn(s, generator=g) * (worker + 1) for s in SHAPES]


def rounding_generator(worker: int) -> torch.Generator:
    return torch.Generator().manual_seed(77 + worker)


def _write(outdir: Path, name: str, data: dict) -> None:
    tmp = outdir / f"{name}.tmp"
    tmp.write_text(json.dumps(data))
    tmp.rename(outdir / f"{name}.json")


def scenario_main(outdir: Path) -> None:
    """Exactness, then timing, in one set of processes (starting processes is the slow part)."""
    torch.set_num_threads(1)
    ctx = init_process_groups(int(os.environ["WORLD_SIZE"]), 1, "gloo", timeout_s=20)
    exact(outdir, ctx)
    timing(outdir, ctx)
    agreement(outdir, ctx)
    dist.barrier()
    dist.destroy_process_group()


def exact(outdir: Path, ctx: DistContext) -> None:
    """Every codec over all workers and over a 2-worker subgroup; then a schedule mismatch."""
    pair = dist.new_group([0, 1])  # every rank creates it; rank 2 is not a member
    results: dict[str, object] = {}
    for label, group in (("all", ctx.outer_group), ("pair", pair)):
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            continue
        # The full group runs in elastic mode (it keeps recent means for survivors and sums on a
        # copy), the pair in the default mode (no copies kept, FP32 summed in place without keep_own).
        elastic = label == "all"
        with TorchDistCommunicator(group, timeout_s=20, store=ctx.store if label == "all" else None,
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
    torch.save(results, outdir / f"exact_{ctx.rank}.pt")


def timing(outdir: Path, ctx: DistContext) -> None:
    """Overlap, blocking and queueing on an emulated link of LATENCY_S per exchange."""

    codec = get_codec("e2m1")
    x = [torch.randn(4096)]
    r: dict[str, float | bool] = {}
    comm = TorchDistCommunicator.from_context(ctx, LinkConfig(latency_ms=LATENCY_S * 1e3))
    comm.barrier()
    # Overlap: launch, compute for about the link time, then wait.
    t0 = time.perf_counter()
    h = comm.allreduce_mean(x, codec)
    r["launch_s"] = time.perf_counter() - t0
    r["done_right_after"] = h.done()
    busy_until = t0 + LATENCY_S + 0.1
    while time.perf_counter() < busy_until:  # real compute, holding the core like training would
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
    # Bandwidth: 0 latency, a payload whose wire bytes take BW_S at the configured rate.
    n = 1 << 16
    payload = codec.packed_nbytes(n)  # wire bytes = payload for M=2 all-gather
    gbps = payload * 8 / 0.4 / 1e9
    comm = TorchDistCommunicator.from_context(ctx, LinkConfig(bandwidth_gbps=gbps))
    comm.barrier()
    t0 = time.perf_counter()
    comm.allreduce_mean([torch.randn(n)], codec).wait()
    r["bandwidth_s"] = time.perf_counter() - t0
    wire = payload * (comm.num_workers - 1)
    r["bandwidth_expected_s"] = LinkConfig(bandwidth_gbps=gbps).transfer_seconds(wire)
    comm.close()
    _write(outdir, f"timing_{ctx.rank}", r)


def agreement(outdir: Path, ctx: DistContext) -> None:
    """OuterSync agrees on its schedule once, then its exchanges skip the header round trip (not on
    an emulated link, whose schedule needs the header); different schedules are a clear error."""
    from torch import nn

    from eagerloco.config import OuterConfig
    from eagerloco.outer import OuterSync

    class Net(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(8, width) for _ in range(2))

    def run(link: LinkConfig | None, width: int = 8) -> dict:
        comm = TorchDistCommunicator.from_context(ctx, link)
        gathers = []
        gather = comm._gather
        comm._gather = lambda buf: (gathers.append(buf.numel()), gather(buf))[1]  # type: ignore[method-assign]
        torch.manual_seed(0)
        model = Net(width)
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

    r = {"plain": run(None), "emulated": run(LinkConfig(latency_ms=1.0)),
         "mismatch": run(None, width=8 if ctx.rank == 0 else 9)}
    _write(outdir, f"agreement_{ctx.rank}", r)


def scenario_peer(outdir: Path, mode: str) -> None:
    """The last worker dies (mode "dead") or hangs (mode "hang") before the second exchange."""

    timeout = float(os.environ.get("TEST_DIST_TIMEOUT", "4"))
    ctx = init_process_groups(int(os.environ["WORLD_SIZE"]), 1, "gloo", timeout_s=timeout)
    comm = TorchDistCommunicator.from_context(ctx, heartbeat_s=0.5)
    codec = get_codec("fp32")
    comm.allreduce_mean([torch.ones(1000)], codec).wait()
    victim = comm.num_workers - 1
    if comm.rank == victim:
        if mode == "dead":
            os._exit(7)
        # Hung: alive (heartbeats go on) but never joins; leaves once the survivors reported.
        give_up = time.monotonic() + 60  # never outlive a failed test for long
        while not all((outdir / f"{mode}_{w}.json").exists() for w in range(victim)):
            if time.monotonic() > give_up:
                break
            time.sleep(0.1)
        os._exit(3)
    time.sleep(0.3)
    t0 = time.perf_counter()
    r: dict[str, object] = {}
    try:
        comm.allreduce_mean([torch.ones(1000)], codec).wait()
        r["error"] = None
    except PeerError as e:
        r["error"], r["workers"] = str(e), e.workers
    r["elapsed_s"] = time.perf_counter() - t0
    r["blocked_s"] = comm.stats.blocked_s
    # Later use fails at once with the same error instead of hanging.
    t1 = time.perf_counter()
    try:
        comm.allreduce_mean([torch.ones(10)], codec).wait()
        r["later"] = "no error"
    except PeerError as e:
        r["later"] = str(e)
    r["later_s"] = time.perf_counter() - t1
    comm.close()
    _write(outdir, f"{mode}_{ctx.rank}", r)


def scenario_groups(outdir: Path, workers: int, ranks_per_worker: int) -> None:
    """init_process_groups: a size mismatch error, then groups checked by all-reducing rank ids."""
    r: dict[str, object] = {}
    try:
        init_process_groups(workers + 1, ranks_per_worker, "gloo", timeout_s=20)
        r["mismatch"] = "no error"
    except ConfigError as e:
        r["mismatch"] = str(e)
    ctx = init_process_groups(workers, ranks_per_worker, "gloo", timeout_s=20)
    r.update(worker=ctx.worker, rank_in_worker=ctx.rank_in_worker, rank=ctx.rank, outer=ctx.is_outer_rank,
             env_workers=os.environ.get("EAGERLOCO_WORKERS"), omp=os.environ.get("OMP_NUM_THREADS"))
    one = torch.tensor([float(ctx.rank)])
    if ctx.inner_group is not None:
        t = one.clone()
        dist.all_reduce(t, group=ctx.inner_group)
        r["inner_sum"] = t.item()
        r["inner_size"] = dist.get_world_size(ctx.inner_group)
    if ctx.outer_group is not None:
        t = one.clone()
        dist.all_reduce(t, group=ctx.outer_group)
        r["outer_sum"] = t.item()
    # Every rank of a worker gets the worker's outer result (first rank exchanges, then broadcasts).
    comm = communicator_for(ctx)
    comm.barrier()
    codec = get_codec("int8")
    h = comm.allreduce_mean(inputs(ctx.worker, 1), codec)
    torch.save({"mean": h.wait(), "own": h.own}, outdir / f"groups_{ctx.rank}.pt")
    comm.close()
    dist.barrier()
    _write(outdir, f"groups_{ctx.rank}", r)
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    scenario, outdir = argv[0], Path(argv[1])
    if scenario == "main":
        scenario_main(outdir)
    elif scenario in ("dead", "hang"):
        scenario_peer(outdir, scenario)
    elif scenario == "groups":
        scenario_groups(outdir, int(argv[2]), int(argv[3]))
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
