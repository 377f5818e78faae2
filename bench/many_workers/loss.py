"""Loss at M = 8 on the tiny model: the flat exchanges (shared support, dense through the reduce-scatter) against
all-gathered SparseLoCo and FP32 DiLoCo (issue 36, items 2 and 4: the short check and the tuned Pareto).

Run from the repository root: ``.venv/bin/python bench/many_workers/loss.py [--seeds 0,1,2] [--rows a,b] [--data kjv]
[--outer-lr A,B | tuned]`` (what is committed: bench/results/many_workers.md). Each row is an ``eagerloco train`` run
(8 in-process workers, Brown or ``--data``, bpe:1024, batch 8 x 64, H = 20); the final eval loss and the bytes each
worker sent are written to bench/results/many_workers_loss.json (keyed ``row/seedN``; ``kjv:row/seedN`` on the KJV,
``400steps:row/seedN`` for other --steps, ``row@lrX/seedN`` at another outer lr than the row's own), which ``run.py
--parts none`` folds into bench/results/many_workers.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from eagerloco.lab.compare.stats import Interval, paired_difference

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
SPARSE = ["--codec", "2bit", "--topk-chunk", "4096", "--error-feedback", "0.95", "--outer-optimizer", "average",
          "--outer-lr", "1.5"]
#: name -> (what it is, its flags). Their own outer lrs are the ones tuned at M = 2 in bench/results/compression/
#: (--outer-lr runs others).
ROWS = {
    "diloco-fp32": ("DiLoCo, FP32 on a ring all-reduce, Nesterov, outer lr 0.2", ["--outer-lr", "0.2"]),
    "sparseloco-64": ("SparseLoCo: top 64 of 4096, 2-bit, all-gathered", [*SPARSE, "--topk", "64"]),
    "shared-64": ("shared support: 64 of 4096 drawn per round, 2-bit, reduce-scattered",
                  [*SPARSE, "--topk", "64", "--transport", "shared-support"]),
    "shared-256": ("shared support: 256 of 4096 drawn per round, 2-bit, reduce-scattered",
                   [*SPARSE, "--topk", "256", "--transport", "shared-support"]),
    "shared-1024": ("shared support: 1024 of 4096 drawn per round, 2-bit, reduce-scattered",
                    [*SPARSE, "--topk", "1024", "--transport", "shared-support"]),
    "shared-128": ("shared support: 128 of 4096 drawn per round, 2-bit, reduce-scattered",
                   [*SPARSE, "--topk", "128", "--transport", "shared-support"]),
    "shared-512": ("shared support: 512 of 4096 drawn per round, 2-bit, reduce-scattered",
                   [*SPARSE, "--topk", "512", "--transport", "shared-support"]),
    "guided-512": ("shared support: 512 of 4096, half the largest of the last mean and half drawn, 2-bit",
                   [*SPARSE, "--topk", "512", "--transport", "shared-support", "--support-guided", "0.5"]),
    "guided-1024": ("shared support: 1024 of 4096, half the largest of the last mean and half drawn, 2-bit",
                    [*SPARSE, "--topk", "1024", "--transport", "shared-support", "--support-guided", "0.5"]),
    "guided-256": ("shared support: 256 of 4096, half the largest of the last mean and half drawn, 2-bit",
                   [*SPARSE, "--topk", "256", "--transport", "shared-support", "--support-guided", "0.5"]),
    "guided75-256": ("shared support: 256 of 4096, three quarters the largest of the last mean, the rest drawn",
                     [*SPARSE, "--topk", "256", "--transport", "shared-support", "--support-guided", "0.75"]),
    "guided-128": ("shared support: 128 of 4096, half the largest of the last mean and half drawn, 2-bit",
                   [*SPARSE, "--topk", "128", "--transport", "shared-support", "--support-guided", "0.5"]),
    "sparseloco-128": ("SparseLoCo: top 128 of 4096, 2-bit, all-gathered", [*SPARSE, "--topk", "128"]),
    "shared-2048": ("shared support: 2048 of 4096 drawn per round, 2-bit, reduce-scattered",
                    [*SPARSE, "--topk", "2048", "--transport", "shared-support"]),
    "guided-2048": ("shared support: 2048 of 4096, half the largest of the last mean and half drawn, 2-bit",
                    [*SPARSE, "--topk", "2048", "--transport", "shared-support", "--support-guided", "0.5"]),
    "shared-nest-1024": ("shared support: 1024 of 4096 drawn per round, 2-bit, Nesterov outer steps",
                         [*SPARSE, "--topk", "1024", "--transport", "shared-support", "--outer-optimizer", "sgd"]),
    "shared-nest-512": ("shared support: 512 of 4096 drawn per round, 2-bit, Nesterov outer steps",
                        [*SPARSE, "--topk", "512", "--transport", "shared-support", "--outer-optimizer", "sgd"]),
    "rs-2bit": ("dense 2-bit through the reduce-scatter, error feedback 0.95, Nesterov",
                ["--outer-lr", "0.2", "--codec", "2bit", "--transport", "reduce-scatter", "--error-feedback", "0.95"]),
    "eager-sparseloco-64": ("1-outer-step eager, SparseLoCo top 64 of 4096", [*SPARSE, "--topk", "64",
                                                                              "--method", "eager"]),
    "eager-shared-1024": ("1-outer-step eager, shared support 1024 of 4096",
                          [*SPARSE, "--topk", "1024", "--transport", "shared-support", "--method", "eager"]),
}


# The sparse rows with another error-feedback decay than SparseLoCo's 0.95 (shared-efB-K, sparseloco-efB-K).
ROWS.update({f"shared-ef{b}-{k}": (f"shared support: {k} of 4096 drawn per round, 2-bit, error feedback {b}",
                                   [*SPARSE, "--topk", k, "--transport", "shared-support", "--error-feedback", b])
             for b in ("1", "0.8", "0.6", "0.4", "0.2", "0.1") for k in ("128", "256", "512", "1024", "2048")})
ROWS.update({f"sparseloco-ef{b}-{k}": (f"SparseLoCo: top {k} of 4096, 2-bit, all-gathered, error feedback {b}",
                                       [*SPARSE, "--topk", k, "--error-feedback", b])
             for b in ("0.8", "0.6") for k in ("64", "128")})


def with_lr(flags: list[str], lr: float) -> list[str]:
    """The row's flags with its outer lr replaced by ``lr``."""
    i = flags.index("--outer-lr")
    return [*flags[:i + 1], f"{lr:g}", *flags[i + 2:]]


