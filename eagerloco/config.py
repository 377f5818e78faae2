"""Validated settings: the outer algorithm, the link, and a whole training run (with its fault settings).

Every check runs before any training step and raises :class:`ConfigError` with a message that
names the flag and the values it accepts. Each field's docstring says what it means in the papers' terms.
"""

from __future__ import annotations

import math
import os
import re
import types
from dataclasses import dataclass, field, fields
from typing import Any, Union, get_args, get_origin, get_type_hints

from eagerloco.codec_sizes import CODEC_NAMES
from eagerloco.schedule import PATTERNS

METHODS = ("dp", "diloco", "streaming", "delayed", "eager")
WEIGHTINGS = ("nonlocal", "stale_average")
OUTER_OPTIMIZERS = ("sgd", "adam", "adamw")
MAX_SEED = 2**63 - 1
MAX_ROUNDS_IN_FLIGHT = 64
#: Slower than this (1 kbit/s) no link carries a model's outer gradient in any useful time.
MIN_BANDWIDTH_GBPS = 1e-6


class ConfigError(ValueError):
    """A setting is invalid; the message names the flag and the allowed values."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class OuterConfig:
    """What the outer algorithm does; one object describes every method of the family.

    method:
      dp         gradient mean every inner step (the baseline)
      diloco     H inner steps, blocking exchange of the mean outer gradient (P must be 1)
      streaming  P staggered fragments, each synced once per H steps, optional tau-step overlap
      delayed    naive delayed outer update: apply the mean that arrived, k rounds late
      eager      eager updates: own fresh outer gradient in place of its missing share
    """

    method: str = "diloco"
    """Which member of the family runs (``--method``): dp, diloco, streaming, delayed or eager."""
    inner_steps: int = 50
    """H: inner steps per outer round. Each fragment is synchronized once every H inner steps."""
    fragments: int = 1
    """P: fragments of blocks synchronized one at a time, staggered (Streaming DiLoCo). 1 for DiLoCo."""
    fragment_pattern: str = "strided"
    """How blocks map to fragments: sequential (contiguous) or strided (block b in fragment b mod P)."""
    overlap_steps: int = 0
    """tau: inner steps an exchange may take before its mean is applied (the overlap of Streaming DiLoCo)."""
    alpha: float = 0.0
    """Merge weight of the local fragment when an overlapped exchange lands: alpha*local + (1-alpha)*outer."""
    eager_rounds: int = 1
    """k: outer rounds an exchange may take for delayed and eager (the papers' k-outer-steps overlap)."""
    eager_weighting: str = "nonlocal"
    """Eager's proxy: nonlocal (every outer gradient applied exactly once) or stale_average."""
    codec: str = "fp32"
    """Format of the outer gradient on the link (bf16, fp8, e2m1, ...); sums stay FP32."""
    codec_block: int = 32
    """Values sharing one scale in the block formats (MX uses 32)."""
    stochastic_rounding: bool = False
    """Round the quantized payload stochastically instead of to nearest."""
    outer_optimizer: str = "sgd"
    """The outer optimizer applied to the averaged outer gradient: sgd, adam or adamw."""
    outer_lr: float = 0.7
    """Outer learning rate (the DiLoCo papers: 0.7; the eager paper lowers it to about 0.4)."""
    outer_momentum: float = 0.9
    """Outer momentum (SGD) or beta1 (Adam); the papers use 0.9."""
    outer_nesterov: bool = True
    """Nesterov momentum for the outer SGD, as in the papers."""

    def validate(self, num_blocks: int | None = None) -> OuterConfig:
        """Raise ConfigError on the first invalid setting; returns self for chaining.

        num_blocks: number of transformer blocks of the model, when known, to check P against.
        """
        _choice("method", self.method, METHODS)
        _choice("fragment_pattern", self.fragment_pattern, PATTERNS)
        _choice("eager_weighting", self.eager_weighting, WEIGHTINGS)
        _choice("codec", self.codec, CODEC_NAMES)
        _choice("outer_optimizer", self.outer_optimizer, OUTER_OPTIMIZERS)
        _int_at_least("inner_steps", self.inner_steps, 1)
        _int_at_least("fragments", self.fragments, 1)
        _int_at_least("eager_rounds", self.eager_rounds, 1)
        if self.eager_rounds > MAX_ROUNDS_IN_FLIGHT:
            raise ConfigError(
                f"{_flag('eager_rounds')} must be at most {MAX_ROUNDS_IN_FLIGHT}: each round in flight keeps a "
                f"copy of the outer gradient (the papers use 1 and 2), got {self.eager_rounds}"
            )
        _int_at_least("overlap_steps", self.overlap_steps, 0)
        _int_at_least("codec_block", self.codec_block, 1)
        if not _finite(self.alpha) or not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"{_flag('alpha')} must be in [0, 1] (weight of the local parameters), got {self.alpha}")
        if not _finite(self.outer_lr) or self.outer_lr <= 0:
            raise ConfigError(f"{_flag('outer_lr')} must be a positive number, got {self.outer_lr}")
        if not _finite(self.outer_momentum) or not 0.0 <= self.outer_momentum < 1.0:
            raise ConfigError(f"{_flag('outer_momentum')} must be in [0, 1), got {self.outer_momentum}")
        if self.outer_nesterov and self.outer_optimizer == "sgd" and self.outer_momentum == 0:
            raise ConfigError(
                f"{_flag('outer_nesterov')} needs {_flag('outer_momentum')} > 0; "
                "pass --no-outer-nesterov for plain SGD"
            )
        if self.method == "diloco" and self.fragments != 1:
            raise ConfigError(
                f"{_flag('method')} diloco synchronizes the whole model at once, so {_flag('fragments')} "
                f"must be 1 (got {self.fragments}); use {_flag('method')} streaming for P > 1"
            )
        if self.method == "dp":
            if self.fragments != 1 or self.overlap_steps != 0:
                raise ConfigError(
                    f"{_flag('method')} dp averages gradients every step: {_flag('fragments')} must be 1 and "
                    f"{_flag('overlap_steps')} 0 (got {self.fragments} and {self.overlap_steps})"
                )
        if self.method in ("delayed", "eager") and self.overlap_steps != 0:
            raise ConfigError(
                f"{_flag('method')} {self.method} already overlaps the exchange with whole rounds "
                f"({_flag('eager_rounds')}); {_flag('overlap_steps')} must be 0, got {self.overlap_steps}"
            )
        if self.method != "dp" and self.fragments > self.inner_steps:
            raise ConfigError(
                f"{_flag('fragments')} ({self.fragments}) must not exceed {_flag('inner_steps')} "
                f"({self.inner_steps}): each fragment needs its own sync step within a round"
            )
        if self.overlap_steps > 0 and self.overlap_steps * self.fragments >= self.inner_steps:
            raise ConfigError(
                f"{_flag('overlap_steps')} must be smaller than H/P = {self.inner_steps}/{self.fragments} "
                f"so one fragment's exchange lands before the next one starts; got {self.overlap_steps}"
            )
        if num_blocks is not None and self.fragments > max(num_blocks, 1):
            raise ConfigError(
                f"{_flag('fragments')} ({self.fragments}) is larger than the model's number of blocks "
                f"({num_blocks}); choose 1..{max(num_blocks, 1)}"
            )
        return self

    @property
    def rounds_in_flight(self) -> int:
        """How many outer rounds an exchange may take before it must be applied."""
        return self.eager_rounds if self.method in ("delayed", "eager") else 0


