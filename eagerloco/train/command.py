"""`eagerloco train` from its parsed flags to its exit status, with one line for a signal or a dead peer."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from eagerloco.comm.errors import PeerError
from eagerloco.comm.groups import OUTER_ADDR_ENV, WORKER_ID_ENV, OuterRendezvous, env_int
from eagerloco.config import ConfigError
from eagerloco.faults import RunStopped, die_with_launcher, signal_name, stop_on_signals
from eagerloco.flags import build_train_config
from eagerloco.train.distributed import in_distributed_env, train_distributed
from eagerloco.train.inprocess import train
from eagerloco.train.job import train_job
from eagerloco.train.outputs import format_table


def run(args: argparse.Namespace) -> int:
    """`eagerloco train`: in-process, this process's share of a multi-process run, or one worker as its
    own job (``--outer-addr``).

    Args:
        args: parsed by a parser that has :func:`eagerloco.flags.add_train_flags`.

    Returns:
        The exit status: 0; 2 when a file cannot be written for lack of room; 3 for a dead peer;
        128 + the signal that stopped the run. Each prints one line naming what happened.
    """
    addr = getattr(args, "outer_addr", None)
    if not addr:
        return _run(args)
    # The job's rendezvous in the environment while it runs, as EAGERLOCO_OUTER_ADDR would give it:
    # the settings' checks see several processes (--elastic), and so would a child process.
    before = os.environ.get(OUTER_ADDR_ENV)
    os.environ[OUTER_ADDR_ENV] = addr
    try:
        return _run(args)
    finally:
        if before is None:
            os.environ.pop(OUTER_ADDR_ENV, None)
        else:
            os.environ[OUTER_ADDR_ENV] = before


def _run(args: argparse.Namespace) -> int:
    cfg = build_train_config(args)
    rdzv = outer_rendezvous(args, cfg.workers)
    try:
        with stop_on_signals():
            if rdzv is not None:  # each worker its own job
                die_with_launcher()
                summary = train_job(cfg, rdzv, args.dist_timeout)
            elif in_distributed_env():
                die_with_launcher()
                summary = train_distributed(cfg, args.ranks_per_worker, args.backend, args.dist_timeout,
                                            bool(args.fsdp), args.outer_backend)
                if summary is None:  # not rank 0: rank 0 prints the table
                    return 0
            else:
                if args.ranks_per_worker != 1 or args.fsdp:
                    flag = "--fsdp" if args.fsdp else "--ranks-per-worker"
                    raise ConfigError(f"{flag} needs several processes: use `eagerloco launch` or torchrun")
                summary = train(cfg)
    except (KeyboardInterrupt, RunStopped) as e:
        signum = e.signum if isinstance(e, RunStopped) else int(signal.SIGINT)
        print(f"eagerloco: {stopped_line(signum, Path(cfg.out))}", file=sys.stderr, flush=True)
        return 128 + signum
    except PeerError as e:  # a dead or frozen peer: name the checkpoint that the restart resumes from
        from eagerloco.checkpoint import checkpoint_root, resume_hint

        print(f"eagerloco: error: {e} ({resume_hint(checkpoint_root(Path(cfg.out)))})", file=sys.stderr, flush=True)
        return 3
    except OSError as e:
        from eagerloco.checkpoint import NO_ROOM_ERRNOS

        if e.errno not in NO_ROOM_ERRNOS:
            raise
        print(f"eagerloco: error: {no_room_line(e, Path(cfg.out))}", file=sys.stderr, flush=True)
        return 2
    print(format_table([summary]))
    print(f"\nwrote {Path(cfg.out) / 'summary.json'} and {Path(cfg.out) / 'metrics.jsonl'}")
    return 0


def outer_rendezvous(args: argparse.Namespace, workers: int) -> OuterRendezvous | None:
    """The outer rendezvous of ``--outer-addr`` / ``--worker-id`` (or EAGERLOCO_OUTER_ADDR and
    EAGERLOCO_WORKER_ID), or None when the workers are not separate jobs.

    Raises:
        ConfigError: --worker-id without --outer-addr, or an invalid address or id.
    """
    addr, worker = getattr(args, "outer_addr", None), getattr(args, "worker_id", None)
    if addr:
        return OuterRendezvous.parse(addr, worker, workers)
    if worker is not None:
        raise ConfigError("--worker-id needs --outer-addr HOST:PORT (worker 0's outer rendezvous); without it the "
                          "workers run in this process or under `eagerloco launch`")
    if os.environ.get(OUTER_ADDR_ENV):
        return OuterRendezvous.parse(os.environ[OUTER_ADDR_ENV], env_int(WORKER_ID_ENV), workers)
    return None


def stopped_line(signum: int, out: Path) -> str:
    """What a run stopped by a signal says: the signal and the newest intact checkpoint to resume from.

    Args:
        signum: the signal that stopped it.
        out: the run directory.

    Returns:
        One line, without the program prefix.
    """
    from eagerloco import checkpoint as ckpt

    found = ckpt.newest_intact(ckpt.checkpoint_root(out))
    if found is not None:
        return (f"stopped by {signal_name(signum)}; the newest good checkpoint is {found[0]} (step {found[1]}): "
                "run the same command with --resume to continue from it")
    return (f"stopped by {signal_name(signum)} before any checkpoint of {out} was written; nothing to resume "
            "(--checkpoint-every N saves one every N steps)")


def no_room_line(e: OSError, out: Path) -> str:
    """What a run says when a file of it cannot be written for lack of room (a full disk, a quota).

    Args:
        e: the write error (its errno one of ``checkpoint.NO_ROOM_ERRNOS``).
        out: the run directory.

    Returns:
        One line naming the file, the reason, the directory to free and the checkpoint to resume from.
    """
    from eagerloco import checkpoint as ckpt

    where = e.filename or out
    return (f"cannot write {where}: {e.strerror or e}; free space on the disk of {out} (or make it writable), "
            f"then continue: {ckpt.resume_hint(ckpt.checkpoint_root(out))}")


__all__ = ["no_room_line", "outer_rendezvous", "run", "stopped_line"]
