"""The settings of ``eagerloco simulate``: one field per flag, checked and resolved into what is simulated.

The field docstrings are the ``--help`` (:func:`eagerloco.flags.add_dataclass_flags`); a setting that
``eagerloco train`` also has takes train's name. A comma list is a sweep, one table row per value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np

from eagerloco.codec_sizes import CODEC_BITS, CODEC_NAMES, SCALE_BYTES
from eagerloco.config import ConfigError, setting
from eagerloco.config.checks import check_choice
from eagerloco.config.outer import MAX_ROUNDS_IN_FLIGHT, check_topk
from eagerloco.config.outer import TRANSPORTS as TRAIN_TRANSPORTS
from eagerloco.flags import FromFlags
from eagerloco.schedule import PATTERNS
from eagerloco.sim import paper
from eagerloco.sim.model import (
    PRESETS,
    ModelSpec,
    Variant,
    default_variants,
    fragment_count,
    select_variants,
    with_name,
)

#: The --help sections, in order, with their titles.
GROUPS = {"model": "model", "method": "method", "exchange": "exchange", "link": "link",
          "output": "search and output", "goodput": "goodput under failures and stalls (--goodput)"}
DEFAULT_TARGETS = "0.5,0.8,0.9,0.95,0.99"
MAX_INNER_STEPS = 100_000
#: train's transports, and the papers' ring all-reduce.
TRANSPORTS = ("ring", *TRAIN_TRANSPORTS)


@dataclass
class SimConfig(FromFlags):
    """The flags of ``eagerloco simulate``; :meth:`validate` checks them and resolves the :class:`Settings`."""

    # -- the model. --model names the simulator's presets, the papers' models described by size and
    # step time; train's --model names architectures it builds. The same setting, another list.
    model: str = setting("1b,10b,100b", group="model")
    """Comma list of the papers' models (1b, 10b, 100b) or custom (needs --params and --layers)."""
    params: float | None = setting(None, group="model")
    """Parameter count (custom model, or override a preset)."""
    layers: int | None = setting(None, group="model")
    """Transformer blocks (custom model, or override a preset)."""
    # Not train's --sim-step-time, which puts a clock on a model that really runs: here the step time
    # is part of the model's description, as --params and --layers are.
    step_time: float | None = setting(None, group="model")
    """Seconds per inner step (forward + backward) of one worker (custom model, or override a preset)."""
    peak_tflops: float | None = setting(None, group="model")
    """The peak TFLOP/s of one worker's device (train's --peak-tflops): derive the step time as
    6*params*tokens-per-step / (this * --mfu)."""
    mfu: float | None = setting(None, group="model")
    """Model FLOPs utilization: with --peak-tflops (default 0.6) it sets the step time; for a preset it
    rescales the preset's step time (stated at 0.6) by 0.6 / MFU."""
    tokens_per_step: float = setting(float(2**20), group="model", shown_default="2**20")
    """Tokens one worker processes per inner step (step time from FLOPs; bytes per token)."""

    # -- the method: train's flags, each taking a comma list where the simulator sweeps it.
    method: str | None = setting(None, group="method", shown_default="all rows")
    """Comma list of methods (dp, diloco, streaming, delayed, eager) or row keys (train's --method takes one)."""
    workers: int | None = setting(None, group="method", shown_default="2")
    """M: workers across the slow link."""
    inner_steps: int = setting(100, group="method")
    """H: inner steps per outer round."""
    fragment_layers: int = setting(3, group="method")
    """Blocks per streaming fragment (the papers use 3 at every scale)."""
    fragments: int | None = setting(None, group="method", shown_default="blocks / --fragment-layers")
    """P: number of streaming fragments (overrides --fragment-layers)."""
    overlap_steps: str = setting("1", group="method")
    """tau: comma list of overlaps (inner steps an exchange may take before its mean is applied), one
    Streaming row each (train's --overlap-steps takes one)."""
    eager_rounds: str = setting("1,2", group="method")
    """k: comma list of outer rounds an exchange may take for eager, one row each (train's takes one)."""
    # train's --eager-rounds is k of whichever method runs, delayed or eager; a table shows both, each
    # with its own list, so naive delayed has a flag of its own.
    delayed_rounds: str = setting("1", group="method")
    """k: comma list of outer rounds an exchange may take for naive delayed, one row each."""
    eager_streaming: bool = setting(False, group="method")
    """Delayed and eager rows exchange the streaming fragments instead of the whole model."""
    worker_speeds: str | None = setting(None, metavar="S0,S1,...", group="method", shown_default="equal")
    """Relative speed of each worker (train's --worker-speeds; 1,0.5: worker 1 at half speed, the model's step
    time is the fastest's): adds each worker's compute utilization with a fixed H and with --adaptive-steps."""

    # -- the exchange
    codec: str | None = setting(None, choices=CODEC_NAMES, group="exchange",
                                shown_default="fp32; bf16 with --paper")
    """Format of the outer gradients on the link: its bits per value, and one scale per --codec-block
    values for the formats below 16 bits (train's --codec)."""
    # The two other rows of the table have their own format: train runs one method, one codec.
    low_codec: str = setting("e2m1", choices=CODEC_NAMES, group="exchange")
    """Format of the extra quantized Streaming row (the papers' FP4 row)."""
    dp_codec: str = setting("bf16", choices=CODEC_NAMES, group="exchange")
    """Format of the data-parallel gradients."""
    fragment_pattern: str = setting("strided", choices=PATTERNS, group="exchange")
    """How blocks map to fragments: sequential (contiguous) or strided (block b in fragment b mod P)."""
    codec_block: int = setting(32, group="exchange")
    """Values sharing one scale in the block formats (MX uses 32)."""
    topk: int | None = setting(None, metavar="K", group="exchange", shown_default="off: every value is sent")
    """Sparse exchange (train's --topk): the outer rows send only the K values of largest magnitude of every
    chunk of --topk-chunk values, in --codec (e.g. 2bit), with their positions (SparseLoCo: 64 of 4096); a
    sparse payload is all-gathered unless --transport shared-support. Data-parallel and the --low-codec row stay
    dense."""
    topk_chunk: int = setting(4096, metavar="C", group="exchange")
    """C: values per chunk of the sparse exchange (the fragment's values in model order; the last chunk may
    be shorter)."""
    scale_bytes: int | None = setting(None, group="exchange",
                                      shown_default=f"{SCALE_BYTES}, what the codecs store; 0 with --paper")
    """Bytes per block scale below 16 bits (the runtime's codecs always store bfloat16 scales)."""
    transport: str = setting("ring", choices=TRANSPORTS, group="exchange")
    """ring: 2(M-1)/M of the payload per worker; allgather: (M-1) payloads for quantized outer gradients,
    as the runtime sends them to keep FP32 sums; reduce-scatter: train's --transport reduce-scatter, 2(M-1)
    shards of whole scale blocks per worker, the bytes the runtime counts; shared-support: train's, the --topk
    rows' values alone through that reduce-scatter (dense rows as reduce-scatter). Data-parallel rows too."""

    # -- the link
    bandwidth_gbps: str | None = setting(None, group="link")
    """Comma list of link bandwidths in Gbit/s (inf: no limit) to report utilization at (train's takes one)."""
    latency_ms: float = setting(0.0, group="link")
    """One-way latency added to every transfer, in milliseconds."""

    # -- search and output
    target_cu: str | None = setting(None, group="output",
                                    shown_default=f"{DEFAULT_TARGETS} without --bandwidth-gbps")
    """Comma list of utilization targets in (0, 1]: the least bandwidth reaching each."""
    bw_min: float = setting(1e-3, group="output")
    """Lowest bandwidth of the grid (Gbit/s)."""
    bw_max: float = setting(1e5, group="output", shown_default="1e5")
    """Highest bandwidth of the grid (Gbit/s)."""
    grid_per_decade: int = setting(100, group="output")
    """Grid points per factor of 10."""
    warmup_rounds: int = setting(8, group="output")
    """Steady state: rounds simulated before measuring."""
    measure_rounds: int = setting(32, group="output")
    """Steady state: rounds measured."""
    rounds: int | None = setting(None, group="output")
    """Measure a short run of N rounds from a cold start instead of the steady state (exchanges still in
    flight at the end are not waited for)."""
    paper: bool = setting(False, group="output")
    """The papers' accounting: 16-bit outer gradients, FP4 without scale bytes, M=2, ring, no latency, their
    bandwidth grid (printed with the result)."""
    compare_reference: bool = setting(False, group="output")
    """With --paper: ours beside the papers' published tables, ratio per cell."""
    plan: bool = setting(False, group="output")
    """The cheapest settings reaching --target-cu at --bandwidth-gbps, per model, as `eagerloco train` flags and
    outer_loop arguments to copy, with its assumptions, its measured loss cost and the runner-up: dense codecs
    and 2-bit top-k exchanges (and --topk's own setting when given), at --worker-speeds when given; a summary
    follows when several models are given."""
    verbose: bool = setting(False, group="output")
    """With --plan: every exchange format's cheapest setting and every candidate with its CU."""
    tokens: float = setting(25e9, group="output", shown_default="2.5e10")
    """Training tokens for the total-bytes column (bytes per worker per token times this)."""
    plot: str | None = setting(None, metavar="DIR", group="output")
    """Write cu_<model>.png per model to DIR."""
    json: str | None = setting(None, metavar="PATH", group="output")
    """Write every number as JSON to PATH ('-': stdout)."""

    def validate(self) -> Settings:
        """Check every flag (ConfigError naming the first bad one) and resolve the :class:`Settings` to simulate.

        ``--paper`` only changes defaults (a flag given still wins)."""
        models, sources = self._models()
        if self.compare_reference and not self.paper:
            raise ConfigError("--compare-reference compares with the papers' accounting: add --paper")
        if self.codec is None:
            self.codec = "bf16" if self.paper else "fp32"
        bits = {name: self._codec_bits(name) for name in ("codec", "low_codec", "dp_codec")}
        scale_bytes = self.scale_bytes if self.scale_bytes is not None else (0 if self.paper else SCALE_BYTES)
        workers = self.workers if self.workers is not None else paper.PAPER_WORKERS
        _at_least("--workers", workers, 1)
        _at_least("--inner-steps", self.inner_steps, 1)
        if self.inner_steps > MAX_INNER_STEPS:
            raise ConfigError(f"--inner-steps must be at most {MAX_INNER_STEPS:,} (the papers use 30 to 500; the "
                              f"simulator walks whole rounds), got {self.inner_steps:,}")
        _at_least("--fragment-layers", self.fragment_layers, 1)
        _at_least("--fragments", self.fragments, 1)
        for model in models:
            if self.fragments is not None and self.fragments > model.layers:
                raise ConfigError(
                    f"--fragments ({self.fragments}) exceeds the {model.layers} blocks of model {model.name}"
                )
        check_choice("fragment_pattern", self.fragment_pattern, PATTERNS)
        check_choice("transport", self.transport, TRANSPORTS)
        _at_least("--codec-block", self.codec_block, 1)
        _at_least("--scale-bytes", scale_bytes, 0)
        check_topk(self.topk, self.topk_chunk)
        taus = number_list("--overlap-steps", self.overlap_steps, int, 0)
        eager_ks = number_list("--eager-rounds", self.eager_rounds, int, 1)
        delayed_ks = number_list("--delayed-rounds", self.delayed_rounds, int, 1)
        for flag, ks in (("--eager-rounds", eager_ks), ("--delayed-rounds", delayed_ks)):
            if max(ks) > MAX_ROUNDS_IN_FLIGHT:
                raise ConfigError(f"{flag} values must be at most {MAX_ROUNDS_IN_FLIGHT} (rounds an exchange may take; "
                                  f"the papers use 1 and 2), got {max(ks):,}")
        rows = default_variants(
            bits=bits["codec"], dp_bits=bits["dp_codec"], low_bits=bits["low_codec"], taus=tuple(dict.fromkeys(taus)),
            delayed_rounds=tuple(dict.fromkeys(delayed_ks)), eager_rounds=tuple(dict.fromkeys(eager_ks)),
            eager_fragmented=self.eager_streaming, topk=self.topk, topk_chunk=self.topk_chunk,
            shared=self.transport == "shared-support")
        wanted = [x.lower() for x in _split("--method", self.method)] if self.method is not None else None
        variants = select_variants(rows, wanted)
        if self.topk is not None and all(v.method == "dp" for v in variants):
            raise ConfigError("--topk compresses outer gradients; --method dp exchanges gradients every step (its "
                              "--dp-codec, dense): choose diloco, streaming, delayed or eager, or drop --topk")
        bandwidths, targets = self._link_and_targets()
        self._check_grid_and_outputs()
        if self.plan and (len(bandwidths) != 1 or len(targets) != 1):
            raise ConfigError("--plan needs one --bandwidth-gbps and one --target-cu (one plan per --model)")
        s = Settings(
            self, models=models, variants=variants, dp_bits=bits["dp_codec"], workers=workers, scale_bytes=scale_bytes,
            bandwidths=bandwidths, targets=targets, grid=paper.paper_grid() if self.paper else None,
            sparse=None if self.topk is None else (bits["codec"], self.topk, self.topk_chunk),
            speeds=self._speeds(workers), step_sources=sources,
        )
        s.add_notes()
        if self.topk is not None:
            s.notes.extend(self._topk_notes(variants, workers))
        return s

    def _speeds(self, workers: int) -> list[float] | None:
        if self.worker_speeds is None:
            return None
        speeds = number_list("--worker-speeds", self.worker_speeds, float)
        if not all(math.isfinite(v) and v > 0 for v in speeds):
            raise ConfigError(f"--worker-speeds must be positive numbers, one per worker, got {self.worker_speeds!r}")
        if len(speeds) != workers:
            raise ConfigError(f"--worker-speeds gives {len(speeds)} speed(s) for --workers {workers}: give one per "
                              "worker")
        return speeds

    def _topk_notes(self, variants: list[Variant], workers: int) -> list[str]:
        notes = []
        if any(v.method == "dp" for v in variants):
            notes.append(f"--topk applies to the outer exchanges; the data-parallel row sends its {self.dp_codec} "
                         "gradients dense, every step")
        if self.transport in ("ring", "reduce-scatter") and workers > 2 and any(v.sparse for v in variants):
            notes.append(f"sparse rows are all-gathered ({workers - 1} payloads per worker), not ring-reduced: "
                         "the workers keep different positions (--transport shared-support draws them alike)")
        return notes

    def _models(self) -> tuple[list[ModelSpec], dict[str, tuple[str, bool]]]:
        """The models, and where each one's step time came from (in words; True where assumed)."""
        names = [x.lower() for x in _split("--model", self.model)]
        for name in names:
            if name not in PRESETS and name != "custom":
                raise ConfigError(f"--model: unknown preset {name!r}; choose from {', '.join(PRESETS)} or custom")
        _positive("--params", self.params)
        _at_least("--layers", self.layers, 1)
        _positive("--step-time", self.step_time)
        _positive("--tokens-per-step", self.tokens_per_step)
        _positive("--peak-tflops", self.peak_tflops)
        if self.mfu is not None and not 0 < self.mfu <= 1:
            raise ConfigError(f"--mfu must be in (0, 1], got {self.mfu}")
        overrides = {
            k: v
            for k, v in (("params", self.params), ("layers", self.layers), ("step_time", self.step_time))
            if v is not None
        }
        if self.peak_tflops is not None and self.step_time is not None:
            raise ConfigError("--step-time and --peak-tflops both set the step time; give one of them")
        if (overrides or self.peak_tflops is not None) and len(names) != 1:
            raise ConfigError("--params/--layers/--step-time/--peak-tflops describe one model; give a single --model "
                              f"(got {self.model!r})")
        models = []
        sources: dict[str, tuple[str, bool]] = {}
        for name in names:
            if name == "custom":
                if self.params is None or self.layers is None:
                    raise ConfigError("--model custom needs --params and --layers")
                if self.step_time is None and self.peak_tflops is None:
                    raise ConfigError(
                        "--model custom needs --step-time, or --peak-tflops (with --mfu, --tokens-per-step)"
                    )
                model = ModelSpec("custom", self.params, self.layers, self.step_time or 0.0)
            else:
                model = with_name(PRESETS[name], **overrides)
            source = ("given (--step-time)", False)
            if self.peak_tflops is not None:
                mfu = paper.PRESET_MFU if self.mfu is None else self.mfu
                step = 6.0 * model.params * self.tokens_per_step / (self.peak_tflops * 1e12 * mfu)
                model = with_name(model, step_time=step)
                source = (f"assumed: 6 x params x {self.tokens_per_step:.3g} tokens (--tokens-per-step) at "
                          f"{self.peak_tflops:g} TFLOP/s (--peak-tflops) and MFU {mfu:g} (--mfu)", True)
            elif self.mfu is not None and name != "custom" and self.step_time is None:
                model = with_name(model, step_time=model.step_time * paper.PRESET_MFU / self.mfu)
                source = (f"assumed: the {name} preset's at MFU {self.mfu:g} (--mfu)", True)
            elif self.step_time is None:
                source = (f"assumed: the {name} preset's (MFU {paper.PRESET_MFU:g} on the papers' hardware; "
                          "--step-time sets it)", True)
            sources[model.name] = source
            models.append(model)
        return models, sources

    def _codec_bits(self, name: str) -> int:
        """Bits per value of a codec field."""
        check_choice(name, getattr(self, name), CODEC_NAMES)
        return CODEC_BITS[getattr(self, name)]

    def _link_and_targets(self) -> tuple[list[float], list[float]]:
        bandwidths = number_list("--bandwidth-gbps", self.bandwidth_gbps, float)
        for b in bandwidths:
            if math.isnan(b) or b <= 0:
                raise ConfigError(f"--bandwidth-gbps values must be positive Gbit/s (inf allowed), got {b}")
        if math.isnan(self.latency_ms) or not math.isfinite(self.latency_ms) or self.latency_ms < 0:
            raise ConfigError(f"--latency-ms must be a finite number >= 0, got {self.latency_ms}")
        target_text = self.target_cu if self.target_cu is not None or bandwidths else DEFAULT_TARGETS
        targets = number_list("--target-cu", target_text, float)
        for t in targets:
            if not 0 < t <= 1:
                raise ConfigError(f"--target-cu values must be in (0, 1], got {t}")
        return bandwidths, targets

    def _check_grid_and_outputs(self) -> None:
        _positive("--bw-min", self.bw_min)
        _positive("--bw-max", self.bw_max)
        if self.bw_min >= self.bw_max:
            raise ConfigError(f"--bw-min ({self.bw_min}) must be below --bw-max ({self.bw_max})")
        _at_least("--grid-per-decade", self.grid_per_decade, 1)
        _at_least("--warmup-rounds", self.warmup_rounds, 0)
        _at_least("--measure-rounds", self.measure_rounds, 1)
        _at_least("--rounds", self.rounds, 1)
        _positive("--tokens", self.tokens)
        if self.plot is not None and Path(self.plot).exists() and not Path(self.plot).is_dir():
            raise ConfigError(f"--plot must name a directory, {self.plot!r} is a file")
        if self.json not in (None, "-") and not Path(self.json).parent.is_dir():
            raise ConfigError(f"--json {self.json}: the directory {Path(self.json).parent} does not exist; "
                              "create it or pick another path")


