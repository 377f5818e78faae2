"""The comparison report: a Markdown table, the combined summary.json and PNG plots (apart from the runner, so that
a report can be redrawn from finished runs).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from eagerloco.extras import require
from eagerloco.jsonfiles import write_json_atomic
from eagerloco.lab.compare.grid import ENTRIES, PAPER_EVAL_LOSS
from eagerloco.units import fmt_bytes

#: Downstream benchmarks: the report's column, and the top-level summary key train writes the accuracy under.
EVAL_COLUMNS: list[tuple[str, str]] = [("HellaSwag", "hellaswag"), ("PIQA", "piqa"), ("ARC-Easy", "arc_easy")]
REFERENCE = "no-overlap"
PLOTS = {"steps": "loss_vs_steps.png", "wallclock": "loss_vs_wallclock.png", "bytes": "loss_vs_bytes.png"}
SWEEP_PLOT = "loss_vs_inner_steps.png"


# --------------------------------------------------------------------------------------------------
# Formatting


def as_number(v: Any) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):  # train writes inf/nan as strings
        try:
            return float(v)
        except ValueError:
            return None
    return None


def benchmark_score(summary: dict[str, Any], key: str) -> float | None:
    """A run's accuracy on a benchmark (``key`` at the top level of its summary); None when it has none."""
    x = as_number(summary.get(key))
    return x if x is not None and math.isfinite(x) else None


def _num(x: Any, fmt: str, finite: bool = False) -> str:
    """``x`` (a number, or train's inf/nan string) formatted by ``fmt``; n/a otherwise (with ``finite``: inf, nan)."""
    v = as_number(x)
    return "n/a" if v is None or (finite and not math.isfinite(v)) else fmt.format(v)


def fmt_score(x: float | None) -> str:
    return _num(x, "{:.1%}" if x is not None and 0.0 <= x <= 1.0 else "{:.3f}")


def fmt_loss(x: Any) -> str:
    return _num(x, "{:.4f}")


def fmt_cu(x: Any) -> str:
    return _num(x, "{:.3f}")


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """A Markdown table padded to line up in a terminal too."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def _delta(r: dict[str, Any], ref: dict[str, Any] | None) -> str:
    a, b = as_number(r.get("final_eval_loss")), as_number(ref.get("final_eval_loss")) if ref else None
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return "n/a"
    return "0" if r is ref else f"{a - b:+.4f}"


#: Chance accuracy of each zero-shot benchmark (4-way HellaSwag and ARC-Easy, 2-way PIQA).
CHANCE = {"HellaSwag": 0.25, "PIQA": 0.5, "ARC-Easy": 0.25}


def benchmark_columns(results: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The zero-shot columns some run has a score for: a column of n/a says nothing."""
    return [(c, key) for c, key in EVAL_COLUMNS if any(benchmark_score(r, key) is not None for r in results)]


def at_chance(results: list[dict[str, Any]], limit: int) -> bool:
    """Whether every zero-shot score of every run is within two standard errors of chance on ``limit``
    questions per task (then the columns say nothing at this size); False when there is none."""
    scores = [(c, x) for c, key in benchmark_columns(results) for r in results
              if (x := benchmark_score(r, key)) is not None and 0.0 <= x <= 1.0]
    if not scores or limit < 1:
        return False
    return all(abs(x - CHANCE[c]) <= 2 * math.sqrt(CHANCE[c] * (1 - CHANCE[c]) / limit) for c, x in scores)


def _outer_lr_varies(results: list[dict[str, Any]]) -> bool:
    lrs = {r["outer"]["outer_lr"] for r in results if "outer" in r and not _per_step(r)}
    return len(lrs) > 1


def _per_step(r: dict[str, Any]) -> bool:
    return r.get("outer", {}).get("method") == "dp"


def fmt_outer_lr(r: dict[str, Any]) -> str:
    """A run's outer lr; '-' for data-parallel and the single worker, which have no outer step."""
    return "-" if _per_step(r) or "outer" not in r else f"{r['outer']['outer_lr']:g}"


