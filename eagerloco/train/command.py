"""`eagerloco train` from its parsed flags to its exit status, with one line for a signal or a dead peer."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from eagerloco.checkpoint import NO_ROOM_ERRNOS, checkpoint_root, newest_intact, resume_hint
from eagerloco.comm.errors import PEER_EXIT_CODE, PeerError
from eagerloco.config import Environment
from eagerloco.errors import DIVERGED_EXIT_CODE, DivergedError
from eagerloco.flags import build_train_config
from eagerloco.signals import RunStopped, die_with_launcher, signal_name, stop_on_signals
from eagerloco.train.outputs import format_table
from eagerloco.train.run import train


def run(args: argparse.Namespace) -> int:
    """`eagerloco train`: in-process, this process's share of a multi-process run, or one worker as its
    own job (``--outer-addr``). Returns the exit status: 0; 2 when a file cannot be written for lack of room;
    3 for a dead peer; 5 for a diverged run; 128 + the signal that stopped the run (each with one line)."""
    env = Environment.read()
    cfg = build_train_config(args, env)
    try:
        with stop_on_signals():
            if cfg.runtime.kind(env) != "inprocess":
                die_with_launcher(env)
            summary = train(cfg, env, validated=True)
            if summary is None:  # not the reporting process: it prints the table
                return 0
    except (KeyboardInterrupt, RunStopped) as e:
        signum = e.signum if isinstance(e, RunStopped) else int(signal.SIGINT)
        print(f"eagerloco: {stopped_line(signum, Path(cfg.out))}", file=sys.stderr, flush=True)
        return 128 + signum
    except PeerError as e:  # a dead or frozen peer: name the checkpoint that the restart resumes from
        print(f"eagerloco: error: {e} ({resume_hint(checkpoint_root(Path(cfg.out)))})", file=sys.stderr, flush=True)
        return PEER_EXIT_CODE
    except DivergedError as e:  # nothing after it was checkpointed: name what was kept
        found = newest_intact(checkpoint_root(Path(cfg.out)))
        kept = "no checkpoint was written" if found is None else f"the newest checkpoint, {found[0]}, is from before it"
        print(f"eagerloco: error: {e} ({kept})", file=sys.stderr, flush=True)
        return DIVERGED_EXIT_CODE
    except OSError as e:
        if e.errno not in NO_ROOM_ERRNOS:
            raise
        print(f"eagerloco: error: {no_room_line(e, Path(cfg.out))}", file=sys.stderr, flush=True)
        return 2
    print(format_table([summary]))
    print(f"\nwrote {Path(cfg.out) / 'summary.json'} and {Path(cfg.out) / 'metrics.jsonl'}")
    return 0


def stopped_line(signum: int, out: Path) -> str:
    """The line (without the program prefix) of a run stopped by ``signum``: the checkpoint to resume from."""
    found = newest_intact(checkpoint_root(out))
    if found is not None:
        return (f"stopped by {signal_name(signum)}; the newest good checkpoint is {found[0]} (step {found[1]}): "
                "run the same command with --resume to continue from it")
    return (f"stopped by {signal_name(signum)} before any checkpoint of {out} was written; nothing to resume "
            "(--checkpoint-every N saves one every N steps)")


def no_room_line(e: OSError, out: Path) -> str:
    """The line of a run whose file cannot be written for lack of room (``e.errno`` in
    ``checkpoint.NO_ROOM_ERRNOS``): the file, the reason, the directory to free, the checkpoint to resume."""
    where = e.filename or out
    return (f"cannot write {where}: {e.strerror or e}; free space on the disk of {out} (or make it writable), "
            f"then continue: {resume_hint(checkpoint_root(out))}")
