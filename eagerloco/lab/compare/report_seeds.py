"""The report of a seeded (and tuned) comparison: means with 90% t intervals, paired differences to
no overlap, the tuning sweep and what it chose, diverged runs marked; plots with bands.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from eagerloco.lab.compare.report import (
    REFERENCE,
    as_number,
    finish_report,
    fmt_cu,
    line_styles,
    load_curves,
    log_h_axis,
    markdown_table,
    pyplot,
    save,
    setup_line,
    zoom_y,
)
from eagerloco.lab.compare.stats import LEVEL, Interval, mean_interval, paired_difference
from eagerloco.lab.compare.tune import setting_text, value_text
from eagerloco.units import fmt_bytes

SEED_PLOTS = {"steps": "loss_vs_steps.png", "delta": "delta_vs_no_overlap.png", "tune": "tuning.png",
              "sweep": "loss_vs_inner_steps.png"}


def _loss(r: dict[str, Any]) -> float:
    v = as_number(r.get("final_eval_loss"))
    return v if v is not None else float("nan")


def _iv(iv: Interval | None) -> dict[str, float] | None:
    return None if iv is None else {"mean": iv.mean, "lo": iv.lo, "hi": iv.hi, "n": iv.n, "sd": iv.sd}


def _mean(rs: list[dict[str, Any]], key: str) -> float | None:
    vals = [v for r in rs if (v := as_number(r.get(key))) is not None]
    return sum(vals) / len(vals) if vals else None


def aggregate(units: list[Any], results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per unit, in the units' order: per-seed losses, the mean with its interval, the difference to the
    no-overlap row at the same H (paired by seed), diverged seeds, and the link columns (means over seeds)."""
    by_unit: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_unit.setdefault(r["unit"], []).append(r)
    losses = {name: {r["seed"]: _loss(r) for r in rs} for name, rs in by_unit.items()}
    rows = []
    for u in units:
        rs = by_unit.get(u.name, [])
        ref = REFERENCE if u.h is None else f"H{u.h}-{REFERENCE}"
        mine = losses.get(u.name, {})
        delta = paired_difference(mine, losses[ref]) if ref in losses and ref != u.name else None
        rows.append({
            "unit": u.name,
            "name": u.entry.name,
            "label": u.entry.label,
            "inner_steps": rs[0]["inner_steps"] if rs else u.h,
            "setting": rs[0].get("setting", {}) if rs else {},
            "outer_lr": rs[0]["outer"]["outer_lr"] if rs else None,
            "losses": mine,
            "loss": _iv(mean_interval(list(mine.values()))),
            "delta": "reference" if ref == u.name else _iv(delta),
            "diverged_seeds": [r["seed"] for r in rs if r.get("diverged")],
            "spiked_seeds": [r["seed"] for r in rs if r.get("spiked") and not r.get("diverged")],
            "tolerated": rs[0].get("tolerated", "n/a") if rs else "n/a",
            "bytes_sent_per_worker": _mean(rs, "bytes_sent_per_worker"),
            "compute_utilization": _mean(rs, "compute_utilization"),
            "wall_s": _mean(rs, "wall_s"),
            "workers": rs[0].get("workers") if rs else None,
        })
    return rows


def fmt_interval(iv: dict[str, float] | None, signed: bool = False) -> str:
    """``5.1234 [5.0012, 5.2456]`` (signed: ``+0.1234 [+0.0500, +0.2000]``); n/a for None."""
    if iv is None:
        return "n/a"
    f = "{:+.4f}" if signed else "{:.4f}"
    if iv["n"] < 2:
        return f.format(iv["mean"])
    return f"{f.format(iv['mean'])} [{f.format(iv['lo'])}, {f.format(iv['hi'])}]"


def reading(delta: Any) -> str:
    """What the paired interval says about a row against no overlap: worse, better, or cannot tell."""
    if delta == "reference":
        return "reference"
    if not isinstance(delta, dict) or delta["n"] < 2:
        return "n/a"
    if delta["lo"] > 0:
        return "worse"
    if delta["hi"] < 0:
        return "better"
    return "cannot tell"


