"""One replica process of one benchmark variant; ``run.py`` starts two of these per variant.

Usage: python bench/peer/worker.py VARIANT REPLICA REPLICAS STEPS H OUT.json

The environment carries MASTER_ADDR / MASTER_PORT (the launcher's TCPStore: the start barrier, and
the rendezvous of eagerloco's process group), BENCH_RUN (a key prefix unique to this run) and, for
torchft, TORCHFT_LIGHTHOUSE. Setup (process groups, quorum, wrappers) happens before a start
barrier, so the timed loop covers the same 200 inner steps in every variant and both replicas start
it together.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload as wl  # noqa: E402  (sibling module; the script is run by path)

TIMEOUT_S = 120.0


def _store() -> dist.TCPStore:
    return dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=timedelta(seconds=TIMEOUT_S), wait_for_workers=False,
    )


def start_barrier(store: dist.Store, replicas: int) -> None:
    """All replicas leave together (after their setup), so they share the cores the same way."""
    prefix = os.environ["BENCH_RUN"]
    if store.add(f"{prefix}/ready", 1) == replicas:
        store.set(f"{prefix}/go", "1")
    store.wait([f"{prefix}/go"])


class _Timer:
    """Seconds, CPU seconds of the calling thread, and calls accumulated under named keys."""

    def __init__(self) -> None:
        self.s: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.n: dict[str, int] = {}

    def add(self, key: str, seconds: float) -> None:
        self.s[key] = self.s.get(key, 0.0) + seconds
        self.n[key] = self.n.get(key, 0) + 1

    def wrap(self, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu[key] = self.cpu.get(key, 0.0) + time.thread_time() - c0
                self.add(key, time.perf_counter() - t0)

        return timed


# --------------------------------------------------------------------------------------------------
# Variants


def run_plain(replica: int, steps: int, h: int) -> dict[str, Any]:
    """Each replica trains alone: the reference every overhead is measured against."""
    model = wl.build_model()
    opt = wl.inner_optimizer(model)
    batches = wl.train_batches(steps, replica)
    wl.warm_up(model, opt, batches[0])
    start_barrier(_store(), int(sys.argv[3]))
    res = wl.run_loop(model, opt, batches)
    return _result(res, model, outer_s=0.0, blocked_s=0.0, bytes_sent=0, syncs=0,
                   outer_steps=[0.0] * len(batches), blocked_steps=[0.0] * len(batches))


def run_ours(method: str, fragments: int, replica: int, steps: int, h: int, overlap: int = 0) -> dict[str, Any]:
    """eagerloco's OuterSync over the torch.distributed transport (fp32, no link emulation).

    overlap: Streaming's tau, the inner steps between launching a fragment's exchange and using it.

    Eager uses outer lr 0.4 (the eager paper's tuned value): with 0.7 its stale half-update and
    Nesterov momentum overshoot on this workload (train loss 2.20 against DiLoCo's 1.55). The
    outer lr does not change what anything costs.
    """
    import eagerloco.comm.distributed as dmod
    from eagerloco.comm import base as comm_base
    from eagerloco.comm.rendezvous import init_process_groups
    from eagerloco.comm.worker import communicator_for
    from eagerloco.config import OuterConfig
    from eagerloco.outer import OuterSync

    replicas = int(sys.argv[3])
    ctx = init_process_groups(replicas, 1, "gloo", timeout_s=TIMEOUT_S)
    comm = communicator_for(ctx)
    model = wl.build_model()
    opt = wl.inner_optimizer(model)
    lr = wl.EAGER_OUTER_LR if method == "eager" else wl.OUTER_LR
    cfg = OuterConfig(method=method, inner_steps=h, fragments=fragments, overlap_steps=overlap, codec="fp32",
                      outer_lr=lr, outer_momentum=wl.OUTER_MOMENTUM, outer_nesterov=True)
    sync = OuterSync(model, opt, comm, cfg)
    # Where the time goes, for the profile in the report: wrap the stages on this instance only.
    prof = _Timer()
    sync.launch_outer = prof.wrap("launch", sync.launch_outer)  # type: ignore[method-assign]
    sync._wait = prof.wrap("wait", sync._wait)  # type: ignore[method-assign]
    comm.allreduce_mean = prof.wrap("launch_comm", comm.allreduce_mean)  # type: ignore[method-assign]
    sync._outer_step = prof.wrap("outer_opt", sync._outer_step)  # type: ignore[method-assign]
    sync._merge = prof.wrap("merge", sync._merge)  # type: ignore[method-assign]
    comm._gather = prof.wrap("thread_gather", comm._gather)  # type: ignore[method-assign]
    comm._sum = prof.wrap("thread_allreduce", comm._sum)  # type: ignore[method-assign]
    comm._execute = prof.wrap("thread_execute", comm._execute)  # type: ignore[method-assign]
    publish = comm.heartbeat.publish

    def publish_timed(*args: Any) -> None:  # heartbeat publishes, most of them prompted by an exchange
        t0, c0 = time.perf_counter(), time.thread_time()
        publish(*args)
        prof.cpu["hb_publish"] = prof.cpu.get("hb_publish", 0.0) + time.thread_time() - c0
        prof.add("hb_publish", time.perf_counter() - t0)

    comm.heartbeat.publish = publish_timed  # type: ignore[method-assign]
    dmod.mean_of_payloads = prof.wrap("thread_mean", comm_base.mean_of_payloads)  # type: ignore[assignment]
    batches = wl.train_batches(steps, replica)
    wl.warm_up(model, opt, batches[0])
    comm.barrier()  # the process group's first collectives are connection setup: keep them untimed
    start_barrier(_store(), replicas)
    # The final drain only waits for the exchange still in flight (eager); it is part of the run.
    res = wl.run_loop(model, opt, batches, before=sync.before_inner_step, after=sync.after_inner_step,
                      finish=sync.drain, counters={"blocked": lambda: comm.stats.blocked_s})
    st = comm.stats
    out = _result(res, model, outer_s=res.hook_s, blocked_s=st.blocked_s, bytes_sent=st.bytes_sent,
                  syncs=st.num_syncs, outer_steps=res.per_step["hook"], blocked_steps=res.per_step["blocked"])
    out["overhead_s"] = st.overhead_s  # outer machinery outside the wait, as eagerloco counts it
    out["profile_s"] = prof.s
    out["profile_cpu_s"] = prof.cpu
    out["profile_calls"] = prof.n
    comm.close()
    dist.destroy_process_group()
    return out


def run_floor(fragments: int, replica: int, steps: int, h: int, overlap: int = 0) -> dict[str, Any]:
    """The exchange alone: a bare gloo all-reduce of the same bytes at the same steps, nothing else.

    No outer gradient, optimizer, copies or bookkeeping: one preallocated FP32 buffer per fragment
    is all-reduced (async) where the method launches its exchange and waited on ``overlap`` steps
    later, as Streaming (or DiLoCo, one fragment) does. Whatever this costs over the plain loop,
    every implementation of the method pays on this machine: it is the floor of the comparison.
    """
    from eagerloco.comm.base import wire_bytes

    replicas = int(sys.argv[3])
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    model = wl.build_model()
    opt = wl.inner_optimizer(model)
    frags = [model] if fragments == 1 else wl.fragment_modules(model, fragments)
    bufs = [torch.zeros(sum(p.numel() for p in f.parameters())) for f in frags]
    batches = wl.train_batches(steps, replica)
    wl.warm_up(model, opt, batches[0])
    for b in bufs:
        dist.all_reduce(b)  # connection setup, untimed (like the other variants' first collective)
    start_barrier(_store(), replicas)
    every = h // fragments
    state: dict[str, Any] = {"step": 0, "launches": 0, "pending": [], "blocked": 0.0, "bytes": 0}

    def wait_due(final: bool = False) -> None:
        while state["pending"] and (final or state["pending"][0][0] <= state["step"]):
            _, work = state["pending"].pop(0)
            t0 = time.perf_counter()
            work.wait()
            state["blocked"] += time.perf_counter() - t0

    def after() -> None:
        state["step"] += 1
        if state["step"] % every == 0:
            buf = bufs[state["launches"] % fragments]
            state["launches"] += 1
            state["bytes"] += buf.numel() * 4
            state["pending"].append((state["step"] + overlap, dist.all_reduce(buf, async_op=True)))
        wait_due()

    res = wl.run_loop(model, opt, batches, after=after, finish=lambda: wait_due(final=True),
                      counters={"blocked": lambda: state["blocked"]})
    out = _result(res, model, outer_s=res.hook_s, blocked_s=state["blocked"],
                  bytes_sent=wire_bytes(state["bytes"], replicas, True), syncs=state["launches"],
                  outer_steps=res.per_step["hook"], blocked_steps=res.per_step["blocked"])
    dist.destroy_process_group()
    return out


class _TimedWork:
    """Proxy of a torchft Work whose wait() is timed (the pseudo-gradient all-reduce)."""

    def __init__(self, work: Any, timer: _Timer) -> None:
        self._work, self._timer = work, timer

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._timer.add("allreduce_wait", time.perf_counter() - t0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def run_torchft(fragments: int, bucketize: bool, replica: int, steps: int, h: int, delay: int = 0) -> dict[str, Any]:
    """torchft 0.2.0's DiLoCo / Streaming DiLoCo: one Manager and ProcessGroupGloo per replica.

    delay: torchft's ``fragment_sync_delay`` (Streaming's tau: the fragment's all-reduce starts this
    many inner steps before the step that waits for it and applies it).

    Each replica is a replica group of one process with its own TCPStore. Timing: the optimizer
    hooks DiLoCo registers (everything it does after each inner step: quorum RPC, pseudo-gradient,
    all-reduce and its wait, should_commit RPC, outer step, copies) are wrapped, which is all of its
    time on the training thread; within them, the blocking parts (start_quorum, the all-reduce
    waits, should_commit) are timed separately as "blocked". Bytes: every tensor given to
    manager.allreduce is counted and converted with the ring formula 2(M-1)/M x bytes.
    """
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    from eagerloco.comm.base import wire_bytes

    replicas = int(sys.argv[3])
    own_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=TIMEOUT_S))
    model = wl.build_model()
    opt = wl.inner_optimizer(model)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=TIMEOUT_S)),
        load_state_dict=None, state_dict=None,
        min_replica_size=replicas, use_async_quorum=False, init_sync=False,
        replica_id=f"bench_replica_{replica}", lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"],
        hostname="127.0.0.1", store_addr="127.0.0.1", store_port=own_store.port, rank=0, world_size=1,
        timeout=timedelta(seconds=TIMEOUT_S), quorum_timeout=timedelta(seconds=TIMEOUT_S),
        connect_timeout=timedelta(seconds=TIMEOUT_S),
    )
    prof = _Timer()
    payload = [0]
    allreduce = manager.allreduce

    def counted_allreduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        payload[0] += tensor.numel() * tensor.element_size()
        t0 = time.perf_counter()
        work = allreduce(tensor, *args, **kwargs)
        prof.add("allreduce_launch", time.perf_counter() - t0)
        return _TimedWork(work, prof)

    frags = [model] if fragments == 1 else wl.fragment_modules(model, fragments)
    outer = [wl.outer_sgd(list(f.parameters())) for f in frags]
    diloco = DiLoCo(manager, frags, opt, outer if fragments > 1 else outer[0], sync_every=h,
                    use_bucketization=bucketize, fragment_sync_delay=delay)
    # Instance attributes shadow the methods that __enter__ registers as optimizer hooks.
    diloco._step_pre_hook = prof.wrap("hooks", diloco._step_pre_hook)  # type: ignore[method-assign]
    diloco._step_post_hook = prof.wrap("hooks", diloco._step_post_hook)  # type: ignore[method-assign]
    batches = wl.train_batches(steps, replica)
    wl.warm_up(model, opt, batches[0])
    # A first quorum before timing: it configures the cross-replica process group (connection
    # setup, like eagerloco's process group init) and needs every replica, so it also lines them up.
    t0 = time.perf_counter()
    manager.start_quorum()
    setup_quorum_s = time.perf_counter() - t0
    manager.allreduce = counted_allreduce  # type: ignore[method-assign]
    manager.start_quorum = prof.wrap("quorum", manager.start_quorum)  # type: ignore[method-assign]
    manager.should_commit = prof.wrap("should_commit", manager.should_commit)  # type: ignore[method-assign]
    start_barrier(_store(), replicas)

    def blocked() -> float:
        return sum(prof.s.get(k, 0.0) for k in ("quorum", "allreduce_wait", "should_commit"))

    with diloco:
        res = wl.run_loop(model, opt, batches, counters={"outer": lambda: prof.s.get("hooks", 0.0),
                                                         "blocked": blocked})
    out = _result(res, model, outer_s=prof.s.get("hooks", 0.0), blocked_s=blocked(),
                  bytes_sent=wire_bytes(payload[0], replicas, True), syncs=prof.n.get("should_commit", 0),
                  outer_steps=res.per_step["outer"], blocked_steps=res.per_step["blocked"])
    out["payload_bytes"] = payload[0]
    out["allreduce_calls"] = prof.n.get("allreduce_launch", 0)
    out["setup_quorum_s"] = setup_quorum_s
    out["profile_s"] = prof.s
    out["profile_calls"] = prof.n
    out["committed_steps"] = manager.current_step()
    manager.shutdown(wait=False)
    return out


def _result(res: wl.LoopResult, model: Any, *, outer_s: float, blocked_s: float, bytes_sent: int,
            syncs: int, outer_steps: list[float], blocked_steps: list[float]) -> dict[str, Any]:
    tail = res.losses[-20:]
    return {
        "wall_s": res.wall_s,
        "cpu_s": res.cpu_s,
        "outer_steps": outer_steps,
        "blocked_steps": blocked_steps,
        "wall_steps": res.per_step["step_s"],
        "outer_s": outer_s,
        "blocked_s": blocked_s,
        "bytes_sent": bytes_sent,
        "syncs": syncs,
        "train_loss_last20": sum(tail) / len(tail),
        "eval_loss": wl.eval_loss(model),
        "first_loss": res.losses[0],
    }


#: Streaming's overlap in the *_overlap variants: tau for eagerloco, fragment_sync_delay for torchft.
OVERLAP_STEPS = int(os.environ.get("BENCH_OVERLAP_STEPS", "1"))

VARIANTS: dict[str, Callable[[int, int, int], dict[str, Any]]] = {
    "plain": run_plain,
    "torchft_diloco": lambda r, s, h: run_torchft(1, False, r, s, h),
    "torchft_diloco_bucketized": lambda r, s, h: run_torchft(1, True, r, s, h),
    "torchft_streaming": lambda r, s, h: run_torchft(2, True, r, s, h),
    "ours_diloco": lambda r, s, h: run_ours("diloco", 1, r, s, h),
    "ours_streaming": lambda r, s, h: run_ours("streaming", 2, r, s, h),
    "ours_eager": lambda r, s, h: run_ours("eager", 1, r, s, h),
    "torchft_streaming_overlap": lambda r, s, h: run_torchft(2, True, r, s, h, delay=OVERLAP_STEPS),
    "ours_streaming_overlap": lambda r, s, h: run_ours("streaming", 2, r, s, h, overlap=OVERLAP_STEPS),
    "floor_diloco": lambda r, s, h: run_floor(1, r, s, h),
    "floor_streaming": lambda r, s, h: run_floor(2, r, s, h),
    "floor_streaming_overlap": lambda r, s, h: run_floor(2, r, s, h, overlap=OVERLAP_STEPS),
}


def main() -> None:
    variant, replica, _replicas, steps, h, out = sys.argv[1:7]
    torch.set_num_threads(1)  # 2 cores, 2 processes: one intra-op thread each
    result = VARIANTS[variant](int(replica), int(steps), int(h))
    result.update(variant=variant, replica=int(replica), threads=torch.get_num_threads())
    tmp = Path(out + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(out)


if __name__ == "__main__":
    main()
