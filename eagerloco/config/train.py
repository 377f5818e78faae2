"""A whole training run's settings: the model, data, inner optimizer and budget, with the outer
algorithm, the link and the runtime as sections. Each field's docstring is also its flag's help."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any

from eagerloco.config.checks import check_choice, check_int_at_least, check_switch, flag_name, is_finite, setting
from eagerloco.config.outer import LinkConfig, OuterConfig
from eagerloco.config.runtime import RuntimeConfig
from eagerloco.environment import Environment
from eagerloco.errors import ConfigError
from eagerloco.extras import check

MAX_SEED = 2**63 - 1
#: Upper bounds of sizes: beyond them a run would not end, or not fit any machine this tool runs on.
MAX_STEPS = 10**9
MAX_WORKERS = 4096
#: The inner AdamW's learning rate: past this every step overflows.
MAX_LR = 10.0
MAX_WEIGHT_DECAY = 10.0
#: An emulated inner step longer than an hour, or a straggler a thousand times slower, outlasts any run.
MAX_STEP_TIME = 3600.0
MAX_SLOWDOWN = 1000.0
INNER_OPTIMIZERS = ("adamw", "muon")
#: Muon's usual peak lr (with torch.optim.Muon's default shape adjustment) and momentum.
MUON_LR = 0.02
MUON_MOMENTUM = 0.95
_DEVICE = "device"


@dataclass
class TrainConfig:
    """Everything a training run needs; validated before the first step (:meth:`validate`)."""

    model: str = "tiny"
    """Model preset (``eagerloco.model.PRESETS``): micro, tiny, 35m, 100m, ..."""
    data: str = "brown"
    """Text to train on: brown, kjv, austen, a comma list of them, a file or directory, or hf:NAME."""
    data_dir: str | None = setting(None, shown_default="$EAGERLOCO_DATA_DIR or ~/.cache/eagerloco")
    """Cache of downloaded data and tokenizers."""
    tokenizer: str = "byte"
    """byte, bpe (8192 tokens) or bpe:<vocab>, trained on the training split."""
    iid: bool = setting(True, flag="--non-iid")
    """Whether workers get i.i.d. shards; --non-iid gives each worker its own sources or genres instead."""
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
    """Inner steps per worker (T); under --adaptive-steps, ticks: the fastest worker's inner steps."""
    lr: float = 3e-3
    """Peak learning rate of the inner AdamW."""
    weight_decay: float = 0.1
    """Weight decay of the inner AdamW, 0 to 10 (and of Muon with --inner-optimizer muon: decoupled, lr x decay a
    step)."""
    inner_optimizer: str = setting("adamw", choices=INNER_OPTIMIZERS)
    """The inner steps' optimizer: adamw; or muon (MuLoCo): torch.optim.Muon for the transformer blocks' 2-D
    weights at --muon-lr, AdamW for the rest (embeddings, head, norms) at --lr, both on the one warmup and
    cosine schedule, each from its own peak."""
    muon_lr: float = MUON_LR
    """Peak learning rate of Muon (--inner-optimizer muon), its update scaled by sqrt(max(1, rows/cols))
    as torch.optim.Muon does; the usual Muon lr, not AdamW's."""
    muon_momentum: float = MUON_MOMENTUM
    """Muon's (Nesterov) momentum, in [0, 1) (--inner-optimizer muon)."""
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
    workers: int = setting(2, group="algorithm", shown_default="the launcher's, else 2")
    """M: workers (replicas, datacenters) joined by the slow link."""
    out: str = "runs/latest"
    """Run directory: metrics.jsonl, summary.json, checkpoints/."""
    sim_step_time: float | None = None
    """Seconds per inner step, above 0 and at most 3600. In-process: the simulated time of a step instead of the
    measured one. Multi-process: each step is padded with a sleep to this wall time, an emulated accelerator of that
    speed, so that processes sharing cores run at equal speed (steps that take longer are counted as
    slow_steps)."""
    progress: bool = True
    """Show a progress bar on a terminal (--no-progress: none)."""
    device: str = setting("auto", group=_DEVICE)
    """Where the workers' models run: auto (cuda when available, else cpu), cpu, cuda or cuda:N."""
    precision: str = setting("auto", choices=("auto", "fp32", "bf16"), group=_DEVICE)
    """Inner-step arithmetic: fp32, or bf16 autocast over FP32 master weights; auto is bf16 on CUDA and fp32
    on CPU. The outer copies, the outer optimizer and the exchange's sums stay FP32 either way."""
    compile: bool = setting(False, group=_DEVICE)
    """torch.compile the model for the inner steps (the first steps pay the compilation); the outer
    algorithm, evaluation and checkpoints see the plain module."""
    peak_tflops: float | None = setting(None, group=_DEVICE, shown_default="known H100/H200/A100 figures")
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
    """Start afresh in an out directory that holds another run, deleting its checkpoints and metrics
    (without it such an out is refused)."""
    slow_workers: list[str] = setting(factory=list, flag="--slow-worker", metavar="ID:FACTOR", group="faults")
    """Emulate a straggler: worker ID takes FACTOR (1 to 1000) times its measured time per inner step
    (multi-process: it sleeps; in-process: simulated time); repeatable."""
    outer: OuterConfig = setting(factory=OuterConfig)
    """The outer algorithm."""
    link: LinkConfig = setting(factory=LinkConfig)
    """The link between workers."""
    runtime: RuntimeConfig = setting(factory=RuntimeConfig)
    """Where the workers run and how they meet."""

    def validate(self, env: Environment | None = None) -> TrainConfig:
        """Check every setting before any step, resolving ``tokens`` into ``steps`` and what the runtime leaves to
        ``env`` (default: read it); returns self.

        Raises:
            ConfigError: naming the first invalid setting's flag and the values it accepts.
        """
        env = Environment.read() if env is None else env
        for name in ("batch_size", "seq_len", "steps", "workers", "eval_batches", "log_every"):
            check_int_at_least(name, getattr(self, name), 1)
        if self.tokens is not None:
            if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1:
                raise ConfigError(f"--tokens must be a positive integer token budget, got {self.tokens!r}")
            per_step = self.batch_size * self.seq_len * self.workers
            self.steps = -(-self.tokens // per_step)
        for name in ("warmup_steps", "eval_every", "seed", "checkpoint_every", "keep_checkpoints"):
            check_int_at_least(name, getattr(self, name), 0)
        for name in ("lr", "weight_decay", "grad_clip"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (name == "lr" and v == 0):
                raise ConfigError(f"{flag_name(name)} must be a finite number >= 0 (lr > 0), got {v!r}")
        self._validate_sizes()
        self._validate_inner_optimizer()
        self._validate_device()
        t = self.sim_step_time
        if t is not None and not (is_finite(t) and 0 < t <= MAX_STEP_TIME):
            raise ConfigError(f"--sim-step-time must be a number of seconds above 0 and at most {MAX_STEP_TIME:g}, "
                              f"got {t!r}")
        self._validate_data()
        self.outer.validate()
        self.link.validate()
        for name in ("resume", "overwrite"):
            check_switch(name, getattr(self, name))
        if self.resume and self.overwrite:
            raise ConfigError("--resume continues the run in --out and --overwrite replaces it: pass one of them")
        parse_slow_workers(self.slow_workers, self.workers)
        self.outer.speed_factors(self.workers)  # one speed per worker, if any
        if self.outer.adaptive_steps and not self.outer.worker_speeds and self.runtime.fsdp:
            raise ConfigError("--adaptive-steps measures each rank's speed, and under --fsdp every rank exchanges "
                              "its own: give the speeds with --worker-speeds")
        if self.outer.transport != "allgather" and self.runtime.elastic:
            raise ConfigError(f"--transport {self.outer.transport} shards each exchange by the number of workers, "
                              "which --elastic changes mid-exchange: use --transport allgather with --elastic")
        self.runtime.validate(self.workers, env, self.device if isinstance(self.device, str) else "auto")
        quorum = self.outer.quorum
        if quorum is not None and quorum > self.workers:
            raise ConfigError(f"--quorum {quorum} is more than the {self.workers} workers (--workers): give at most "
                              f"{self.workers} ({self.workers}: every exchange waits for every worker)")
        kind = self.runtime.kind(env)
        if quorum is not None and quorum < self.workers and kind != "inprocess":
            o = self.outer
            why = ("runs in-process or across jobs at a coordinator (--outer-addr), not under a launcher"
                   if kind != "job"
                   else "across jobs sends fp32 payloads only: drop --codec and --topk" if o.codec != "fp32" or o.topk
                   else "")
            if why:
                raise ConfigError(f"--quorum below --workers {why}; or drop --quorum")
        kernel = self.runtime.kernel_link_gbps
        if kernel is not None:  # the kernel shapes the bandwidth: the run records its rate
            given = self.link.bandwidth_gbps
            if math.isfinite(given) and given != kernel:
                raise ConfigError(
                    f"the launcher shapes the link to {kernel:g} Gbit/s in the kernel (--kernel-link-gbps), but "
                    f"train got --bandwidth-gbps {given:g}: pass the bandwidth once, to the launcher"
                )
            self.link.bandwidth_gbps = kernel
        self._check_memory(self.workers if kind == "inprocess" else 1)
        return self

    def _check_memory(self, replicas: int) -> None:
        """Refuse a run whose models cannot fit this machine's memory (an estimate: model.training_bytes)."""
        from eagerloco.data.tokenizer import parse_tokenizer_name
        from eagerloco.model import model_config, training_bytes

        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):  # not a POSIX machine: no estimate
            return
        vocab = parse_tokenizer_name(self.tokenizer)[1] or 256
        need = replicas * training_bytes(model_config(self.model, vocab, self.seq_len), self.batch_size, self.seq_len)
        if need > total:
            where = f"{replicas} workers in this process" if replicas > 1 else "one worker"
            raise ConfigError(
                f"--model {self.model} with --seq-len {self.seq_len:,} and --batch-size {self.batch_size} needs about "
                f"{need / 2**30:,.1f} GiB for {where}, more than this machine's {total / 2**30:,.1f} GiB: lower "
                "--seq-len, --batch-size or --workers, or run the workers as processes on several machines"
            )

    def _validate_sizes(self) -> None:
        for name, high, what in (("steps", MAX_STEPS, "inner steps"), ("workers", MAX_WORKERS, "workers")):
            if getattr(self, name) > high:
                raise ConfigError(f"--{name} {getattr(self, name):,} is more {what} than any run of this tool can "
                                  f"take (at most {high:,}); did you mean a smaller number?")
        if self.weight_decay > MAX_WEIGHT_DECAY:
            raise ConfigError(f"--weight-decay {self.weight_decay:g} is past {MAX_WEIGHT_DECAY:g}, where each step "
                              "shrinks the weights past zero; the papers use about 0.1")
        if self.lr > MAX_LR:
            raise ConfigError(f"--lr {self.lr:g} is past {MAX_LR:g}, where every AdamW step overflows; the papers' "
                              "inner learning rates are about 1e-4 to 1e-2")

    def _validate_inner_optimizer(self) -> None:
        check_choice("inner_optimizer", self.inner_optimizer, INNER_OPTIMIZERS)
        if not is_finite(self.muon_lr) or not 0 < self.muon_lr <= MAX_LR:
            raise ConfigError(f"--muon-lr must be a finite number > 0 and at most {MAX_LR:g} (Muon's usual peak is "
                              f"about 0.02), got {self.muon_lr!r}")
        if not is_finite(self.muon_momentum) or not 0 <= self.muon_momentum < 1:
            raise ConfigError(f"--muon-momentum must be a number in [0, 1) (Muon's usual is 0.95), "
                              f"got {self.muon_momentum!r}")

    def _validate_data(self) -> None:
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
        if self.tokenizer != "byte":
            check("tokenizers", "--tokenizer bpe")
        if self.seed > MAX_SEED:
            raise ConfigError(f"--seed must be at most 2**63 - 1 (it seeds torch and numpy generators), "
                              f"got {self.seed}")
        from eagerloco.evals import TASKS

        unknown = [t for t in self.eval_task_list if t not in TASKS]
        if unknown:
            raise ConfigError(f"--eval-tasks: unknown task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)}")
        if self.eval_task_list:
            check("pyarrow", "--eval-tasks")  # read at the end of the run: refused before it, not after
        check_int_at_least("eval_limit", self.eval_limit, 1)

    def _validate_device(self) -> None:
        from eagerloco.device import PRECISIONS, DeviceError, resolve_device  # imports torch

        try:  # DeviceError for a name that is not auto, cpu, cuda or cuda:N too
            resolve_device(self.device)
        except DeviceError as e:
            raise ConfigError(str(e)) from None
        check_choice("precision", self.precision, PRECISIONS)
        check_switch("compile", self.compile)
        p = self.peak_tflops
        if p is not None and (not is_finite(p) or p <= 0):
            raise ConfigError(f"--peak-tflops must be a positive number of TFLOP/s, got {p!r}")

    def slowdown(self, worker: int) -> float:
        """How many times slower than measured this worker's inner steps are (1.0: not a straggler): its
        --slow-worker factor times the fastest --worker-speeds over its own."""
        factors = self.outer.speed_factors(self.workers)  # a worker joining beyond the first M: no speed given
        return parse_slow_workers(self.slow_workers).get(worker, 1.0) * (factors[worker] if worker < len(factors)
                                                                         else 1.0)

    @property
    def eval_task_list(self) -> list[str]:
        """The zero-shot tasks of ``eval_tasks`` as a list."""
        return [t.strip() for t in self.eval_tasks.split(",") if t.strip()]


def parse_slow_workers(specs: Any, workers: int | None = None) -> dict[int, float]:
    """``{worker id: slowdown factor}`` from ``--slow-worker`` specs (``["1:1.5", ...]``, one string, or None),
    ids checked against ``workers`` when known; ConfigError naming a bad entry and the fix."""
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
        if not math.isfinite(f) or not 1.0 <= f <= MAX_SLOWDOWN:
            raise ConfigError(f"--slow-worker {text!r}: FACTOR must be a number from 1 to {MAX_SLOWDOWN:g} (how many "
                              f"times slower), got {fac}")
        if w in out:
            raise ConfigError(f"--slow-worker: worker {w} is given twice; give each worker once")
        out[w] = f
    return out
