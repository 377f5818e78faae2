"""`eagerloco simulate` speaks train's flags: the same names for the same settings, and for one release the
simulator's old spellings, each with a warning and the same result as the new name."""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass

import pytest

from eagerloco.cli import make_parser
from eagerloco.config import setting
from eagerloco.flags import add_dataclass_flags
from eagerloco.sim import cli
from eagerloco.sim.config import SimConfig
from eagerloco.sim.model import PRESETS

BASE = ["--model", "1b", "--grid-per-decade", "5", "--target-cu", "0.5,0.9", "--bandwidth-gbps", "2,20"]

#: (old spelling, new spelling): each pair changes the result, so a spelling that did nothing would show.
RENAMED = [
    (["-H", "50"], ["--inner-steps", "50"]),
    (["-M", "4"], ["--workers", "4"]),
    (["--tau", "1,2"], ["--overlap-steps", "1,2"]),
    (["--pattern", "sequential"], ["--fragment-pattern", "sequential"]),
    (["--block", "8"], ["--codec-block", "8"]),
    (["--bits", "8"], ["--codec", "fp8"]),
    (["--bits", "16"], ["--codec", "bf16"]),
    (["--bits", "4"], ["--codec", "e2m1"]),
    (["--low-bits", "8"], ["--low-codec", "fp8"]),
    (["--dp-bits", "32"], ["--dp-codec", "fp32"]),
    (["--accel-tflops", "400"], ["--peak-tflops", "400"]),
    (["--bandwidth", "3"], ["--bandwidth-gbps", "3"]),
]


def _parse(argv: list[str]) -> argparse.Namespace:
    return make_parser().parse_args(["simulate", *argv])