@dataclass
class Settings:
    """What one simulate invocation simulates: the checked flags, and what :meth:`SimConfig.validate` resolved."""

    cfg: SimConfig
    models: list[ModelSpec]
    variants: list[Variant]
    dp_bits: int
    workers: int
    scale_bytes: int
    bandwidths: list[float]
    targets: list[float]
    grid: np.ndarray | None = None  # explicit grid (--paper), else --bw-min..--bw-max
    sparse: tuple[int, int, int] | None = None  # --topk: (bits of --codec, K, --topk-chunk)
    speeds: list[float] | None = None  # --worker-speeds
    #: Where each model's step time came from, in words, and whether it is assumed (not --step-time).
    step_sources: dict[str, tuple[str, bool]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def fragments_for(self, model: ModelSpec) -> int:
        c = self.cfg
        return c.fragments if c.fragments is not None else fragment_count(model.layers, c.fragment_layers)

    def add_notes(self) -> None:
        """The notes printed under the tables: the paper's assumptions, rows that training would refuse."""
        if self.cfg.paper:
            self.notes.extend(f"paper accounting: {a}" for a in paper.PAPER_ASSUMPTIONS)
        for model in self.models:
            P = self.fragments_for(model)
            for v in self.variants:
                if v.fragmented and v.overlap_steps and v.overlap_steps * P >= self.cfg.inner_steps:
                    self.notes.append(
                        f"{model.name}: {v.label} has tau*P = {v.overlap_steps * P} >= H = {self.cfg.inner_steps}; "
                        "simulated as is, but training refuses it (exchanges of several fragments overlap)"
                    )


def _split(flag: str, text: str | None) -> list[str]:
    if text is None:
        return []
    items = [x.strip() for x in str(text).split(",") if x.strip()]
    if not items:
        raise ConfigError(f"{flag} needs at least one value, got {text!r}")
    return items


N = TypeVar("N", int, float)


def number_list(flag: str, text: str | None, kind: type[N], low: int | None = None) -> list[N]:
    """A comma list's values as ``kind`` (int or float), each >= ``low`` when given; ConfigError naming the flag."""
    out = []
    for x in _split(flag, text):
        try:
            v = kind(x)
        except ValueError:
            what = "integers" if kind is int else "numbers"
            raise ConfigError(f"{flag} takes {what} separated by commas, got {x!r}") from None
        if low is not None and v < low:
            raise ConfigError(f"{flag} values must be integers >= {low}, got {v}")
        out.append(v)
    return out


def _positive(flag: str, v: float | None) -> None:
    if v is not None and (math.isnan(v) or v <= 0 or math.isinf(v)):
        raise ConfigError(f"{flag} must be a positive finite number, got {v}")


def _at_least(flag: str, v: int | None, low: int) -> None:
    if v is not None and v < low:
        raise ConfigError(f"{flag} must be an integer >= {low}, got {v}")
