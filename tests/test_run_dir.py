"""The run directory loses nothing that is not the run's, and every file of a run is checked before use.

``--overwrite`` removes exactly the files listed in the run's manifest (``.eagerloco-run.json``);
anything else at a run's paths makes it refuse, naming it, before anything is removed. A lock, a
meta.json field or a run file of the wrong kind is one line naming the file, the field and the fix,
never a traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from jobs import popen

from eagerloco import checkpoint as ckpt
from eagerloco.cli import main
from eagerloco.train.rundir import LOCK_NAME, MANIFEST_NAME, kind_of, read_manifest

FAST = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1", "--no-progress",
        "--log-every", "1"]
#: The run every test starts from (made once, copied): checkpoints at steps 2, 4 and 6, TensorBoard events.
RUN = [*FAST, "--method", "diloco", "--inner-steps", "2", "--steps", "6", "--checkpoint-every", "2",
       "--keep-checkpoints", "3"]


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the command; it must fail with exit status 2 and exactly one line on stderr."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("eagerloco: error: ") and err.count("\n") == 1, err
    return err


def _last_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Like _error, after lines that report what was skipped on the way."""
    capsys.readouterr()
    assert main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert all(ln.startswith("eagerloco: ") for ln in lines) and lines[-1].startswith("eagerloco: error: "), lines
    return lines[-1]


def _files(root: Path) -> dict[str, bytes]:
    """Every regular file under root (through links to directories too) and its bytes."""
    found = {}
    for d, _, names in os.walk(root, followlinks=True):
        for n in names:
            p = Path(d) / n
            if p.is_file():
                found[str(p.relative_to(root))] = p.read_bytes()
    return found


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("made") / "run"
    assert main(["train", *RUN, "--tensorboard", "--out", str(out)]) == 0
    return out


@pytest.fixture
def run(made: Path, tmp_path: Path) -> Path:
    """A copy of the finished run, in a directory of its own."""
    out = tmp_path / "run"
    shutil.copytree(made, out, symlinks=True)
    return out


def _final_loss(out: Path) -> float:
    return json.loads((out / "summary.json").read_text())["final_eval_loss"]


# -- --overwrite deletes only what eagerloco wrote ------------------------------------------------------------


def test_the_manifest_lists_every_file_the_run_wrote(made: Path) -> None:
    listed = read_manifest(made)
    assert listed is not None
    on_disk = {p for p in _files(made) if p != MANIFEST_NAME}
    assert on_disk == {r for r, k in listed.items() if k == "file" and (made / r).exists()}
    assert {"metrics.jsonl", "summary.json", "checkpoints", "tensorboard"} <= set(listed)
    assert any(r.startswith("tensorboard/events.out.tfevents.") for r in listed)


def test_overwrite_refuses_a_directory_that_holds_files_it_did_not_write(tmp_path: Path, capsys) -> None:
    out = tmp_path / "elsewhere"
    (out / "checkpoints" / "resnet").mkdir(parents=True)
    (out / "checkpoints" / "resnet" / "best.pth").write_bytes(b"weights")
    (out / "tensorboard" / "exp1").mkdir(parents=True)
    (out / "tensorboard" / "exp1" / "events.out.tfevents.1.host").write_bytes(b"events")
    before = _files(out)
    err = _error(capsys, ["train", *FAST, "--steps", "2", "--out", str(out), "--overwrite"])
    assert "checkpoints/resnet, tensorboard/exp1, which eagerloco did not write" in err
    assert "nothing was removed" in err
    assert _files(out) == before


