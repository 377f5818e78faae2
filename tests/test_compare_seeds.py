"""Seeded and tuned comparisons: the interval arithmetic against closed forms, seeds that really change
data and initialization (and repeat bit for bit), a tuner that finds a known best setting, divergence
marked against the unigram entropy, and bad input refused before anything trains."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch

import eagerloco.train
from eagerloco.config import ConfigError, TrainConfig
from eagerloco.lab import compare
from eagerloco.lab.compare import seeded
from eagerloco.lab.compare.report_seeds import aggregate, fmt_interval, reading, seeded_table
from eagerloco.lab.compare.stats import (
    diverged,
    mean_interval,
    paired_difference,
    spiked,
    t_cdf,
    t_quantile,
    unigram_entropy,
)
from eagerloco.lab.compare.tune import choose, parse_tune, setting_text, settings_for

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------------------------
# Interval arithmetic against closed forms


@pytest.mark.parametrize("p", [0.6, 0.9, 0.95, 0.975, 0.995])
def test_t_quantile_matches_the_closed_forms(p: float) -> None:
    # df = 1 (Cauchy): tan(pi (p - 1/2)); df = 2: (2p - 1) / sqrt(2 p (1 - p));
    # df = 4: 2 sqrt(q - 1) with a = 4 p (1 - p), q = cos(acos(sqrt a) / 3) / sqrt a.
    assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)
    assert t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-9)
    a = 4 * p * (1 - p)
    q = math.cos(math.acos(math.sqrt(a)) / 3) / math.sqrt(a)
    assert t_quantile(p, 4) == pytest.approx(2 * math.sqrt(q - 1), rel=1e-9)
    assert t_quantile(1 - p, 3) == pytest.approx(-t_quantile(p, 3))
    # Many degrees of freedom: close to the normal quantile.
    normal = {0.6: 0.2533471, 0.9: 1.2815516, 0.95: 1.6448536, 0.975: 1.9599640, 0.995: 2.5758293}[p]
    assert t_quantile(p, 2000) == pytest.approx(normal, rel=2e-3)


def test_t_cdf_is_a_distribution() -> None:
    for df in (1, 2, 3, 7, 30):
        assert t_cdf(0.0, df) == pytest.approx(0.5)
        assert t_cdf(1.3, df) + t_cdf(-1.3, df) == pytest.approx(1.0)
        assert t_cdf(-50, df) < t_cdf(-1, df) < t_cdf(1, df) < t_cdf(50, df)
    with pytest.raises(ValueError):
        t_cdf(1.0, 0)


def test_mean_interval_and_paired_difference_closed_form() -> None:
    # [1, 2, 3]: mean 2, sd 1, 90% half-width t(0.95, 2) / sqrt(3) = 0.9 / sqrt(0.095) / sqrt(3).
    iv = mean_interval([1.0, 2.0, 3.0])
    half = 0.9 / math.sqrt(0.095) / math.sqrt(3)
    assert (iv.mean, iv.sd, iv.n) == (2.0, 1.0, 3)
    assert (iv.lo, iv.hi) == (pytest.approx(2 - half), pytest.approx(2 + half))
    # Paired by seed: the shared offset cancels, only the differences' spread counts.
    a = {0: 5.0, 1: 6.0, 2: 7.5}
    b = {0: 4.9, 1: 5.7, 2: 7.3, 3: 1.0}  # seed 3 has no partner: left out
    d = paired_difference(a, b)
    diffs = [0.1, 0.3, 0.2]
    assert d.n == 3 and d.mean == pytest.approx(0.2)
    assert d.half_width == pytest.approx(t_quantile(0.95, 2) * 0.1 / math.sqrt(3))
    assert d.lo > 0 and reading({"mean": d.mean, "lo": d.lo, "hi": d.hi, "n": 3}) == "worse"
    assert mean_interval(diffs).lo == pytest.approx(d.lo)
    # One value: no width; a non-finite one: no mean at all; the 95% interval is wider than the 90% one.
    assert mean_interval([4.0]).lo == mean_interval([4.0]).hi == 4.0
    assert mean_interval([1.0, float("nan")]) is None and mean_interval([]) is None
    assert mean_interval([1.0, 2.0, 3.0], 0.95).half_width > iv.half_width
    assert fmt_interval({"mean": 0.2, "lo": 0.05, "hi": 0.35, "n": 3}, signed=True) == "+0.2000 [+0.0500, +0.3500]"


def test_unigram_entropy_and_divergence() -> None:
    assert unigram_entropy([1, 1, 2, 0]) == pytest.approx(-(2 * 0.25 * math.log(0.25) + 0.5 * math.log(0.5)))
    assert unigram_entropy([7]) == 0.0
    with pytest.raises(ValueError):
        unigram_entropy([0, 0])
    h = 6.0
    assert not diverged(4.9, h) and diverged(6.4, h) and diverged(float("nan"), h) and diverged(float("inf"), h)
    assert not spiked([8.3, 7.0, 5.5, 5.0, 4.9], h)  # starts above (an untrained model), ends below
    assert spiked([8.3, 5.5, 12.0, 5.9], h)  # climbed back above mid-run, recovered
    assert spiked([8.3, 5.5, float("nan")], h)
    assert not spiked([8.3, 7.0, 6.5, 6.4], h)  # never got below: diverged at the end, but no spike


# --------------------------------------------------------------------------------------------------
# The tuner's pieces


def test_parse_tune_and_what_each_entry_sweeps() -> None:
    axes = parse_tune(["outer-lr=0.2,0.35,0.2", "lr=1e-3,3e-3", "outer_nesterov=true,false"])
    assert [(a.key, a.section, a.values) for a in axes] == [
        ("outer_lr", "outer", (0.2, 0.35)), ("lr", "train", (0.001, 0.003)), ("outer_nesterov", "outer", (True, False))]
    lr_only = parse_tune(["outer_lr=0.5,1.0"])
    e = compare.ENTRIES
    assert settings_for(e["eager-1"], lr_only) == [{"outer_lr": 0.5}, {"outer_lr": 1.0}]
    for fixed in ("dp", "single", "averaging", "delayed-1-lowlr"):  # they set the outer lr themselves
        assert settings_for(e[fixed], lr_only) == [{}], fixed
    assert len(settings_for(e["no-overlap"], axes)) == 8 and settings_for(e["dp"], axes) == [
        {"lr": 0.001}, {"lr": 0.003}]
    assert setting_text({"outer_lr": 0.35, "outer_nesterov": False}) == "outer_lr=0.35,outer_nesterov=False"
    for bad, needle in [("outer_lr", "KEY=V1"), ("outer_lr=", "KEY=V1"), ("nope=1", "nope"), ("seed=1,2", "seed"),
                        ("method=dp", "method"), ("outer_lr=fast", "fast"), ("steps=1.5", "1.5")]:
        with pytest.raises(ConfigError, match=needle):
            parse_tune([bad])
    with pytest.raises(ConfigError, match="twice"):
        parse_tune(["lr=1e-3", "lr=2e-3"])


def test_choose_takes_the_lowest_loss_that_did_not_diverge() -> None:
    assert choose([5.0, 4.0, 4.5], [False, False, False]) == 1
    assert choose([5.0, 3.0, 4.5], [False, True, False]) == 2  # the lowest diverged (went back above entropy)
    assert choose([5.0, float("nan"), 4.0, 4.0], [False, False, False, False]) == 2  # first of equals, nan skipped
    assert choose([7.0, 8.0], [True, True]) == 0  # all diverged: still the lowest
    with pytest.raises(ValueError):
        choose([float("nan")], [False])


def test_report_rows_mark_diverged_runs_and_pair_by_seed() -> None:
    units = seeded.units_for(compare.resolve_grid("no-overlap,delayed-1"), None)
    assert [u.name for u in units] == ["dp", "single", "averaging", "no-overlap", "delayed-1"]
    base = {"inner_steps": 20, "outer": {"outer_lr": 0.7}, "tolerated": "0", "bytes_sent_per_worker": 1.0,
            "compute_utilization": 0.5, "wall_s": 1.0}
    ref = {0: 5.0, 1: 5.5, 2: 4.8}
    results = [{**base, "unit": "no-overlap", "seed": s, "final_eval_loss": v, "diverged": False, "spiked": s == 2}
               for s, v in ref.items()]
    results += [{**base, "unit": "delayed-1", "seed": s, "final_eval_loss": v + d, "diverged": s == 1}
                for (s, v), d in zip(ref.items(), (0.5, 3.0, 0.4), strict=True)]
    rows = {r["unit"]: r for r in aggregate(units, results)}
    delayed = rows["delayed-1"]
    assert delayed["delta"]["mean"] == pytest.approx((0.5 + 3.0 + 0.4) / 3)
    assert delayed["diverged_seeds"] == [1] and rows["no-overlap"]["delta"] == "reference"
    assert rows["dp"]["loss"] is None  # no runs: n/a, not zero
    table = seeded_table(list(rows.values()), sweep=False)
    line = next(ln for ln in table.splitlines() if "naive delayed" in ln)
    assert "1-outer-step naive delayed †" in line and "8.500†" in line and "1/3" in line
    line = next(ln for ln in table.splitlines() if ln.startswith("| no overlap"))
    assert "no overlap ‡" in line and "4.800‡" in line and "0/3, 1/3" in line


# --------------------------------------------------------------------------------------------------
# Real runs: seeds and tuning through the command


def _compare(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="eagerloco")
    compare.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["compare", *argv])
    return args.func(args)


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("text")
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly pack boxes of liquor".split()
    for i in range(6):
        (d / f"doc{i}.txt").write_text(" ".join(words[(i * 3 + j * j) % len(words)] for j in range(700)) + "\n")
    return d


def _fast(text_dir: Path, out: Path) -> list[str]:
    return ["--data", str(text_dir), "--workers", "2", "--model", "tiny", "--batch-size", "2", "--seq-len", "16",
            "--eval-batches", "1", "--warmup-steps", "1", "--log-every", "1", "--sim-step-time", "0.05",
            "--bandwidth-gbps", "0.05", "--latency-ms", "20", "--no-progress", "--threads", "1",
            "--inner-steps", "2", "--out", str(out)]


class CountingTrain:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self._train = eagerloco.train.train

    def __call__(self, cfg):  # noqa: ANN001 - same signature as train()
        self.calls.append(str(Path(cfg.out).relative_to(Path(cfg.out).parents[2])))
        return self._train(cfg)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> CountingTrain:
    counter = CountingTrain()
    monkeypatch.setattr(eagerloco.train, "train", counter)
    return counter


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(ln)["loss"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_seeds_change_data_order_and_initialization_and_repeat_bit_for_bit(text_dir: Path, tmp_path: Path,
                                                                            counted: CountingTrain) -> None:
    from eagerloco.data import get_tokenizer, load_corpus, worker_streams
    from eagerloco.train.worker import build_model

    # The pieces a seed drives: initialization, and the batches each worker draws.
    def init_and_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = TrainConfig(data=str(text_dir), seq_len=16, batch_size=2, seed=seed)
        corpus = load_corpus(cfg.data, seed=seed)
        tok = get_tokenizer("byte", corpus)
        x, _ = worker_streams(corpus, tok, 2, 2, 16, seed)[1].next_batch()
        return next(build_model(cfg, tok.vocab_size).parameters()).detach().clone(), x

    (w0, x0), (w1, x1), (w0b, x0b) = init_and_batch(0), init_and_batch(1), init_and_batch(0)
    assert not torch.equal(w0, w1) and not torch.equal(x0, x1)
    assert torch.equal(w0, w0b) and torch.equal(x0, x0b)

    out = tmp_path / "seeds"
    argv = [*_fast(text_dir, out), "--steps", "4", "--seeds", "2", "--grid", "no-overlap"]
    assert _compare(*argv) == 0
    units = ["dp", "single", "averaging", "no-overlap"]  # the baselines come first in every seeded comparison
    assert counted.calls == [f"runs/{u}/seed{s}" for u in units for s in (0, 1)]
    runs = out / "runs"
    for u in units:
        a, b = _losses(runs / u / "seed0"), _losses(runs / u / "seed1")
        assert a[0] != b[0], u  # different data and initialization from the first step
        cfg = json.loads((runs / u / "seed1" / "summary.json").read_text())["config"]
        assert cfg["seed"] == 1
    before = {u: (_losses(runs / u / "seed0"), json.loads((runs / u / "seed0" / "summary.json").read_text()))
              for u in units}
    counted.calls.clear()
    assert _compare(*argv, "--force") == 0  # retrain: the same numbers, bit for bit
    assert len(counted.calls) == 8
    for u in units:
        summary = json.loads((runs / u / "seed0" / "summary.json").read_text())
        assert _losses(runs / u / "seed0") == before[u][0]
        assert summary["final_eval_loss"] == before[u][1]["final_eval_loss"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["seeds"] == [0, 1] and [r["unit"] for r in summary["rows"]] == units
    no = next(r for r in summary["rows"] if r["unit"] == "no-overlap")
    assert set(no["losses"]) == {"0", "1"} and no["loss"]["n"] == 2
    assert all(isinstance(r["unigram_entropy"], float) and "diverged" in r for r in summary["runs"])
    report = (out / "report.md").read_text()
    assert "90% CI" in report and "single worker" in report and "plain averaging" in report
    for name in ("loss_vs_steps.png", "delta_vs_no_overlap.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC and f"]({name})" in report
    counted.calls.clear()
    assert _compare(*argv) == 0 and counted.calls == []  # finished runs are reused


@pytest.mark.slow
def test_tuner_picks_the_known_best_and_variants_follow_their_method(text_dir: Path, tmp_path: Path,
                                                                      counted: CountingTrain) -> None:
    # Outer SGD without momentum: an outer lr of 1e-4 leaves the outer parameters at their
    # initialization (whatever the workers learn is thrown away), 1.0 applies the workers' mean
    # progress. The answer is known: 1.0 wins, for every method swept.
    out = tmp_path / "tuned"
    argv = [*_fast(text_dir, out), "--steps", "6", "--tune", "outer_lr=0.0001,1.0", "--grid", "no-overlap,eager-1,"
            "eager-1-4bit", "--lr", "0.01", "--outer-momentum", "0", "--no-outer-nesterov"]
    assert _compare(*argv) == 0
    tuned = [c for c in counted.calls if c.startswith("tune/")]
    assert sorted(tuned) == sorted(f"tune/{u}/outer_lr={v}" for u in ("no-overlap", "eager-1") for v in ("0.0001", "1"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tune_seed"] == 1000 and summary["seeds"] == [0]
    assert summary["chosen"] == {"no-overlap": {"outer_lr": 1.0}, "eager-1": {"outer_lr": 1.0},
                                 "eager-1-4bit": {"outer_lr": 1.0}}  # the 4-bit variant takes eager's
    tuning = {(r["unit"], r["setting"]["outer_lr"]): r for r in summary["tuning_runs"]}
    for u in ("no-overlap", "eager-1"):
        assert tuning[(u, 1.0)]["chosen"] and not tuning[(u, 0.0001)]["chosen"]
        assert tuning[(u, 1.0)]["final_eval_loss"] < tuning[(u, 0.0001)]["final_eval_loss"]
    by = {r["unit"]: r for r in summary["runs"]}
    assert by["eager-1-4bit"]["outer"]["outer_lr"] == 1.0 and by["eager-1-4bit"]["outer"]["codec"] == "e2m1"
    assert by["dp"]["outer"]["outer_lr"] == 0.7 and by["averaging"]["outer"]["outer_momentum"] == 0.0
    seed_of = {json.loads((out / "tune" / "eager-1" / "outer_lr=1" / "summary.json").read_text())["config"]["seed"]}
    assert seed_of == {1000}
    report = (out / "report.md").read_text()
    assert "## Tuning sweep (seed 1000)" in report and "tuned: outer_lr=1" in report
    sweep = [ln for ln in report.splitlines() if ln.startswith("| 1-outer-step eager ")]
    assert sweep and "**" in sweep[-1]
    assert (out / "tuning.png").read_bytes()[:8] == PNG_MAGIC

    # A sweep of H at the settings chosen above.
    sweep_out = tmp_path / "h"
    counted.calls.clear()
    assert _compare(*_fast(text_dir, sweep_out)[:-4], "--out", str(sweep_out), "--steps", "6", "--lr", "0.01",
                    "--outer-momentum", "0", "--no-outer-nesterov",
                    "--sweep", "inner-steps", "--inner-steps-list", "3", "--grid", "no-overlap,eager-1",
                    "--tuned-from", str(out)) == 0
    runs = json.loads((sweep_out / "summary.json").read_text())["runs"]
    assert {(r["unit"], r["outer"]["outer_lr"], r["inner_steps"]) for r in runs} == {
        ("H3-no-overlap", 1.0, 3), ("H3-eager-1", 1.0, 3)}
    assert (sweep_out / "loss_vs_inner_steps.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_divergence_is_warned_and_marked(text_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(seeded, "data_entropy", lambda cfg: 0.5)  # below any loss these runs reach
    out = tmp_path / "div"
    assert _compare(*_fast(text_dir, out), "--steps", "2", "--seeds", "1", "--grid", "no-overlap") == 0
    err = capsys.readouterr().err
    assert err.count("diverged") == 4 and "unigram entropy" in err
    summary = json.loads((out / "summary.json").read_text())
    assert all(r["diverged"] for r in summary["runs"]) and all(r["diverged_seeds"] == [0] for r in summary["rows"])
    assert "no overlap †" in (out / "report.md").read_text()
    # Without --seeds too: warned, in summary.json and in a note under the unchanged table.
    plain = tmp_path / "plain"
    assert _compare(*_fast(text_dir, plain), "--steps", "2", "--grid", "no-overlap,dp") == 0
    assert capsys.readouterr().err.count("diverged") == 2
    assert all(r["diverged"] for r in json.loads((plain / "summary.json").read_text())["runs"])
    assert "- **Diverged**: no overlap; data-parallel." in (plain / "report.md").read_text()
    monkeypatch.setattr(seeded, "data_entropy", lambda cfg: 50.0)  # above every loss: nothing diverged
    assert _compare(*_fast(text_dir, plain), "--steps", "2", "--grid", "no-overlap,dp") == 0
    assert "diverged" not in capsys.readouterr().err and "Diverged" not in (plain / "report.md").read_text()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--seeds", "0"], "--seeds"),
        (["--tune", "outer_lr"], "KEY=V1"),
        (["--tune", "warp=1,2"], "warp"),
        (["--tune-seed", "3"], "--tune-seed needs --tune"),
        (["--tune", "outer_lr=0.5", "--tuned-from", "x"], "--tuned-from"),
        (["--tune", "outer_lr=-1,0.5"], "--outer-lr"),
        (["--seeds", "2", "--tuned-from", "/nonexistent"], "--tuned-from"),
    ],
)
def test_bad_seed_and_tune_input_fails_before_any_training(tmp_path: Path, counted: CountingTrain, argv: list[str],
                                                            needle: str) -> None:
    out = tmp_path / "bad"
    with pytest.raises(ConfigError, match=needle):
        _compare("--out", str(out), "--no-progress", *argv)
    assert counted.calls == [] and not out.exists()
