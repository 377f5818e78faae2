"""`eagerloco demo` (`make demo`): one seed of the committed seeded comparison, at its tuned settings.

It prints a table that fits a 100-column terminal, the comparison's paired result (3 seeds, 90% interval) beside
this run's own difference; the full table and plots go to ``<out>/report.md``.
"""

from __future__ import annotations

import argparse
import textwrap
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from eagerloco.config import ConfigError
from eagerloco.lab.compare.cli import add_arguments, prepare, use_threads
from eagerloco.lab.compare.grid import ENTRIES, resolve_grid
from eagerloco.lab.compare.reference import PROTOCOL_FLAGS, load_reference, protocol_of, tuned_settings
from eagerloco.lab.compare.report import as_number, fmt_cu, fmt_loss, fmt_outer_lr, markdown_table
from eagerloco.lab.compare.runner import PlannedRun, checked, plan_runs, print_done, run_plans
from eagerloco.lab.compare.tune import apply_setting, value_text

#: The rows: one worker alone (does communicating pay at all?), the reference, the naive delay and the
#: eager update that fixes it. The comparison's other rows are quoted from it in the report, not run:
#: 400 steps of all nine do not fit the demo's few minutes on 2 cores.
DEMO_GRID = ("single", "no-overlap", "delayed-1", "eager-1")
#: How long `make demo` takes on 2 idle cores from a fresh clone (bootstrap, download and the four runs),
#: measured; the README says the same, and the demo prints its own runs' time at the end.
DEMO_MINUTES = 4
DEMO_OUT = "runs/demo"
#: The printed table's width limit (a terminal); the report keeps every column.
TABLE_WIDTH = 100
#: Flags of compare that change what the demo is: a seeded or tuned comparison is `eagerloco compare`.
NOT_IN_DEMO = ("seeds", "tune", "tune_seed", "tuned_from", "sweep", "inner_steps_list")


def add_parser(subparsers: Any) -> None:
    """Register the ``demo`` subcommand (compare's flags, the demo's defaults); its handler is :func:`run`."""
    try:
        ref = load_reference()
        protocol = " " + " ".join(f"{flag} {value_text(ref['protocol'][k])}" for k, flag in PROTOCOL_FLAGS)
        source = ref["source"]
    except ConfigError:  # reported when the demo runs, not by every command
        protocol, source = "", "the committed seeded comparison"
    p = subparsers.add_parser(
        "demo", help="short comparison of the methods at their tuned outer lr, with the seeded result beside it",
        description=(
            f"Runs `eagerloco compare --grid {','.join(DEMO_GRID)}{protocol} --threads 1 --out {DEMO_OUT}`, "
            f"each method at the outer lr tuned in {source} (shipped with the package), and prints its "
            "table beside that comparison's seeded result. Flags override the demo's settings (--outer-lr: "
            "every method at that lr instead); the defaults shown below are compare's, not the demo's."),
    )
    add_arguments(p)
    p.set_defaults(func=run)


def demo_defaults(reference: dict[str, Any]) -> dict[str, Any]:
    """The flags the demo sets unless the command line does: the comparison's protocol, its grid, its
    output directory and one thread (two threads on two shared cores slow down many times)."""
    return {**{k: reference["protocol"][k] for k, _ in PROTOCOL_FLAGS}, "grid": ",".join(DEMO_GRID),
            "out": DEMO_OUT, "threads": 1}


def with_defaults(args: argparse.Namespace, reference: dict[str, Any]) -> argparse.Namespace:
    """``args`` with the demo's defaults where no flag was given (not --steps when --tokens was); ConfigError for a
    flag that makes it a seeded, tuned or swept comparison."""
    given = [f for f in NOT_IN_DEMO if getattr(args, f, None) is not None]
    if given:
        flags = ", ".join("--" + f.replace("_", "-") for f in given)
        raise ConfigError(f"demo: {flags} is for `eagerloco compare`; the seeded version of the demo is "
                          f"`{reference['command']}`")
    ns = argparse.Namespace(**vars(args))
    for key, value in demo_defaults(reference).items():
        if getattr(ns, key, None) is None and not (key == "steps" and getattr(ns, "tokens", None) is not None):
            setattr(ns, key, value)
    return ns


