"""Ctrl-C at any moment of the command's start-up (parsing the flags, importing torch) ends with one line and
status 130, for `eagerloco train` and `eagerloco launch`, run as the installed command or as python -m."""

from __future__ import annotations

import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Runs the command's entry point with a SIGINT delivered exactly when the start-up reaches WHERE: the first
#: import of torch, or the parsing of the flags.
PROGRAM = """
import builtins, os, signal, sys, argparse
where = sys.argv[1]
sys.argv = ["eagerloco", *sys.argv[2:]]
signal.signal(signal.SIGINT, signal.default_int_handler)
real_import, real_parse = builtins.__import__, argparse.ArgumentParser.parse_args

def interrupting_import(name, *args, **kwargs):
    if where == "torch" and name == "torch":
        builtins.__import__ = real_import
        os.kill(os.getpid(), signal.SIGINT)
    return real_import(name, *args, **kwargs)

def interrupting_parse(self, *args, **kwargs):
    if where == "parse":
        os.kill(os.getpid(), signal.SIGINT)
    return real_parse(self, *args, **kwargs)

builtins.__import__ = interrupting_import
argparse.ArgumentParser.parse_args = interrupting_parse
from eagerloco.__main__ import run
run()
"""


def test_the_installed_command_starts_inside_the_handler() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["eagerloco"] == "eagerloco.__main__:run"


@pytest.mark.processes
@pytest.mark.parametrize("where", ["parse", "torch"])
@pytest.mark.parametrize("command", [["train", "--model", "micro", "--steps", "1", "--no-progress"],
                                     ["launch", "--workers", "2", "--", "--model", "micro", "--steps", "1"]],
                         ids=["train", "launch"])
def test_ctrl_c_during_start_up_is_one_line(tmp_path: Path, where: str, command: list[str]) -> None:
    r = subprocess.run([sys.executable, "-c", PROGRAM, where, *command, "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 128 + signal.SIGINT, (r.stdout, r.stderr)
    assert r.stderr == "eagerloco: stopped by SIGINT before the command started\n", r.stderr
    assert not (tmp_path / "run").exists()