@dataclass
class LinkConfig:
    """The slow link between workers: bandwidth in Gbit/s (inf: no limit) and one-way latency."""

    bandwidth_gbps: float = math.inf
    """Link bandwidth in Gbit/s between workers (the papers' x-axis); inf: no limit."""
    latency_ms: float = 0.0
    """One-way latency added to every exchange, in milliseconds."""
    jitter_ms: float = 0.0
    """Uniform extra latency in [0, jitter_ms] per exchange, in milliseconds."""

    def validate(self) -> LinkConfig:
        if math.isnan(self.bandwidth_gbps) or self.bandwidth_gbps <= 0:
            raise ConfigError(
                f"--bandwidth-gbps must be a positive number of Gbit/s (inf for no limit), got {self.bandwidth_gbps}"
            )
        if self.bandwidth_gbps < MIN_BANDWIDTH_GBPS:
            raise ConfigError(
                f"--bandwidth-gbps {self.bandwidth_gbps:g} is below {MIN_BANDWIDTH_GBPS:g} Gbit/s (1 kbit/s), where "
                "one exchange would outlast any run; did you mean a larger value?"
            )
        for name in ("latency_ms", "jitter_ms"):
            v = getattr(self, name)
            if not _finite(v) or v < 0:
                raise ConfigError(f"{_flag(name)} must be a finite number >= 0, got {v}")
        return self

    def transfer_seconds(self, nbytes: int) -> float:
        """Seconds the link needs to carry nbytes, latency included (jitter is applied by the caller)."""
        return self.latency_ms / 1e3 + nbytes * 8 / (self.bandwidth_gbps * 1e9)