def plan_demo(args: argparse.Namespace, reference: dict[str, Any]) -> tuple[list[PlannedRun], Any, Path, float]:
    """Every run of the demo at its tuned setting (none with --outer-lr), validated: the runs, the base configuration,
    the output directory and the lowered-lr outer lr; ConfigError naming a bad setting or entry."""
    entries = resolve_grid(args.grid)
    base, out, lowered = prepare(args)
    settings = {} if args.outer_lr is not None else tuned_settings(reference, [e.name for e in entries])
    plans = plan_runs(base, entries, out, lowered)
    for p in plans:
        setting = settings.get(p.entry.name)
        if setting:
            where = f"grid entry {p.entry.name!r} at its tuned {setting}"
            p.cfg, p.setting = checked(apply_setting(p.cfg, setting), where), setting
    return plans, base, out, lowered


def _pct(x: float) -> str:
    return f"{x:+.2f}%"


def seeded_cell(reference: dict[str, Any], name: str) -> str:
    """The comparison's paired difference to no overlap for this entry: ``+2.80% [+2.50, +3.10]``."""
    row = reference["rows"].get(name)
    if row is None:
        return "not in it"
    if row["delta_pct"] is None:
        return "0"
    d = row["delta_pct"]
    return f"{_pct(d['mean'])} [{d['lo']:+.2f}, {d['hi']:+.2f}]"


def _mark(r: dict[str, Any]) -> str:
    return " †" if r.get("diverged") else " ‡" if r.get("spiked") else ""


def demo_table(results: list[dict[str, Any]], reference: dict[str, Any], seed: int, width: int = TABLE_WIDTH) -> str:
    """This run's rows beside the seeded comparison's (its paired difference, mean [90% interval]); labels give way to
    short names where the table would be wider than ``width``."""
    ref = next((r for r in results if r["name"] == "no-overlap"), None)
    b = fmt_loss(ref.get("final_eval_loss")) if ref else "n/a"
    seeds = reference["seeds"]
    headers = ["method", "outer lr", "CU", "eval loss", f"Δ, seed {seed}",
               f"Δ, seeds {seeds[0]}-{seeds[-1]} [{100 * reference['level']:.0f}% CI]"]

    def delta(r: dict[str, Any]) -> str:
        a = fmt_loss(r.get("final_eval_loss"))
        if r is ref:
            return "0"
        if "n/a" in (a, b):
            return "n/a"
        return _pct(100 * (float(a) / float(b) - 1))

    def table(label_key: str) -> str:
        return markdown_table(headers, [
            [r[label_key] + _mark(r), fmt_outer_lr(r), fmt_cu(r.get("compute_utilization")),
             fmt_loss(r.get("final_eval_loss")), delta(r), seeded_cell(reference, r["name"])] for r in results])

    text = table("label")
    return text if max(map(len, text.splitlines())) <= width else table("name")


def conclusion(results: list[dict[str, Any]]) -> str | None:
    """What the table shows, in one sentence: the loss an overlapping method gives up against no overlap, for
    the compute utilization it gains on the emulated link (eager's, and naive delayed's beside it), and whether
    two workers beat one alone. None without the no-overlap row or an overlapping one to weigh against it."""
    by = {r["name"]: r for r in results}
    ref, key = by.get("no-overlap"), next((n for n in ("eager-1", "delayed-1") if n in by), None)
    if ref is None or key is None or not _numbers(ref):
        return None

    def delta(r: dict[str, Any]) -> float:
        return 100 * (float(r["final_eval_loss"]) / float(ref["final_eval_loss"]) - 1)

    main_row = by[key]
    if not _numbers(main_row):
        return None
    d, cu, cu0 = delta(main_row), float(main_row["compute_utilization"]), float(ref["compute_utilization"])
    name = "eager" if key == "eager-1" else "naive delayed"
    text = (f"On this link, {name} takes compute utilization from {cu0:.3f} (no overlap) to {cu:.3f} at {d:+.2f}% "
            "eval loss")
    other = by.get("delayed-1") if key == "eager-1" else None
    if other is not None and _numbers(other):
        od = delta(other)
        other_cu = float(other["compute_utilization"])
        text += f", {'less' if d < od else 'no less'} than naive delayed's {od:+.2f}% (CU {other_cu:.3f})"
    single = by.get("single")
    if single is not None and _numbers(single):
        sd = delta(single)
        pays = "pay" if sd > 0 else "do not pay"
        text += f"; one worker alone ends {sd:+.2f}% from no overlap: two workers {pays} for their link"
    return text + "."


