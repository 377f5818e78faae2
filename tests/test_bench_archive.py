"""bench/archive_metrics.py: a comparison's run logs into one reproducible archive and back."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "archive_metrics.py"
spec = importlib.util.spec_from_file_location("archive_metrics", SCRIPT)
assert spec and spec.loader
archive_metrics = importlib.util.module_from_spec(spec)
spec.loader.exec_module(archive_metrics)


def comparison(root: Path, logs: dict[str, str]) -> Path:
    for name, text in logs.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
        (root / name).with_name("summary.json").write_text("{}")
    return root


LOGS = {"runs/dp/seed0/metrics.jsonl": '{"step": 1}\n', "tune/eager-1/outer_lr=0.2/metrics.jsonl": '{"step": 2}\n'}


def test_pack_removes_the_logs_and_unpack_puts_them_back(tmp_path: Path) -> None:
    d = comparison(tmp_path / "cmp", LOGS)
    assert archive_metrics.pack(d) == (2, 2)
    assert not list(d.rglob("metrics.jsonl"))
    assert (d / "runs/dp/seed0/summary.json").is_file()  # summaries stay
    assert archive_metrics.unpack(d) == 2
    assert {str(p.relative_to(d)): p.read_text() for p in d.rglob("metrics.jsonl")} == LOGS


@pytest.mark.processes
def test_the_archive_is_the_same_bytes_for_the_same_logs(tmp_path: Path) -> None:
    a = comparison(tmp_path / "a", LOGS)
    b = comparison(tmp_path / "b", dict(reversed(LOGS.items())))  # other creation order and times
    archive_metrics.pack(a)
    archive_metrics.pack(b)
    assert (a / "metrics.tar.xz").read_bytes() == (b / "metrics.tar.xz").read_bytes()
    listing = subprocess.run(["tar", "-tvJf", str(a / "metrics.tar.xz")], capture_output=True, text=True, check=True)
    assert [ln.split()[-1] for ln in listing.stdout.splitlines()] == sorted(LOGS)
    assert all(" 0/0 " in ln and "1970-01-01" in ln for ln in listing.stdout.splitlines())


def test_a_second_pack_adds_new_logs_and_replaces_rerun_ones(tmp_path: Path) -> None:
    d = comparison(tmp_path / "cmp", LOGS)
    archive_metrics.pack(d)
    comparison(d, {"probe/runs/single/seed0/metrics.jsonl": "new\n", "runs/dp/seed0/metrics.jsonl": "rerun\n"})
    assert archive_metrics.pack(d) == (2, 3)
    archive_metrics.unpack(d)
    assert (d / "runs/dp/seed0/metrics.jsonl").read_text() == "rerun\n"
    assert (d / "tune/eager-1/outer_lr=0.2/metrics.jsonl").read_text() == '{"step": 2}\n'


@pytest.mark.processes
def test_the_command_line_and_plain_tar_unpack_alike(tmp_path: Path) -> None:
    d = comparison(tmp_path / "cmp", LOGS)
    done = subprocess.run([sys.executable, str(SCRIPT), "pack", str(d)], capture_output=True, text=True)
    assert done.returncode == 0 and "2 logs (2 packed now)" in done.stdout, done.stderr
    subprocess.run(["tar", "-xJf", str(d / "metrics.tar.xz"), "-C", str(d)], check=True)
    assert {str(p.relative_to(d)): p.read_text() for p in d.rglob("metrics.jsonl")} == LOGS
    missing = subprocess.run([sys.executable, str(SCRIPT), "unpack", str(tmp_path / "none")], capture_output=True,
                             text=True)
    assert missing.returncode == 2 and "no such directory" in missing.stderr