def seeded_table(rows: list[dict[str, Any]], sweep: bool) -> str:
    """The main table: mean eval loss and the paired difference with their intervals, per row."""
    pct = f"{100 * LEVEL:.0f}%"
    headers = (["H"] if sweep else []) + [
        "method", "setting", f"eval loss, mean [{pct} CI]", f"Δ vs no overlap [{pct} CI], paired", "reading",
        "per seed", "diverged † / spiked ‡", "tolerated latency", "bytes exchanged / worker", "CU (link)"]
    body = []
    for r in rows:
        seeds = sorted(r["losses"])
        per_seed = " / ".join(f"{r['losses'][s]:.3f}" + _mark(r, s) for s in seeds)
        div = f"{len(r['diverged_seeds'])}/{len(seeds)}, {len(r['spiked_seeds'])}/{len(seeds)}"
        delta = "0" if r["delta"] == "reference" else fmt_interval(r["delta"], signed=True)
        cells = ([str(r["inner_steps"])] if sweep else []) + [
            r["label"] + _row_mark(r), _setting_cell(r), fmt_interval(r["loss"]), delta,
            reading(r["delta"]), per_seed, div, r["tolerated"], fmt_bytes(r["bytes_sent_per_worker"]),
            fmt_cu(r["compute_utilization"])]
        body.append(cells)
    return markdown_table(headers, body)


def _mark(row: dict[str, Any], seed: int) -> str:
    return "†" if seed in row["diverged_seeds"] else "‡" if seed in row["spiked_seeds"] else ""


def _row_mark(row: dict[str, Any]) -> str:
    marks = ("†" if row["diverged_seeds"] else "") + ("‡" if row["spiked_seeds"] else "")
    return f" {marks}" if marks else ""


def _setting_cell(r: dict[str, Any]) -> str:
    if r["setting"]:
        return "tuned: " + setting_text(r["setting"])
    if r["name"] in ("dp", "single"):
        return "-"
    return f"outer lr {r['outer_lr']:g}" if r["outer_lr"] is not None else "-"


def tune_table(tune_results: list[dict[str, Any]], base_outer: dict[str, Any], base: dict[str, Any]) -> str:
    """The sweep: one row per tuned unit, one column per setting (held-out loss on the tuning seed);
    the chosen cell in bold, diverged cells with †, spiked ones with ‡, the base (papers') value's
    column marked."""
    settings: list[str] = []
    rows: dict[str, dict[str, str]] = {}
    labels: dict[str, str] = {}
    for r in tune_results:
        s = setting_text(r.get("setting", {}))
        if s not in settings:
            settings.append(s)
        cell = f"{_loss(r):.4f}" + ("†" if r.get("diverged") else "‡" if r.get("spiked") else "")
        rows.setdefault(r["unit"], {})[s] = f"**{cell}**" if r.get("chosen") else cell
        labels[r["unit"]] = r["label"] + (f" (H = {r['inner_steps']})" if r.get("in_sweep") else "")

    def is_base(s: str) -> bool:
        parts = dict(p.split("=", 1) for p in s.split(",") if "=" in p)
        for k, v in parts.items():
            ref = base_outer.get(k, base.get(k))
            if not isinstance(ref, (int, float)) or isinstance(ref, bool):
                return str(ref) == v
            try:
                if not math.isclose(float(v), float(ref)):
                    return False
            except ValueError:
                return False
        return bool(parts)

    headers = ["method"] + [s + (" (default)" if is_base(s) else "") for s in settings]
    body = [[labels[u]] + [cells.get(s, "-") for s in settings] for u, cells in rows.items()]
    return markdown_table(headers, body)


# --------------------------------------------------------------------------------------------------
# Plots