def _numbers(r: dict[str, Any]) -> bool:
    return all(as_number(r.get(k)) is not None for k in ("final_eval_loss", "compute_utilization"))


def protocol_changes(base: Any, reference: dict[str, Any]) -> list[str]:
    """The comparison's protocol settings this run changed, as ``steps 100 (seeded: 400)``."""
    mine = protocol_of(asdict(base))
    return [f"{k} {value_text(v)} (seeded: {value_text(reference['protocol'][k])})"
            for k, v in mine.items() if v != reference["protocol"][k]]


def _lr_changes(results: list[dict[str, Any]], reference: dict[str, Any]) -> list[str]:
    rows = reference["rows"]
    return [f"{r['label']} {fmt_outer_lr(r)} (seeded: {rows[r['name']]['outer_lr']:g})" for r in results
            if r["name"] in rows and fmt_outer_lr(r) != "-" and r["outer"]["outer_lr"] != rows[r["name"]]["outer_lr"]]


def summary_lines(results: list[dict[str, Any]], reference: dict[str, Any], base: Any) -> list[str]:
    """What the table used and why, what it left out, and how to rerun the seeded version: plain sentences."""
    seeds = reference["seeds"]
    span = f"seeds {seeds[0]}-{seeds[-1]}"
    p = reference["protocol"]
    tuned = ", ".join(f"{r['label']} {fmt_outer_lr(r)}" for r in results if r.get("setting"))
    changed = protocol_changes(base, reference) + _lr_changes(results, reference)
    lines = [
        f"Settings: seed {base.seed} on the protocol of {reference['source']} ({p['steps']} steps, "
        f"{p['workers']} workers x batch {p['batch_size']} x {p['seq_len']} tokens, {p['tokenizer']}, "
        f"H = {p['inner_steps']}: the budget where tuned DiLoCo beats one worker alone)"
        + (", with the changes below" if changed else "")
        + (f"; outer lr as that comparison's sweep chose per method ({tuned}), not the papers' 0.7, the worst "
           "value tried at this scale." if tuned else "."),
        f"Δ: eval loss relative to no overlap's; {span}: the committed comparison's paired mean and "
        f"{100 * reference['level']:.0f}% t interval. CU: compute utilization on the simulated link. "
        "† diverged, ‡ spiked (eval loss back above the unigram entropy).",
    ]
    if changed:
        lines.append(f"This run differs from the seeded comparison in: {'; '.join(changed)}, so its Δ is no "
                     f"sample of the {span} column.")
    ran = {r["name"] for r in results}
    others = [f"{row['label']} {seeded_cell(reference, n)}" for n, row in reference["rows"].items() if n not in ran]
    if others:
        lines.append(f"Not run here ({span}, Δ): " + "; ".join(others) + ".")
    return lines


def rerun_sentence(reference: dict[str, Any]) -> str:
    """How to rerun the seeded version; the command follows it (inline in the report, on its own lines
    in the terminal)."""
    return (f"To rerun the seeded version (its tuning sweep and {len(reference['seeds'])} seeds of every row, "
            "about 100 minutes on 2 shared cores; finished runs are reused if it is stopped), run")


def command_lines(command: str, width: int = TABLE_WIDTH) -> list[str]:
    """A shell command broken before flags into lines of at most ``width`` columns, joined by `` \\``."""
    units: list[str] = []  # the command's words, then each flag with its value
    for w in command.split(" "):
        if units and not w.startswith("--") and units[-1].startswith("--") and " " not in units[-1]:
            units[-1] += " " + w
        else:
            units.append(w)
    lines, cur = [], ""
    for u in units:
        if cur and u.startswith("--") and len(cur) + 1 + len(u) + 2 > width:
            lines.append(cur + " \\")
            cur = "    " + u
        else:
            cur = f"{cur} {u}" if cur else u
    return [*lines, cur]


