"""`eagerloco demo`: the tuned settings it ships are the committed comparison's, its plan runs them, and
its printed table fits 100 columns with the seeded result beside each row."""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import asdict
from pathlib import Path

import pytest

from eagerloco.cli import main, make_parser
from eagerloco.config import ConfigError
from eagerloco.lab.compare import demo
from eagerloco.lab.compare.reference import (
    REFERENCE_FILE,
    load_reference,
    protocol_of,
    reference_from_summary,
)
from eagerloco.lab.compare.runner import build_base_config

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "bench" / "results" / "compare_seeds_400"


def _demo_plans(*argv: str):  # noqa: ANN202 - (plans, base, out, lowered)
    args = make_parser().parse_args(["demo", *argv])
    ref = load_reference()
    return demo.plan_demo(demo.with_defaults(args, ref), ref)


def test_shipped_tuned_values_are_the_committed_comparisons() -> None:
    summary = json.loads((COMMITTED / "summary.json").read_text())
    shipped = load_reference()
    # Regenerating from the committed summary gives the shipped file exactly.
    assert reference_from_summary(summary) == shipped
    assert shipped["chosen"] == summary["chosen"]
    assert {n: s["outer_lr"] for n, s in shipped["chosen"].items()} == {
        "no-overlap": 0.2, "overlap-1": 0.35, "delayed-1": 0.1, "eager-1": 0.2, "eager-2": 0.1, "eager-1-4bit": 0.2}
    # The relative differences are the ones findings.md (written by another script) reports.
    findings = (COMMITTED / "findings.md").read_text()
    for name in ("delayed-1", "eager-1"):
        d = shipped["rows"][name]["delta_pct"]
        assert f"{d['mean']:+.2f}% [{d['lo']:+.2f}%, {d['hi']:+.2f}%]" in findings, name
    assert shipped["rows"]["no-overlap"]["delta_pct"] is None
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert REFERENCE_FILE.name in pyproject["tool"]["setuptools"]["package-data"]["eagerloco.lab.compare"]


def test_the_rerun_command_is_the_committed_protocol() -> None:
    ref = load_reference()
    argv = ref["command"].split()
    assert argv[:2] == ["eagerloco", "compare"] and "--seeds" in argv and "--tune" in argv
    args = make_parser().parse_args(argv[1:])
    base, _ = build_base_config(args)
    assert protocol_of(asdict(base)) == ref["protocol"]
    assert args.seeds == len(ref["seeds"]) and args.tune == ["outer_lr=0.1,0.2,0.35,0.5"]


def test_the_demo_plan_runs_each_method_at_its_tuned_outer_lr_on_the_committed_protocol() -> None:
    ref = load_reference()
    plans, base, out, _ = _demo_plans()
    assert [p.entry.name for p in plans] == list(demo.DEMO_GRID)
    assert out == Path(demo.DEMO_OUT)
    assert demo.protocol_changes(base, ref) == []
    lrs = {p.entry.name: p.cfg.outer.outer_lr for p in plans}
    assert lrs["no-overlap"] == 0.2 and lrs["delayed-1"] == 0.1 and lrs["eager-1"] == 0.2
    assert {p.entry.name: p.setting for p in plans if p.setting} == {
        n: ref["chosen"][n] for n in ("no-overlap", "delayed-1", "eager-1")}
    by = {p.entry.name: p.cfg for p in plans}
    assert by["single"].workers == 1 and by["single"].outer.method == "dp"
    assert all(c.steps == 400 and c.tokenizer == "bpe:1024" and c.eval_tasks == "" for c in by.values())


def test_demo_flags_override_its_settings() -> None:
    ref = load_reference()
    plans, base, _, _ = _demo_plans("--outer-lr", "0.5", "--steps", "100", "--grid", "no-overlap,eager-1")
    assert [(p.entry.name, p.cfg.outer.outer_lr, p.setting) for p in plans] == [
        ("no-overlap", 0.5, None), ("eager-1", 0.5, None)]
    assert demo.protocol_changes(base, ref) == ["steps 100 (seeded: 400)"]
    plans, base, _, _ = _demo_plans("--tokens", "40960")
    assert base.steps == 40960 // (2 * 8 * 64)  # --tokens instead of the demo's --steps: no clash