def test_out_dot_in_a_home_directory_deletes_nothing(tmp_path: Path, capsys, monkeypatch) -> None:
    home = tmp_path / "home"
    (home / "checkpoints").mkdir(parents=True)
    (home / "checkpoints" / "llama-ft.safetensors").write_bytes(b"fine-tuned")
    (home / ".bashrc").write_text("export X=1\n")
    before = _files(home)
    monkeypatch.chdir(home)
    assert "checkpoints/llama-ft.safetensors" in _error(capsys, ["train", *FAST, "--steps", "2", "--out", "."])
    assert "checkpoints/llama-ft.safetensors" in _error(capsys, ["train", *FAST, "--steps", "2", "--out", ".",
                                                                "--overwrite"])
    assert _files(home) == before
    (home / "checkpoints" / "llama-ft.safetensors").rename(home / "llama-ft.safetensors")
    err = _error(capsys, ["train", *FAST, "--steps", "2", "--out", ".", "--overwrite"])
    assert "holds .bashrc, checkpoints, llama-ft.safetensors" not in err  # an empty checkpoints dir is a run's path
    assert "holds .bashrc, llama-ft.safetensors, which eagerloco did not write" in err
    assert "drop --overwrite to start a run beside them" in err
    assert set(_files(home)) == {".bashrc", "llama-ft.safetensors"}


def test_files_put_into_a_run_directory_are_never_deleted(run: Path, capsys) -> None:
    (run / "checkpoints" / "resnet").mkdir()
    (run / "checkpoints" / "resnet" / "best.pth").write_bytes(b"weights")
    (run / "checkpoints" / "step_00000004" / "notes.txt").write_text("good run")
    before = _files(run)
    err = _error(capsys, ["train", *RUN, "--out", str(run), "--overwrite"])
    assert "checkpoints/resnet, checkpoints/step_00000004/notes.txt, which eagerloco did not write" in err
    assert f"{run / MANIFEST_NAME} does not list them" in err
    err = _error(capsys, ["train", *RUN, "--out", str(run)])
    assert "holds an earlier run (metrics.jsonl, summary.json, checkpoints (step_00000002 .. step_00000006), " \
           "tensorboard) and checkpoints/resnet, checkpoints/step_00000004/notes.txt, which eagerloco did not" in err
    assert _files(run) == before


def test_overwrite_removes_exactly_the_listed_files(run: Path, capsys) -> None:
    (run / "notes.txt").write_text("mine")
    (run / "data").mkdir()
    (run / "data" / "shard0.bin").write_bytes(b"tokens")
    capsys.readouterr()
    assert main(["train", *FAST, "--steps", "2", "--out", str(run), "--overwrite"]) == 0
    # 3 checkpoints of 3 files, metrics.jsonl, summary.json, TensorBoard's event file
    assert "removed the earlier run's 12 files" in capsys.readouterr().err
    assert set(_files(run)) == {"notes.txt", "data/shard0.bin", "metrics.jsonl", "summary.json", MANIFEST_NAME}
    assert not (run / "checkpoints").exists() and not (run / "tensorboard").exists()
    assert set(read_manifest(run)) == {LOCK_NAME, "metrics.jsonl", "summary.json", "summary.json.tmp"}


def test_a_symlinked_checkpoints_directory(run: Path, tmp_path: Path, capsys) -> None:
    """The run's checkpoints on another disk: its checkpoints there are removed, the link, the directory it
    points to and anything else in it are not; with anything else there nothing is removed at all."""
    disk = tmp_path / "scratch"
    shutil.move(run / "checkpoints", disk)
    (run / "checkpoints").symlink_to(disk, target_is_directory=True)
    (disk / "keep.pth").write_bytes(b"another run's")
    before, outside = _files(run), _files(disk)
    assert "checkpoints/keep.pth, which eagerloco did not write" in _error(
        capsys, ["train", *FAST, "--steps", "2", "--out", str(run), "--overwrite"])
    assert _files(run) == before and _files(disk) == outside  # metrics.jsonl and summary.json too
    (disk / "keep.pth").unlink()
    assert main(["train", *FAST, "--steps", "2", "--out", str(run), "--overwrite"]) == 0
    assert (run / "checkpoints").is_symlink() and disk.is_dir() and list(disk.iterdir()) == []


