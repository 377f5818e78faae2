"""The `eagerloco` command: train, compare (demo), simulate, launch."""

from __future__ import annotations

import argparse
import math
import os
import sys
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

from eagerloco.checkpoint import CheckpointError
from eagerloco.comm.errors import PeerError
from eagerloco.config import METHODS, PATTERNS, WEIGHTINGS, ConfigError, LinkConfig, OuterConfig, from_dict
from eagerloco.data import DataError

# CLI flag -> (section, field). Sections: "train" (TrainConfig), "outer", "link".
_OUTER_FIELDS = {f.name for f in fields(OuterConfig)}
_LINK_FIELDS = {f.name for f in fields(LinkConfig)}


def _add_train_flags(p: argparse.ArgumentParser) -> None:
    from eagerloco.codecs import CODEC_NAMES

    g = p.add_argument_group("algorithm")
    g.add_argument("--method", choices=METHODS, help="dp, diloco, streaming, delayed or eager (default diloco)")
    g.add_argument("--workers", type=int, help="number of workers M (default 2)")
    g.add_argument("--inner-steps", type=int, help="inner steps per round H (default 50)")
    g.add_argument("--fragments", type=int, help="fragments P for streaming (default 1)")
    g.add_argument("--fragment-pattern", choices=PATTERNS, help="block-to-fragment pattern (default strided)")
    g.add_argument("--overlap-steps", type=int, help="tau: inner steps an exchange may take (default 0)")
    g.add_argument("--alpha", type=float, help="merge weight of the local parameters in [0, 1] (default 0)")
    g.add_argument("--eager-rounds", type=int, help="k: rounds an exchange may take for delayed/eager (default 1)")
    g.add_argument("--eager-weighting", choices=WEIGHTINGS, help="eager weighting (default nonlocal)")
    g.add_argument("--codec", choices=CODEC_NAMES, help="exchange format (default fp32)")
    g.add_argument("--codec-block", type=int, help="values per shared scale for block codecs (default 32)")
    g.add_argument("--stochastic-rounding", action="store_true", default=None, help="stochastic rounding")
    g.add_argument("--outer-optimizer", choices=("sgd", "adam", "adamw"), help="outer optimizer (default sgd)")
    g.add_argument("--outer-lr", type=float, help="outer learning rate (default 0.7)")
    g.add_argument("--outer-momentum", type=float, help="outer momentum (default 0.9)")
    g.add_argument("--no-outer-nesterov", dest="outer_nesterov", action="store_false", default=None,
                   help="plain momentum instead of Nesterov")
    g = p.add_argument_group("link")
    g.add_argument("--bandwidth-gbps", type=float, help="link bandwidth in Gbit/s (default inf)")
    g.add_argument("--latency-ms", type=float, help="link latency in ms (default 0)")
    g.add_argument("--jitter-ms", type=float, help="uniform extra latency in [0, J] ms (default 0)")
    g = p.add_argument_group("training")
    g.add_argument("--model", help="model preset (default tiny)")
    g.add_argument("--data", help="'brown' or a path to a text file or directory (default brown)")
    g.add_argument("--data-dir", help="cache directory for downloaded data (default ~/.cache/eagerloco)")
    g.add_argument("--tokenizer", help="byte, bpe (8192 tokens) or bpe:<vocab>, trained on the training split")
    g.add_argument("--non-iid", dest="iid", action="store_false", default=None,
                   help="give workers different sources / genres instead of i.i.d. shards")
    g.add_argument("--eval-tasks", help="zero-shot tasks at the end: comma list of hellaswag, piqa, arc_easy")
    g.add_argument("--eval-limit", type=int, help="examples per zero-shot task (default 200)")
    g.add_argument("--batch-size", type=int, help="sequences per worker per step (default 8)")
    g.add_argument("--seq-len", type=int, help="tokens per sequence (default 128)")
    g.add_argument("--steps", type=int, help="inner steps per worker (default 200)")
    g.add_argument("--lr", type=float, help="inner AdamW peak learning rate (default 3e-3)")
    g.add_argument("--weight-decay", type=float, help="inner AdamW weight decay (default 0.1)")
    g.add_argument("--warmup-steps", type=int, help="linear warmup steps (default 20)")
    g.add_argument("--grad-clip", type=float, help="gradient-norm clip, 0 for none (default 1.0)")
    g.add_argument("--eval-every", type=int, help="evaluate every N steps, 0: only at the end (default 0)")
    g.add_argument("--eval-batches", type=int, help="held-out batches per evaluation (default 8)")
    g.add_argument("--log-every", type=int, help="metrics line every N steps (default 10)")
    g.add_argument("--sim-step-time", type=float,
                   help="seconds per inner step. In-process: the simulated time of a step instead of the measured "
                   "one. Multi-process: each step is padded with a sleep to this wall time, an emulated "
                   "accelerator of that speed, so that processes sharing cores run at equal speed "
                   "(steps that take longer are counted as slow_steps)")
    g.add_argument("--tokens", type=int, help="token budget over all workers; sets --steps")
    g.add_argument("--checkpoint-every", type=int, help="checkpoint every N steps, 0: never (default 0)")
    g.add_argument("--keep-checkpoints", type=int, help="how many checkpoints to keep (default 2)")
    g.add_argument("--resume", action="store_true", default=None,
                   help="continue from the newest valid checkpoint in --out")
    g.add_argument("--seed", type=int, help="random seed (default 0)")
    g.add_argument("--out", help="output directory (default runs/latest)")
    g.add_argument("--tensorboard", action="store_true", default=None,
                   help="also write TensorBoard events to <out>/tensorboard")
    g.add_argument("--no-progress", dest="progress", action="store_false", default=None, help="no progress bar")
    p.add_argument("--config", type=Path, help="TOML file: top-level training keys, [outer] and [link] tables")
    g = p.add_argument_group("multi-process (under torchrun or `eagerloco launch`)")
    g.add_argument("--ranks-per-worker", type=int,
                   help="ranks per worker, data-parallel inside it (default: the launcher's, else 1)")
    g.add_argument("--fsdp", action="store_true", default=None,
                   help="shard each worker's parameters, gradients and optimizer state over its ranks (FSDP2) "
                   "instead of replicating them; every rank then exchanges its own shard with the same rank of "
                   "the other workers, each over 1/R of the worker's link (needs --ranks-per-worker 2 or more)")
    g.add_argument("--backend", choices=("gloo", "nccl"), help="inner backend (default: nccl with CUDA, else gloo)")
    g.add_argument("--dist-timeout", type=float, default=300.0,
                   help="seconds before a silent peer is declared dead (default 300)")
    g = p.add_argument_group("faults")
    g.add_argument("--elastic", action="store_true", default=None,
                   help="multi-process: when a worker dies the others go on (mean over the workers present) and "
                   "admit it again when it comes back; without it they stop with an error naming it")
    g.add_argument("--rejoin", action="store_true", default=None,
                   help="this process comes back into a running --elastic run (environment: the run's MASTER_ADDR, "
                   "MASTER_PORT and WORLD_SIZE, RANK = its worker id); a live worker hands it the current state "
                   "at the next round boundary")
    g.add_argument("--slow-worker", dest="slow_workers", action="append", default=None, metavar="ID:FACTOR",
                   help="emulate a straggler: worker ID takes FACTOR (>= 1) times its measured time per inner step "
                   "(multi-process: it sleeps; in-process: simulated time); repeatable")


