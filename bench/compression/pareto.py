"""Loss per byte of the compressed exchanges, read off a seeded, tuned comparison (`eagerloco compare
--grid compression --seeds 3 --tune ...`): the table, the plot and which settings are on the frontier.

    python bench/compression/pareto.py RUN_DIR [RUN_DIR ...] [--out bench/results/compression]

Each RUN_DIR is a comparison's --out (its summary.json), all with the same protocol and seeds; a method in
several takes its row from the last (a wider tuning sweep, say). Writes <out>/pareto.md and
<out>/pareto.png and prints the table. Differences to DiLoCo (fp32, "no overlap") are paired by seed;
"reaches DiLoCo's loss" means the paired 90% interval of the difference includes 0 or lies below it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from eagerloco.lab.compare.stats import Interval, paired_difference  # noqa: E402
from eagerloco.units import fmt_bytes  # noqa: E402

REFERENCE = "no-overlap"
BASELINES = ("dp", "single", "averaging")


@dataclass
class Point:
    name: str
    label: str
    setting: str
    bytes_per_worker: float
    loss: Interval
    delta: Interval | None  # paired, against DiLoCo fp32
    per_seed: dict[int, float]
    marks: str

    @property
    def reaches_reference(self) -> bool:
        return self.delta is not None and self.delta.lo <= 0.0


def _losses(summary: dict, unit: str) -> dict[int, float]:
    return {int(r["seed"]): float(r["final_eval_loss"]) for r in summary["runs"] if r["unit"] == unit}


def points(summaries: list[dict]) -> list[Point]:
    """Every method of the comparisons but the baselines that exchange nothing comparable, each from the
    last comparison that has it."""
    rows = {row["name"]: (row, summary) for summary in summaries for row in summary["rows"]}
    ref_row, ref_summary = rows[REFERENCE]
    ref = _losses(ref_summary, ref_row["unit"])
    out = []
    for row, summary in rows.values():
        if row["name"] in BASELINES:
            continue
        mine = _losses(summary, row["unit"])
        loss = row["loss"]
        setting = ", ".join(f"{k}={v:g}" for k, v in (row.get("setting") or {}).items()) or "-"
        marks = ("†" if row.get("diverged_seeds") else "") + ("‡" if row.get("spiked_seeds") else "")
        out.append(Point(row["name"], row["label"], setting, float(row["bytes_sent_per_worker"]),
                         Interval(loss["mean"], loss["lo"], loss["hi"], loss["n"], loss["sd"]),
                         paired_difference(mine, ref), mine, marks))
    return out


def frontier(pts: list[Point]) -> set[str]:
    """Names of the points no other point beats on both bytes and mean loss (lower is better on both)."""
    return {p.name for p in pts
            if not any(q.bytes_per_worker <= p.bytes_per_worker and q.loss.mean < p.loss.mean
                       or q.bytes_per_worker < p.bytes_per_worker and q.loss.mean <= p.loss.mean for q in pts)}


def _tune_text(summary: dict) -> str:
    return "; ".join(f"{a['key']} in {{{', '.join(f'{v:g}' for v in a['values'])}}}" for a in summary.get("tune") or [])


def render(summaries: list[dict], pts: list[Point], commands: list[str]) -> str:
    ref = next(p for p in pts if p.name == REFERENCE)
    front = frontier(pts)
    pts = sorted(pts, key=lambda p: -p.bytes_per_worker)
    summary = summaries[-1]
    seeds = ", ".join(str(s) for s in summary["seeds"])
    tune = " / ".join(dict.fromkeys(_tune_text(s) for s in summaries))
    lines = [
        "# Compressed exchanges: final eval loss against bytes sent",
        "",
        f"tiny GPT, 2 workers x batch 8 x 64 tokens, 400 steps, H = 20, seeds {seeds}, outer lr tuned per "
        f"method on seed {summary.get('tune_seed')} ({tune}; a method takes its row from the last comparison "
        "that has it). Made by:",
        "",
        *(f"    {c}" for c in commands),
        "    python bench/compression/pareto.py <their --out, in that order> --out bench/results/compression",
        "",
        "| method | outer lr | bytes / worker | x fewer than DiLoCo fp32 | eval loss, mean [90% CI] "
        "| Δ vs DiLoCo fp32, paired [90% CI] | reaches DiLoCo's loss | on the frontier |",
        "|---|---|---:|---:|---|---|---|---|",
    ]
    for p in pts:
        d = "0 (reference)" if p.name == REFERENCE else (
            f"{p.delta.mean:+.4f} [{p.delta.lo:+.4f}, {p.delta.hi:+.4f}]" if p.delta else "n/a")
        lines.append(
            f"| {p.label}{' ' + p.marks if p.marks else ''} | {p.setting} | {fmt_bytes(p.bytes_per_worker)} | "
            f"{ref.bytes_per_worker / p.bytes_per_worker:.1f}x | {p.loss.mean:.4f} [{p.loss.lo:.4f}, {p.loss.hi:.4f}] "
            f"| {d} | {'yes' if p.reaches_reference or p.name == REFERENCE else 'no'} "
            f"| {'yes' if p.name in front else ''} |")
    reach = [p for p in pts if p.reaches_reference and p.bytes_per_worker < ref.bytes_per_worker]
    # The most compressed, and among equally compressed the lowest loss.
    best = min(reach, key=lambda p: (p.bytes_per_worker, p.loss.mean), default=None)
    lines += ["", "**Reaches DiLoCo's loss**: the paired 90% interval of the difference to DiLoCo fp32 (same seed, "
              "same data) includes 0 or lies below it. **Frontier**: no other row sends fewer bytes with a lower "
              "mean loss. † diverged, ‡ spiked on some seed (see the comparison's report)."]
    if best is not None:
        lines += ["", f"Best compression at DiLoCo's loss: **{best.label}**, "
                  f"{ref.bytes_per_worker / best.bytes_per_worker:.0f}x fewer bytes than DiLoCo fp32 "
                  f"(Δ {best.delta.mean:+.4f} [{best.delta.lo:+.4f}, {best.delta.hi:+.4f}])." if best.delta else ""]
    return "\n".join(lines) + "\n"


def plot(pts: list[Point], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for p in pts:
        muon = "Muon" in p.label
        ax.errorbar(p.bytes_per_worker, p.loss.mean, yerr=[[p.loss.mean - p.loss.lo], [p.loss.hi - p.loss.mean]],
                    fmt="^" if muon else "o", color="C1" if muon else "C0", capsize=3)
        ax.annotate(p.name, (p.bytes_per_worker, p.loss.mean), textcoords="offset points", xytext=(5, 4),
                    fontsize=7)
    for group, color, label in (([p for p in pts if "Muon" not in p.label], "C0", "frontier, AdamW inner steps"),
                                (pts, "C1", "frontier, all (Muon inner steps)")):
        names = frontier(group)
        line = sorted((p for p in group if p.name in names), key=lambda p: p.bytes_per_worker)
        ax.plot([p.bytes_per_worker for p in line], [p.loss.mean for p in line], "-", color=color, alpha=0.5,
                label=label)
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per worker (log)")
    ax.set_ylabel("final eval loss (mean, 90% CI over seeds)")
    ax.set_title("Compressed exchanges: loss against bytes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dirs", type=Path, nargs="+")
    p.add_argument("--out", type=Path, default=Path("bench/results/compression"))
    p.add_argument("--command", action="append", default=[],
                   help="the command that made each comparison, in order (repeat), for the page")
    args = p.parse_args(argv)
    summaries = [json.loads((d / "summary.json").read_text()) for d in args.run_dirs]
    pts = points(summaries)
    args.out.mkdir(parents=True, exist_ok=True)
    text = render(summaries, pts, args.command)
    (args.out / "pareto.md").write_text(text)
    plot(pts, args.out / "pareto.png")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
