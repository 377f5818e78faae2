"""The training flags and how they become a TrainConfig: defaults <- TOML file <- flags.

Used by `eagerloco train` and `eagerloco compare`; imports no torch.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

from eagerloco.codec_sizes import CODEC_NAMES
from eagerloco.config import METHODS, PATTERNS, WEIGHTINGS, ConfigError, LinkConfig, OuterConfig, TrainConfig, from_dict

# CLI flag -> (section, field). Sections: "train" (TrainConfig), "outer", "link".
_OUTER_FIELDS = {f.name for f in fields(OuterConfig)}
_LINK_FIELDS = {f.name for f in fields(LinkConfig)}
#: Arguments that are not settings of the run: the parser's own and those of the process layout.
PROCESS_FLAGS = ("config", "func", "command", "ranks_per_worker", "fsdp", "backend", "outer_backend", "dist_timeout",
                 "outer_addr", "worker_id")


def add_train_flags(p: argparse.ArgumentParser) -> None:
    """Add the flags of `eagerloco train` (also used by `eagerloco compare`) to a parser."""
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
    g.add_argument("--overwrite", action="store_true", default=None,
                   help="start afresh in an --out that holds another run, deleting its checkpoints and metrics "
                   "(without it such an --out is refused)")
    g.add_argument("--seed", type=int, help="random seed (default 0)")
    g.add_argument("--out", help="output directory (default runs/latest)")
    g.add_argument("--tensorboard", action="store_true", default=None,
                   help="also write TensorBoard events to <out>/tensorboard")
    g.add_argument("--no-progress", dest="progress", action="store_false", default=None, help="no progress bar")
    g = p.add_argument_group("device")
    g.add_argument("--device", help="auto (cuda when available, else cpu), cpu, cuda or cuda:N (default auto)")
    g.add_argument("--precision", choices=("auto", "fp32", "bf16"),
                   help="inner steps in fp32, or bf16 autocast over FP32 master weights; auto: bf16 on CUDA, fp32 "
                   "on CPU (default auto). Outer copies, outer optimizer and the exchange's sums stay FP32")
    g.add_argument("--compile", action="store_true", default=None,
                   help="torch.compile the model for the inner steps (the first steps pay the compilation)")
    g.add_argument("--peak-tflops", type=float,
                   help="the device's peak TFLOP/s for MFU (default: known H100/H200/A100 figures at the run's "
                   "precision; none on CPU)")
    p.add_argument("--config", type=Path, help="TOML file: top-level training keys, [outer] and [link] tables")
    g = p.add_argument_group("multi-process (under torchrun or `eagerloco launch`)")
    g.add_argument("--ranks-per-worker", type=int,
                   help="ranks per worker, data-parallel inside it (default: the launcher's, else 1)")
    g.add_argument("--fsdp", action="store_true", default=None,
                   help="shard each worker's parameters, gradients and optimizer state over its ranks (FSDP2) "
                   "instead of replicating them; every rank then exchanges its own shard with the same rank of "
                   "the other workers, each over 1/R of the worker's link (needs --ranks-per-worker 2 or more)")
    g.add_argument("--backend", choices=("gloo", "nccl"), help="inner backend (default: nccl with CUDA, else gloo)")
    g.add_argument("--outer-backend", choices=("gloo", "nccl"),
                   help="backend of the outer group between workers (default gloo: payloads move through pinned "
                   "host memory and a dead peer is an exception; nccl keeps them on the GPU)")
    g.add_argument("--dist-timeout", type=float, default=300.0,
                   help="seconds before a silent peer is declared dead (default 300)")
    g.add_argument("--outer-addr", metavar="HOST:PORT",
                   help="each worker its own job (one process, started on its own): the outer rendezvous worker 0 "
                   "hosts at its address and this port; every job passes the same --workers and its own "
                   "--worker-id (and its own --out); environment: EAGERLOCO_OUTER_ADDR")
    g.add_argument("--worker-id", type=int, metavar="I",
                   help="this job's worker, 0..M-1, with --outer-addr (environment: EAGERLOCO_WORKER_ID)")
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
    """The run's settings: defaults <- config file (``--config``) <- flags given on the command line.

    Args:
        args: parsed by a parser that has :func:`add_train_flags`; flags not given are None.

    Returns:
        The validated TrainConfig. ``args.ranks_per_worker`` is filled in from the launcher when unset.

    Raises:
        ConfigError: an unknown key, an unreadable config file or an invalid value, named.
    """

    data: dict[str, Any] = {}
    outer: dict[str, Any] = {}
    link: dict[str, Any] = {}
    if args.config is not None:
        if not args.config.is_file():
            raise ConfigError(f"--config {args.config}: no such file; pass a TOML file")
        try:
            raw = tomllib.loads(args.config.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise ConfigError(f"--config {args.config}: not a text file; pass a TOML file (UTF-8)") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"--config {args.config}: not valid TOML ({e})") from e
        for table, into in (("outer", outer), ("link", link)):
            value = raw.pop(table, {})
            if not isinstance(value, dict):
                raise ConfigError(f"--config {args.config}: [{table}] must be a table of settings "
                                  f"(a [{table}] section), got {table} = {value!r}")
            into.update(value)
        data.update(raw)
    train_fields = {f.name for f in fields(TrainConfig)} - {"outer", "link"}
    for key, value in vars(args).items():
        if value is None or key in PROCESS_FLAGS:
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
    if "tokens" in data and "steps" in data:
        raise ConfigError(f"pass either steps or tokens (a token budget that sets the steps), not both ({where})")
    cfg = from_dict(TrainConfig, data, where)
    cfg.outer = from_dict(OuterConfig, outer, f"[outer] of {where}")
    cfg.link = from_dict(LinkConfig, link, f"[link] of {where}")
    return cfg.validate()


__all__ = ["add_train_flags", "build_train_config"]