def row_lr(flags: list[str]) -> float:
    return float(flags[flags.index("--outer-lr") + 1])


def split_key(key: str) -> tuple[str, str, int]:
    """"kjv:guided-512@lr2/seed0" -> ("kjv:", "guided-512", 0): the corpus and length prefix, the row, the seed."""
    name, seed = key.split("/")
    prefix, _, row = name.rpartition(":")
    return f"{prefix}:" if prefix else "", row.split("@")[0], int(seed.removeprefix("seed"))


def by_lr(results: dict[str, Any], prefix: str, name: str) -> dict[float, dict[int, dict[str, Any]]]:
    """The runs of a row on one corpus and length: outer lr -> seed -> run."""
    out: dict[float, dict[int, dict[str, Any]]] = {}
    for key, r in results.items():
        p, row, seed = split_key(key)
        if (p, row) == (prefix, name):
            out.setdefault(row_lr(r["flags"]), {})[seed] = r
    return out


def tuned_lr(runs: dict[float, dict[int, dict[str, Any]]]) -> float | None:
    """The outer lr of the lowest seed-0 loss among a row's runs (:func:`by_lr`), None before any seed-0 run."""
    tried = {lr: rs[0]["final_eval_loss"] for lr, rs in runs.items() if 0 in rs}
    return min(tried, key=tried.__getitem__) if tried else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--rows", default=",".join(ROWS), help="comma list of the rows to run")
    ap.add_argument("--data", default="brown", help="the corpus (train's --data); rows off Brown are keyed data:row")
    ap.add_argument("--outer-lr", default="", help="comma list of outer lrs for every row instead of its own "
                    "(keyed row@lrX unless it is the row's own), or 'tuned': the lr of the row's lowest seed-0 loss")
    ap.add_argument("--runs", default="/tmp/many_workers_loss", help="where the runs' directories go")
    args = ap.parse_args()
    out_path = RESULTS / "many_workers_loss.json"
    results = json.loads(out_path.read_text()) if out_path.exists() else {}
    # Rows off the defaults are keyed apart: kjv:row, 400steps:row, kjv-400steps:row.
    off = [args.data] if args.data != "brown" else []
    off += [f"{args.steps}steps"] if args.steps != 200 else []
    prefix = f"{'-'.join(off)}:" if off else ""
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name in args.rows.split(","):
            if args.outer_lr == "tuned":
                lr = tuned_lr(by_lr(results, prefix, name))
                if lr is None:
                    raise SystemExit(f"no seed-0 run of {prefix}{name} to tune from: run --seeds 0 --outer-lr A,B,C")
                lrs = [lr]
            else:
                lrs = [float(x) for x in args.outer_lr.split(",")] if args.outer_lr else [row_lr(ROWS[name][1])]
            for lr in lrs:
                run_row(results, out_path, name, lr, seed, prefix, args)


