"""`eagerloco compare`: the grid runs, the report has every row and column, plots are real PNGs,
finished runs are reused, the sweep covers every (H, method), and bad input fails before training."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

import eagerloco.train
from eagerloco.config import ConfigError, OuterConfig
from eagerloco.lab import compare
from eagerloco.lab.compare.report import EVAL_COLUMNS, PLOTS, SWEEP_PLOT

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STEP_S = 0.05  # --sim-step-time: the link clock, and so the tolerated seconds, are exact
H = 4


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagerloco")
    compare.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def _compare(*argv: str) -> int:
    args = _parser().parse_args(["compare", *argv])
    return args.func(args)


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A few small documents: loading them is instant, unlike the full corpus."""
    d = tmp_path_factory.mktemp("text")
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly pack boxes of liquor".split()
    for i in range(4):
        (d / f"doc{i}.txt").write_text(" ".join(words[(i + j) % len(words)] for j in range(900)) + "\n")
    return d


def _fast(text_dir: Path, out: Path) -> list[str]:
    return ["--data", str(text_dir), "--workers", "2", "--model", "tiny", "--batch-size", "2", "--seq-len", "32",
            "--eval-batches", "1", "--warmup-steps", "1", "--log-every", "2", "--sim-step-time", str(STEP_S),
            "--bandwidth-gbps", "0.05", "--latency-ms", "20", "--no-progress", "--out", str(out)]