@pytest.mark.parametrize("flag", [["--seeds", "3"], ["--tune", "outer_lr=0.1,0.2"], ["--sweep", "inner-steps"]])
def test_seeded_flags_point_to_compare(flag: list[str]) -> None:
    args = make_parser().parse_args(["demo", *flag])
    with pytest.raises(ConfigError, match=r"is for `eagerloco compare`; .*`eagerloco compare .*--seeds 3"):
        demo.with_defaults(args, load_reference())


def _result(name: str, label: str, loss: float, lr: float, method: str = "diloco", **kw: object) -> dict:
    return {"name": name, "label": label, "final_eval_loss": loss, "compute_utilization": 0.66,
            "outer": {"method": method, "outer_lr": lr}, **kw}


FAKE = [
    _result("single", "single worker", 5.08, 0.7, method="dp"),
    _result("no-overlap", "no overlap", 5.0, 0.2, setting={"outer_lr": 0.2}),
    _result("delayed-1", "1-outer-step naive delayed", 5.3, 0.1, spiked=True, setting={"outer_lr": 0.1}),
    _result("eager-1", "1-outer-step eager", 5.15, 0.2, setting={"outer_lr": 0.2}),
]


def _rows(table: str) -> dict[str, dict[str, str]]:
    lines = table.splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return {(cells := [c.strip() for c in ln.strip("|").split("|")])[0]: dict(zip(head, cells, strict=True))
            for ln in lines[2:]}


def test_demo_table_fits_100_columns_and_puts_the_seeded_result_beside_each_row() -> None:
    table = demo.demo_table(FAKE, load_reference(), seed=0)
    assert max(len(line) for line in table.splitlines()) <= 100
    rows = _rows(table)
    seeded = "Δ, seeds 0-2 [90% CI]"
    assert rows["1-outer-step eager"][seeded] == "+2.80% [+2.50, +3.10]"
    assert rows["1-outer-step naive delayed ‡"][seeded] == "+6.87% [+5.97, +7.76]"
    assert rows["single worker"][seeded] == "+1.18% [+0.43, +1.93]"
    assert rows["no overlap"][seeded] == "0" and rows["no overlap"]["Δ, seed 0"] == "0"
    assert rows["1-outer-step eager"]["Δ, seed 0"] == "+3.00%"
    assert [r["outer lr"] for r in rows.values()] == ["-", "0.2", "0.1", "0.2"]
    # A grid whose labels would not fit falls back to the entries' short names.
    long = [*FAKE, _result("streaming-2-overlap-1-4bit", "streaming P=2, 1-inner-step overlap, 4-bit", 5.2, 0.7)]
    table = demo.demo_table(long, load_reference(), seed=0)
    assert max(len(line) for line in table.splitlines()) <= 100
    assert _rows(table)["streaming-2-overlap-1-4bit"][seeded] == "not in it"


def test_the_rerun_command_wraps_into_pasteable_lines() -> None:
    cmd = load_reference()["command"]
    lines = demo.command_lines(cmd, 98)
    assert len(lines) > 1 and all(len(line) <= 98 for line in lines)
    assert all(line.endswith(" \\") for line in lines[:-1])
    assert " ".join(line.removesuffix(" \\").strip() for line in lines) == cmd