def build_train_config(args: argparse.Namespace) -> Any:
    """Defaults <- config file <- flags given on the command line."""
    from eagerloco.train import TrainConfig

    data: dict[str, Any] = {}
    outer: dict[str, Any] = {}
    link: dict[str, Any] = {}
    if args.config is not None:
        if not args.config.is_file():
            raise ConfigError(f"--config {args.config}: no such file; pass a TOML file")
        try:
            raw = tomllib.loads(args.config.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"--config {args.config}: not valid TOML ({e})") from e
        outer.update(raw.pop("outer", {}))
        link.update(raw.pop("link", {}))
        data.update(raw)
    train_fields = {f.name for f in fields(TrainConfig)} - {"outer", "link"}
    for key, value in vars(args).items():
        if value is None or key in ("config", "func", "command", "ranks_per_worker", "fsdp", "backend", "dist_timeout"):
            continue
        if key in _OUTER_FIELDS:
            outer[key] = value
        elif key in _LINK_FIELDS:
            link[key] = value
        elif key in train_fields:
            data[key] = value
    # Under `eagerloco launch`, the worker count given to the launcher is the default here too.
    launched = os.environ.get("EAGERLOCO_WORKERS")
    if args.workers is None and "workers" not in data and launched:
        data["workers"] = int(launched)
    if getattr(args, "ranks_per_worker", 1) is None:
        args.ranks_per_worker = int(os.environ.get("EAGERLOCO_RANKS_PER_WORKER") or 1)
    where = f"--config {args.config}" if args.config else "the command line"
    cfg = from_dict(TrainConfig, data, where)
    cfg.outer = from_dict(OuterConfig, outer, f"[outer] of {where}")
    cfg.link = from_dict(LinkConfig, link, f"[link] of {where}")
    return cfg.validate()