class CountingTrain:
    """Wraps train() to count how many runs really train."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._train = eagerloco.train.train

    def __call__(self, cfg):  # noqa: ANN001 - same signature as train()
        self.calls.append(Path(cfg.out).name)
        return self._train(cfg)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> CountingTrain:
    counter = CountingTrain()
    monkeypatch.setattr(eagerloco.train, "train", counter)
    return counter


def _table_rows(report: str) -> dict[str, dict[str, str]]:
    """The report's Markdown table as {row label: {column: cell}}."""
    lines = [ln for ln in report.splitlines() if ln.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        rows[cells[0] if head[0] == "method" else f"{cells[0]}/{cells[1]}"] = dict(zip(head, cells, strict=True))
    return rows


@pytest.mark.slow
def test_paper_grid_report_plots_summary_and_cache(text_dir: Path, tmp_path: Path, counted: CountingTrain,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cmp"
    argv = [*_fast(text_dir, out), "--steps", "8", "--inner-steps", str(H)]
    assert _compare(*argv) == 0
    printed = capsys.readouterr().out
    assert printed.rstrip().splitlines()[-1] == f"report: {out / 'report.md'}"
    assert len(counted.calls) == len(compare.PAPER_GRID)

    report = (out / "report.md").read_text()
    rows = _table_rows(report)
    labels = [compare.ENTRIES[n].label for n in compare.PAPER_GRID]
    assert list(rows) == labels
    for col in ("outer lr", "tolerated latency", "eval loss", "bytes exchanged / worker", "peak bytes", "CU (link)"):
        assert col in rows["no overlap"], col
    assert not {c for c, _ in EVAL_COLUMNS} & set(rows["no overlap"])  # no run computed benchmarks: no columns
    # The lowered-lr row makes the outer lr differ between rows, so the table shows it.
    assert [r["outer lr"] for r in rows.values()] == ["-", "0.7", "0.7", "0.7", "0.35", "0.7", "0.7"]
    assert all(re.fullmatch(r"\d+\.\d{4}", r["eval loss"]) for r in rows.values())
    assert rows["data-parallel"]["bytes exchanged / worker"] != rows["no overlap"]["bytes exchanged / worker"]

    # Tolerated latency from the schedule: 0 / tau steps / k rounds of H, seconds = steps x step time.
    expected = {
        "data-parallel": "0",
        "no overlap": "0",
        "1-inner-step overlap": f"1 step ({STEP_S:.2f} s)",
        "1-outer-step naive delayed": f"1 round = {H} steps ({H * STEP_S:.2f} s)",
        "1-outer-step naive delayed, lowered lr": f"1 round = {H} steps ({H * STEP_S:.2f} s)",
        "1-outer-step eager": f"1 round = {H} steps ({H * STEP_S:.2f} s)",
        "2-outer-steps eager": f"2 rounds = {2 * H} steps ({2 * H * STEP_S:.2f} s)",
    }
    assert {k: v["tolerated latency"] for k, v in rows.items()} == expected

    for name in PLOTS.values():
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC, name
        assert f"]({name})" in report

    summary = json.loads((out / "summary.json").read_text())
    runs = summary["runs"]
    assert [r["name"] for r in runs] == compare.PAPER_GRID
    assert [r["tolerated_steps"] for r in runs] == [0, 0, 1, H, H, H, 2 * H]
    assert {r["steps"] for r in runs} == {8} and len({r["tokens"] for r in runs}) == 1  # one budget
    by = {r["name"]: r for r in runs}
    assert by["delayed-1-lowlr"]["outer"]["outer_lr"] == pytest.approx(0.35)
    assert by["delayed-1"]["outer"]["outer_lr"] == pytest.approx(0.7)
    assert by["eager-2"]["outer"]["eager_rounds"] == 2 and by["overlap-1"]["outer"]["overlap_steps"] == 1
    # The default eval cadence gives a curve, not only the final point.
    evals = [json.loads(ln) for ln in (out / "runs" / "eager-1" / "metrics.jsonl").read_text().splitlines()]
    assert sum("eval_loss" in e for e in evals) >= 3

    # Rerun: every run is reused, nothing trains, the run files are untouched.
    stamps = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/summary.json")}
    counted.calls.clear()
    assert _compare(*argv) == 0
    assert counted.calls == []
    assert {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/summary.json")} == stamps
    assert capsys.readouterr().out.count("reusing") == len(compare.PAPER_GRID)
    assert all(r["cached"] for r in json.loads((out / "summary.json").read_text())["runs"])

    # A run killed before its summary was written is retrained; the others are still reused.
    (out / "runs" / "eager-2" / "summary.json").unlink()
    assert _compare(*argv) == 0
    assert counted.calls == ["eager-2"]
    counted.calls.clear()

    # A changed setting retrains the affected runs; --force retrains even unchanged ones.
    assert _compare(*argv, "--grid", "eager-1,no-overlap", "--lr", "0.002") == 0
    assert counted.calls == ["eager-1", "no-overlap"]
    counted.calls.clear()
    assert _compare(*argv, "--grid", "no-overlap", "--lr", "0.002", "--force") == 0
    assert counted.calls == ["no-overlap"]


# slow: a whole sweep over H, its runs and its report
@pytest.mark.slow
def test_sweep_inner_steps_one_row_per_h_and_method(text_dir: Path, tmp_path: Path, counted: CountingTrain) -> None:
    out = tmp_path / "sweep"
    assert _compare(*_fast(text_dir, out), "--steps", "6", "--sweep", "inner-steps",
                    "--inner-steps-list", "3,2") == 0
    methods = [compare.ENTRIES[n].label for n in compare.SWEEP_GRID]
    rows = _table_rows((out / "report.md").read_text())
    assert sorted(rows) == sorted(f"{h}/{m}" for h in (2, 3) for m in methods)
    assert rows["3/1-outer-step eager"]["tolerated latency"] == f"1 round = 3 steps ({3 * STEP_S:.2f} s)"
    assert rows["2/no overlap"]["tolerated latency"] == "0"
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert sorted((r["inner_steps"], r["name"]) for r in runs) == sorted(
        (h, n) for h in (2, 3) for n in compare.SWEEP_GRID)
    assert all(r["inner_steps"] == r["outer"]["inner_steps"] for r in runs)
    assert (out / SWEEP_PLOT).read_bytes()[:8] == PNG_MAGIC
    assert len(counted.calls) == 6


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--grid", "paper,eager-9"], ["'eager-9'", *compare.ENTRIES]),
        (["--grid", ""], ["--grid", "no-overlap"]),
        (["--method", "eager"], ["--method", "--grid"]),
        (["--overlap-steps", "1"], ["--overlap-steps"]),
        (["--steps", "5", "--tokens", "1000"], ["--steps", "--tokens"]),
        (["--sweep", "inner-steps", "--inner-steps-list", "10,x"], ["--inner-steps-list"]),
        (["--inner-steps-list", "10,20"], ["--sweep"]),
        (["--sweep", "inner-steps", "--inner-steps", "5"], ["--inner-steps-list"]),
        (["--grid", "overlap-1", "--inner-steps", "1"], ["overlap-1", "--overlap-steps"]),
        (["--lowered-outer-lr", "0"], ["--lowered-outer-lr"]),
        (["--threads", "0"], ["--threads"]),
    ],
)
def test_bad_input_fails_before_any_training(tmp_path: Path, counted: CountingTrain, argv: list[str],
                                            needles: list[str]) -> None:
    out = tmp_path / "bad"
    with pytest.raises(ConfigError) as e:
        _compare("--out", str(out), "--no-progress", *argv)
    for needle in needles:
        assert needle in str(e.value), needle
    assert counted.calls == [] and not out.exists()


def test_grids_and_names() -> None:
    assert [e.name for e in compare.resolve_grid("paper")] == compare.PAPER_GRID
    everything = [e.name for e in compare.resolve_grid("all")]
    assert set(compare.PAPER_GRID) < set(everything) and any("streaming" in n for n in everything)
    assert any("4bit" in n for n in everything)
    # Names or labels (without commas), spaces tolerated, duplicates dropped.
    assert [e.name for e in compare.resolve_grid(" eager-1 , 1-outer-step eager,dp")] == ["eager-1", "dp"]
    assert [e.name for e in compare.resolve_grid("paper,streaming-2")] == [*compare.PAPER_GRID, "streaming-2"]
    assert len({e.label for e in compare.ENTRIES.values()}) == len(compare.ENTRIES)


@pytest.mark.parametrize(
    ("outer", "steps", "text"),
    [
        ({"method": "dp"}, 0, "0"),
        ({"method": "diloco"}, 0, "0"),
        ({"method": "diloco", "overlap_steps": 2}, 2, "2 steps (0.20 s)"),
        ({"method": "streaming", "fragments": 2, "overlap_steps": 1}, 1, "1 step (0.10 s)"),
        ({"method": "streaming", "fragments": 2}, 0, "0"),
        ({"method": "delayed"}, 10, "1 round = 10 steps (1.00 s)"),
        ({"method": "eager", "eager_rounds": 3}, 30, "3 rounds = 30 steps (3.00 s)"),
    ],
)
def test_tolerated_latency_follows_the_schedule(outer: dict, steps: int, text: str) -> None:
    cfg = OuterConfig(inner_steps=10, **outer).validate()
    assert compare.tolerated_steps(cfg) == steps
    assert compare.tolerated_text(cfg, 0.1) == text


def test_every_grid_entry_is_a_valid_config() -> None:
    from eagerloco.train import TrainConfig

    base = TrainConfig(outer=OuterConfig(inner_steps=20))
    plans = compare.plan_runs(base, compare.resolve_grid("all"), Path("unused"), 0.35)
    assert [p.run_dir.name for p in plans] == compare.ALL_GRID


def test_benchmark_columns_show_the_accuracies_a_run_recorded() -> None:
    from eagerloco.lab.compare.report import results_table

    base = {"tolerated": "0", "final_eval_loss": 2.5, "bytes_sent_per_worker": 10, "peak_sync_bytes": 5,
            "compute_utilization": 0.5, "wall_s": 1.0}
    rows = _table_rows(results_table([
        {**base, "name": "no-overlap", "label": "no overlap", "hellaswag": 0.25, "piqa": 0.5, "arc_easy": 0.3},
        {**base, "name": "eager-1", "label": "1-outer-step eager", "final_eval_loss": 2.6},
    ]))
    assert [rows["no overlap"][c] for c in ("HellaSwag", "PIQA", "ARC-Easy")] == ["25.0%", "50.0%", "30.0%"]
    assert rows["1-outer-step eager"]["PIQA"] == "n/a" and rows["1-outer-step eager"]["Δ vs no overlap"] == "+0.1000"


def test_workers_of_unequal_speed_get_their_own_columns() -> None:
    from eagerloco.lab.compare.report import results_table

    base = {"tolerated": "0", "final_eval_loss": 2.5, "bytes_sent_per_worker": 10, "peak_sync_bytes": 5,
            "compute_utilization": 0.5, "wall_s": 1.0}
    plain = _table_rows(results_table([{**base, "name": "no-overlap", "label": "no overlap"}]))
    assert "H_m" not in plain["no overlap"]
    rows = _table_rows(results_table([
        {**base, "name": "no-overlap", "label": "fixed", "outer": {"worker_speeds": [1.0, 0.5], "outer_lr": 0.7},
         "worker_cu": [0.5, 1.0], "worker_idle_s": [3.25, 0.0]},
        {**base, "name": "eager-1", "label": "adaptive", "round_steps": [8, 4], "worker_cu": [0.97, 0.96],
         "worker_idle_s": [0.1, 0.2]},
    ]))
    assert [rows["fixed"][c] for c in ("H_m", "CU per worker", "idle s per worker")] == ["-", "0.50/1.00", "3.2/0.0"]
    assert [rows["adaptive"][c] for c in ("H_m", "CU per worker")] == ["8/4", "0.97/0.96"]


@pytest.mark.parametrize(("scores", "limit", "chance"), [
    ({"hellaswag": 0.28, "piqa": 0.45, "arc_easy": 0.20}, 100, True),  # 2 SE: 8.7 / 10 / 8.7 points
    ({"hellaswag": 0.34, "piqa": 0.45, "arc_easy": 0.20}, 100, False),  # HellaSwag 9 points above chance
    ({"hellaswag": 0.28}, 1000, False),  # 2 SE on 1000 questions: 2.7 points
    ({}, 100, False),  # nothing scored: nothing to call chance
])
def test_zero_shot_columns_at_chance_are_called_so(scores: dict, limit: int, chance: bool) -> None:
    from eagerloco.lab.compare.report import at_chance

    assert at_chance([{"name": "no-overlap", **scores}, {"name": "eager-1", **scores}], limit) is chance
