"""A resume compares what decides a run's numbers, and a checkpoint whose state does not fit them (its
meta.json edited, its error-feedback buffer not finite) is one line, never a traceback or a diverged run."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from runs import train_here

from eagerloco.config import ConfigError, TrainConfig
from eagerloco.jsonfiles import finite_json
from eagerloco.train.resume import check_resume_config

RUN = ["--model", "micro", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1", "--no-progress",
       "--steps", "4", "--inner-steps", "2", "--checkpoint-every", "2", "--topk", "4", "--codec", "2bit"]


def test_moving_the_data_cache_does_not_block_a_resume() -> None:
    saved = finite_json(asdict(TrainConfig(data_dir="/old/cache")))
    check_resume_config(saved, TrainConfig(data_dir="/new/cache"))
    with pytest.raises(ConfigError, match="data: 'brown' -> 'kjv'"):  # which data still decides
        check_resume_config(saved, TrainConfig(data="kjv", data_dir="/new/cache"))


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with error feedback, its checkpoint of step 2 (and 4) written."""
    out = tmp_path_factory.mktemp("run")
    r = train_here([*RUN, "--error-feedback", "0.9", "--out", str(out)])
    assert r.returncode == 0, r.stderr
    return out


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / "step_00000004")  # resume from step 2
    return dst / "checkpoints" / "step_00000002"


def _edit_meta(ckpt: Path, section: str | None, key: str, value: object) -> None:
    meta = json.loads((ckpt / "meta.json").read_text())
    (meta["config"] if section is None else meta["config"][section])[key] = value
    (ckpt / "meta.json").write_text(json.dumps(meta))


def _one_error_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err and lines[0].startswith("eagerloco: error: "), err
    return lines[0]


@pytest.mark.parametrize(("section", "key", "value", "flags", "needle"), [
    ("outer", "error_feedback", None, [], "error feedback on and this run has it off"),
    (None, "inner_optimizer", "muon", ["--error-feedback", "0.9", "--inner-optimizer", "muon"], "CombinedOptimizer"),
])
def test_an_edited_meta_json_is_one_line(checkpointed: Path, tmp_path: Path, section: str | None, key: str,
                                         value: object, flags: list[str], needle: str) -> None:
    ckpt = _copy(checkpointed, tmp_path / "run")
    _edit_meta(ckpt, section, key, value)
    r = train_here([*RUN, *flags, "--out", str(tmp_path / "run"), "--resume"])
    assert r.returncode == 2
    line = _one_error_line(r.stderr)
    assert "worker 0's state in the checkpoint does not fit this run's settings" in line and needle in line, line


def test_a_non_finite_error_feedback_buffer_is_not_resumed(checkpointed: Path, tmp_path: Path) -> None:
    ckpt = _copy(checkpointed, tmp_path / "run")
    state = torch.load(ckpt / "worker_1.pt", weights_only=False)
    state["sync"]["error_feedback"][0][0].view(-1)[0] = math.nan
    torch.save(state, ckpt / "worker_1.pt")
    meta = json.loads((ckpt / "meta.json").read_text())
    data = (ckpt / "worker_1.pt").read_bytes()
    entry = next(e for e in meta["files"] if e["file"] == "worker_1.pt")
    entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())  # an intact file, written so
    (ckpt / "meta.json").write_text(json.dumps(meta))
    r = train_here([*RUN, "--error-feedback", "0.9", "--out", str(tmp_path / "run"), "--resume"])
    assert r.returncode == 2
    line = _one_error_line(r.stderr)
    assert "worker 1's state" in line and "error-feedback buffers are not finite" in line, line
