"""Nothing a run has done is lost to odd input or a full disk, and every such case ends in one line.

Real files: undecodable --data, a takeover of metrics.jsonl by a new reporter, a disk that fills
up during a checkpoint, a read-only data cache.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from runs import launch_here, train_here

from eagerloco.data import DataError, load_corpus


def _text(n: int = 40) -> str:
    return "".join(f"line {i} of a plain English text about nothing in particular.\n" for i in range(n))


def test_binary_data_is_refused_with_the_share_that_is_not_utf8(tmp_path: Path) -> None:
    f = tmp_path / "blob.txt"
    f.write_bytes(bytes(range(256)) * 40)
    with pytest.raises(DataError, match=r"are not UTF-8.*convert it to UTF-8"):
        load_corpus(str(f), data_dir=tmp_path / "cache")
    d = tmp_path / "dir"
    (d / "a").mkdir(parents=True)
    (d / "a" / "good.txt").write_text(_text())
    (d / "a" / "latin1.txt").write_bytes(("caf\u00e9 na\u00efve " * 200).encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt"):
        load_corpus(str(d), data_dir=tmp_path / "cache")


def test_a_few_latin1_bytes_train_with_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "mostly.txt"
    f.write_bytes(_text(400).encode() + "Caf\u00e9\n".encode("latin-1"))
    corpus = load_corpus(str(f), data_dir=tmp_path / "cache")
    err = capsys.readouterr().err
    assert "warning" in err and "1 of its" in err and "U+FFFD" in err and err.count("\n") == 1, err
    assert sum(d.count("\ufffd") for d in corpus.train_docs + corpus.eval_docs) == 1
    clean = tmp_path / "clean.txt"  # a real U+FFFD in a UTF-8 file is text, not a decoding error
    clean.write_text(_text(400) + "\ufffd\n", encoding="utf-8")
    load_corpus(str(clean), data_dir=tmp_path / "cache")
    assert capsys.readouterr().err == ""


def test_a_new_reporter_writes_the_lines_the_old_one_never_wrote(tmp_path: Path) -> None:
    """An elastic leader killed between a step and its line: the next leader, which did not report
    that step, kept its own record of it and fills the gap when it takes over the file."""
    from eagerloco.config import TrainConfig
    from eagerloco.train.outputs import RunOutput

    cfg = TrainConfig(out=str(tmp_path))
    leader = {"now": 0}
    old = RunOutput(cfg, 0, lambda: leader["now"] == 0)
    new = RunOutput(cfg, 0, lambda: leader["now"] == 1)
    for step in (2, 4):
        for out in (old, new):
            out.log({"step": step, "loss": 1.0 / step})
    new.log({"step": 6, "loss": 0.5})  # the old leader died after step 6, before its line
    leader["now"] = 1
    for step in (8, 10):
        for out in (old, new):
            out.log({"step": step, "loss": 1.0 / step})
    old.close()
    new.close()
    lines = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [2, 4, 6, 8, 10]
    assert lines[2]["loss"] == 0.5


FAST = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1", "--no-progress",
        "--log-every", "2", "--seed", "4", "--workers", "2", "--steps", "8", "--checkpoint-every", "2"]


@pytest.fixture
def small_disk(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A 48 MiB tmpfs: room for one checkpoint of the tiny model (2 x 16 MiB), not for two."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _train(argv: list[str]) -> subprocess.CompletedProcess:
    return train_here([*FAST, *argv])


@pytest.mark.root
@pytest.mark.processes
def test_a_full_disk_is_named_cleaned_up_and_the_run_resumes_once_there_is_room(tmp_path: Path,
                                                                                   small_disk: Path) -> None:
    out = small_disk / "run"
    root = out / "checkpoints"
    for attempt in ("run", "resume on the still full disk"):
        r = _train(["--out", str(out)] + (["--resume"] if attempt != "run" else []))
        assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
        assert "Traceback" not in r.stderr, r.stderr[-3000:]
        err = [ln for ln in r.stderr.splitlines() if ln.startswith("eagerloco: error:")]
        assert len(err) == 1, r.stderr
        assert "No space left on device" in err[0] and f"free space on the disk of {root}" in err[0], err[0]
        assert f"the newest good checkpoint is {root / 'step_00000002'} (step 2)" in err[0], err[0]
        assert "--resume" in err[0]
        # The previous good checkpoint survives; what the failed one staged is gone.
        assert [p.name for p in root.iterdir()] == ["step_00000002"]
        assert not (out / "summary.json.tmp").exists() and not (out / ".eagerloco.lock").exists()
    subprocess.run(["mount", "-o", "remount,size=256m", str(small_disk)], check=True)
    r = _train(["--out", str(out), "--resume"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    clean = _train(["--out", str(tmp_path / "clean")])
    assert clean.returncode == 0, clean.stderr[-3000:]
    resumed, uninterrupted = (json.loads((d / "summary.json").read_text()) for d in (out, tmp_path / "clean"))
    assert resumed["final_eval_loss"] == uninterrupted["final_eval_loss"]  # nothing lost
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 4, 6, 8]


@pytest.mark.root
@pytest.mark.processes
def test_a_read_only_cache_is_read_and_what_it_lacks_is_named(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A data cache on a read-only mount (a lab's shared copy): what it holds is read as is, token
    ids it lacks are encoded in memory, a tokenizer it lacks is named with the fix."""
    from eagerloco.cli import main
    from eagerloco.data import encode_corpus, get_tokenizer

    cache = tmp_path / "cache"
    cache.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(cache)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.decode().strip()}")
    try:
        text = tmp_path / "text.txt"
        text.write_text(_text(600))
        corpus = load_corpus(str(text), data_dir=cache)
        tok = get_tokenizer("bpe:300", corpus)
        train, _ = encode_corpus(corpus, tok)
        subprocess.run(["mount", "-o", "remount,ro", str(cache)], check=True)
        with pytest.raises(OSError):
            (cache / "probe").write_text("")  # really read-only, even to root
        capsys.readouterr()
        again = get_tokenizer("bpe:300", corpus)  # intact: read, nothing written, nothing said
        assert again.fingerprint == tok.fingerprint
        assert encode_corpus(corpus, again)[0].num_tokens == train.num_tokens
        assert capsys.readouterr().err == ""
        other = load_corpus(str(text), data_dir=cache, eval_fraction=0.1)  # other token ids: not cached
        assert encode_corpus(other, again)[0].num_tokens > 0
        assert "cannot be written: encoding" in capsys.readouterr().err
        argv = ["train", *FAST[:-4], "--steps", "1", "--data", str(text), "--data-dir", str(cache),
                "--tokenizer", "bpe:280", "--out", str(tmp_path / "run")]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("eagerloco: error: "), err
        assert f"the data cache {cache / 'tokenizers'} cannot be written" in err and "bpe:280" in err, err
        assert "--data-dir" in err
    finally:
        subprocess.run(["umount", "-l", str(cache)], capture_output=True)


@pytest.mark.root
@pytest.mark.processes
def test_a_full_disk_stops_every_rank_with_the_same_line(tmp_path: Path, small_disk: Path) -> None:
    """Two processes share the full disk: the rank that cannot write its file tells the other, both
    end with the same line, the staging directory is removed, and the run resumes once there is room."""
    out = small_disk / "run"
    argv = [*FAST, "--out", str(out)]
    r = launch_here(argv, 2, timeout=600)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-2000:]
    assert "Traceback" not in r.stdout + r.stderr, r.stdout[-4000:]
    lines = {ln.split("] ", 1)[0]: ln.split("] ", 1)[1] for ln in r.stdout.splitlines()
             if "eagerloco: error:" in ln and ln.startswith("[rank ")}
    assert sorted(lines) == ["[rank 0", "[rank 1"] and len(set(lines.values())) == 1, r.stdout[-3000:]
    message = lines["[rank 0"]
    assert "No space left on device" in message and "step_00000002 (step 2)" in message, message
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000002"]
    subprocess.run(["mount", "-o", "remount,size=256m", str(small_disk)], check=True)
    r = launch_here([*argv, "--resume"], 2, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 4, 6, 8]