def _band(ax: Any, xs: list[float], runs: list[list[float]], style: dict[str, Any], label: str) -> None:
    means, los, his = [], [], []
    for i in range(len(xs)):
        iv = mean_interval([run[i] for run in runs])
        means.append(iv.mean if iv else float("nan"))
        los.append(iv.lo if iv else float("nan"))
        his.append(iv.hi if iv else float("nan"))
    ax.plot(xs, means, label=label, **style, markersize=3.5, linewidth=1.6)
    ax.fill_between(xs, los, his, color=style["color"], alpha=0.18, linewidth=0)


def plot_steps(rows: list[dict[str, Any]], results: list[dict[str, Any]], out: Path, subtitle: str) -> Path:
    """Eval loss against inner steps: the mean over seeds with its 90% band, one line per row."""
    plt = pyplot()

    styles = line_styles([{"name": r["unit"]} for r in rows])
    fig, ax = plt.subplots(figsize=(11.5, 6))
    everything: list[float] = []
    for row in rows:
        curves = [load_curves(r)["eval"] for r in results if r["unit"] == row["unit"]]
        if not curves:
            continue
        steps = sorted(set.intersection(*({p[0] for p in c} for c in curves)))
        runs = [[next(p[3] for p in c if p[0] == s) for s in steps] for c in curves]
        everything += [v for run in runs for v in run]
        mean = fmt_interval(row["loss"])
        _band(ax, steps, runs, styles[row["unit"]], f"{row['label']}{_row_mark(row)} ({mean})")
    clipped = zoom_y(ax, everything)
    ax.grid(True, alpha=0.3)
    ax.set_xlabel("inner steps (per worker)")
    ax.set_ylabel("eval loss (nats/token)")
    ax.set_title(f"Eval loss against inner steps: mean over seeds, {100 * LEVEL:.0f}% t band\n{subtitle}", fontsize=10)
    ax.legend(fontsize=7, title="method (final eval loss, mean [90% CI])", title_fontsize=7, loc="upper left",
              bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    if clipped:
        ax.text(1.01, 0.0, f"y axis clipped: {clipped} point(s) above it", transform=ax.transAxes, fontsize=7,
                color="dimgray")
    return save(plt, fig, out / SEED_PLOTS["steps"])


def plot_delta(rows: list[dict[str, Any]], out: Path, subtitle: str) -> Path:
    """The paired difference to no overlap with its 90% interval, one bar per row (a forest plot)."""
    plt = pyplot()

    shown = [r for r in rows if isinstance(r["delta"], dict)]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(shown) + 1.8))
    for i, r in enumerate(shown):
        d = r["delta"]
        color = {"worse": "tab:red", "better": "tab:green"}.get(reading(d), "tab:gray")
        ax.errorbar([d["mean"]], [i], xerr=[[d["mean"] - d["lo"]], [d["hi"] - d["mean"]]], fmt="o", color=color,
                    capsize=3)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(shown)))
    ax.set_yticklabels([(f"H={r['inner_steps']} " if r["unit"].startswith("H") else "") + r["label"]
                        + _row_mark(r) for r in shown], fontsize=8)
    ax.invert_yaxis()
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_xlabel(f"final eval loss minus no overlap's, same seed (mean, {100 * LEVEL:.0f}% t interval)")
    ax.set_title(f"Difference to no overlap, paired by seed\n{subtitle}", fontsize=9)
    return save(plt, fig, out / SEED_PLOTS["delta"])


