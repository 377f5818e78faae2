"""One process of a multi-process test of the torch.distributed transport (see test_distributed.py);
its inputs and expected means are shared with the tests on threads (test_transport.py).

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
from eagerloco.comm.base import flatten, mean_of_payloads
from eagerloco.comm.errors import PeerError
from eagerloco.comm.rendezvous import init_process_groups
from eagerloco.comm.worker import communicator_for
from eagerloco.config import ConfigError

CODECS = ("fp32", "int8", "e2m1")
SHAPES = ((37, 5), (101,))  # odd sizes: partial last block, odd count of 4-bit codes


def inputs(worker: int, codec_index: int) -> list[torch.Tensor]:
    """Worker w's tensors for one exchange; the test rebuilds them to compute the expected mean."""
    g = torch.Generator().manual_seed(1000 * worker + codec_index)
    return [torch.randn(s, generator=g) * (worker + 1) for s in SHAPES]


def rounding_generator(worker: int) -> torch.Generator:
    return torch.Generator().manual_seed(77 + worker)


def expected_mean(name: str, ci: int, workers: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The in-process computation: every worker packs its input, mean_of_payloads in worker order."""
    stochastic = name == "e2m1"
    codec = get_codec(name, stochastic=stochastic)
    payloads = []
    for w in range(workers):
        gen = rounding_generator(w) if stochastic else None
        payloads.append(codec.pack(flatten(inputs(w, ci)), gen))
    numel = payloads[0].numel() and flatten(inputs(0, ci)).numel()
    return mean_of_payloads(codec, payloads, numel), payloads


def _write(outdir: Path, name: str, data: dict) -> None:
    tmp = outdir / f"{name}.tmp"
    tmp.write_text(json.dumps(data))
    tmp.rename(outdir / f"{name}.json")


def scenario_peer(outdir: Path, mode: str) -> None:
    """The last worker dies (mode "dead") or hangs (mode "hang") before the second exchange."""

    timeout = float(os.environ.get("TEST_DIST_TIMEOUT", "4"))
    ctx = init_process_groups(int(os.environ["WORLD_SIZE"]), 1, "gloo", timeout_s=timeout)
    comm = communicator_for(ctx, heartbeat_s=0.5)
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
    if scenario in ("dead", "hang"):
        scenario_peer(outdir, scenario)
    elif scenario == "groups":
        scenario_groups(outdir, int(argv[2]), int(argv[3]))
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
