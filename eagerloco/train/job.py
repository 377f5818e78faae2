"""One worker per job: ``eagerloco train --outer-addr HOST:PORT --worker-id I --workers M``.

Each worker is its own process, started on its own (by hand, a scheduler, another machine), as the
hook API's workers are: the jobs meet through the outer rendezvous worker 0 hosts
(:func:`~eagerloco.comm.groups.join_outer_group`) and exchange on a gloo group of their own. The
loop, algorithm and accounting are those of every runtime (:func:`~eagerloco.train.loop.run_training`);
the worker trains on shard I of the data, exactly the shard worker I has in-process or under
``eagerloco launch``, so the numbers are those of the other runtimes' worker I.

Each job owns its run directory (``--out``; give each job its own when they share a disk): its
metrics, its summary (this worker's link accounting), its evaluations and its checkpoints, which
hold this worker's state only; ``--resume`` continues each job from its own newest checkpoint
(resume every job, from checkpoints of the same step). With ``--elastic`` the survivors of a dead
worker go on (:mod:`eagerloco.comm.elastic_jobs`; worker 0 must stay).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from eagerloco import checkpoint as ckpt
from eagerloco.comm.distributed import TorchDistCommunicator
from eagerloco.comm.groups import OuterRendezvous, env_int, join_outer_group, leave_outer_group
from eagerloco.comm.link import check_exchange_fits, emulated_link
from eagerloco.config import ConfigError, TrainConfig
from eagerloco.device import resolve_device
from eagerloco.faults import fault_injection
from eagerloco.jsonfiles import write_json_atomic
from eagerloco.kernel_link_env import kernel_link_from_env, link_shaping
from eagerloco.train.loop import Worker, prepare, run_training, task_evals
from eagerloco.train.outputs import RunOutput
from eagerloco.train.resume import announce_resume, checkpoint_meta, resume_checkpoint
from eagerloco.train.rundir import claim


def train_job(cfg: TrainConfig, rdzv: OuterRendezvous, timeout_s: float = 300.0) -> dict[str, Any]:
    """Train worker ``rdzv.worker`` of ``rdzv.workers`` as a job of its own.

    Args:
        cfg: the run's settings (validated here); ``cfg.workers`` must equal ``rdzv.workers``.
        rdzv: the outer rendezvous (worker 0's host:port, this worker's id, M).
        timeout_s: seconds before a silent peer is declared dead.

    Returns:
        This worker's summary (also written to ``<out>/summary.json``).

    Raises:
        ConfigError: an invalid setting or launch.
        PeerError: another worker died or stopped answering; the message names it.
    """
    cfg.validate()
    if cfg.workers != rdzv.workers:
        raise ConfigError(f"--workers {cfg.workers} is the number of workers of the run: with --outer-addr every "
                          f"job passes the same --workers (the rendezvous was given {rdzv.workers})")
    if (env_int("WORLD_SIZE") or 1) > 1:
        raise ConfigError("`eagerloco train --outer-addr` runs one process per worker; start it with python, not "
                          "torchrun, or make each worker a job of several ranks with the hook API "
                          "(eagerloco.outer_loop, examples/)")
    if cfg.rejoin:
        raise ConfigError("--rejoin is for `eagerloco launch --elastic` runs; with --outer-addr a worker that died "
                          "does not come back into the running run (restart every job with --resume)")
    with claim(cfg):
        return _run(cfg, rdzv, timeout_s)


def _run(cfg: TrainConfig, rdzv: OuterRendezvous, timeout_s: float) -> dict[str, Any]:
    from eagerloco.data import worker_streams

    me = rdzv.worker
    out = Path(cfg.out)
    root = ckpt.checkpoint_root(out)
    found = resume_checkpoint(cfg, "distributed")
    corpus, tok, model, evb = prepare(cfg)
    device = resolve_device(cfg.device)
    model = model.to(device)
    stream = worker_streams(corpus, tok, cfg.workers, cfg.batch_size, cfg.seq_len, cfg.seed, iid=cfg.iid)[me]
    kernel_gbps = kernel_link_from_env()
    link = emulated_link(cfg.link, kernel_gbps)
    if kernel_gbps is not None:  # the kernel shapes the bandwidth: the run records its rate
        cfg.link.bandwidth_gbps = kernel_gbps
    check_exchange_fits(link, cfg.outer, cfg.workers, sum(p.numel() for p in model.parameters()), timeout_s)
    ctx = join_outer_group(rdzv, timeout_s)
    comm = TorchDistCommunicator.from_context(ctx, link, seed=cfg.seed, timeout_s=timeout_s, device=device,
                                              elastic=cfg.elastic)
    membership = None
    try:
        worker = Worker(model, comm, stream, cfg)
        if cfg.elastic:
            from eagerloco.comm.elastic_jobs import JobsMembership
            from eagerloco.schedule import apply_delay

            oc = cfg.outer
            membership = JobsMembership(ctx.outer_store, me, rdzv.workers, timeout_s, group=ctx.outer_group,
                                        inner_steps=oc.inner_steps, is_dp=oc.method == "dp", steps=cfg.steps,
                                        delay=apply_delay(oc.method, oc.inner_steps, oc.overlap_steps,
                                                          oc.eager_rounds))
            ctx.outer_group = None  # the membership owns the group (and its successors)
            membership.attach(comm, worker)
        start_step, real_elapsed = 0, 0.0
        if found is not None:
            path, meta = found
            worker.load_state_dict(ckpt.load_worker_state(path, me))
            start_step, real_elapsed = int(meta["step"]), float(meta.get("real_elapsed", 0.0))
            announce_resume(path, start_step, cfg)
        out.mkdir(parents=True, exist_ok=True)
        comm.barrier()  # every job has joined and resumed from the same step
        t_run = time.perf_counter()

        def save(step: int) -> None:
            meta = checkpoint_meta(cfg, real_elapsed + time.perf_counter() - t_run, runtime="distributed",
                                   ranks_per_worker=1, separate_jobs=True, worker=me)
            ckpt.save(root, step, {me: worker.state_dict()}, meta, keep=cfg.keep_checkpoints)

        injected = fault_injection(me)

        def on_step(step: int) -> None:
            if membership is not None:
                membership.on_step(step)
            if injected is not None:
                injected(step)

        output = RunOutput(cfg, start_step, lambda: True)
        try:
            summary = run_training(cfg, [worker], evb, cfg.workers, output.log, cfg.progress, start_step, save,
                                   real_elapsed, on_step=on_step, final_evals=task_evals(cfg, tok))
        finally:
            output.close()
        comm.barrier()  # run_training drained: every job is done with the link before worker 0's store goes
        members = membership.members if membership is not None else list(range(cfg.workers))
        summary.update(runtime="job", worker=me, members=members, link_shaping=link_shaping(),
                       num_params=sum(p.numel() for p in model.parameters()), config=asdict(cfg))
        write_json_atomic(out / "summary.json", summary)
        comm.close()
        return summary
    except BaseException:  # a dead peer, a signal: drop what is queued, do not wait
        comm.close(cancel=True)
        raise
    finally:
        if membership is not None:
            membership.teardown()
        leave_outer_group(ctx)


__all__ = ["train_job"]