def _cmd_train(args: argparse.Namespace) -> int:
    from eagerloco.dist_train import in_distributed_env, train_distributed
    from eagerloco.train import train

    cfg = build_train_config(args)
    if in_distributed_env():
        summary = train_distributed(cfg, args.ranks_per_worker, args.backend, args.dist_timeout, bool(args.fsdp))
        if summary is None:  # not rank 0: rank 0 prints the table
            return 0
    else:
        if args.ranks_per_worker != 1 or args.fsdp:
            flag = "--fsdp" if args.fsdp else "--ranks-per-worker"
            raise ConfigError(f"{flag} needs several processes: use `eagerloco launch` or torchrun")
        summary = train(cfg)
    print(format_table([summary]))
    print(f"\nwrote {Path(cfg.out) / 'summary.json'} and {Path(cfg.out) / 'metrics.jsonl'}")
    return 0


def _demo_argv(extra: list[str]) -> list[str]:
    """The `make demo` job: a small `eagerloco compare` of the eager paper's grid; extra flags win."""
    from eagerloco.compare import DEMO_ARGV

    return ["compare", *DEMO_ARGV, *extra]


def _cmd_data(args: argparse.Namespace) -> int:
    from eagerloco.data import fetch_source

    for path in fetch_source(args.data, args.data_dir):
        print(f"ready: {path}")
    return 0


def format_table(summaries: list[dict[str, Any]]) -> str:
    """The comparison table: method, eval loss, bytes, peak, compute utilization on the link."""
    head = ("method", "eval loss", "bytes sent/worker", "peak sync", "blocked s", "CU (link)")
    rows = []
    for s in summaries:
        rows.append((
            s.get("label", s["method"]),
            f"{s['final_eval_loss']:.4f}",
            _fmt_bytes(s["bytes_sent_per_worker"]),
            _fmt_bytes(s["peak_sync_bytes"]),
            f"{s['blocked_s']:.2f}",
            f"{s['compute_utilization']:.3f}",
        ))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def _fmt_bytes(n: float) -> str:
    if not math.isfinite(n):
        return str(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eagerloco",
        description="DiLoCo, Streaming DiLoCo and eager outer updates for training across slow links.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train M workers on real text (in-process, simulated link)")
    _add_train_flags(p)
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
    from eagerloco import compare, launch
    from eagerloco.sim import cli as sim_cli

    sim_cli.add_parser(sub)
    launch.add_parser(sub)
    compare.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"] and not {"-h", "--help"} & set(argv):
        argv = _demo_argv(argv[1:])
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"eagerloco: error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, DataError, CheckpointError) as e:
        print(f"eagerloco: error: {e}", file=sys.stderr)
        return 2
    except PeerError as e:
        print(f"eagerloco: error: {e}", file=sys.stderr, flush=True)
        return 3
