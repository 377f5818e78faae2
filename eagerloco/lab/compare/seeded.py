"""Seeded and tuned comparisons (``--seeds N``, ``--tune KEY=V1,V2,...``).

A tuned comparison sweeps each method on a tuning seed of its own and keeps the lowest held-out loss, then runs
every entry at its choice once per seed (a seed sets the data split and order, the initialization and the
shards). A run whose loss ends above the unigram entropy of its data diverged.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from eagerloco.config import ConfigError, TrainConfig
from eagerloco.lab.compare.grid import BASELINES, ENTRIES, GridEntry
from eagerloco.lab.compare.runner import PlannedRun, checked, entry_config, print_done, run_plans
from eagerloco.lab.compare.stats import diverged, spiked, unigram_entropy
from eagerloco.lab.compare.tune import TuneAxis, apply_setting, choose, setting_text, settings_for

#: The tuning seed is this far from the first comparison seed unless --tune-seed says otherwise.
TUNE_SEED_OFFSET = 1000


@dataclass(frozen=True)
class Unit:
    """One row of a seeded comparison: a grid entry, at the swept H when the comparison sweeps H."""

    entry: GridEntry
    h: int | None = None

    @property
    def name(self) -> str:
        return self.entry.name if self.h is None else f"H{self.h}-{self.entry.name}"


def units_for(entries: list[GridEntry], sweep_h: list[int] | None) -> list[Unit]:
    """The rows in report order: every entry (at every swept H); without a sweep the baselines come first, so every
    seeded report shows whether the outer optimizer helps at all."""
    if sweep_h:
        return [Unit(e, h) for h in sweep_h for e in entries]
    base = [ENTRIES[n] for n in BASELINES if ENTRIES[n] not in entries]
    return [Unit(e) for e in [*base, *entries]]


def _plan(base: TrainConfig, unit: Unit, run_dir: Path, lowered: float, seed: int, setting: dict[str, Any],
          tag: str) -> PlannedRun:
    where = f"grid entry {unit.entry.name!r}" + (f" at H = {unit.h}" if unit.h is not None else "")
    where += f" with {setting_text(setting)}" if setting else ""
    cfg = entry_config(base, unit.entry, run_dir, lowered, unit.h)
    cfg = checked(replace(apply_setting(cfg, setting), seed=seed), where)
    return PlannedRun(unit.entry, cfg, run_dir, cfg.outer.inner_steps, unit.h is not None, seed, setting, tag)


def plan_tuning(base: TrainConfig, units: list[Unit], axes: list[TuneAxis], out: Path, lowered: float,
                tune_seed: int) -> dict[str, list[PlannedRun]]:
    """The sweep on ``tune_seed``: {unit: one run per setting} for each unit with a free swept key, under
    ``<out>/tune/<unit>/<setting>``; ConfigError naming an invalid setting before anything trains."""
    plans: dict[str, list[PlannedRun]] = {}
    names = {u.name for u in units}
    for u in units:
        settings = settings_for(u.entry, axes)
        if settings == [{}] or parent_unit(u, names) is not None:
            continue
        plans[u.name] = [
            _plan(base, u, out / "tune" / u.name / setting_text(s), lowered, tune_seed, s,
                  f"tune/{u.name}/{setting_text(s)}")
            for s in settings
        ]
    return plans


def parent_unit(unit: Unit, names: set[str]) -> str | None:
    """The unit whose chosen setting a variant (``GridEntry.tune_as``, e.g. eager with 4-bit exchange
    takes eager's) runs at, when that unit is in the comparison; None otherwise (it is tuned itself)."""
    if unit.entry.tune_as is None:
        return None
    name = unit.entry.tune_as if unit.h is None else f"H{unit.h}-{unit.entry.tune_as}"
    return name if name in names else None


def chosen_from(path: Path, units: list[Unit]) -> dict[str, dict[str, Any]]:
    """{unit: setting} a finished tuned comparison at ``path`` chose, matched by entry name (so a sweep of H runs each
    method at the setting tuned at the base H); ConfigError without a readable summary."""
    import json

    file = path / "summary.json" if path.is_dir() else path
    try:
        saved = json.loads(file.read_text())
        chosen = saved["chosen"]
        if not isinstance(chosen, dict):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--tuned-from {path}: no summary.json of a tuned comparison there ({e})") from e
    by_entry = {name.split("-", 1)[1] if name.startswith("H") and name[1:2].isdigit() else name: s
                for name, s in chosen.items()}
    return {u.name: dict(by_entry[u.entry.name]) for u in units if u.entry.name in by_entry}


def plan_seeded(base: TrainConfig, units: list[Unit], chosen: dict[str, dict[str, Any]], seeds: list[int],
                out: Path, lowered: float) -> list[PlannedRun]:
    """Every unit once per seed at its chosen setting (else the base one), under ``<out>/runs/<unit>/seed<s>``;
    ConfigError naming an invalid entry before anything trains."""
    return [
        _plan(base, u, out / "runs" / u.name / f"seed{s}", lowered, s, chosen.get(u.name, {}), f"{u.name}/seed{s}")
        for u in units
        for s in seeds
    ]


_ENTROPY: dict[tuple[Any, ...], float] = {}


def data_entropy(cfg: TrainConfig) -> float:
    """Unigram entropy (nats per token) of the run's training split under its tokenizer: the loss of a model that
    learned only the token frequencies."""
    import numpy as np

    from eagerloco.data import encode_corpus, get_tokenizer, load_corpus

    key = (cfg.data, cfg.data_dir, cfg.tokenizer, cfg.seed)
    if key not in _ENTROPY:
        corpus = load_corpus(cfg.data, data_dir=cfg.data_dir, seed=cfg.seed)
        tok = get_tokenizer(cfg.tokenizer, corpus, cfg.data_dir)
        train_tokens, _ = encode_corpus(corpus, tok)
        counts = np.bincount(np.asarray(train_tokens.tokens, dtype=np.int64), minlength=tok.vocab_size)
        _ENTROPY[key] = unigram_entropy(counts.tolist())
    return _ENTROPY[key]


def mark_divergence(results: list[dict[str, Any]], plans: list[PlannedRun]) -> None:
    """Add ``unigram_entropy``, ``diverged`` and ``spiked`` to each result (in the plans' order), warning on stderr
    for each run that did."""
    from eagerloco.lab.compare.report import as_number, load_curves

    for r, p in zip(results, plans, strict=True):
        h1 = data_entropy(p.cfg)
        final = as_number(r.get("final_eval_loss"))
        final = final if final is not None else float("nan")
        curve = [e[3] for e in load_curves(r)["eval"]]
        r["unigram_entropy"] = h1
        r["diverged"] = diverged(final, h1)
        r["spiked"] = spiked(curve, h1)
        worst = max((v for v in curve if v == v), default=float("nan"))
        where = f"{r['label']} (seed {p.cfg.seed}, {p.run_dir})"
        if r["diverged"]:
            print(f"eagerloco: warning: {where} diverged: its final eval loss {final:.4f} is above the unigram "
                  f"entropy of the data, {h1:.4f} nats/token; the report marks it", file=sys.stderr, flush=True)
        elif r["spiked"]:
            print(f"eagerloco: warning: {where} spiked: its eval loss climbed back to {worst:.4f}, above the "
                  f"unigram entropy of the data ({h1:.4f} nats/token), before ending at {final:.4f}; the report "
                  "marks it", file=sys.stderr, flush=True)


def run_seeded(args: argparse.Namespace, entries: list[GridEntry], base: TrainConfig, out: Path, lowered: float,
               sweep_h: list[int] | None, axes: list[TuneAxis]) -> int:
    """`eagerloco compare --seeds N [--tune ...]`: plan everything, sweep, pick, run the seeds, report; 0, or
    ConfigError for an invalid setting before anything trains."""
    from eagerloco.lab.compare.report_seeds import write_seeded_report

    seeds = list(range(base.seed, base.seed + (args.seeds or 1)))  # --seeds checked >= 1 by the command
    tune_seed = args.tune_seed if args.tune_seed is not None else base.seed + TUNE_SEED_OFFSET
    if axes and tune_seed in seeds:
        print(f"eagerloco: warning: the tuning seed {tune_seed} is also a comparison seed: the chosen settings "
              "are scored on a seed that reports them", file=sys.stderr)
    units = units_for(entries, sweep_h)
    tuning = plan_tuning(base, units, axes, out, lowered, tune_seed) if axes else {}
    if axes and getattr(args, "tuned_from", None) is not None:
        raise ConfigError("pass either --tune (sweep here) or --tuned-from (settings chosen before), not both")
    plan_seeded(base, units, {}, seeds, out, lowered)  # every entry valid before anything trains
    link = f"{base.link.bandwidth_gbps:g} Gbit/s + {base.link.latency_ms:g} ms"
    n_tune = sum(len(v) for v in tuning.values())
    print(f"compare: {len(units)} methods x {len(seeds)} seed(s) ({', '.join(map(str, seeds))})"
          + (f" after a sweep of {n_tune} runs on seed {tune_seed}" if tuning else "")
          + f", {base.steps} steps x {base.workers} workers ({base.model}, link {link}) -> {out}", flush=True)
    t0 = time.perf_counter()
    chosen: dict[str, dict[str, Any]] = {}
    tune_results: list[dict[str, Any]] = []
    if getattr(args, "tuned_from", None) is not None:
        chosen.update(chosen_from(Path(args.tuned_from), units))
    for name, plans in tuning.items():
        results = run_plans(plans, force=args.force)
        mark_divergence(results, plans)
        losses = [r.get("final_eval_loss") for r in results]
        pick = choose([float(v) if isinstance(v, (int, float)) else float("nan") for v in losses],
                      [r["diverged"] for r in results])
        chosen[name] = dict(plans[pick].setting or {})
        for i, r in enumerate(results):
            r["unit"], r["chosen"] = name, i == pick
        tune_results += results
        print(f"    -> {name}: {setting_text(chosen[name])}", flush=True)
    names = {u.name for u in units}
    for u in units:
        parent = parent_unit(u, names)
        if parent is not None and parent in chosen:
            chosen[u.name] = dict(chosen[parent])
    plans = plan_seeded(base, units, chosen, seeds, out, lowered)
    results = run_plans(plans, force=args.force)
    mark_divergence(results, plans)
    for r, u in zip(results, [u for u in units for _ in seeds], strict=True):
        r["unit"] = u.name
    meta = {
        "kind": "seeded-sweep-inner-steps" if sweep_h else "seeded-grid",
        "grid": [u.entry.name for u in units if u.h is None or u.h == units[0].h],
        "units": [u.name for u in units],
        "sweep_inner_steps": sweep_h,
        "seeds": seeds,
        "tune": [{"key": a.key, "values": list(a.values)} for a in axes],
        "tune_seed": tune_seed if axes else None,
        "chosen": chosen,
        "tuned_from": str(args.tuned_from) if getattr(args, "tuned_from", None) is not None else None,
        "lowered_outer_lr": lowered,
        "base_config": asdict(base),
        "elapsed_s": time.perf_counter() - t0,
    }
    paths = write_seeded_report(out, units, results, tune_results, meta)
    print()
    print(paths["table"])
    print_done(results + tune_results, meta["elapsed_s"], paths["report"])
    return 0
