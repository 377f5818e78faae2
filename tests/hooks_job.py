"""One worker of tests/test_hooks_jobs.py, started as its own job (plain python or torchrun).

Usage: python tests/hooks_job.py SCENARIO OUTDIR WORKER WORKERS PORT [PORT ...]

- ``methods``: for every method, a plain loop through ``eagerloco.outer_loop`` (rendezvous at the
  first port of the pair) and the same loop with explicit OuterSync calls (the second port); then
  DiLoCo through the hooks over an emulated slow link (the last port); writes the results to
  OUTDIR/methods_<worker>.pt.
- ``kill``: DiLoCo through the hooks; worker 1 dies at step 5, worker 0 reports what it raised.
- ``elastic``: DiLoCo through the hooks with ``elastic=True`` (EAGERLOCO_FAULT_KILL says who dies),
  each worker reports how it ended in OUTDIR/elastic_<worker>.json.
- ``unfinished``: eager through the hooks, the loop never finished (no ``with``, no finish()).
- ``world``: one WORLD of two ranks, each a worker (started by ``eagerloco launch``, no rendezvous):
  eager with explicit calls, then through the hooks; writes OUTDIR/world_<rank>.pt.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
import zlib
from pathlib import Path

import torch
from test_hooks import METHODS
from toy import Toy

import eagerloco
from eagerloco.comm.connect import connect
from eagerloco.comm.rendezvous import OuterRendezvous, init_process_groups, join_outer_group
from eagerloco.comm.worker import communicator_for
from eagerloco.config import LinkConfig, OuterConfig
from eagerloco.outer import OuterSync

STEPS = 9


def _loss(model: torch.nn.Module, worker: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{worker}/{step}".encode()))
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, generator=g)
    return ((model(x) - y) ** 2).mean()


def _init() -> Toy:
    torch.manual_seed(0)
    return Toy(num_blocks=4, width=8)


def gloo_threads() -> int:
    """How many of this process's threads are gloo's (a group's workers, a transport's event loop)."""
    tasks = Path("/proc/self/task")
    return sum((t / "comm").read_text().strip() in ("pt_gloo_runloop", "gloo_tcp_loop") for t in tasks.iterdir())


def hooked(settings: dict, port: int, worker: int, workers: int, **kwargs: object) -> dict:
    gc.collect()  # the explicit run before this one may leave its group to the collector
    model = _init()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    peers = connect(f"127.0.0.1:{port}", worker, workers, timeout_s=30, **kwargs)  # type: ignore[arg-type]
    with eagerloco.outer_loop(model, opt, OuterConfig(**settings), peers=peers) as outer:
        for step in range(1, STEPS + 1):
            opt.zero_grad()
            _loss(model, worker, step).backward()
            opt.step()
    left = gloo_threads()  # the loop is finished but still referenced (by `outer`): its group must be freed
    return {"params": [p.detach().clone() for p in model.parameters()], "outer": outer.outer_parameters(),
            "gloo_threads_after": left,
            "bytes_sent": outer.comm.stats.bytes_sent, "num_syncs": outer.comm.stats.num_syncs,
            "sizes": [sum(p.numel() for p in f) for f in outer.sync.params], "metrics": outer.metrics()}


def explicit(settings: dict, port: int, worker: int, workers: int) -> dict:
    model = _init()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ctx = join_outer_group(OuterRendezvous("127.0.0.1", port, worker, workers), timeout_s=30)
    comm = communicator_for(ctx, None, seed=0, timeout_s=30)
    sync = OuterSync(model, opt, comm, OuterConfig(**settings))
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        _loss(model, worker, step).backward()
        sync.before_inner_step()
        opt.step()
        sync.after_inner_step()
    sync.drain()
    sync.consensus()  # as the hook API ends a run it joined itself: eager's workers end with one model
    comm.barrier()
    comm.close()
    return {"params": [p.detach().clone() for p in model.parameters()], "outer": sync.outer_parameters(),
            "bytes_sent": comm.stats.bytes_sent}


def world(out: Path) -> None:
    """Under one WORLD (RANK, WORLD_SIZE set by the launcher), outer_loop makes each rank a worker."""
    settings = METHODS["eager"]
    ctx = init_process_groups(int(os.environ["WORLD_SIZE"]), 1, "gloo", timeout_s=30)
    model = _init()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    comm = communicator_for(ctx, None, seed=0, timeout_s=30)
    sync = OuterSync(model, opt, comm, OuterConfig(**settings))
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        _loss(model, ctx.worker, step).backward()
        sync.before_inner_step()
        opt.step()
        sync.after_inner_step()
    sync.drain()
    sync.consensus()  # as the hook API ends a run it joined itself
    comm.barrier()
    comm.close()
    explicit_params = [p.detach().clone() for p in model.parameters()]
    model = _init()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with eagerloco.outer_loop(model, opt, OuterConfig(**settings), peers=connect(timeout_s=30)) as outer:
        assert outer.num_workers == 2 and outer.worker == ctx.worker
        for step in range(1, STEPS + 1):
            opt.zero_grad()
            _loss(model, ctx.worker, step).backward()
            opt.step()
    torch.save({"explicit": explicit_params, "hooked": [p.detach().clone() for p in model.parameters()]},
               out / f"world_{ctx.rank}.pt")


def main() -> None:
    if sys.argv[1] == "world":
        torch.set_num_threads(1)
        world(Path(sys.argv[2]))
        return
    scenario, outdir, worker, workers, *ports = sys.argv[1:]
    w, m, ports_i = int(worker), int(workers), [int(p) for p in ports]
    torch.set_num_threads(1)
    out = Path(outdir)
    if scenario == "methods":
        results = {}
        for i, name in enumerate(sorted(METHODS)):
            results[name] = {"hooked": hooked(METHODS[name], ports_i[2 * i], w, m),
                             "explicit": explicit(METHODS[name], ports_i[2 * i + 1], w, m)}
        # DiLoCo over an emulated slow link (200 ms, 10 Mbit/s) between the jobs: 3 blocking syncs.
        results["link"] = hooked(METHODS["diloco"], ports_i[2 * len(METHODS)], w, m,
                                 link=LinkConfig(bandwidth_gbps=0.01, latency_ms=200))
        torch.save(results, out / f"methods_{w}.pt")
    elif scenario == "kill":
        model = _init()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        try:
            with eagerloco.outer_loop(model, opt, OuterConfig(method="diloco", inner_steps=2),
                                      peers=connect(f"127.0.0.1:{ports_i[0]}", w, m, timeout_s=20)):
                for step in range(1, 41):
                    if w == 1 and step == 5:
                        os._exit(3)  # dies without a word, mid-run
                    opt.zero_grad()
                    _loss(model, w, step).backward()
                    opt.step()
        except Exception as e:
            (out / f"kill_{w}.json").write_text(json.dumps({"type": type(e).__name__, "message": str(e),
                                                            "trace": traceback.format_exc()}))
            sys.exit(1)
    elif scenario == "elastic":
        model = _init()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        report: dict = {}
        try:
            peers = connect(f"127.0.0.1:{ports_i[0]}", w, m, timeout_s=20, elastic=True)
            with eagerloco.outer_loop(model, opt, OuterConfig(method="diloco", inner_steps=2), peers=peers) as outer:
                for step in range(1, 13):
                    opt.zero_grad()
                    _loss(model, w, step).backward()
                    opt.step()
            report = {"workers": outer.num_workers, "syncs": outer.comm.stats.num_syncs}
        except Exception as e:
            report = {"type": type(e).__name__, "message": str(e), "trace": traceback.format_exc()}
        (out / f"elastic_{w}.json").write_text(json.dumps(report))
        sys.exit(1 if "type" in report else 0)
    elif scenario == "unfinished":  # eager through the hooks, never finished: exits with an exchange in flight
        model = _init()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        eagerloco.outer_loop(model, opt, OuterConfig(method="eager", inner_steps=3),
                             peers=connect(f"127.0.0.1:{ports_i[0]}", w, m, timeout_s=20)).start()
        for step in range(1, STEPS + 1):
            opt.zero_grad()
            _loss(model, w, step).backward()
            opt.step()
        print(f"worker {w}: trained", flush=True)
    else:
        raise SystemExit(f"unknown scenario {scenario}")


if __name__ == "__main__":
    main()
