"""The documentation site: its examples run (and a resume is bit-exact), its generated references cover every
public name and flag, and the metrics reference names every key a run and a hook-API loop write."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import runpy
from pathlib import Path

import pytest
import torch
from runs import train_here

import eagerloco
from eagerloco.cli import make_parser

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
EXAMPLES = REPO / "examples"


def example(name: str) -> dict:
    """An example script's names, without running its ``__main__`` part."""
    return runpy.run_path(str(EXAMPLES / name), run_name=f"example_{Path(name).stem}")


def reference_hook():
    spec = importlib.util.spec_from_file_location("docs_reference_hook", DOCS / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def metrics_tables() -> dict[str, dict[str, str]]:
    """docs/reference/metrics.md as {section: {key: when}}, the sections its headings name."""
    tables: dict[str, dict[str, str]] = {}
    section = None
    for line in (DOCS / "reference" / "metrics.md").read_text().splitlines():
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        row = re.match(r"\| `([^`]+)` \| [^|]+ \| ([^|]+) \|", line)
        if row and section is not None:
            assert row.group(1) not in tables.setdefault(section, {}), f"{section}: {row.group(1)} twice"
            tables[section][row.group(1)] = row.group(2).strip()
    return tables


def always(table: dict[str, str]) -> set[str]:
    return {k for k, when in table.items() if when == "always"}


def test_outer_sync_example_trains(capsys) -> None:
    """The explicit OuterSync example of the own-loop guide runs as written and really trains."""
    assert '--8<-- "examples/outer_sync.py"' in (DOCS / "guides" / "own-loop.md").read_text()
    runpy.run_path(str(EXAMPLES / "outer_sync.py"), run_name="__main__")
    out = capsys.readouterr().out
    before = float(re.search(r"eval loss before ([0-9.]+)", out).group(1))
    after = float(re.search(r"eval loss after ([0-9.]+)", out).group(1))
    assert after < 0.5 * before, out
    assert int(re.search(r"sent (\d+) B", out).group(1)) > 0


def test_own_loop_resume_is_bit_exact(tmp_path) -> None:
    """examples/resume_loop.py stopped at step 10 and resumed ends with the weights of one run of 20 steps, to
    the bit: its checkpoint holds the RNG state its dropout draws from."""
    main = example("resume_loop.py")["main"]
    whole, _ = main(["--steps", "20", "--checkpoint", str(tmp_path / "whole.pt")])
    ckpt = str(tmp_path / "ckpt.pt")
    stopped, _ = main(["--steps", "20", "--stop-at", "13", "--every", "5", "--checkpoint", ckpt])
    resumed, _ = main(["--steps", "20", "--checkpoint", ckpt, "--resume"])
    assert torch.load(ckpt, weights_only=False)["step"] == 20
    for name, value in whole.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name
    assert not all(torch.equal(v, stopped.state_dict()[k]) for k, v in whole.state_dict().items())


def test_outer_metrics_keys_are_the_reference(tmp_path) -> None:
    """outer.metrics() of a hook-API loop has exactly the keys of the metrics reference."""
    _, metrics = example("resume_loop.py")["main"](["--steps", "6", "--checkpoint", str(tmp_path / "c.pt")])
    assert set(metrics) == set(metrics_tables()["outer.metrics()"])
    ints = {"bytes_sent", "bytes_received", "outer_syncs"}
    assert all(isinstance(v, int if k in ints else float) for k, v in metrics.items()), metrics


@pytest.mark.slow
def test_run_keys_are_the_reference(tmp_path) -> None:
    """A small run writes exactly the documented keys of metrics.jsonl, summary.json and its per-worker entries:
    those always written and those its flags add."""
    out = tmp_path / "run"
    r = train_here(["--model", "tiny", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1",
                    "--no-progress", "--workers", "2", "--inner-steps", "3", "--log-every", "3",
                    "--sim-step-time", "0.05", "--bandwidth-gbps", "0.01", "--steps", "6", "--method", "diloco",
                    "--inner-optimizer", "muon", "--adaptive-steps", "--worker-speeds", "1,0.5",
                    "--eval-every", "3", "--peak-tflops", "1", "--out", str(out)])
    assert r.returncode == 0, r.stderr
    tables = metrics_tables()
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    written = set().union(*lines)
    assert written == always(tables["metrics.jsonl"]) | {"mfu", "eval_loss", "muon_lr", "round_steps",
                                                          "worker_steps"}
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == always(tables["summary.json"]) | {"round_steps", "worker_steps"}
    for worker in summary["per_worker"]:
        assert set(worker) == set(tables["per_worker"])


def test_api_reference_covers_every_public_name() -> None:
    """The generated API page has an entry for every name of eagerloco.__all__, at the object that defines it."""
    hook = reference_hook()
    entries = re.findall(r"^::: (\S+)$", hook.api_reference(), re.M)
    assert [e.rsplit(".", 1)[-1] for e in entries] == list(eagerloco.__all__)
    assert "<!-- generated: api -->" in (DOCS / "reference" / "api.md").read_text()


def test_cli_reference_covers_every_flag(monkeypatch) -> None:
    """The generated command-line page lists every flag that each command's --help prints."""
    monkeypatch.setenv("COLUMNS", "10000")  # argparse wraps its help at hyphens otherwise
    page = reference_hook().cli_reference()
    commands = re.findall(r"^## eagerloco (\S+)$", page, re.M)
    assert commands == ["train", "demo", "data", "simulate", "launch", "coordinator", "compare"]
    sections = dict(zip(commands, re.split(r"^## eagerloco \S+$", page, flags=re.M)[1:], strict=True))
    for name, text in sections.items():
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
            make_parser().parse_args([name, "--help"])
        # the option lines of --help: "  --flag X, --other X   help" (a short flag may come first)
        options = re.findall(r"^  (-[^ ].*?)(?:  |$)", buf.getvalue(), re.M)
        flags = {f for line in options for f in re.findall(r"--[a-z0-9][a-z0-9-]*", line)} - {"--help"}
        assert flags, name
        missing = sorted(f for f in flags if f"`{f}`" not in text)
        assert not missing, f"eagerloco {name}: {missing}"