def _seeded_rows_table(results: list[dict[str, Any]], reference: dict[str, Any], seed: int) -> str:
    from eagerloco.lab.compare.report_seeds import fmt_interval

    mine = {r["name"]: r for r in results}
    headers = ["method", "outer lr", "eval loss, mean [90% CI]", "Δ vs no overlap [90% CI]", "Δ, relative",
               f"this demo, seed {seed}"]
    rows = []
    for name, row in reference["rows"].items():
        entry = ENTRIES.get(name)
        per_step = entry is not None and entry.outer.get("method") == "dp"
        lr = "-" if per_step else f"{row['outer_lr']:g}" + (" (tuned)" if row["tuned"] else "")
        loss = {**row["loss"], "n": len(row["losses"])}
        delta = "0" if row["delta"] is None else fmt_interval({**row["delta"], "n": len(row["losses"])}, signed=True)
        ran = mine.get(name)
        rows.append([row["label"], lr, fmt_interval(loss), delta, seeded_cell(reference, name),
                     fmt_loss(ran.get("final_eval_loss")) if ran else "not run"])
    return markdown_table(headers, rows)


def report_preface(results: list[dict[str, Any]], reference: dict[str, Any], base: Any) -> list[str]:
    """The demo's part of report.md: its table beside the seeded one, why these settings, the rerun command."""
    return [
        "## The demo beside the seeded comparison",
        "",
        demo_table(results, reference, base.seed),
        "",
        *([said, ""] if (said := conclusion(results)) is not None else []),
        *(f"- {line}" for line in summary_lines(results, reference, base)),
        "- Rows: one worker alone (whether communicating pays at all), no overlap (the reference), 1-outer-step "
        "naive delayed and 1-outer-step eager (the eager paper's point); 400 steps of the comparison's other rows "
        f"do not fit the demo's {DEMO_MINUTES} minutes on 2 cores, so they are quoted below, not run. No zero-shot "
        "tasks: at this size HellaSwag, PIQA and ARC-Easy score at chance.",
        f"- {rerun_sentence(reference)} `{reference['command']}`.",
        "",
        f"### The seeded comparison, every row (`{reference['source']}`)",
        "",
        _seeded_rows_table(results, reference, base.seed),
    ]


def run(args: argparse.Namespace) -> int:
    """`eagerloco demo`: plan, train or reuse, write the report, print the narrow table and what it means."""
    from eagerloco.lab.compare.report import write_report
    from eagerloco.lab.compare.seeded import mark_divergence

    reference = load_reference()
    args = with_defaults(args, reference)
    plans, base, out, lowered = plan_demo(args, reference)
    use_threads(args)
    print(f"demo: {len(plans)} runs of {base.steps} steps, each at its tuned outer lr ({reference['source']}) "
          f"-> {out}", flush=True)
    t0 = time.perf_counter()
    results = run_plans(plans, force=args.force)
    mark_divergence(results, plans)
    for r, p in zip(results, plans, strict=True):
        r["setting"] = p.setting or {}
    meta = {"kind": "grid", "grid": [p.entry.name for p in plans], "sweep_inner_steps": None,
            "lowered_outer_lr": lowered, "base_config": asdict(base), "elapsed_s": time.perf_counter() - t0,
            "demo": {"reference": reference["source"], "settings": {p.entry.name: p.setting for p in plans
                                                                    if p.setting}}}
    paths = write_report(out, results, meta, preface=report_preface(results, reference, base))
    print()
    print(demo_table(results, reference, base.seed))
    said = conclusion(results)
    if said is not None:
        print(textwrap.fill(said, TABLE_WIDTH, break_long_words=False, break_on_hyphens=False))
    print()
    for line in summary_lines(results, reference, base):
        print(textwrap.fill(line, TABLE_WIDTH, break_long_words=False, break_on_hyphens=False))
    print(textwrap.fill(rerun_sentence(reference) + ":", TABLE_WIDTH, break_on_hyphens=False))
    print("\n".join("  " + ln for ln in command_lines(reference["command"], TABLE_WIDTH - 2)))
    print_done(results, meta["elapsed_s"], paths["report"], "every column, plots and summary.json")
    return 0
