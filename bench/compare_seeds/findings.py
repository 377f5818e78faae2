"""The papers' findings read off a seeded comparison: for each, the paired 90% t interval and whether it
supports the finding, contradicts it, or cannot tell.

    python bench/compare_seeds/findings.py bench/results/compare_seeds [--sweep bench/results/compare_seeds/h_sweep]

Writes <dir>/findings.md and prints it. Differences are paired by seed (same data, initialization and
held-out set); relative ones are the row's loss over no overlap's on the same seed, minus 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from eagerloco.lab.compare.stats import Interval, mean_interval  # noqa: E402

#: A difference smaller than this (relative) counts as "equal" / "within a few percent" / "under 1%".
EQUAL = 0.01
FEW_PERCENT = 0.03


def losses(summary: dict, unit: str) -> dict[int, float]:
    return {int(r["seed"]): float(r["final_eval_loss"]) for r in summary["runs"] if r["unit"] == unit}


def diff(a: dict[int, float], b: dict[int, float], relative: bool = False) -> Interval | None:
    seeds = sorted(set(a) & set(b))
    return mean_interval([(a[s] / b[s] - 1) if relative else (a[s] - b[s]) for s in seeds])


def fmt(iv: Interval | None, pct: bool = False) -> str:
    if iv is None:
        return "n/a"
    if pct:
        return f"{100 * iv.mean:+.2f}% [{100 * iv.lo:+.2f}%, {100 * iv.hi:+.2f}%]"
    return f"{iv.mean:+.4f} [{iv.lo:+.4f}, {iv.hi:+.4f}]"


def greater(iv: Interval | None) -> str:
    """Finding 'x > 0'."""
    if iv is None:
        return "cannot tell (missing runs)"
    return "supports" if iv.lo > 0 else "contradicts" if iv.hi < 0 else "cannot tell"


def less(iv: Interval | None) -> str:
    """Finding 'x < 0'."""
    if iv is None:
        return "cannot tell (missing runs)"
    return "supports" if iv.hi < 0 else "contradicts" if iv.lo > 0 else "cannot tell"


def within(iv: Interval | None, margin: float) -> str:
    """Finding '|x| < margin' (relative)."""
    if iv is None:
        return "cannot tell (missing runs)"
    if -margin < iv.lo and iv.hi < margin:
        return "supports"
    if iv.lo >= margin or iv.hi <= -margin:
        return "contradicts"
    return "cannot tell"


def below(iv: Interval | None, margin: float) -> str:
    """Finding 'x < margin' (a cost under margin; a gain counts as under it)."""
    if iv is None:
        return "cannot tell (missing runs)"
    return "supports" if iv.hi < margin else "contradicts" if iv.lo >= margin else "cannot tell"


def small_positive(iv: Interval | None, margin: float) -> str:
    """Finding '0 < x < margin' ("a bit worse")."""
    if iv is None:
        return "cannot tell (missing runs)"
    if iv.lo > 0 and iv.hi < margin:
        return "supports"
    if iv.hi < 0 or iv.lo >= margin:
        return "contradicts"
    return "cannot tell"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--sweep", type=Path, default=None, help="a seeded --sweep inner-steps comparison")
    args = ap.parse_args()
    s = json.loads((args.dir / "summary.json").read_text())
    ref = losses(s, "no-overlap")
    u = {name: losses(s, name) for name in s["units"]}
    rows = []

    d = diff(u.get("delayed-1", {}), ref, relative=True)
    rows.append(("naive delayed clearly worse than no overlap (paper +12.7%)", fmt(d, True), greater(d)))
    d = diff(u.get("eager-1", {}), ref, relative=True)
    rows.append((f"eager within a few percent of no overlap (Δ within ±{100 * FEW_PERCENT:.0f}%; paper +0.7%)",
                 fmt(d, True), within(d, FEW_PERCENT)))
    d = diff(u.get("eager-2", {}), u.get("eager-1", {}), relative=True)
    rows.append((f"2-outer-steps eager a bit worse than 1 (0 < Δ < {100 * FEW_PERCENT:.0f}%; paper +1.5%)",
                 fmt(d, True), small_positive(d, FEW_PERCENT)))
    d = diff(u.get("overlap-1", {}), ref, relative=True)
    rows.append((f"1-inner-step overlap equal to no overlap (Δ within ±{100 * EQUAL:.0f}%; paper 0%)", fmt(d, True),
                 within(d, EQUAL)))
    d = diff(u.get("eager-1-4bit", {}), u.get("eager-1", {}), relative=True)
    rows.append((f"4-bit exchange costs under {100 * EQUAL:.0f}% (eager, 4-bit vs FP32)", fmt(d, True),
                 below(d, EQUAL)))
    gaps = {}
    h0 = s["base_config"]["outer"]["inner_steps"]
    gaps[h0] = {k: u["delayed-1"][k] - u["eager-1"][k] for k in u.get("delayed-1", {}) if k in u.get("eager-1", {})}
    if args.sweep is not None:
        sw = json.loads((args.sweep / "summary.json").read_text())
        for h in sw["sweep_inner_steps"]:
            a, b = losses(sw, f"H{h}-delayed-1"), losses(sw, f"H{h}-eager-1")
            gaps[h] = {k: a[k] - b[k] for k in a if k in b}
    hs = sorted(gaps)
    gap_text = "; ".join(f"H={h}: {fmt(mean_interval(list(gaps[h].values())))}" for h in hs)
    verdicts = []
    for lo_h, hi_h in zip(hs, hs[1:], strict=False):
        d = diff(gaps[hi_h], gaps[lo_h])
        verdicts.append(f"H {lo_h}->{hi_h}: {fmt(d)} {greater(d)}")
    rows.append(("delayed-minus-eager gap grows with H (loss gap per H; change of the gap, paired)",
                 gap_text + ("<br>" + "<br>".join(verdicts) if verdicts else ""),
                 "see the changes" if verdicts else "cannot tell (one H)"))
    # Whether the comparison's reference is a fair baseline: the outer step must beat one worker alone.
    single = u.get("single", {})
    d = diff(ref, single, relative=True)
    rows.append(("baseline: tuned DiLoCo (no overlap) better than a single worker (Δ < 0)", fmt(d, True),
                 less(d)))
    d = diff(u.get("averaging", {}), single, relative=True)
    rows.append(("baseline: plain averaging better than a single worker (Δ < 0)", fmt(d, True),
                 less(d)))
    lines = ["| finding | paired 90% t interval | the interval |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    text = "\n".join(lines) + "\n"
    (args.dir / "findings.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
