"""The `eagerloco` command: the parser and the dispatch to each subcommand.

Each subcommand's module is imported only when it runs, so `eagerloco simulate` never imports torch.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from eagerloco.config import ConfigError
from eagerloco.faults import RunStopped, die_with_launcher, signal_name, stop_on_signals
from eagerloco.flags import add_train_flags, build_train_config


def _cmd_train(args: argparse.Namespace) -> int:
    from eagerloco.comm.errors import PeerError
    from eagerloco.train import in_distributed_env, train, train_distributed
    from eagerloco.train.outputs import format_table

    cfg = build_train_config(args)
    try:
        with stop_on_signals():
            if in_distributed_env():
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


def _cmd_data(args: argparse.Namespace) -> int:
    from eagerloco.data import fetch_source

    for path in fetch_source(args.data, args.data_dir):
        print(f"ready: {path}")
    return 0


def _demo_argv(extra: list[str]) -> list[str]:
    """The `make demo` job: a small `eagerloco compare` of the eager paper's grid; extra flags win."""
    from eagerloco.compare.grid import DEMO_ARGV

    return ["compare", *DEMO_ARGV, *extra]


def make_parser() -> argparse.ArgumentParser:
    """The whole `eagerloco` parser; each subcommand's handler is ``args.func``."""
    from eagerloco import launch
    from eagerloco.compare import cli as compare_cli
    from eagerloco.sim import cli as sim_cli

    parser = argparse.ArgumentParser(
        prog="eagerloco",
        description="DiLoCo, Streaming DiLoCo and eager outer updates for training across slow links.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train M workers on real text (in-process, simulated link)")
    add_train_flags(p)
    p.set_defaults(func=_cmd_train)
    p = sub.add_parser("demo", help="short comparison of the methods on the default data (eagerloco compare)",
                       description="Runs `eagerloco compare` with the demo's settings; extra compare flags "
                                   "(e.g. --steps 100 --out DIR) override them.")
    p.set_defaults(func=lambda args: main(_demo_argv([])))
    p = sub.add_parser("data", help="fetch and cache the default data (the Brown Corpus)")
    p.add_argument("action", choices=["fetch"], help="fetch: download once, verify the cache afterwards")
    p.add_argument("--data", default="brown", help="source(s): brown, kjv, austen, or a comma list (default brown)")
    p.add_argument("--data-dir", default=None, help="cache dir (default $EAGERLOCO_DATA_DIR or ~/.cache/eagerloco)")
    p.set_defaults(func=_cmd_data)
    sim_cli.add_parser(sub)
    launch.add_parser(sub)
    compare_cli.add_parser(sub)
    return parser


def _exit_code(e: BaseException) -> int | None:
    """2 for bad input (a setting, a file, data, a checkpoint), 3 for a dead peer; None: not ours to report.

    The error classes are imported here, when an error is being reported, so that a command
    that never loads torch does not load it to name the errors it cannot raise.
    """
    from eagerloco.checkpoint import CheckpointError
    from eagerloco.comm.errors import PeerError
    from eagerloco.data import DataError

    if isinstance(e, (ConfigError, FileNotFoundError, DataError, CheckpointError)):
        return 2
    if isinstance(e, PeerError):
        return 3
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the `eagerloco` command.

    Args:
        argv: the arguments after the program name (default ``sys.argv[1:]``).

    Returns:
        The exit status: 0, 2 for bad input (with one line naming it on stderr), 3 for a dead peer.
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"] and not {"-h", "--help"} & set(argv):
        argv = _demo_argv(argv[1:])
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except Exception as e:
        code = _exit_code(e)
        if code is None:
            raise
        print(f"eagerloco: error: {e}", file=sys.stderr, flush=True)
        return code
