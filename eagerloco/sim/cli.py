"""``eagerloco simulate``: compute utilization of each method on a given link, before paying for a run.

Modes: the default tables, ``--paper``, ``--paper --compare-reference``, ``--plan`` and ``--goodput``
(docs/guides/simulator.md); everything printed is also in the report that ``--json`` writes. Imports no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagerloco.config import ConfigError
from eagerloco.extras import MissingExtraError, check
from eagerloco.flags import add_dataclass_flags
from eagerloco.jsonfiles import finite_json, write_json_atomic
from eagerloco.sim import paper
from eagerloco.sim.config import GROUPS, Settings, SimConfig
from eagerloco.sim.goodput import GoodputConfig, format_goodput, goodput_report
from eagerloco.sim.plot import PLOT_NEEDS, plot_cu
from eagerloco.sim.report import format_text
from eagerloco.sim.tables import compute

__all__ = ["Reference", "add_arguments", "add_parser", "compute", "format_text", "run"]

#: ``--compare-reference``: (MFU, cold-start rounds or None, fragment pattern) -> the report and its text, ours beside
#: the papers' published tables (the lab's :func:`eagerloco.lab.sim_reference.compare_text`).
Reference = Callable[[float, int | None, str], tuple[dict[str, Any], str]]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``simulate`` subcommand with all its flags; its handler is :func:`run`."""
    p = subparsers.add_parser(
        "simulate",
        help="simulate compute utilization of each method against link bandwidth",
        description=(
            "Event simulation of each method's schedule (the same one training uses) on a link that "
            "carries one transfer at a time. Reports compute utilization = compute time / wall time "
            "over a long run, the least bandwidth reaching each target, and bytes per token. A flag "
            "that `eagerloco train` also has means the same there; a comma list sweeps it."
        ),
    )
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The simulate flags, made from :class:`SimConfig` and :class:`GoodputConfig`."""
    groups = {name: p.add_argument_group(title) for name, title in GROUPS.items()}
    add_dataclass_flags(groups, SimConfig)
    add_dataclass_flags(groups, GoodputConfig)


def run(args: argparse.Namespace, reference: Reference | None = None) -> int:
    """Simulate, print the tables, and write --json / --plot outputs; 2 on invalid input. ``reference``: what
    ``--compare-reference`` prints, which the command line (:mod:`eagerloco.cli`) takes from the lab."""
    started = time.perf_counter()
    try:
        cfg = SimConfig.from_args(args)
        settings = cfg.validate()
        gp = GoodputConfig.from_args(args)
        if gp.goodput and (cfg.plan or cfg.compare_reference or cfg.plot is not None):
            raise ConfigError("--goodput is a report of its own: drop --plan, --compare-reference and --plot")
        if gp.goodput:
            report = goodput_report(gp, settings)
        if cfg.compare_reference and reference is None:
            raise ConfigError("--compare-reference sets ours beside the papers' tables, which the lab holds: run it as "
                              "`eagerloco simulate`")
        if cfg.plot is not None:
            check("matplotlib", PLOT_NEEDS)  # before simulating, not after
    except (ConfigError, MissingExtraError) as e:
        print(f"eagerloco simulate: error: {e}", file=sys.stderr)
        return 2
    text = None  # the default tables are written once the report has its time
    if gp.goodput:
        text = format_goodput(report)
    elif cfg.compare_reference or cfg.plan:
        report, text = special(cfg, settings, reference)
    else:
        report, curves, grid = compute(settings)
        if cfg.plot is not None:
            written = []
            for m in report["models"]:
                name = m["model"]["name"]
                title = (f"{name}: {m['model']['params']:.3g} params, step {m['model']['step_time']:.3g} s, "
                         f"M={settings.workers}, H={cfg.inner_steps}, P={m['fragments']}")
                path = Path(cfg.plot) / f"cu_{name.replace('*', '-custom')}.png"
                written.append(str(plot_cu(path, title, grid, curves[name], settings.targets)))
            report["plots"] = written
    report["seconds"] = time.perf_counter() - started
    if text is None:
        text = "\n".join([format_text(report), *(f"wrote {path}" for path in report.get("plots", []))])
    print(text, file=sys.stderr if cfg.json == "-" else sys.stdout)
    write_json(cfg.json, report)
    return 0


def special(cfg: SimConfig, s: Settings, reference: Reference | None = None) -> tuple[dict[str, Any], str]:
    """--compare-reference and --plan: their report and text."""
    if cfg.compare_reference:
        assert reference is not None  # run() refused it without one
        return reference(paper.PRESET_MFU if cfg.mfu is None else cfg.mfu, cfg.rounds, cfg.fragment_pattern)
    from dataclasses import replace

    from eagerloco.sim.advice import STEP_TIME_FACTORS, format_decision
    from eagerloco.sim.plan import SPARSE, Question, cheapest, format_summary, plan

    sparse = SPARSE if s.sparse is None or s.sparse in SPARSE else (*SPARSE, s.sparse)
    q = Question(s.bandwidths[0], s.targets[0], s.workers, cfg.fragment_layers, s.scale_bytes, cfg.transport,
                 cfg.latency_ms, cfg.fragment_pattern, s.dp_bits, cfg.codec_block, sparse,
                 None if s.speeds is None else tuple(s.speeds))
    reports, texts = [], []
    for m in s.models:
        report = plan(m, q)
        source, assumed = s.step_sources.get(m.name, ("given", False))
        shifted = ({f: cheapest(replace(m, step_time=m.step_time * f), q) for f in STEP_TIME_FACTORS}
                   if assumed and report["best"] is not None else None)
        report["step_time_source"] = source
        report["at_other_step_times"] = None if shifted is None else {str(f): r for f, r in shifted.items()}
        reports.append(report)
        texts.append(format_decision(report, source, shifted, cfg.verbose))
    notes = "".join(f"\nnote: {n}" for n in s.notes)
    if len(reports) == 1:
        return reports[0], texts[0] + notes
    text = "\n\n".join([*texts, format_summary(reports)])
    return {"bandwidth_gbps": s.bandwidths[0], "target": s.targets[0], "plans": reports}, text + notes


def write_json(path: str | None, report: dict[str, Any]) -> None:
    """Write the report as strict JSON to path ('-': stdout); nothing when path is None."""
    if path is None:
        return
    if path == "-":
        print(json.dumps(finite_json(report), indent=2, allow_nan=False))
    else:
        write_json_atomic(Path(path), report)  # its directory was checked before simulating

