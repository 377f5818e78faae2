"""The comparison grids as data: entries, named grids, the papers' numbers, the demo's and compare's defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from eagerloco.config import ConfigError, OuterConfig

OUTER_KEYS = frozenset(f.name for f in fields(OuterConfig))


@dataclass(frozen=True)
class GridEntry:
    """One method of a comparison: a short name (CLI, run directory), the report's label, and the
    OuterConfig fields it sets; every field it does not set comes from the base configuration."""

    name: str
    label: str
    outer: dict[str, Any] = field(default_factory=dict)
    lowered_lr: bool = False  # outer lr <- --lowered-outer-lr
    train: dict[str, Any] = field(default_factory=dict)  # TrainConfig fields it sets (the single worker's M = 1)
    tune_as: str | None = None  # a variant: under --tune it runs at this entry's chosen setting (like for like)

    def fixes(self, key: str) -> bool:
        """Whether this entry sets ``key`` itself, so a tuning sweep of that setting skips it: the fields
        it sets, the outer lr of a lowered-lr entry, and every outer setting of data-parallel
        (it has no outer optimizer)."""
        if key in self.outer or key in self.train or (key == "outer_lr" and self.lowered_lr):
            return True
        return OuterConfig(method=self.outer.get("method", "diloco")).per_step and key in OUTER_KEYS


# Method-specific fields are always set by the entry, so a base config file written for another
# method (say streaming with overlap) cannot leak into an entry where it would be invalid.
METHOD_FIELDS = {"method": "diloco", "fragments": 1, "overlap_steps": 0, "eager_rounds": 1}

#: The sparse exchanges compared: percent of the values kept -> k of every chunk of 4096.
SPARSE_DENSITIES = {"25": 1024, "6": 256, "1.5": 64}


def _sparse(k: int) -> dict[str, Any]:
    """SparseLoCo's exchange as OuterConfig fields: top k of 4096 in 2 bits, error feedback 0.95, plain
    averaging as the outer step (the decayed buffer plays the outer momentum's part)."""
    return {"method": "diloco", "topk": k, "topk_chunk": 4096, "codec": "2bit", "error_feedback": 0.95,
            "outer_optimizer": "average"}


ENTRIES: dict[str, GridEntry] = {
    e.name: e
    for e in (
        GridEntry("dp", "data-parallel", {"method": "dp"}),
        # Baselines that say whether the outer optimizer helps at this scale: one worker alone with the
        # same per-worker batch (half the tokens), and DiLoCo with plain parameter averaging.
        GridEntry("single", "single worker", {"method": "dp"}, train={"workers": 1}),
        GridEntry("averaging", "plain averaging (outer lr 1, no momentum)",
                  {"method": "diloco", "outer_optimizer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.0,
                   "outer_nesterov": False}),
        GridEntry("no-overlap", "no overlap", {"method": "diloco"}),
        GridEntry("overlap-1", "1-inner-step overlap", {"method": "diloco", "overlap_steps": 1}),
        GridEntry("delayed-1", "1-outer-step naive delayed", {"method": "delayed", "eager_rounds": 1}),
        GridEntry("delayed-1-lowlr", "1-outer-step naive delayed, lowered lr",
                  {"method": "delayed", "eager_rounds": 1}, lowered_lr=True),
        GridEntry("eager-1", "1-outer-step eager", {"method": "eager", "eager_rounds": 1}),
        GridEntry("eager-2", "2-outer-steps eager", {"method": "eager", "eager_rounds": 2}),
        # Beyond the eager paper's table: eager with the lowered outer lr too (at this scale the default
        # 0.7 with Nesterov 0.9 overshoots on the half-stale eager update), streaming, 4-bit exchange,
        # the other eager weighting.
        GridEntry("eager-1-lowlr", "1-outer-step eager, lowered lr",
                  {"method": "eager", "eager_rounds": 1}, lowered_lr=True),
        GridEntry("eager-2-lowlr", "2-outer-steps eager, lowered lr",
                  {"method": "eager", "eager_rounds": 2}, lowered_lr=True),
        GridEntry("delayed-2", "2-outer-steps naive delayed", {"method": "delayed", "eager_rounds": 2}),
        GridEntry("eager-1-stale-avg", "1-outer-step eager, stale-average weighting",
                  {"method": "eager", "eager_weighting": "stale_average"}),
        GridEntry("eager-1-4bit", "1-outer-step eager, 4-bit", {"method": "eager", "codec": "e2m1"},
                  tune_as="eager-1"),
        GridEntry("streaming-2", "streaming P=2", {"method": "streaming", "fragments": 2}),
        GridEntry("streaming-2-overlap-1", "streaming P=2, 1-inner-step overlap",
                  {"method": "streaming", "fragments": 2, "overlap_steps": 1}),
        GridEntry("streaming-2-overlap-1-4bit", "streaming P=2, 1-inner-step overlap, 4-bit",
                  {"method": "streaming", "fragments": 2, "overlap_steps": 1, "codec": "e2m1"}),
        GridEntry("streaming-2-eager-1-4bit", "streaming P=2, 1-outer-step eager, 4-bit",
                  {"method": "eager", "fragments": 2, "codec": "e2m1"}),
        # Compressed exchanges (SparseLoCo, MuLoCo): the top k of every chunk of 4096 values in 2 bits,
        # error feedback 0.95 and plain averaging, at about 25%, 6% and 1.5% of the values; the same
        # without error feedback (what the buffer buys); and composed with eager, Streaming and Muon.
        GridEntry("no-overlap-4bit", "no overlap, 4-bit", {"method": "diloco", "codec": "e2m1"}),
        *(GridEntry(f"sparseloco-{pct}", f"SparseLoCo, top {k} of 4096 ({pct}%), 2-bit", {**_sparse(k)})
          for pct, k in SPARSE_DENSITIES.items()),
        *(GridEntry(f"topk-{pct}-no-ef", f"top {k} of 4096 ({pct}%), 2-bit, no error feedback",
                    {**_sparse(k), "error_feedback": None}) for pct, k in SPARSE_DENSITIES.items()),
        GridEntry("eager-1-sparseloco-1.5", "1-outer-step eager, SparseLoCo 1.5%", {**_sparse(64), "method": "eager"}),
        GridEntry("streaming-2-sparseloco-1.5", "streaming P=2, SparseLoCo 1.5%",
                  {**_sparse(64), "method": "streaming", "fragments": 2}),
        # MuLoCo: Muon for the blocks' matrices in the inner steps (AdamW for the rest), with DiLoCo's
        # FP32 exchange and with SparseLoCo's.
        GridEntry("muloco", "DiLoCo, Muon inner steps (MuLoCo)", {"method": "diloco"},
                  train={"inner_optimizer": "muon"}),
        GridEntry("muloco-sparseloco-1.5", "Muon inner steps, SparseLoCo 1.5% (MuLoCo)", {**_sparse(64)},
                  train={"inner_optimizer": "muon"}),
    )
}

#: The eager paper's comparison (its Table of 500M-model results) plus the data-parallel baseline.
PAPER_GRID = ["dp", "no-overlap", "overlap-1", "delayed-1", "delayed-1-lowlr", "eager-1", "eager-2"]
ALL_GRID = list(ENTRIES)
#: What `--sweep inner-steps` compares at each H unless --grid says otherwise.
SWEEP_GRID = ["no-overlap", "delayed-1", "eager-1"]
#: Put in every seeded or tuned comparison (``--seeds``, ``--tune``) so a reader sees whether the outer
#: optimizer helps at all: data-parallel, one worker alone, plain averaging.
BASELINES = ["dp", "single", "averaging"]
#: The loss-per-byte comparison of compressed exchanges (bench/results/compression).
COMPRESSION_GRID = ["no-overlap", "no-overlap-4bit", *(f"sparseloco-{p}" for p in SPARSE_DENSITIES),
                    *(f"topk-{p}-no-ef" for p in SPARSE_DENSITIES), "eager-1-sparseloco-1.5",
                    "streaming-2-sparseloco-1.5", "muloco", "muloco-sparseloco-1.5"]
#: The two best of bench/results/compression (141x fewer bytes than DiLoCo at its loss or below), beside DiLoCo.
COMPRESSION_BEST = ["no-overlap", "sparseloco-1.5", "muloco-sparseloco-1.5"]
GRIDS = {"paper": PAPER_GRID, "all": ALL_GRID, "baselines": BASELINES, "compression": COMPRESSION_GRID,
         "compression-best": COMPRESSION_BEST}

#: Eval loss the eager paper reports for its 500M model at H = 30 (docs/algorithms.md, section 6).
PAPER_EVAL_LOSS = {"no-overlap": 2.67, "overlap-1": 2.67, "delayed-1": 3.01, "delayed-1-lowlr": 2.73,
                   "eager-1": 2.69, "eager-2": 2.73}

#: compare's own defaults, used where neither a flag nor the config file sets the field. The link
#: carries one fp32 exchange of the tiny model between 2 workers in about 1 s: longer than the 1-step
#: overlap hides, shorter than one round of H = 20 steps (~1.2 s at ~60 ms a step), so the
#: methods' tolerated windows show up in the compute-utilization column.
COMPARE_DEFAULTS: dict[str, Any] = {"inner_steps": 20, "bandwidth_gbps": 0.03, "latency_ms": 50.0}
DEFAULT_OUT = "runs/compare"
DEFAULT_SWEEP_H = "10,20,50"

#: TrainConfig fields that do not change a run's numbers: a cached run is reused across them.
#: (runtime: compare trains in this process; elastic and rejoin: where the runtime settings were before.)
CACHE_IGNORED = {"out", "progress", "resume", "overwrite", "checkpoint_every", "keep_checkpoints", "tokens", "runtime",
                 "elastic", "rejoin"}
#: Flags that choose the method; in compare the grid entry does.
PER_ENTRY_FLAGS = ("method", "fragments", "overlap_steps", "eager_rounds")


def grid_help(sep: str = "; ") -> str:
    return sep.join(f"{e.name} ({e.label})" for e in ENTRIES.values())


def resolve_grid(spec: str) -> list[GridEntry]:
    """A named grid (:data:`GRIDS`), or a comma list of entry names, labels without commas, or those grids."""
    by_label = {e.label.lower(): e for e in ENTRIES.values()}
    chosen: list[GridEntry] = []
    unknown = []
    for raw in spec.split(","):
        name = raw.strip()
        if name in GRIDS:
            found = [ENTRIES[n] for n in GRIDS[name]]
        else:
            one = ENTRIES.get(name) or by_label.get(name.lower())
            found = [one] if one is not None else []
        if not found:
            unknown.append(name)
        chosen += [e for e in found if e not in chosen]
    if unknown or not chosen:
        bad = ", ".join(repr(u) for u in unknown) or repr(spec)
        raise ConfigError(
            f"--grid: unknown entry {bad}; pass 'paper', 'all' or a comma list of these names:\n  "
            + grid_help("\n  ")
        )
    return chosen


def tolerated_steps(outer: OuterConfig) -> int:
    """Inner steps an exchange may take before it is applied: the schedule's own number."""
    return outer.apply_delay


def tolerated_text(outer: OuterConfig, step_s: float | None) -> str:
    """'0', '1 step (0.06 s)', '1 round = 20 steps (1.20 s)': steps from the schedule, seconds on
    the link's clock (steps x mean measured step time)."""
    steps = tolerated_steps(outer)
    if steps == 0:
        return "0"
    secs = f" ({steps * step_s:.2f} s)" if step_s is not None and math.isfinite(step_s) else ""
    if outer.rounds_in_flight:
        k = outer.rounds_in_flight
        return f"{k} round{'s' if k != 1 else ''} = {steps} steps{secs}"
    return f"{steps} step{'s' if steps != 1 else ''}{secs}"