def run_row(results: dict[str, dict], out_path: Path, name: str, lr: float, seed: int, prefix: str,
            args: argparse.Namespace) -> None:
    """One run of a row at an outer lr and seed, skipped when its key is already in ``results``."""
    own = ROWS[name][1]
    flags = with_lr(own, lr)
    key = f"{prefix}{name}{'' if lr == row_lr(own) else f'@lr{lr:g}'}/seed{seed}"
    if key in results:
        return
    run = Path(args.runs) / key.replace(":", "-")
    cmd = [sys.executable, "-m", "eagerloco", "train", "--model", "tiny", "--tokenizer", "bpe:1024",
           "--batch-size", "8", "--seq-len", "64", "--steps", str(args.steps), "--inner-steps", "20",
           "--workers", str(args.workers), "--sim-step-time", "0.1", "--seed", str(seed), "--no-progress",
           "--overwrite", "--data", args.data, "--out", str(run), *flags]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)
    s = json.loads((run / "summary.json").read_text())
    results[key] = {"final_eval_loss": s["final_eval_loss"], "steps": args.steps, "workers": args.workers,
                    "bytes_sent_per_worker": s["bytes_sent_per_worker"], "flags": flags,
                    "real_s": round(time.perf_counter() - t0)}
    print(key, json.dumps(results[key]), flush=True)
    out_path.write_text(json.dumps(results, indent=1) + "\n")


#: Corpus prefix of a key -> its name in the tables (rows off 200 steps stay out of the Pareto).
CORPORA = {"": "Brown", "kjv:": "KJV"}
#: Row-name prefix -> the exchange its rows stand for in the Pareto (issue 36, item 4).
TRANSPORTS = {
    "sparseloco-": "SparseLoCo, top K all-gathered",
    "shared-": "shared support, every position drawn (`--transport shared-support`)",
    "guided-": "shared support, half from the last mean (`--support-guided 0.5`)",
    "rs-": "dense through the reduce-scatter (`--transport reduce-scatter`)",
}
BASE = "diloco-fp32"


def _order(row: str) -> tuple[int, int, str]:  # DiLoCo first, then by exchange and K, densest first
    k = row.rsplit("-", 1)[-1]
    kind = next((i for i, p in enumerate(TRANSPORTS) if row.startswith(p)), -1)
    return kind, -int(k) if k.isdigit() else 0, row


def pareto(results: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Corpus prefix -> row -> its tuned entry: the outer lr of its lowest seed-0 loss (``tried``: each lr's seed-0
    loss), the seeds' losses at that lr, their difference to DiLoCo at its own tuned lr paired by seed (``gap``,
    90% t interval) and the bytes ratio to DiLoCo."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for prefix in CORPORA:
        names = {split_key(k)[1] for k in results if split_key(k)[0] == prefix}
        base_runs = by_lr(results, prefix, BASE)
        base_lr = tuned_lr(base_runs)
        if base_lr is None:
            continue
        base = {s: r["final_eval_loss"] for s, r in base_runs[base_lr].items()}
        base_bytes = base_runs[base_lr][0]["bytes_sent_per_worker"]
        table = out.setdefault(prefix, {})
        for name in sorted((n for n in names if n == BASE or n.startswith(tuple(TRANSPORTS))), key=_order):
            runs = by_lr(results, prefix, name)
            lr = tuned_lr(runs)
            if lr is None:
                continue
            losses = {s: r["final_eval_loss"] for s, r in runs[lr].items()}
            tried = {x: rs[0]["final_eval_loss"] for x, rs in sorted(runs.items()) if 0 in rs}
            own = {s: r["final_eval_loss"] for s, r in runs.get(row_lr(ROWS[name][1]), {}).items()}
            table[name] = {"lr": lr, "tried": tried, "own": paired_difference(losses, own),
                           "losses": losses, "gap": None if name == BASE else paired_difference(losses, base),
                           "ratio": base_bytes / runs[lr][0]["bytes_sent_per_worker"]}
    return out


def reaches(entry: dict[str, Any]) -> bool | None:
    """Whether the row's paired interval to DiLoCo includes 0 or lies below it; None before 3 seeds."""
    gap: Interval | None = entry["gap"]
    return None if gap is None or gap.n < 3 else gap.lo <= 0