def test_a_symlinked_tensorboard_directory_is_never_emptied(run: Path, tmp_path: Path, capsys) -> None:
    logs = tmp_path / "my-logs"
    (logs / "exp1").mkdir(parents=True)
    (logs / "exp1" / "events.out.tfevents.1.host").write_bytes(b"events")
    shutil.rmtree(run / "tensorboard")
    (run / "tensorboard").symlink_to(logs, target_is_directory=True)
    before = _files(run)
    assert "tensorboard/exp1, which eagerloco did not write" in _error(
        capsys, ["train", *FAST, "--steps", "2", "--out", str(run), "--overwrite"])
    assert _files(run) == before and (logs / "exp1" / "events.out.tfevents.1.host").exists()


def test_resume_keeps_the_manifest_up_to_date(run: Path, capsys) -> None:
    """Pruned checkpoints leave the manifest, new ones join it, staging directories are listed before use."""
    shutil.rmtree(run / "checkpoints" / "step_00000006")
    assert main(["train", *RUN, "--keep-checkpoints", "1", "--out", str(run), "--resume"]) == 0
    listed = read_manifest(run)
    steps = sorted({r.split("/")[1] for r in listed if r.startswith("checkpoints/step_")})
    assert steps == ["step_00000006"] == [p.name for p in ckpt.list_checkpoints(run / "checkpoints")]
    assert not any(".partial-" in r for r in listed)


def test_an_unfinished_checkpoint_is_removed_only_where_the_run_listed_it(run: Path, capsys) -> None:
    """A staging directory the run listed is its own (left by a crash); one it did not list may be another
    run's in flight in a shared checkpoints directory, and stays."""
    ours, theirs = (run / "checkpoints" / f".partial-step_{s:08d}" for s in (8, 10))
    for d in (ours, theirs):
        d.mkdir()
        (d / "worker_0.pt").write_bytes(b"half")
    m = json.loads((run / MANIFEST_NAME).read_text())
    m["entries"]["checkpoints/.partial-step_00000008"] = "dir"
    (run / MANIFEST_NAME).write_text(json.dumps(m))
    capsys.readouterr()
    assert main(["train", *RUN, "--out", str(run), "--resume"]) == 0  # finished already: nothing to train
    assert "left unfinished in" in capsys.readouterr().err
    assert not ours.exists() and (theirs / "worker_0.pt").read_bytes() == b"half"
    assert not any(".partial-step_00000008" in r for r in read_manifest(run))


def test_a_manifest_naming_paths_outside_the_run_is_refused(run: Path, tmp_path: Path, capsys) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("not the run's")
    m = json.loads((run / MANIFEST_NAME).read_text())
    m["entries"]["../victim.txt"] = "file"
    (run / MANIFEST_NAME).write_text(json.dumps(m))
    err = _error(capsys, ["train", *FAST, "--steps", "2", "--out", str(run), "--overwrite"])
    assert "entry '../victim.txt' is not a path inside the run directory" in err and str(run / MANIFEST_NAME) in err
    assert victim.read_text() == "not the run's"
    (run / MANIFEST_NAME).write_text("{torn")
    assert "is unreadable" in _error(capsys, ["train", *FAST, "--steps", "2", "--out", str(run), "--overwrite"])


def test_compare_never_deletes_a_run_directory_it_did_not_write(tmp_path: Path, capsys) -> None:
    out = tmp_path / "cmp"
    theirs = out / "runs" / "no-overlap" / "checkpoints" / "resnet"
    theirs.mkdir(parents=True)
    (theirs / "best.pth").write_bytes(b"weights")
    err = _error(capsys, ["compare", *FAST, "--grid", "no-overlap", "--steps", "2", "--out", str(out)])
    assert "compare, run no-overlap:" in err and "checkpoints/resnet, which eagerloco did not write" in err
    assert (theirs / "best.pth").read_bytes() == b"weights"
    assert not (out / "runs" / "no-overlap" / "metrics.jsonl").exists()