# slow: the whole demo, its runs and its report
@pytest.mark.slow
def test_make_demo_end_to_end_on_tiny_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "text"
    text.mkdir()
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly pack boxes of liquor".split()
    for i in range(4):
        (text / f"doc{i}.txt").write_text(" ".join(words[(i + j) % len(words)] for j in range(900)) + "\n")
    out = tmp_path / "demo"
    argv = ["demo", "--data", str(text), "--tokenizer", "byte", "--batch-size", "2", "--seq-len", "32",
            "--steps", "8", "--inner-steps", "4", "--eval-batches", "1", "--warmup-steps", "1", "--no-progress",
            "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    table = [ln for ln in lines if ln.startswith("|")]
    assert len(table) == 2 + len(demo.DEMO_GRID)
    assert all(len(ln) <= 100 for ln in lines if not ln.startswith(("[", "    eval loss", "demo:", "report:")))
    assert "Δ, seeds 0-2 [90% CI]" in table[0] and "+2.80% [+2.50, +3.10]" in printed
    single = [r for name, r in _rows("\n".join(table)).items() if name.startswith("single worker")]
    assert [r["CU"] for r in single] == ["1.000"]  # alone, it waits on no link (8 steps: marked † diverged)
    assert "On this link, eager takes compute utilization from " in " ".join(printed.split())
    words = " ".join(printed.split())
    assert "This run differs from the seeded comparison in: data " in words
    assert "tokenizer byte (seeded: bpe:1024); batch_size 2 (seeded: 8)" in words
    assert ("outer lr as that comparison's sweep chose per method (no overlap 0.2, 1-outer-step naive delayed 0.1, "
            "1-outer-step eager 0.2), not the papers' 0.7") in words
    assert "  eagerloco compare --tokenizer bpe:1024" in printed  # the rerun command, on its own lines
    report = (out / "report.md").read_text()
    assert "## The demo beside the seeded comparison" in report and "## Every column" in report
    assert f"`{load_reference()['command']}`" in report
    assert "HellaSwag" not in report.split("## Every column")[1].split("\n\n")[1]  # no zero-shot column
    summary = json.loads((out / "summary.json").read_text())
    assert {r["name"]: r["outer"]["outer_lr"] for r in summary["runs"]} == {
        "single": 0.7, "no-overlap": 0.2, "delayed-1": 0.1, "eager-1": 0.2}
    assert re.search(r"\| data-parallel +\| - +\| 4\.7054 \[4\.4780, 4\.9327\]", report)  # seeded, not run


def _with(name: str, loss: float, cu: float) -> dict:
    return {**next(r for r in FAKE if r["name"] == name), "final_eval_loss": loss, "compute_utilization": cu}


def test_the_conclusion_weighs_the_loss_against_the_compute_utilization() -> None:
    """The sentence under the table, from a fake report table: eager's loss against no overlap for the CU it
    gains, naive delayed's beside it, and whether two workers beat one alone."""
    table = [_with("single", 5.059, 1.0), _with("no-overlap", 5.0, 0.66), _with("delayed-1", 5.35, 1.0),
             _with("eager-1", 5.1375, 1.0)]
    assert demo.conclusion(table) == (
        "On this link, eager takes compute utilization from 0.660 (no overlap) to 1.000 at +2.75% eval loss, less "
        "than naive delayed's +7.00% (CU 1.000); one worker alone ends +1.18% from no overlap: two workers pay for "
        "their link.")
    worse = [_with("no-overlap", 5.0, 0.66), _with("delayed-1", 5.1, 1.0), _with("eager-1", 5.2, 1.0),
             _with("single", 4.9, 1.0)]
    said = demo.conclusion(worse)
    assert said is not None and "no less than naive delayed's +2.00%" in said and "do not pay" in said
    assert demo.conclusion([_with("no-overlap", 5.0, 0.66), _with("delayed-1", 5.2, 1.0)]) == (
        "On this link, naive delayed takes compute utilization from 0.660 (no overlap) to 1.000 at +4.00% eval loss.")
    assert demo.conclusion(table[1:2]) is None and demo.conclusion(table[2:]) is None  # nothing to weigh
    assert demo.conclusion([_with("no-overlap", 5.0, 0.66), {**table[3], "final_eval_loss": None}]) is None


def test_the_demo_states_one_duration() -> None:
    """Every "N minutes" the demo's texts, the README and the documentation give for the demo is DEMO_MINUTES."""
    source = Path(demo.__file__).read_text()
    assert re.findall(r"demo's (\d+) minutes", source) == []  # the texts take the constant
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        stated = re.findall(r"About (\d+) minutes on 2 idle cores", page.read_text())
        assert all(int(n) == demo.DEMO_MINUTES for n in stated), page