def plot_tune(tune_results: list[dict[str, Any]], out: Path, key: str, subtitle: str) -> Path:
    """Held-out loss on the tuning seed against the swept value, one line per method, chosen ringed."""
    plt = pyplot()

    units = list(dict.fromkeys(r["unit"] for r in tune_results))
    styles = line_styles([{"name": u} for u in units])
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for u in units:
        rs = sorted((r for r in tune_results if r["unit"] == u), key=lambda r: r["setting"][key])
        xs, ys = [r["setting"][key] for r in rs], [_loss(r) for r in rs]
        st = styles[u]
        ax.plot(xs, ys, label=rs[0]["label"], **st)
        for r, x, y in zip(rs, xs, ys, strict=True):
            if r.get("chosen"):
                ax.plot([x], [y], "o", markersize=11, markerfacecolor="none", color=st["color"])
            if r.get("diverged"):
                ax.plot([x], [y], "x", markersize=9, color="red")
    zoom_y(ax, [_loss(r) for r in tune_results])
    ax.set_xscale("log")
    ax.set_xlabel(f"{key} (log scale)")
    ax.set_ylabel("final eval loss on the tuning seed")
    ax.grid(True, alpha=0.3)
    ax.set_title(f"Tuning sweep: circle = chosen, red x = diverged\n{subtitle}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return save(plt, fig, out / SEED_PLOTS["tune"])


def plot_sweep_bands(rows: list[dict[str, Any]], out: Path, subtitle: str) -> Path:
    """Final eval loss against H: the mean over seeds with its 90% band, one line per method."""
    plt = pyplot()

    names = list(dict.fromkeys(r["name"] for r in rows))
    styles = line_styles([{"name": n} for n in names])
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for n in names:
        rs = sorted((r for r in rows if r["name"] == n and r["loss"]), key=lambda r: r["inner_steps"])
        if not rs:
            continue
        xs = [r["inner_steps"] for r in rs]
        st = styles[n]
        ax.plot(xs, [r["loss"]["mean"] for r in rs], label=rs[0]["label"], **st)
        ax.fill_between(xs, [r["loss"]["lo"] for r in rs], [r["loss"]["hi"] for r in rs], color=st["color"],
                        alpha=0.18, linewidth=0)
    log_h_axis(ax, sorted({r["inner_steps"] for r in rows}))
    ax.grid(True, alpha=0.3)
    ax.set_xlabel("inner steps per round H (log scale)")
    ax.set_ylabel("final eval loss (nats/token)")
    ax.set_title(f"Final eval loss against H: mean over seeds, {100 * LEVEL:.0f}% t band\n{subtitle}", fontsize=9)
    ax.legend(fontsize=8)
    return save(plt, fig, out / SEED_PLOTS["sweep"])


# --------------------------------------------------------------------------------------------------
# The report


def _notes(rows: list[dict[str, Any]], results: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    b = meta["base_config"]
    outer = b["outer"]
    seeds = meta["seeds"]
    entropies = {r["seed"]: r["unigram_entropy"] for r in results if "unigram_entropy" in r}
    notes = [
        f"- **eval loss**: final loss of the outer parameters on {b['eval_batches']} held-out batch(es) "
        f"(nats per {b.get('tokenizer', 'byte')} token), mean over the seeds {', '.join(map(str, seeds))} "
        f"with a two-sided {100 * LEVEL:.0f}% Student-t interval (mean ± t(n-1) · sd / √n). A seed sets the "
        "held-out documents, the tokenizer trained on the rest, the data order, the initialization and the "
        "worker shards together.",
        f"- **Δ vs no overlap**: the row's loss minus no overlap's on the same seed, mean and {100 * LEVEL:.0f}% t "
        "interval of those differences (paired, so the seed-to-seed spread that both share cancels); "
        "**reading**: worse / better when the interval excludes 0, cannot tell otherwise.",
        "- **diverged** (†): the run's final eval loss is above the unigram entropy of its "
        "training data (the loss of a model that learned only the token frequencies: "
        + ", ".join(f"seed {s}: {h:.3f}" for s, h in sorted(entropies.items()))
        + " nats/token); **spiked** (‡): it climbed back above that entropy after having been below it and "
        "recovered by the end (an instability early in training, when every run is near the entropy). Both "
        "are averaged with the others (they are what the method did) but marked in the table, the per-seed "
        "column and the plots; the tuner passes over diverged runs only.",
        "- **Baselines**: data-parallel (gradient mean every step), a single worker alone with the same "
        "per-worker batch (half the tokens of two workers), and plain parameter averaging (DiLoCo with outer "
        "SGD lr 1, no momentum): whether the outer optimizer helps at this scale.",
        f"- Shared by every run unless the row says otherwise: outer {outer['outer_optimizer']} lr "
        f"{outer['outer_lr']:g} momentum {outer['outer_momentum']:g}{' Nesterov' if outer['outer_nesterov'] else ''}"
        f", exchange codec {outer['codec']}, H = {outer['inner_steps']}, inner AdamW lr {b['lr']:g} "
        f"(warmup {b['warmup_steps']}, cosine to 10%), data {b['data']}.",
    ]
    if meta["tune"]:
        axes = "; ".join(f"{a['key']} in {{{', '.join(map(value_text, a['values']))}}}" for a in meta["tune"])
        notes.append(
            f"- **Tuning**: every method with a free swept setting ({axes}) ran each value once on the tuning "
            f"seed {meta['tune_seed']} (not a reported seed) and keeps the one with the lowest final held-out "
            "loss among the runs that did not diverge; the seeded rows run at that choice (**setting**). "
            "The sweep table below also gives each method's loss at the papers' default (the column marked "
            "default) on that seed; `eagerloco compare --seeds N` without `--tune` runs every method at it.")
    if meta.get("tuned_from"):
        chosen = "; ".join(f"{name} {setting_text(s)}" for name, s in meta["chosen"].items())
        notes.append(f"- **Settings** chosen by the tuned comparison in `{meta['tuned_from']}` (by entry name, "
                     f"tuned there at its own H and batch): {chosen}.")
    return notes


def write_seeded_report(out: Path, units: list[Any], results: list[dict[str, Any]],
                        tune_results: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """Write <out>/report.md, <out>/summary.json and the plots of a seeded comparison; returns their paths and the
    main table's text."""
    out.mkdir(parents=True, exist_ok=True)
    sweep = meta["kind"] == "seeded-sweep-inner-steps"
    rows = aggregate(units, results)
    table = seeded_table(rows, sweep)
    b = meta["base_config"]
    subtitle = setup_line(meta, results).replace(f"seed {b['seed']}", f"seeds {', '.join(map(str, meta['seeds']))}")
    tuned = ", tuned " + ", ".join(a["key"] for a in meta["tune"]) if meta["tune"] else ""
    lines = [f"# {'Inner-steps sweep' if sweep else 'Method comparison'} over {len(meta['seeds'])} seed(s){tuned}",
             "", subtitle + ".", "", table, "", *_notes(rows, results, meta), ""]
    plots: dict[str, Path] = {}
    if tune_results:
        lines += [f"## Tuning sweep (seed {meta['tune_seed']}): final eval loss per setting, chosen in bold", "",
                  tune_table(tune_results, b["outer"], b), ""]
        if len(meta["tune"]) == 1 and all(isinstance(v, (int, float)) and v > 0 for v in meta["tune"][0]["values"]):
            plots["tune"] = plot_tune(tune_results, out, meta["tune"][0]["key"], subtitle)
            lines += [f"![tuning sweep]({plots['tune'].name})", ""]
    if sweep:
        plots["sweep"] = plot_sweep_bands(rows, out, subtitle)
        lines += ["## Final eval loss against H", "", f"![eval loss against H]({plots['sweep'].name})", ""]
    else:
        plots["steps"] = plot_steps(rows, results, out, subtitle)
        lines += ["## Eval loss against inner steps", "", f"![eval loss against steps]({plots['steps'].name})", ""]
    if any(isinstance(r["delta"], dict) for r in rows):
        plots["delta"] = plot_delta(rows, out, subtitle)
        lines += ["## Difference to no overlap, paired by seed", "", f"![difference]({plots['delta'].name})", ""]
    runs = [(f"{r['label']}, seed {r['seed']}" + (f", {setting_text(r['setting'])}" if r.get("setting") else ""), r)
            for r in [*tune_results, *results]]
    summary = {**meta, "rows": rows, "runs": results, "tuning_runs": tune_results}
    return finish_report(out, lines, runs, summary, plots, table)
