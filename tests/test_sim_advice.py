"""`simulate --plan` as a person reads it: its assumptions, the answer as a command that runs, the runner-up,
the measured loss costs (read back from bench/results), the step-time warning and the worker speeds."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import pytest

from eagerloco.cli import main
from eagerloco.sim import cli
from eagerloco.sim.advice import MEASURED, format_decision, measured_note, settings, train_command
from eagerloco.sim.config import SimConfig
from eagerloco.sim.model import ModelSpec
from eagerloco.sim.plan import Question, plan

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
#: The question of a new user: a 7B model of 32 blocks, 1 s an inner step, over 1 Gbit/s.
SEVEN_B = ["--plan", "--model", "custom", "--params", "7e9", "--layers", "32", "--step-time", "1",
           "--bandwidth-gbps", "1", "--target-cu", "0.9"]


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["simulate", *argv]) == 0
    return capsys.readouterr().out


def test_the_plan_of_a_7b_states_its_assumptions_and_the_commands_within_30_lines(capsys) -> None:
    text = _plan(capsys, *SEVEN_B)
    lines = text.rstrip("\n").splitlines()
    assert len(lines) <= 30
    assert lines[1] == ("assumed: 2 workers (--workers), latency 0 ms (--latency-ms), equal speeds "
                        "(--worker-speeds), ring exchange (--transport)")
    assert lines[2] == "step time: 1 s per inner step, given (--step-time)"
    assert lines[3] == "recommended: diloco H=30 2bit top64/4096 -> CU 0.969"
    # A sparse exchange comes with error feedback and plain averaging, at the outer lr its comparison tuned.
    assert lines[4] == ("  eagerloco train --method diloco --inner-steps 30 --codec 2bit --topk 64 --topk-chunk 4096 "
                        "--error-feedback 0.95 --outer-optimizer average --outer-lr 1.5 --workers 2 --bandwidth-gbps 1")
    assert lines[5] == ("  outer_loop(model, optimizer, OuterConfig(method='diloco', inner_steps=30, codec='2bit', "
                        "topk=64, topk_chunk=4096, error_feedback=0.95, outer_optimizer='average', outer_lr=1.5))")
    assert lines[6].startswith("  measured loss cost: +0.014 nats [-0.009, +0.037] against DiLoCo in fp32")
    assert lines[7].startswith("runner-up: ") and "2bit" not in lines[7]  # the other kind of exchange: dense
    assert "warning" not in text  # the step time was given
    assert lines[-1] == "(every format's cheapest and all 169 candidates: --verbose)"
    verbose = _plan(capsys, *SEVEN_B, "--verbose")
    assert verbose.startswith(text.rsplit("\n", 2)[0]) and len(verbose.splitlines()) > 169


@pytest.mark.slow
def test_the_printed_command_runs(capsys, tmp_path: Path) -> None:
    """The recommendation's train command as printed, with two substitutions so that it runs here in seconds:
    train's micro model for the 7B (--model micro) and one round of steps (--steps 30, H being 30); --out and
    --no-progress only say where the files go and keep the output short."""
    line = next(ln for ln in _plan(capsys, *SEVEN_B).splitlines() if ln.startswith("  eagerloco train "))
    argv = shlex.split(line)[1:]
    out = tmp_path / "run"
    assert main([*argv, "--model", "micro", "--steps", "30", "--out", str(out), "--no-progress"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert (s["method"], s["inner_steps"], s["codec"], s["workers"]) == ("diloco", 30, "2bit", 2)
    assert s["config"]["outer"]["error_feedback"] == 0.95 and s["config"]["outer"]["topk"] == 64


@pytest.mark.slow
def test_an_assumed_step_time_that_changes_the_answer_is_a_warning(capsys) -> None:
    """The 1b preset's step time is assumed (60% MFU); at 0.1 Gbit/s and 95% the answer moves with it. The JSON
    report holds the answers at the other step times."""
    argv = ["--plan", "--model", "1b", "--bandwidth-gbps", "0.1", "--target-cu", "0.95"]
    parser = argparse.ArgumentParser(prog="eagerloco")
    cli.add_parser(parser.add_subparsers(dest="command", required=True))
    cfg = SimConfig.from_args(parser.parse_args(["simulate", *argv]))
    report, text = cli.special(cfg, cfg.validate())
    assert set(report["at_other_step_times"]) == {"0.5", "2.0"}
    assert report["step_time_source"].startswith("assumed: the 1b")
    assert "step time: 0.1 s per inner step, assumed: the 1b preset's" in text
    warning = [ln for ln in text.splitlines() if ln.startswith("warning: ")]
    assert len(warning) == 1 and "at 0.05 s: " in warning[0] and "--step-time" in warning[0]
    given = _plan(capsys, "--plan", "--model", "1b", "--step-time", "0.1", "--bandwidth-gbps", "0.1",
                  "--target-cu", "0.95")
    assert "warning" not in given and "given (--step-time)" in given


def test_worker_speeds_change_the_plan(capsys) -> None:
    """Half-speed worker 1: a fixed H makes the fast worker idle half of every round (CU 0.75 at best); adaptive
    steps size the rounds by speed, and the command says so."""
    base = ["--plan", "--model", "custom", "--params", "1e9", "--layers", "6", "--step-time", "0.1",
            "--bandwidth-gbps", "1", "--target-cu", "0.95"]
    equal = _plan(capsys, *base)
    text = _plan(capsys, *base, "--worker-speeds", "1,0.5")
    assert text != equal
    assert "speeds 1,0.5 (--worker-speeds)" in text
    rec = next(ln for ln in text.splitlines() if ln.startswith("  eagerloco train "))
    assert "--adaptive-steps" in rec and rec.endswith("--worker-speeds 1,0.5")
    model = ModelSpec("1b-in-6", 1e9, 6, 0.1)
    fixed_only = plan(model, Question(1.0, 0.95, speeds=(1.0, 0.5)))
    dp = next(r for r in fixed_only["candidates"] if r["family"] == "dp")
    assert not dp["adaptive_steps"] and dp["cu"] <= 0.75 + 1e-9  # dp has no rounds to size


def test_the_note_of_a_setting_never_measured_says_so() -> None:
    row = {"family": "streaming", "format": "fp8", "topk": None}
    assert measured_note(row) == "measured loss cost: none in bench/results for this method and format"
    bf16 = {"family": "eager", "format": "bf16", "topk": None}
    assert "measured with e2m1" in measured_note(bf16)


@pytest.mark.parametrize("key", sorted(MEASURED))
def test_measured_costs_are_the_committed_comparisons(key: tuple[str, str]) -> None:
    m = MEASURED[key]
    rows = {r["name"]: r for r in json.loads((RESULTS / m.source / "summary.json").read_text())["rows"]}
    delta = rows[m.row]["delta"]
    assert (m.mean, m.lo, m.hi) == tuple(round(delta[k], 3) for k in ("mean", "lo", "hi"))
    if m.outer_lr is not None:
        assert rows[m.row]["setting"]["outer_lr"] == m.outer_lr


def test_no_answer_says_what_to_change() -> None:
    report = plan(ModelSpec("big", 1e11, 6, 0.1), Question(1e-3, 0.99))
    text = format_decision(report, "given (--step-time)", None)
    assert "no candidate reaches the target" in text and "lower --target-cu" in text


def test_dense_answers_keep_the_default_outer_optimizer() -> None:
    row = {"method": "streaming", "family": "streaming-tau", "inner_steps": 50, "fragments": 4, "tau": 2,
           "eager_rounds": 0, "codec": "e2m1", "topk": None, "adaptive_steps": False}
    assert settings(row) == {"method": "streaming", "inner_steps": 50, "fragments": 4, "overlap_steps": 2,
                             "codec": "e2m1"}
    report = {"workers": 3, "bandwidth_gbps": 0.5, "latency_ms": 20.0, "worker_speeds": None, "transport": "ring"}
    assert train_command(row, report) == ("eagerloco train --method streaming --inner-steps 50 --fragments 4 "
                                          "--overlap-steps 2 --codec e2m1 --workers 3 --bandwidth-gbps 0.5 "
                                          "--latency-ms 20")