@dataclass
class TrainConfig:
    """Everything a training run needs; validated before the first step (:meth:`validate`)."""

    model: str = "tiny"
    """Model preset (``eagerloco.model.PRESETS``): tiny, 35m, 100m, ..."""
    data: str = "brown"
    """Text to train on: brown, kjv, austen, a comma list of them, a file or directory, or hf:NAME."""
    data_dir: str | None = None
    """Cache of downloaded data and tokenizers (default $EAGERLOCO_DATA_DIR or ~/.cache/eagerloco)."""
    tokenizer: str = "byte"
    """byte, bpe (8192 tokens) or bpe:<vocab>, trained on the training split."""
    iid: bool = True
    """Whether workers get i.i.d. shards; False gives each worker its own sources or genres (non-i.i.d.)."""
    eval_tasks: str = ""
    """Zero-shot tasks scored at the end on the outer parameters: comma list of hellaswag, piqa, arc_easy."""
    eval_limit: int = 200
    """Examples per zero-shot task."""
    tensorboard: bool = False
    """Also write TensorBoard events to <out>/tensorboard (metrics.jsonl is always written)."""
    batch_size: int = 8
    """Sequences per worker per inner step."""
    seq_len: int = 128
    """Tokens per sequence."""
    steps: int = 200
    """Inner steps per worker (T)."""
    lr: float = 3e-3
    """Peak learning rate of the inner AdamW."""
    weight_decay: float = 0.1
    """Weight decay of the inner AdamW."""
    warmup_steps: int = 20
    """Linear warmup of the inner learning rate, then cosine decay to 10% of the peak."""
    grad_clip: float = 1.0
    """Clip the inner gradient's norm to this; 0: no clipping."""
    eval_every: int = 0
    """Evaluate the outer parameters every N inner steps; 0: only at the end."""
    eval_batches: int = 8
    """Held-out batches per evaluation."""
    log_every: int = 10
    """A metrics.jsonl line every N inner steps."""
    seed: int = 0
    """Seed of initialization, data order and worker shards."""
    workers: int = 2
    """M: workers (replicas, datacenters) joined by the slow link."""
    out: str = "runs/latest"
    """Run directory: metrics.jsonl, summary.json, checkpoints/."""
    sim_step_time: float | None = None
    """Seconds per inner step: simulated in-process, padded with a sleep on processes (an emulated accelerator)."""
    progress: bool = True
    """Show a progress bar on a terminal."""
    device: str = "auto"
    """Where the workers' models run: auto (cuda when available, else cpu), cpu, cuda or cuda:N."""
    precision: str = "auto"
    """Inner-step arithmetic: fp32, or bf16 autocast over FP32 master weights; auto is bf16 on CUDA and fp32
    on CPU. The outer copies, the outer optimizer and the exchange's sums stay FP32 either way."""
    compile: bool = False
    """torch.compile the model for the inner steps; the outer algorithm, evaluation and checkpoints see the
    plain module."""
    peak_tflops: float | None = None
    """The device's peak TFLOP/s that MFU is measured against; default from the table of known GPUs at the
    run's precision (H100, H200, A100), none on a CPU (then the summary has no MFU)."""
    tokens: int | None = None
    """Token budget over all workers; sets steps when given."""
    checkpoint_every: int = 0
    """Checkpoint every N inner steps; 0: never."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep."""
    resume: bool = False
    """Continue from the newest valid checkpoint under out (the same numbers as an uninterrupted run)."""
    overwrite: bool = False
    """Start afresh in an out directory that holds another run, removing that run's files."""
    elastic: bool = False
    """Multi-process: when a worker dies the survivors go on and admit it when it comes back."""
    rejoin: bool = False
    """This process comes back into a running elastic run."""
    slow_workers: list[str] = field(default_factory=list)
    """Emulated stragglers, "ID:FACTOR": worker ID takes FACTOR times as long per inner step."""
    outer: OuterConfig = field(default_factory=OuterConfig)
    """The outer algorithm."""
    link: LinkConfig = field(default_factory=LinkConfig)
    """The link between workers."""

    def validate(self) -> TrainConfig:
        """Check every setting (and resolve ``tokens`` into ``steps``).

        Returns:
            self, for chaining.

        Raises:
            ConfigError: naming the first invalid setting's flag and the values it accepts.
        """
        for name in ("batch_size", "seq_len", "steps", "workers", "eval_batches", "log_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if self.tokens is not None:
            if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1:
                raise ConfigError(f"--tokens must be a positive integer token budget, got {self.tokens!r}")
            per_step = self.batch_size * self.seq_len * self.workers
            self.steps = -(-self.tokens // per_step)
        for name in ("warmup_steps", "eval_every", "seed", "checkpoint_every", "keep_checkpoints"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 0, got {v!r}")
        for name in ("lr", "weight_decay", "grad_clip"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (name == "lr" and v == 0):
                raise ConfigError(f"--{name.replace('_', '-')} must be a finite number >= 0 (lr > 0), got {v!r}")
        self._validate_device()
        if self.sim_step_time is not None and not (math.isfinite(self.sim_step_time) and self.sim_step_time > 0):
            raise ConfigError(f"--sim-step-time must be a positive number of seconds, got {self.sim_step_time}")
        from eagerloco.model import model_config  # local imports: both import torch

        try:
            model_config(self.model)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        if not isinstance(self.tokenizer, str) or not re.fullmatch(r"byte|bpe(:\d+)?", self.tokenizer):
            raise ConfigError(f"--tokenizer must be byte, bpe or bpe:<vocab size>, got {self.tokenizer!r}")
        from eagerloco.data.tokenizer import parse_tokenizer_name

        try:
            parse_tokenizer_name(self.tokenizer)
        except ValueError as e:
            raise ConfigError(f"--tokenizer: {e}") from None
        if self.seed > MAX_SEED:
            raise ConfigError(f"--seed must be at most 2**63 - 1 (it seeds torch and numpy generators), "
                              f"got {self.seed}")
        from eagerloco.evals import TASKS

        unknown = [t for t in self.eval_task_list if t not in TASKS]
        if unknown:
            raise ConfigError(f"--eval-tasks: unknown task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)}")
        if isinstance(self.eval_limit, bool) or not isinstance(self.eval_limit, int) or self.eval_limit < 1:
            raise ConfigError(f"--eval-limit must be an integer >= 1, got {self.eval_limit!r}")
        self.outer.validate()
        self.link.validate()
        self._validate_faults()
        return self

    def _validate_device(self) -> None:
        from eagerloco.device import DEVICE_PATTERN, PRECISIONS, DeviceError, resolve_device  # imports torch

        if not isinstance(self.device, str) or not re.fullmatch(DEVICE_PATTERN, self.device):
            raise ConfigError(f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        try:
            resolve_device(self.device)
        except DeviceError as e:
            raise ConfigError(str(e)) from None
        _choice("precision", self.precision, PRECISIONS)
        if not isinstance(self.compile, bool):
            raise ConfigError(f"--compile is a switch (true/false), got {self.compile!r}")
        p = self.peak_tflops
        if p is not None and (not _finite(p) or p <= 0):
            raise ConfigError(f"--peak-tflops must be a positive number of TFLOP/s, got {p!r}")

    def _validate_faults(self) -> None:
        for name in ("elastic", "rejoin", "resume", "overwrite"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ConfigError(f"--{name} is a switch (true/false), got {v!r}")
        parse_slow_workers(self.slow_workers, self.workers)
        # Several processes: a launcher's WORLD, or each worker its own job (an outer rendezvous).
        distributed = (("RANK" in os.environ and "WORLD_SIZE" in os.environ)
                       or bool(os.environ.get("EAGERLOCO_OUTER_ADDR")))
        if self.resume and self.overwrite:
            raise ConfigError("--resume continues the run in --out and --overwrite replaces it: pass one of them")
        if self.rejoin and not self.elastic:
            raise ConfigError("--rejoin needs --elastic: only an elastic run admits a worker that comes back")
        if self.elastic and not distributed:
            raise ConfigError(
                "--elastic needs the multi-process runtime, where workers can die and come back: "
                "`eagerloco launch --workers M --elastic -- <train args> --elastic`, torchrun, or one job per "
                "worker (--outer-addr HOST:PORT --worker-id I); the in-process runtime has nothing to lose"
            )

    def slowdown(self, worker: int) -> float:
        """How many times slower than measured this worker's inner steps are (1.0: not a straggler)."""
        return parse_slow_workers(self.slow_workers).get(worker, 1.0)

    @property
    def eval_task_list(self) -> list[str]:
        """The zero-shot tasks of ``eval_tasks`` as a list."""
        return [t.strip() for t in self.eval_tasks.split(",") if t.strip()]


def parse_slow_workers(specs: Any, workers: int | None = None) -> dict[int, float]:
    """Parse the straggler settings.

    Args:
        specs: ``["1:1.5", ...]`` (``--slow-worker``, repeatable), one such string, or None.
        workers: the number of workers, to check the ids against, when known.

    Returns:
        {worker id: slowdown factor}.

    Raises:
        ConfigError: naming the bad entry and the fix.
    """
    if specs is None:
        return {}
    if isinstance(specs, str):
        specs = [specs]
    if not isinstance(specs, (list, tuple)):
        raise ConfigError(f"--slow-worker must be given as ID:FACTOR (repeatable), got {specs!r}")
    out: dict[int, float] = {}
    for spec in specs:
        text = str(spec).strip()
        wid, sep, fac = text.partition(":")
        try:
            if not sep:
                raise ValueError
            w, f = int(wid), float(fac)
        except ValueError:
            raise ConfigError(
                f"--slow-worker {text!r}: expected ID:FACTOR, e.g. --slow-worker 1:1.5 "
                "(worker 1 takes 1.5x as long per inner step)"
            ) from None
        if w < 0 or (workers is not None and w >= workers):
            hi = f"0..{workers - 1}" if workers is not None else ">= 0"
            raise ConfigError(f"--slow-worker {text!r}: worker id must be in {hi} (--workers {workers})")
        if not math.isfinite(f) or f < 1.0:
            raise ConfigError(
                f"--slow-worker {text!r}: FACTOR must be a finite number >= 1 (how many times slower), got {fac}"
            )
        if w in out:
            raise ConfigError(f"--slow-worker: worker {w} is given twice; give each worker once")
        out[w] = f
    return out


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{_flag(name)} must be one of {', '.join(allowed)}; got {value!r}")


def _int_at_least(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{_flag(name)} must be an integer >= {low}, got {value!r}")


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _type_name(tp: Any) -> str:
    args = [a for a in get_args(tp) if a is not type(None)]
    if get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args) + (" (or absent)" if type(None) in get_args(tp) else "")
    if get_origin(tp) is list:
        return f"a list of {_type_name(args[0]).removeprefix('a ').removeprefix('an ')}s"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(tp, f"a [{getattr(tp, '__name__', tp)}] table")


def _type_ok(value: Any, tp: Any) -> bool:
    """Whether value has the declared type, strictly: a bool is not an int, "no" is not a bool."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return any(_type_ok(value, a) for a in get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is list:
        return isinstance(value, list) and all(_type_ok(v, get_args(tp)[0]) for v in value)
    return isinstance(value, tp)


def from_dict(cls: type, data: Any, where: str) -> Any:
    """Build a config dataclass from a mapping, checking every key and value against the field's type.

    The dataclasses' own type hints are the schema: no library needed for a handful of flat types.

    Args:
        cls: OuterConfig, LinkConfig or TrainConfig (nested tables are built by the caller).
        data: the mapping, e.g. a TOML table.
        where: what to name in errors, e.g. ``--config run.toml``.

    Returns:
        The dataclass (not yet validated for ranges and combinations: call ``validate()``).

    Raises:
        ConfigError: an unknown key (listing the known ones) or a value of the wrong type, naming
            the key, ``where`` and the expected type.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a table of settings, got {data!r}")
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)} in {where}; known: {', '.join(sorted(known))}")
    for key, value in data.items():
        if not _type_ok(value, hints[key]):
            raise ConfigError(f"{key} = {value!r} in {where}: expected {_type_name(hints[key])}")
    return cls(**data)


__all__ = [
    "ConfigError",
    "LinkConfig",
    "METHODS",
    "OuterConfig",
    "PATTERNS",
    "TrainConfig",
    "WEIGHTINGS",
    "from_dict",
    "parse_slow_workers",
]