def _report(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[dict, str]:
    """The report of the default mode (without its timing) and what parsing the flags wrote to stderr."""
    args = _parse(argv)
    err = capsys.readouterr().err
    report = cli.compute(SimConfig.from_args(args).validate())[0]
    return report, err


@pytest.mark.parametrize("old, new", RENAMED, ids=[" ".join(o) for o, _ in RENAMED])
def test_an_old_spelling_warns_and_gives_the_new_ones_result(old: list[str], new: list[str], capsys) -> None:
    with_new, err_new = _report([*BASE, *new], capsys)
    with_old, err_old = _report([*BASE, *old], capsys)
    without, _ = _report([*BASE, *new[:-2]], capsys)
    assert err_new == ""
    assert err_old == f"eagerloco simulate: warning: {old[0]} is now {new[0]}; the old name goes in the next release\n"
    assert with_old == with_new
    assert with_new != without  # the setting changes the numbers, so an alias that did nothing would fail


def test_an_old_spelling_on_the_command_line_warns_once_and_runs(capsys) -> None:
    rc = cli.run(_parse([*BASE, "--tau", "2"]))
    out, err = capsys.readouterr()
    assert rc == 0 and "Streaming tau=2 32-bit" in out
    assert err.count("warning") == 1 and "--tau is now --overlap-steps" in err


def test_paper_defaults_yield_to_an_old_bits_flag_as_to_the_codec(capsys) -> None:
    old, _ = _report([*BASE, "--paper", "--bits", "32"], capsys)
    new, _ = _report([*BASE, "--paper", "--codec", "fp32"], capsys)
    paper, _ = _report([*BASE, "--paper"], capsys)
    assert old == new != paper
    assert [r["label"] for r in paper["models"][0]["rows"]][1] == "DiLoCo 16-bit"
    assert [r["label"] for r in new["models"][0]["rows"]][1] == "DiLoCo 32-bit"


def test_a_bit_count_without_a_codec_is_still_simulated(capsys) -> None:
    cfg = SimConfig.from_args(_parse([*BASE, "--bits", "6", "--method", "diloco"]))
    capsys.readouterr()
    report = cli.compute(cfg.validate())[0]
    assert cfg.codec == "6"  # no codec has 6 bits: the number stays
    (row,) = report["models"][0]["rows"]
    assert row["label"] == "DiLoCo 6-bit"
    n = PRESETS["1b"].params
    payload = n * 6 / 8 + math.ceil(n / 32) * 2  # values, then a bfloat16 scale per block of 32
    assert row["bytes_per_step"] == pytest.approx(payload / 100, rel=1e-12)  # M = 2: the ring sends one payload


def test_a_bit_count_with_a_codec_becomes_that_codec(capsys) -> None:
    cfg = SimConfig.from_args(_parse(["--bits", "16", "--low-bits", "8", "--dp-bits", "32"]))
    cfg.validate()
    assert (cfg.codec, cfg.low_codec, cfg.dp_codec) == ("bf16", "fp8", "fp32")


@pytest.mark.parametrize("argv, needle", [
    (["--bits", "64"], "--bits must be a number of bits per value in 1..32"),
    (["--low-bits", "0"], "--low-bits must be a number of bits per value in 1..32"),
    (["--bits", "fp9"], "--codec must be one of fp32, bf16"),
    (["--pattern", "zigzag"], "--fragment-pattern must be one of strided, sequential"),
    (["--tau", "-1"], "--overlap-steps values must be integers >= 0"),
    (["--block", "0"], "--codec-block must be an integer >= 1"),
])
def test_bad_values_through_an_old_spelling_are_named(argv: list[str], needle: str, capsys) -> None:
    rc = cli.run(_parse(argv))
    err = capsys.readouterr().err
    assert rc == 2 and needle in err, err


#: Settings both commands have: the simulator must call them what train calls them.
SHARED = {"--method": "eager", "--workers": "3", "--inner-steps": "7", "--fragments": "4", "--overlap-steps": "2",
          "--eager-rounds": "2", "--codec": "fp8", "--codec-block": "16", "--fragment-pattern": "sequential",
          "--bandwidth-gbps": "5", "--latency-ms": "10", "--peak-tflops": "400", "--topk": "64", "--topk-chunk": "1024"}


@pytest.mark.parametrize("flag", list(SHARED))
def test_train_and_simulate_take_the_same_flag_for_the_same_setting(flag: str) -> None:
    value = SHARED[flag]
    dest = flag[2:].replace("-", "_")
    train = getattr(make_parser().parse_args(["train", flag, value]), dest)
    sim = getattr(make_parser().parse_args(["simulate", flag, value]), dest)
    assert train is not None and sim is not None
    assert type(train)(sim) == train  # the same value (the simulator keeps a comma list as text)


def _options(command: str, capsys) -> set[str]:
    """The flags the usage line of ``eagerloco COMMAND --help`` lists."""
    with pytest.raises(SystemExit):
        make_parser().parse_args([command, "--help"])
    usage = capsys.readouterr().out.split("\n\n")[0]
    return set(re.findall(r"\[(-{1,2}[\w-]+)", usage))


def test_the_help_lists_the_new_names_only(capsys) -> None:
    train, sim = _options("train", capsys), _options("simulate", capsys)
    assert set(SHARED) <= train & sim
    old = {"--tau", "--bits", "--low-bits", "--dp-bits", "--pattern", "--block", "--accel-tflops", "-H", "-M",
           "--bandwidth"}
    assert not old & sim and {"--codec", "--low-codec", "--dp-codec"} <= sim


# ------------------------------------------------------------------ the generator's aliases, on their own


@dataclass
class _Toy:
    rate: float = setting(1.0, aliases=("--speed",))
    """How fast."""
    loud: bool = setting(False, aliases=("--noisy",))
    """Shout."""
    tags: list[str] = setting(factory=list, flag="--tag", aliases=("--label",))
    """Repeatable."""


def test_aliases_of_a_value_a_switch_and_a_repeatable_flag(capsys) -> None:
    p = argparse.ArgumentParser(prog="toy")
    add_dataclass_flags({"training": p.add_argument_group("toy")}, _Toy)
    args = p.parse_args(["--speed", "2.5", "--noisy", "--tag", "a", "--label", "b"])
    assert (args.rate, args.loud, args.tags) == (2.5, True, ["a", "b"])
    err = capsys.readouterr().err.splitlines()
    assert err == [f"toy: warning: {o} is now {n}; the old name goes in the next release"
                   for o, n in (("--speed", "--rate"), ("--noisy", "--loud"), ("--label", "--tag"))]
    assert p.parse_args([]).rate is None  # not given: left to the dataclass's default
    assert "--speed" not in p.format_help() and "--rate" in p.format_help()
