"""The `eagerloco` command: the parser and the dispatch to each subcommand, the library's and the lab's.

Each subcommand's module is imported only when it runs, so `eagerloco simulate` never imports torch.
"""

from __future__ import annotations

import argparse
import sys

from eagerloco.environment import Environment, quiet_torch_cpp_warnings
from eagerloco.flags import add_train_flags


def _cmd_train(args: argparse.Namespace) -> int:
    from eagerloco.train.command import run

    return run(args)


def _cmd_launch(args: argparse.Namespace) -> int:
    if args.kernel_link_gbps is not None:  # the link shaped by the kernel is the lab's
        from eagerloco.lab.launch import run_shaped

        return run_shaped(args)
    from eagerloco.launch import run

    return run(args)


def _cmd_simulate(args: argparse.Namespace) -> int:
    from eagerloco.sim.cli import run

    if args.compare_reference:  # the papers' published tables are the lab's
        from eagerloco.lab.sim_reference import compare_text

        return run(args, compare_text)
    return run(args)


def make_parser() -> argparse.ArgumentParser:
    """The whole `eagerloco` parser; each subcommand's handler is ``args.func``."""
    from eagerloco import launch
    from eagerloco.lab import fetch
    from eagerloco.lab.compare import cli as compare_cli
    from eagerloco.lab.compare import demo
    from eagerloco.launch import coordinator
    from eagerloco.sim import cli as sim_cli

    parser = argparse.ArgumentParser(
        prog="eagerloco",
        description="DiLoCo, Streaming DiLoCo and eager outer updates for training across slow links.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train M workers on real text (in-process, simulated link)")
    add_train_flags(p)
    p.set_defaults(func=_cmd_train)
    demo.add_parser(sub)
    fetch.add_parser(sub)
    sim_cli.add_parser(sub).set_defaults(func=_cmd_simulate)
    launch.add_parser(sub).set_defaults(func=_cmd_launch)
    coordinator.add_parser(sub).set_defaults(func=coordinator.run)
    compare_cli.add_parser(sub)
    return parser


def _exit_code(e: BaseException) -> int | None:
    """2 for bad input (a setting, a file, data, a checkpoint, an optional package not installed), 3 for a
    dead peer, 4 for workers that launched different exchanges, 5 for a run whose numbers stopped being finite;
    None: not ours to report.

    The error classes are imported here, when an error is being reported, so that a command
    that never loads torch does not load it to name the errors it cannot raise.
    """
    from eagerloco.checkpoint import CheckpointError
    from eagerloco.data import DataError
    from eagerloco.hooks.settings import EXIT_STATUS  # the hook API's errors, as exit_on_errors ends a script

    if isinstance(e, (FileNotFoundError, DataError, CheckpointError)):
        return 2
    return next((code for cls, code in EXIT_STATUS if isinstance(e, cls)), None)


def is_launched_training(argv: list[str] | None = None) -> bool:
    """Whether this process is a rank of a launched run (RANK and WORLD_SIZE set) running ``train`` (``argv``: the
    arguments after the program name), which ends without the interpreter's teardown."""
    argv = sys.argv[1:] if argv is None else argv
    return argv[:1] == ["train"] and Environment.read().launched


def preload_train() -> None:
    """Import what ``train`` runs (torch, the trainer, the compiler stack an optimizer loads on its first step), torch's
    C++ warnings quieted: the rank server does it once for every rank it forks."""
    quiet_torch_cpp_warnings()
    import torch._dynamo  # noqa: F401 - the first optimizer step imports it, about half of a rank's start

    import eagerloco.train.command  # noqa: F401


def run_rank(argv: list[str], threads: str | None) -> int:
    """A forked rank's ``python -m eagerloco ARGV`` (``threads``: its OMP_NUM_THREADS); the exit status as
    :func:`main` gives it, 130 for Ctrl-C before the command started."""
    import torch

    if threads:
        torch.set_num_threads(max(1, int(threads)))
    try:
        return main(argv)
    except KeyboardInterrupt:
        print("eagerloco: stopped by SIGINT before the command started", file=sys.stderr, flush=True)
        return 130


def main(argv: list[str] | None = None) -> int:
    """Run the `eagerloco` command; the exit status: 0, 2 for bad input (one line on stderr names it), 3 for a dead
    peer, 4 for workers that launched different exchanges, 5 for a run that diverged."""
    argv = sys.argv[1:] if argv is None else argv
    quiet_torch_cpp_warnings()
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