def answer(table: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """Per exchange, the best bytes ratio whose loss reaches DiLoCo's on every corpus, and the sentence of what is
    left (rows short of 3 outer lrs on seed 0, best at the edge of them, short of 3 seeds at the chosen lr, or missing
    on a corpus)."""
    said = []
    for p, what in TRANSPORTS.items():
        rows = sorted({n for t in table.values() for n in t if n.startswith(p)}, key=_order)
        ok = [n for n in rows if all(n in t and reaches(t[n]) for t in table.values())]
        both = [n for n in rows if all(n in t for t in table.values())]
        if ok:
            ratio, best = max((next(iter(table.values()))[n]["ratio"], n) for n in ok)
            said.append(f"{what}: **{ratio:.0f}x** ({best})")
        elif both:  # the densest row measured on every corpus, and how far it is
            ratio, n = min((next(iter(table.values()))[n]["ratio"], n) for n in both)
            gaps = ", ".join(f"{t[n]['gap'].mean:+.3f} on {CORPORA[c]}" for c, t in table.items())
            said.append(f"{what}: no row measured reaches it (the densest on both, {n} at {ratio:.0f}x: {gaps})")
        else:
            said.append(f"{what}: not measured on both corpora")
    left = []
    for prefix, t in table.items():
        for n, e in t.items():
            short = [f"{len(e[part])} {what}{'s' * (len(e[part]) > 1)}"
                     for part, what in (("tried", "outer lr"), ("losses", "seed")) if len(e[part]) < 3]
            if len(e["tried"]) >= 3 and e["lr"] in (min(e["tried"]), max(e["tried"])):
                short.append("best at the edge of the outer lrs tried")
            if short:
                left.append(f"{prefix}{n} ({', '.join(short)})")
    for n in sorted({n for t in table.values() for n in t}, key=_order):
        left += [f"{p}{n} (not run)" for p in table if n not in table[p]]
    moved = [f"{t[BASE]['lr']:g} on {CORPORA[c]} ({t[BASE]['own'].mean:+.3f} [{t[BASE]['own'].lo:+.3f}, "
             f"{t[BASE]['own'].hi:+.3f}] against {row_lr(ROWS[BASE][1]):g} over {t[BASE]['own'].n} seeds)"
             for c, t in table.items() if BASE in t and t[BASE]["own"] is not None and t[BASE]["own"].n > 1]
    return ["The best compression against FP32 DiLoCo at M = 8 whose loss reaches DiLoCo's (paired 90% interval over "
            f"3 seeds including 0 or below it) on {' and '.join(CORPORA[p] for p in table)}: " + "; ".join(said) + "."
            + (" DiLoCo's tuned Nesterov lr at M = 8: " + ", ".join(moved) + "." if moved else ""),
            "", "What is left: " + ("; ".join(left) or "nothing") + "."]


def pareto_markdown(results: dict[str, Any]) -> list[str]:
    """The tuned Pareto at M = 8 (issue 36, item 4): per corpus and row, the chosen outer lr, the loss, the gap to
    DiLoCo with its interval, the bytes ratio; the answer above it."""
    table = pareto(results)
    if not table:
        return []
    lines = ["", "## Tuned Pareto at M = 8 (`bench/many_workers/loss.py`)", "",
             "The protocol of the loss check below (tiny model, 200 steps, H = 20, 8 in-process workers), with each "
             "row's outer lr tuned per corpus: the lr of the lowest seed-0 loss among those tried (`--outer-lr A,B,C "
             "--seeds 0`, then `--outer-lr tuned --seeds 1,2`), DiLoCo's Nesterov lr too; every gap is paired by seed "
             "against DiLoCo at its own tuned lr. Seed 0 both chose the lr and counts among the 3 seeds, which "
             "favours every row a little, DiLoCo included. The sparse rows are those of the check below (2-bit values, "
             "error feedback 0.95, or B in rows named -efB-, plain averaging; -nest- rows take Nesterov steps at "
             "DiLoCo's momentum instead); rs-2bit sends every value in 2 bits through the reduce-scatter "
             "with error feedback 0.95 and DiLoCo's Nesterov step, at DiLoCo's tuned lr. A row that reaches DiLoCo at "
             "fewer than 3 outer lrs tried is reported: tuning it can only choose a lower seed-0 loss.", "",
             *answer(table)]
    for prefix, t in table.items():
        lines += ["", f"### {CORPORA[prefix]}", "",
                  "| row | outer lr (seed-0 loss at each tried) | seeds | final eval loss | minus DiLoCo, paired "
                  "[90% CI] | fewer bytes than DiLoCo fp32 | reaches DiLoCo |", "|---|---|---|---|---|---|---|"]
        for name, e in t.items():
            tried = ", ".join(f"{'**' if lr == e['lr'] else ''}{lr:g}: {loss:.3f}{'**' if lr == e['lr'] else ''}"
                              for lr, loss in e["tried"].items())
            gap: Interval | None = e["gap"]
            gap_s = "" if gap is None else (f"{gap.mean:+.3f}" + (f" [{gap.lo:+.3f}, {gap.hi:+.3f}]" if gap.n > 1
                                                                  else ""))
            pending = "" if gap is None else f"({gap.n} seed{'s' * (gap.n > 1)} paired, 3 wanted)"
            ok = {None: pending, True: "yes", False: "no"}[reaches(e)]
            mean = sum(e["losses"].values()) / len(e["losses"])
            ratio = "" if name == BASE else f"{e['ratio']:.0f}x"
            lines.append(f"| {name} | {tried} | {len(e['losses'])} | {mean:.3f} | {gap_s} | {ratio} | {ok} |")
    return lines


def loss_table(results: dict[str, Any]) -> list[str]:
    """The short loss check of bench/many_workers/loss.py: mean final eval loss per row over its seeds."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for key, r in results.items():
        if "@" in key and split_key(key)[0] in CORPORA:  # another outer lr than the row's own: the Pareto's tuning
            continue
        rows.setdefault(key.split("/")[0], []).append({**r, "seed": key.split("/")[1]})

    def base_of(name: str) -> str:  # the DiLoCo row of the row's corpus and length (kjv:row, 400steps:row), any lr
        prefix = f"{name.split(':')[0]}:" if ":" in name else ""
        return next((n for n in rows if n.startswith(f"{prefix}{BASE}") and ":" not in n[len(prefix):]),
                    f"{prefix}{BASE}")

    first = next(iter(results.values()))
    lines = ["", f"## Loss at M = {first['workers']} (`bench/many_workers/loss.py`)", "",
             "Tiny model, Brown (rows kjv:... on the KJV, `--data kjv`), bpe:1024, batch 8 x 64, "
             f"{first['steps']} steps (rows 400steps:... 400, kjv-800steps:... 800 on the KJV, each against DiLoCo "
             f"of its corpus and length; row@lrX at outer lr X), H = 20, {first['workers']} "
             "in-process workers; sparse rows with error feedback 0.95 (B in rows -efB-) and plain averaging at outer "
             "lr 1.5, DiLoCo "
             "with Nesterov at 0.2 (the outer lrs tuned at M = 2 in bench/results/compression, not retuned). "
             "A short check at the outer lrs of M = 2; the tuned Pareto is above. The eager rows (1-outer-step "
             "eager, the same outer lr, untuned for eager at this M) say whether the shared support composes with "
             "eager as top-k does, not what eager costs. shared-K draws the K positions of every chunk; guided-K "
             "takes half of them from the largest entries of the last mean (`--support-guided 0.5`; guided75-K three "
             "quarters) and draws the rest.", "",
             "| row | seeds | final eval loss | minus DiLoCo fp32 (paired; each seed) | bytes per worker per run "
             "| fewer than DiLoCo fp32 |", "|---|---|---|---|---|---|"]
    def order(name: str) -> tuple:  # by corpus and length, DiLoCo first, then by K, the eager rows last
        prefix, _, row = name.rpartition(":")
        k = row.rsplit("-", 1)[-1]
        return prefix, row != "diloco-fp32", row.startswith("eager"), int(k) if k.isdigit() else 0, row

    for name, rs in sorted(rows.items(), key=lambda item: order(item[0])):
        base = {r["seed"]: r["final_eval_loss"] for r in rows.get(base_of(name), [])}
        base_bytes = rows[base_of(name)][0]["bytes_sent_per_worker"] if base_of(name) in rows else None
        loss = statistics.mean(r["final_eval_loss"] for r in rs)
        paired = [r["final_eval_loss"] - base[r["seed"]] for r in rs if r["seed"] in base]
        each = f" ({', '.join(f'{d:+.3f}' for d in paired)})" if len(paired) > 1 else ""
        delta = f"{statistics.mean(paired):+.3f}{each}" if paired and name != base_of(name) else ""
        nbytes = rs[0]["bytes_sent_per_worker"]
        ratio = f"{base_bytes / nbytes:.0f}x" if base_bytes and name != base_of(name) else ""
        lines.append(f"| {name} | {len(rs)} | {loss:.3f} | {delta} | {nbytes / 1e6:.3f} MB | {ratio} |")
    return lines


def loss_markdown(results: dict[str, Any]) -> list[str]:
    """The Markdown sections of bench/results/many_workers.md drawn from many_workers_loss.json."""
    return pareto_markdown(results) + loss_table(results)

if __name__ == "__main__":
    main()