@pytest.mark.processes
def test_a_launched_run_lists_every_rank_s_files_and_overwrite_removes_them(tmp_path: Path, capsys) -> None:
    """Only the reporting process writes the manifest; it lists the files every rank wrote."""
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    cmd = [sys.executable, "-m", "eagerloco", "launch", "--workers", "2", "--", *FAST, "--workers", "2",
           "--steps", "4", "--checkpoint-every", "2", "--keep-checkpoints", "1", "--out", str(out)]
    p = popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env, "OMP_NUM_THREADS": "1"})
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    listed = read_manifest(out)
    files = {r for r, k in listed.items() if k == "file" and (out / r).exists()}
    assert files == {p for p in _files(out) if p != MANIFEST_NAME}
    assert {"checkpoints/step_00000004/worker_0.pt", "checkpoints/step_00000004/worker_1.pt"} <= files
    assert not any("step_00000002" in r or ".partial-" in r for r in listed)  # pruned, published
    (out / "notes.txt").write_text("mine")
    assert main(["train", *FAST, "--steps", "1", "--out", str(out), "--overwrite"]) == 0
    assert set(_files(out)) == {"notes.txt", "metrics.jsonl", "summary.json", MANIFEST_NAME}


# -- every run file's kind and every meta.json field checked before use ---------------------------------------


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ({"pid": "abc", "host": "h"}, "pid 'abc' is not a process id"),
        (None, "it is not a table"),
        ({"pid": 10**30, "host": "h"}, "pid 1000000000000000000000000000000 is not a process id"),
        ({"pid": 0, "host": "h"}, "pid 0 is not a process id"),
        ({"pid": 123}, "host None is not a host name"),
    ],
)
def test_a_lock_eagerloco_did_not_write_is_named(tmp_path: Path, capsys, content, needle: str) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_NAME).write_text(json.dumps(content))
    err = _error(capsys, ["train", *FAST, "--steps", "2", "--out", str(out)])
    assert f"the run lock {out / LOCK_NAME} holds" in err and needle in err and f"delete {out / LOCK_NAME}" in err
    assert (out / LOCK_NAME).exists() and not (out / "metrics.jsonl").exists()


def test_a_torn_lock_left_long_ago_is_taken_over(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    out.mkdir()
    lock = out / LOCK_NAME
    lock.write_text('{"pid": 12')  # a writer that died mid-write
    old = time.time() - 60
    os.utime(lock, (old, old))
    capsys.readouterr()
    assert main(["train", *FAST, "--steps", "1", "--out", str(out)]) == 0
    assert f"taking over {lock} from a run that stopped writing it" in capsys.readouterr().err
    assert not lock.exists()


def _damage_meta(run: Path, steps: tuple[int, ...], edit) -> None:
    for step in steps:
        meta = run / "checkpoints" / f"step_{step:08d}" / "meta.json"
        m = json.loads(meta.read_text())
        edit(m)
        meta.write_text(json.dumps(m))


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda m: m.update(real_elapsed="abc"), "real_elapsed 'abc' is not a number of seconds"),
        (lambda m: m.update(real_elapsed=float("inf")), "real_elapsed inf is not a number of seconds"),
        (lambda m: m.update(group={}), "group.link_free None is not a time in seconds"),
        (lambda m: m.update(group=[1, 2]), "group [1, 2] is not the simulated link's state"),
        (lambda m: m["group"].update(rng=None), "group.rng None is not a random generator's state"),
        (lambda m: m["group"].update(rng=[3, [1, 2], None]), "group.rng [3, [1, 2], None] is not a random"),
    ],
)
def test_meta_fields_are_checked_before_use(run: Path, capsys, edit, needle: str) -> None:
    _damage_meta(run, (2, 4, 6), edit)
    err = _last_error(capsys, ["train", *RUN, "--out", str(run), "--resume"])
    assert "no usable checkpoint under" in err and needle in err
    assert str(run / "checkpoints" / "step_00000006" / "meta.json") in err and "drop --resume" in err


def _resume_point(run: Path, capsys) -> tuple[Path, int, str]:
    from eagerloco.cli import make_parser
    from eagerloco.flags import build_train_config
    from eagerloco.train.resume import resume_checkpoint

    capsys.readouterr()
    found = resume_checkpoint(build_train_config(make_parser().parse_args(["train", *RUN, "--out", str(run),
                                                                           "--resume"])))
    assert found is not None
    return found[0], found[1]["step"], capsys.readouterr().err


