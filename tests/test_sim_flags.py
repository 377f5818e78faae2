"""`eagerloco simulate` speaks train's flags: the same names for the same settings."""

from __future__ import annotations

import argparse
import re

import pytest

from eagerloco.cli import make_parser
from eagerloco.sim import cli
from eagerloco.sim.config import SimConfig

BASE = ["--model", "1b", "--grid-per-decade", "5", "--target-cu", "0.5,0.9", "--bandwidth-gbps", "2,20"]


def _parse(argv: list[str]) -> argparse.Namespace:
    return make_parser().parse_args(["simulate", *argv])


def _report(argv: list[str]) -> dict:
    """The report of the default mode (without its timing)."""
    return cli.compute(SimConfig.from_args(_parse(argv)).validate())[0]


def test_paper_defaults_yield_to_a_codec_given() -> None:
    given, paper = _report([*BASE, "--paper", "--codec", "fp32"]), _report([*BASE, "--paper"])
    assert [r["label"] for r in paper["models"][0]["rows"]][1] == "DiLoCo 16-bit"
    assert [r["label"] for r in given["models"][0]["rows"]][1] == "DiLoCo 32-bit"


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


def test_the_help_lists_the_shared_flags_in_both(capsys) -> None:
    train, sim = _options("train", capsys), _options("simulate", capsys)
    assert set(SHARED) <= train & sim
    assert {"--codec", "--low-codec", "--dp-codec"} <= sim