def _unequal(results: list[dict[str, Any]]) -> bool:
    """Whether some run had workers of unequal speed (--worker-speeds) or sized its rounds to them."""
    return any("round_steps" in r or r.get("outer", {}).get("worker_speeds") for r in results)


def fmt_per_worker(r: dict[str, Any]) -> list[str]:
    """Workers of unequal speed: each worker's inner steps in the last round (H_m; '-' at a fixed H), its
    compute utilization (its compute seconds over the run's wall clock) and its seconds idle waiting for peers."""
    steps = "/".join(str(n) for n in r["round_steps"]) if "round_steps" in r else "-"
    cu, idle = r.get("worker_cu"), r.get("worker_idle_s")
    return [steps, "/".join(f"{c:.2f}" for c in cu) if cu else "n/a",
            "/".join(f"{s:.1f}" for s in idle) if idle else "n/a"]


def _columns(results: list[dict[str, Any]], with_ref: bool) -> tuple[list[str], list[tuple[str, str]]]:
    bench = benchmark_columns(results)
    headers = (["outer lr"] if _outer_lr_varies(results) else []) + ["tolerated latency", "eval loss"]
    headers += (["Δ vs no overlap"] if with_ref else []) + [c for c, _ in bench]
    headers += ["bytes exchanged / worker", "peak bytes", "CU (link)", "wall (link)", "tokens/s", "MFU"]
    headers += ["H_m", "CU per worker", "idle s per worker"] if _unequal(results) else []
    return headers, bench


def _cells(r: dict[str, Any], ref: dict[str, Any] | None, with_ref: bool, lr_col: bool,
           bench: list[tuple[str, str]], unequal: bool = False) -> list[str]:
    row = ([fmt_outer_lr(r)] if lr_col else []) + [r["tolerated"], fmt_loss(r.get("final_eval_loss"))]
    if with_ref:
        row.append(_delta(r, ref))
    row += [fmt_score(benchmark_score(r, key)) for _, key in bench]
    # tokens/s: every worker's tokens over the training loop's real wall time; MFU: n/a where the peak is unknown
    row += [fmt_bytes(r.get("bytes_sent_per_worker")), fmt_bytes(r.get("peak_sync_bytes")),
            fmt_cu(r.get("compute_utilization")), _num(r.get("wall_s"), "{:.1f} s"),
            _num(r.get("tokens_per_s"), "{:,.0f}", finite=True), _num(r.get("mfu"), "{:.1%}", finite=True)]
    return row + (fmt_per_worker(r) if unequal else [])


def results_table(results: list[dict[str, Any]], sweep: bool = False) -> str:
    """One row per run; in a sweep the runs sorted by H, each compared with the no-overlap run at its own H."""
    refs = {r["inner_steps"] if sweep else None: r for r in reversed(results) if r["name"] == REFERENCE}
    headers, bench = _columns(results, bool(refs))
    lr_col = headers[0] == "outer lr"
    rows = [[*([str(r["inner_steps"])] if sweep else []), r["label"],
             *_cells(r, refs.get(r["inner_steps"] if sweep else None), bool(refs), lr_col, bench, _unequal(results))]
            for r in (sorted(results, key=lambda r: r["inner_steps"]) if sweep else results)]
    return markdown_table([*(["H"] if sweep else []), "method", *headers], rows)


# --------------------------------------------------------------------------------------------------
# Curves


def load_curves(result: dict[str, Any]) -> dict[str, list[tuple[float, ...]]]:
    """From a run's metrics.jsonl: eval points (step, link seconds, bytes, eval loss), ending with
    the final evaluation from its summary, and train points (step, link seconds, bytes, loss)."""
    evals: list[tuple[float, ...]] = []
    trains: list[tuple[float, ...]] = []
    path = Path(result["run_dir"]) / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
            at = (float(rec["step"]), as_number(rec.get("wall_s")) or 0.0, as_number(rec.get("bytes_sent")) or 0.0)
            if as_number(rec.get("loss")) is not None:
                trains.append((*at, float(as_number(rec["loss"]))))  # type: ignore[arg-type]
            if as_number(rec.get("eval_loss")) is not None:
                evals.append((*at, float(as_number(rec["eval_loss"]))))  # type: ignore[arg-type]
    final = as_number(result.get("final_eval_loss"))
    if final is not None:
        evals = [e for e in evals if e[0] < result["steps"]]
        evals.append((float(result["steps"]), as_number(result.get("wall_s")) or 0.0,
                      as_number(result.get("bytes_sent_per_worker")) or 0.0, final))
    return {"eval": evals, "train": trains}