def test_a_step_that_disagrees_with_its_directory_is_not_resumed(run: Path, made: Path, capsys) -> None:
    """step_00000006 saying step 4 would resume "step 4" from step 6's state: it is skipped."""
    _damage_meta(run, (6,), lambda m: m.update(step=4))
    capsys.readouterr()
    assert main(["train", *RUN, "--out", str(run), "--resume"]) == 0
    captured = capsys.readouterr()
    assert "skipping checkpoint step_00000006" in captured.err
    assert "step 4 disagrees with its directory step_00000006" in captured.err
    assert f"resuming from {run / 'checkpoints' / 'step_00000004'} (step 4 of 6)" in captured.out
    assert _final_loss(run) == _final_loss(made)


def test_a_step_past_the_run_is_not_resumed(run: Path, capsys) -> None:
    _damage_meta(run, (6,), lambda m: m.update(step=10**30))
    path, step, err = _resume_point(run, capsys)
    assert (path.name, step) == ("step_00000004", 4)
    assert "step 1000000000000000000000000000000 disagrees with its directory step_00000006" in err
    # consistent with its directory, but past the run's last step
    far = run / "checkpoints" / f"step_{10**30:08d}"
    shutil.copytree(run / "checkpoints" / "step_00000004", far)
    _damage_meta(run, (10**30,), lambda m: m.update(step=10**30))
    path, step, err = _resume_point(run, capsys)
    assert (path.name, step) == ("step_00000004", 4)
    assert "step 1000000000000000000000000000000 is past the run's last step (6)" in err


@pytest.mark.parametrize("flags", [[], ["--resume"], ["--overwrite"]])
def test_checkpoints_that_is_a_file(tmp_path: Path, capsys, flags: list[str]) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("not a directory")
    err = _error(capsys, ["train", *RUN, "--out", str(out), *flags])
    assert f"{out / 'checkpoints'} is a file, not a directory" in err
    assert (out / "checkpoints").read_text() == "not a directory"


@pytest.mark.parametrize("name", ["metrics.jsonl", "summary.json", "summary.json.tmp", MANIFEST_NAME])
@pytest.mark.parametrize("flags", [[], ["--resume"], ["--overwrite"]])
def test_a_run_file_that_is_a_directory(run: Path, capsys, name: str, flags: list[str]) -> None:
    target = run / name
    if target.exists():
        target.unlink()
    target.mkdir()
    (target / "inside.txt").write_text("mine")
    before = _files(run)
    err = _error(capsys, ["train", *RUN, "--out", str(run), *flags])
    assert f"{target} is a directory" in err and "move it away or pass another --out" in err
    assert _files(run) == before


def test_a_run_file_that_is_a_link_is_never_written_through(run: Path, tmp_path: Path, capsys) -> None:
    theirs = tmp_path / "theirs.jsonl"
    theirs.write_text("their metrics\n")
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(theirs)
    for flags in ([], ["--resume"], ["--overwrite"]):
        err = _error(capsys, ["train", *RUN, "--out", str(run), *flags])
        assert f"{run / 'metrics.jsonl'} is a symbolic link" in err
    assert theirs.read_text() == "their metrics\n" and (run / "metrics.jsonl").is_symlink()


def test_a_manifest_published_meanwhile_is_seen_as_absent_or_as_a_file_never_as_something_else(tmp_path: Path) -> None:
    """Another rank renames the manifest into place while this one looks: one look (lstat), so it is absent or a
    file. Successive looks (link? directory? file? anything?) saw it as "other" between two of them, and a rank
    of a launched run stopped with "... is a other, not the list of the files"."""
    path = tmp_path / "published"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert [kind_of(p) for p in (path, tmp_path, fifo)] == [None, "dir", "other"]
    stop = threading.Event()

    def publish() -> None:
        while not stop.is_set():
            staged = tmp_path / "staged"
            staged.write_text("{}")
            os.replace(staged, path)
            path.unlink()

    t = threading.Thread(target=publish, daemon=True)
    t.start()
    try:
        seen = {kind_of(path) for _ in range(20000)}
    finally:
        stop.set()
        t.join()
    assert seen <= {None, "file"}, seen
