"""Errors that say what is wrong in one line: through the hook API (naming arguments), the command line
(naming flags, with a distinct exit status), exit_on_errors, and for sizes no run could take."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from toy import Toy

import eagerloco
from eagerloco.cli import main
from eagerloco.comm.connect import connect
from eagerloco.comm.errors import ScheduleMismatchError
from eagerloco.config import ConfigError, OuterConfig
from testing.faults import SITE_DIR

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1", "--no-progress"]


@pytest.mark.parametrize(("settings", "message"), [
    ({"method": "Diloco"}, "method must be one of dp, diloco, streaming, delayed, eager; got 'Diloco'"),
    ({"codec": "fp7"}, "codec must be one of fp32, bf16, fp8, e2m1, e3m0, int8, int4, 2bit; got 'fp7'"),
    ({"inner_steps": 0}, "inner_steps must be an integer >= 1, got 0"),
    ({"method": "diloco", "fragments": 2}, "so fragments must be 1 (got 2)"),
    ({"method": "streaming", "fragments": 9, "inner_steps": 20}, "fragments (9) is larger than the model's number"),
])
def test_an_invalid_setting_through_the_hook_api_is_itself_and_names_the_argument(settings: dict, message: str) -> None:
    model = Toy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError) as e:
        eagerloco.outer_loop(model, opt, OuterConfig(**settings))
    assert message in str(e.value), str(e.value)
    assert "--" not in str(e.value)  # the API's names, not the command line's
    assert e.value.__cause__ is None and e.value.__suppress_context__  # no chained traceback to read through


def test_an_invalid_rendezvous_through_the_python_api_names_the_argument() -> None:
    with pytest.raises(ConfigError) as e:
        connect(outer_addr="nohost", worker_id=0, workers=2)
    assert "outer_addr must be host:port" in str(e.value) and "--" not in str(e.value), str(e.value)
    assert e.value.__cause__ is None and e.value.__suppress_context__


def test_a_peer_that_never_comes_through_the_hook_api_names_the_arguments() -> None:
    """The rendezvous' PeerError says what to check as connect() names it (outer_addr), not as the command
    line does (--outer-addr)."""
    from test_hooks_jobs import free_ports

    with pytest.raises(eagerloco.PeerError) as e:
        connect(outer_addr=f"127.0.0.1:{free_ports(1)[0]}", workers=2, worker_id=1, timeout_s=1)
    assert "check outer_addr and that a coordinator runs there" in str(e.value), str(e.value)
    assert "--" not in str(e.value) and e.value.workers == []
    assert e.value.__cause__ is None and e.value.__suppress_context__


def test_a_peer_error_in_the_hooks_names_the_arguments_and_keeps_the_worker_it_blames() -> None:
    from testing.scripted import ScriptedCommunicator

    frozen = eagerloco.PeerError("worker 1 is frozen or gone while the others waited for it: its last heartbeat is "
                                 "31.0 s old (--dist-timeout 30 s). Check its log", [1])
    model = Toy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = eagerloco.outer_loop(model, opt, OuterConfig(method="diloco", inner_steps=2),
                                 peers=ScriptedCommunicator(2, fail={0: frozen})).start()
    with pytest.raises(eagerloco.PeerError) as e:
        for _ in range(2):
            model(torch.ones(1, 3)).sum().backward()
            opt.step()
    assert "(timeout_s 30 s)" in str(e.value) and "--" not in str(e.value), str(e.value)
    assert e.value.workers == [1] and outer.finished


@pytest.mark.parametrize("framework", ["hf", "lightning"])
@pytest.mark.parametrize(("settings", "message"), [
    ({"codec": "fp7"}, "codec must be one of"),
    ({"sync_evry": 50}, "unknown option 'sync_evry'"),
    ({"method": "diloco", "fragments": 2}, "so fragments must be 1 (got 2)"),
    ({"topk": 9, "topk_chunk": 8}, "topk (9) must not exceed topk_chunk (8)"),
])
def test_a_callback_checks_its_settings_when_it_is_made(framework: str, settings: dict, message: str) -> None:
    """A framework callback is made long before training starts (after the model and data load): a bad
    setting fails there, as outer_loop says it, not minutes later at train start."""
    module = pytest.importorskip(f"eagerloco.integrations.{'hf' if framework == 'hf' else 'lightning'}")
    outer = {k: v for k, v in settings.items() if k != "sync_evry"}
    with pytest.raises(ConfigError) as e:
        module.OuterLoopCallback(OuterConfig(**outer), **{k: v for k, v in settings.items() if k not in outer})
    assert message in str(e.value) and "--" not in str(e.value), str(e.value)
    module.OuterLoopCallback(OuterConfig(method="eager", inner_steps=5), outer_addr="127.0.0.1:1", worker_id=0,
                             workers=2)


@pytest.mark.parametrize(("error", "code"), [(ConfigError("bad"), 2), (eagerloco.PeerError("gone"), 3),
                                              (ScheduleMismatchError("differ"), 4)])
def test_exit_on_errors_ends_with_one_line_and_a_status_of_its_own(error: Exception, code: int,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e, eagerloco.exit_on_errors():
        raise error
    assert e.value.code == code
    assert capsys.readouterr().err == f"eagerloco: error: {error}\n"


@pytest.mark.parametrize(("argv", "needle"), [
    (["--steps", str(10**23)], "--steps 100,000,000,000,000,000,000,000 is more inner steps than any run"),
    (["--workers", str(10**8)], "--workers 100,000,000 is more workers than any run of this tool can take"),
    (["--lr", "1e308"], "--lr 1e+308 is past 10, where every AdamW step overflows"),
    (["--tokenizer", "bpe:4294967296"], "the vocabulary must be at most 1,048,576"),
    (["--seq-len", str(10**9)], "needs about"),
])
def test_sizes_no_run_could_take_are_refused_before_anything_runs(tmp_path: Path, argv: list[str], needle: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", *FAST, "--out", str(tmp_path / "r"), *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_a_schedule_mismatch_on_the_command_line_is_one_line_with_status_4(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from eagerloco.train import command

    def differ(args: object) -> int:
        raise ScheduleMismatchError("workers launched different exchanges at the same point")

    monkeypatch.setattr(command, "run", differ)
    assert main(["train", *FAST]) == 4
    assert capsys.readouterr().err == "eagerloco: error: workers launched different exchanges at the same point\n"


@pytest.mark.processes
def test_ctrl_c_while_the_command_starts_ends_with_one_line(tmp_path: Path) -> None:
    # Without the tests' fault injection, whose sitecustomize imports eagerloco before the command: a SIGINT
    # there (a loaded machine's 0.3 s) is Python's own fatal error in site, which no user's interpreter has.
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p) != SITE_DIR]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    p = subprocess.Popen([sys.executable, "-m", "eagerloco", "train", *FAST, "--steps", "2", "--out", str(tmp_path)],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    time.sleep(0.3)  # importing: the command has not started yet
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGINT, out + err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("eagerloco: stopped by SIGINT"), err


def test_a_schedule_mismatch_through_the_api_names_no_flag() -> None:
    """The schedule check's advice says --resume on the command line; through the hook API (api_error, used by
    every OuterLoop entry point) it says how the API resumes, and stays a ScheduleMismatchError (exit 4)."""
    from eagerloco.comm.errors import api_error
    from eagerloco.comm.ops import check_schedules

    rows = torch.tensor([[1, 2], [1, 3]])
    with pytest.raises(ScheduleMismatchError) as caught:
        check_schedules(rows, 0, [0, 1], lambda w: f"worker {w}", "H = 4")
    assert "--resume from the same checkpoint" in str(caught.value)
    said = api_error(caught.value)
    assert isinstance(said, ScheduleMismatchError), said
    assert "load_state_dict() from the same checkpoint" in str(said) and "--" not in str(said), said