def _ema(values: list[float], weight: float = 0.6) -> list[float]:
    out, acc = [], None
    for v in values:
        acc = v if acc is None else weight * acc + (1 - weight) * v
        out.append(acc)
    return out


#: What the missing-matplotlib message names.
PLOT_NEEDS = "eagerloco compare (its plots)"


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display), or the one line that names the [plot] extra."""
    require("matplotlib", PLOT_NEEDS).use("Agg")
    return require("matplotlib.pyplot", PLOT_NEEDS)


def save(plt: Any, fig: Any, path: Path) -> Path:
    """Lay the figure out, write it to ``path`` as a PNG at 110 dpi and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def line_styles(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One color and line style per grid entry, the same in every plot."""
    cmap = require("matplotlib", PLOT_NEEDS).colormaps["tab10"]
    names = list(dict.fromkeys(r["name"] for r in results))
    styles = {}
    i = 0
    for n in names:
        if n == "dp":
            styles[n] = {"color": "black", "linestyle": "--", "marker": "s"}
            continue
        delayed = n.startswith("delayed")  # dotted, triangles: tell naive delayed from eager at a glance
        styles[n] = {"color": cmap(i % 10), "linestyle": ":" if delayed else "-", "marker": "^" if delayed else "o"}
        i += 1
    return styles


def setup_line(meta: dict[str, Any], results: list[dict[str, Any]]) -> str:
    b = meta["base_config"]
    link = b["link"]
    bw = link["bandwidth_gbps"]
    r0 = results[0] if results else {}
    params = r0.get("num_params")
    return (
        f"{b['model']} GPT" + (f" ({params / 1e6:.2f}M params)" if isinstance(params, (int, float)) else "")
        + f", {b['workers']} workers x batch {b['batch_size']} x {b['seq_len']} tokens, {b['steps']} steps, "
        f"seed {b['seed']}; link {bw:g} Gbit/s + {link['latency_ms']:g} ms"
    )


def plot_curves(results: list[dict[str, Any]], out: Path, meta: dict[str, Any]) -> dict[str, Path]:
    """Eval loss (top, with markers) and smoothed train loss (bottom) against steps, link seconds and bytes."""
    plt = pyplot()

    curves = {r["key"]: load_curves(r) for r in results}
    styles = line_styles(results)
    # Data-parallel's link time is often 10x the others': a log axis keeps both readable.
    walls = [w for r in results if (w := as_number(r.get("wall_s"))) and w > 0]
    log_wall = bool(walls) and max(walls) > 8 * min(walls)
    axes_spec = {
        "steps": (0, "inner steps (per worker)", "Eval loss against inner steps", False),
        "wallclock": (1, "wall-clock on the emulated link (s" + (", log scale)" if log_wall else ")"),
                      "Eval loss against wall-clock time on the link", log_wall),
        "bytes": (2, "bytes sent per worker (log scale)", "Eval loss against bytes exchanged", True),
    }
    paths = {}
    subtitle = setup_line(meta, results)
    for kind, (col, xlabel, title, logx) in axes_spec.items():
        fig, (ax, ax2) = plt.subplots(2, 1, figsize=(11.5, 7.5), sharex=True,
                                      gridspec_kw={"height_ratios": [2.2, 1]})
        for r in results:
            c, st = curves[r["key"]], styles[r["name"]]
            ev = [p for p in c["eval"] if not logx or p[col] > 0]
            tr = [p for p in c["train"] if not logx or p[col] > 0]
            if ev:
                loss = r.get("final_eval_loss")
                label = f"{r['label']} ({fmt_loss(loss)})"
                ax.plot([p[col] for p in ev], [p[3] for p in ev], label=label, **st, markersize=3.5, linewidth=1.6)
            if tr:
                ax2.plot([p[col] for p in tr], _ema([p[3] for p in tr]), color=st["color"],
                         linestyle=st["linestyle"], linewidth=1.2)
        for a in (ax, ax2):
            a.grid(True, which="major", alpha=0.3)
            if logx:
                a.set_xscale("log")
                a.grid(True, which="minor", alpha=0.1)
        clipped = zoom_y(ax, [p[3] for c in curves.values() for p in c["eval"]])
        zoom_y(ax2, [p[3] for c in curves.values() for p in c["train"]])
        notes = ["top: eval loss of the outer parameters", "bottom: train loss (EMA over logged steps)"]
        if clipped:
            notes.append(f"y axis clipped: {clipped} point(s) above it\n(early steps, diverging runs)")
        ax.set_ylabel("eval loss (nats/token)")
        ax2.set_ylabel("train loss\n(smoothed)")
        ax2.set_xlabel(xlabel)
        ax.set_title(f"{title}\n{subtitle}", fontsize=10)
        ax.legend(fontsize=8, title="method (final eval loss)", title_fontsize=8, loc="upper left",
                  bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        if kind == "bytes":
            ticker = require("matplotlib.ticker", PLOT_NEEDS)
            ax2.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: fmt_bytes(x, ".3g")))
            ax2.xaxis.set_minor_formatter(ticker.FuncFormatter(_minor_bytes_label))
            notes.append("points before a run's first exchange\n(0 bytes) are not shown")
        ax.text(1.01, 0.0, "\n".join(notes), transform=ax.transAxes, va="bottom", ha="left", fontsize=7,
                color="dimgray")
        paths[kind] = save(plt, fig, out / PLOTS[kind])
    return paths


def _minor_bytes_label(x: float, _pos: int) -> str:
    """Label the 2x and 5x minor ticks of a log bytes axis (enough when it spans under a decade)."""
    if x <= 0:
        return ""
    lead = x / 10 ** math.floor(math.log10(x))
    return fmt_bytes(x, ".3g") if round(lead) in (2, 5) and abs(lead - round(lead)) < 1e-6 else ""


def zoom_y(ax: Any, values: list[float]) -> int:
    """Clip the early, high losses so the differences at the end (what the comparison is about)
    show; returns how many points are above the axis."""
    vals = sorted(v for v in values if math.isfinite(v))
    if len(vals) < 3:
        return 0
    low, high = vals[0], vals[int(0.9 * (len(vals) - 1))]
    pad = 0.08 * max(high - low, 1e-3)
    top = high + 3 * pad
    ax.set_ylim(low - pad, top)
    return sum(v > top for v in vals)


def log_h_axis(ax: Any, hs: list[int]) -> None:
    """A log axis of inner steps per round, ticked at each H shown."""
    ax.set_xscale("log")
    ax.set_xticks(hs)
    ax.set_xticklabels([str(h) for h in hs])
    ax.minorticks_off()


def plot_sweep(results: list[dict[str, Any]], out: Path, meta: dict[str, Any]) -> Path:
    """Final eval loss (top) and compute utilization on the link (bottom) against H, per method."""
    plt = pyplot()

    styles = line_styles(results)
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    hs = sorted({r["inner_steps"] for r in results})
    for name in dict.fromkeys(r["name"] for r in results):
        rows = sorted((r for r in results if r["name"] == name), key=lambda r: r["inner_steps"])
        ax.plot([r["inner_steps"] for r in rows], [as_number(r.get("final_eval_loss")) for r in rows],
                label=rows[0]["label"], **styles[name])
        ax2.plot([r["inner_steps"] for r in rows], [as_number(r.get("compute_utilization")) for r in rows],
                 **styles[name])
    for a in (ax, ax2):
        log_h_axis(a, hs)
        a.grid(True, alpha=0.3)
    ax.set_ylabel("final eval loss (nats/token)")
    ax2.set_ylabel("compute utilization\non the link")
    ax2.set_xlabel("inner steps per round H (log scale)")
    ax.set_title(f"Final eval loss against H\n{setup_line(meta, results)}", fontsize=10)
    ax.legend(fontsize=8)
    return save(plt, fig, out / SWEEP_PLOT)


# --------------------------------------------------------------------------------------------------
# The report


def _notes(results: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    b = meta["base_config"]
    link = b["link"]
    step = next((r["mean_step_s"] for r in results if r.get("mean_step_s") is not None), None)
    step_txt = f"{step:.3f} s" if step is not None else "n/a"
    source = "fixed by --sim-step-time" if b.get("sim_step_time") is not None else "measured"
    outer = b["outer"]
    limit = b.get("eval_limit")
    any_4bit = any(r["outer"]["codec"] != outer["codec"] for r in results)
    lowered = any(e.lowered_lr for r in results if (e := ENTRIES.get(r["name"])) is not None)
    notes = [
        "- **tolerated latency**: how long an exchange may take before the schedule applies it "
        "(`schedule.apply_delay`), in inner steps and in seconds on the link's clock "
        f"(steps x the mean step time, {step_txt}, {source}). 0: the exchange blocks.",
        f"- **eval loss**: mean loss of the outer parameters at the end on {b['eval_batches']} held-out "
        f"batch(es) (nats per {b.get('tokenizer', 'byte')} token); **Δ** is against the no-overlap row"
        + (" at the same H." if meta["kind"] != "grid" else "."),
        "- **bytes exchanged**: bytes each worker sent over the whole run (compressed size); **peak bytes**: "
        "the largest single payload.",
        f"- **CU (link)**: compute time / wall-clock on the emulated link ({link['bandwidth_gbps']:g} Gbit/s, "
        f"{link['latency_ms']:g} ms latency, one transfer at a time); **wall (link)**: that wall-clock.",
        "- **tokens/s**: every worker's tokens over the real wall time of the training loop on this machine; "
        "**MFU**: those tokens' model FLOPs (6N + 12 L d T per token) over the device's peak "
        f"({_device_line(results)}); n/a on a CPU without `--peak-tflops`.",
        f"- Shared by every run: outer {outer['outer_optimizer']}"
        + (" (lr: the outer lr column)" if _outer_lr_varies(results) else f" lr {outer['outer_lr']:g}")
        + f" momentum {outer['outer_momentum']:g}{' Nesterov' if outer['outer_nesterov'] else ''}, "
        f"exchange codec {outer['codec']}{' unless the row says 4-bit' if any_4bit else ''}, "
        f"inner AdamW lr {b['lr']:g}, data {b['data']}"
        + (f"; the lowered-lr rows use outer lr {meta['lowered_outer_lr']:g}." if lowered else "."),
    ]
    bench = [c for c, _ in benchmark_columns(results)]
    if bench:
        chance = " / ".join(f"{100 * CHANCE[c]:.0f}%" for c in bench)
        se = 50 / math.sqrt(limit) if isinstance(limit, int) and limit > 0 else float("nan")
        notes.insert(2, f"- **{' / '.join(bench)}**: zero-shot accuracy of the final outer parameters "
                        f"(`--eval-tasks`); chance is {chance}, and on {limit} questions per task one standard "
                        f"error is up to {se:.0f} points"
                        + ("; **chance level at this size**: every score is within two standard errors of "
                           "chance." if isinstance(limit, int) and at_chance(results, limit) else "."))
    times = [r["step_s"] for r in results if r.get("step_s")]
    if times and b.get("sim_step_time") is None and max(times) > 1.25 * min(times):
        notes.append(
            f"- The measured step time varied between runs ({min(times):.3f} to {max(times):.3f} s: other load on "
            "the machine), which moves the link columns; `--sim-step-time` fixes it for a like-for-like clock."
        )
    gone = [r for r in results if r.get("diverged")]
    if gone:
        h1 = ", ".join(sorted({f"{r['unigram_entropy']:.3f}" for r in gone}))
        notes.append(
            "- **Diverged**: " + "; ".join(r["label"] + (f" (H = {r['inner_steps']})" if meta["kind"] != "grid" else "")
                                           for r in gone)
            + f". Their final eval loss is above the unigram entropy of the data ({h1} "
            "nats/token: the loss of a model that learned only the token frequencies); do not read their "
            "differences as a method's cost. `--seeds N` gives intervals.")
    jumpy = [r for r in results if r.get("spiked") and not r.get("diverged")]
    if jumpy:
        notes.append("- **Spiked**: " + "; ".join(r["label"] for r in jumpy) + ": their eval loss climbed back "
                     "above the unigram entropy of the data after having been below it, then recovered.")
    names = {r["name"] for r in results}
    paper = [(n, v) for n, v in PAPER_EVAL_LOSS.items() if n in names]
    if paper and meta["kind"] == "grid":
        ref = "; ".join(f"{ENTRIES[n].label} {v:.2f}" for n, v in paper)
        notes.append(f"- For scale, the eager paper reports eval loss for a 500M model at H = 30: {ref}.")
    return notes


def _device_line(results: list[dict[str, Any]]) -> str:
    seen = sorted({f"{r.get('device', '?')}, {r.get('precision', 'fp32')}"
                   + (f", {r['peak_tflops']:g} TFLOP/s" if as_number(r.get("peak_tflops")) else "")
                   + (", compiled" if r.get("compile") else "") for r in results})
    return "; ".join(seen) if seen else "n/a"


def write_report(out: Path, results: list[dict[str, Any]], meta: dict[str, Any],
                 preface: list[str] | None = None) -> dict[str, Any]:
    """Write <out>/report.md, <out>/summary.json and the plots; returns their paths and the table. ``preface``:
    Markdown lines before the table."""
    out.mkdir(parents=True, exist_ok=True)
    sweep = meta["kind"] != "grid"
    table = results_table(results, sweep)
    lines = [
        "# Inner-steps sweep" if sweep else "# Method comparison",
        "",
        setup_line(meta, results) + ".",
        "",
        *([*preface, "", "## Every column", ""] if preface else []),
        table,
        "",
        *_notes(results, meta),
        "",
    ]
    if sweep:
        plot = plot_sweep(results, out, meta)
        plots: dict[str, Path] = {"sweep": plot}
        lines += ["## Final eval loss and compute utilization against H", "", f"![eval loss against H]({plot.name})",
                  ""]
    else:
        plots = plot_curves(results, out, meta)
        for kind, heading in (("steps", "Eval loss against inner steps"),
                              ("wallclock", "Eval loss against wall-clock time on the emulated link"),
                              ("bytes", "Eval loss against bytes exchanged")):
            lines += [f"## {heading}", "", f"![{heading}]({plots[kind].name})", ""]
    runs = [(r["label"] + (f" (H = {r['inner_steps']})" if sweep else ""), r) for r in results]
    return finish_report(out, lines, runs, {**meta, "runs": results}, plots, table)


def finish_report(out: Path, lines: list[str], runs: list[tuple[str, dict[str, Any]]], summary: dict[str, Any],
                  plots: dict[str, Path], table: str) -> dict[str, Any]:
    """Write ``lines`` and the "## Runs" list (each run's label, directory, trained or reused) to <out>/report.md,
    ``summary`` to <out>/summary.json; returns their paths, the plots and the table."""
    lines = [*lines, "## Runs", ""]
    for label, r in runs:
        how = "reused" if r.get("cached") else f"trained in {as_number(r.get('real_wall_s')) or 0:.0f} s"
        lines.append(f"- {label}: `{r['run_dir']}` ({how})")
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    write_json_atomic(out / "summary.json", summary)
    return {"report": report, "summary": out / "summary.json", "plots": plots, "table": table}
