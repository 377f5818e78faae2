"""Jane Austen: six novels in the R package janeaustenr's lazy-load database (data/Rdata.rdb/.rdx)."""

from __future__ import annotations

import re
import warnings
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from eagerloco.data.cache import DataError
from eagerloco.data.store import Doc, stored, unzip_docs
from eagerloco.extras import require
from eagerloco.lab.corpora.debian import from_debs

AUSTEN_PACKAGES = ("r-cran-janeaustenr",)
AUSTEN_NOVELS = {  # R object name -> (title, number of chapters)
    "sensesensibility": ("Sense and Sensibility", 50),
    "prideprejudice": ("Pride and Prejudice", 61),
    "mansfieldpark": ("Mansfield Park", 48),
    "emma": ("Emma", 55),
    "northangerabbey": ("Northanger Abbey", 31),
    "persuasion": ("Persuasion", 24),
}
_AUSTEN_CHAPTER = re.compile(r"^\s*chapter\s+(\d+|[ivxlc]+)\.?\s*$", re.IGNORECASE)
_AUSTEN_DROP = re.compile(r"^\s*(volume\s+[ivx]+|the end|finis)\s*$", re.IGNORECASE)


def read_lazyload_db(rdx: Path) -> dict[str, Any]:
    """Every object of an R lazy-load database (``X.rdx`` index, ``X.rdb`` blobs of a 4-byte length and a zlib stream),
    converted by ``rdata``, which reads RDS but not this container."""
    rdata = require("rdata", "--data austen (reading the novels' R data)")
    index = rdata.read_rds(rdx)
    compressed = np.asarray(index["compressed"]).ravel()
    if compressed.dtype != bool or not compressed[0]:  # 2 / 3 would be bzip2 / xz blobs
        raise DataError(f"{rdx}: only zlib-compressed lazy-load databases are supported")
    blob = rdx.with_suffix(".rdb").read_bytes()
    out: dict[str, Any] = {}
    for name, (offset, length) in index["variables"].items():
        chunk = blob[int(offset) : int(offset) + int(length)]
        size = int.from_bytes(chunk[:4], "big")
        try:
            raw = zlib.decompress(chunk[4:])
        except zlib.error as e:
            raise DataError(f"{rdx.with_suffix('.rdb')}: object {name} is damaged: {e}") from e
        if len(raw) != size:
            raise DataError(f"{rdx.with_suffix('.rdb')}: object {name} has {len(raw)} bytes, expected {size}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out[str(name)] = rdata.conversion.convert(rdata.parser.parse_data(raw))
    return out


def austen_chapters(lines: Sequence[str]) -> list[str]:
    """A novel's lines as chapters, one paragraph per line, the heading kept; front matter goes with the first chapter,
    "VOLUME II" and "THE END" are dropped."""
    front: list[str] = []
    chapters: list[list[str]] = []
    for line in lines:
        if _AUSTEN_DROP.match(line):
            continue
        if _AUSTEN_CHAPTER.match(line):
            chapters.append(front if not chapters else [])
        (chapters[-1] if chapters else front).append(line)
    chapters = chapters or [front]
    out = []
    for ch in chapters:
        paragraphs, cur = [], []
        for line in [*ch, ""]:
            heading = _AUSTEN_CHAPTER.match(line) is not None
            if line.strip() and not heading:
                cur.append(line.strip())
                continue
            if cur:
                paragraphs.append(" ".join(cur))
                cur = []
            if heading:  # a heading is a line of its own even without a blank line after it
                paragraphs.append(line.strip())
        out.append("\n".join(paragraphs) + "\n")
    return out


def _austen_from_tree(tree: Path) -> list[Doc]:
    rdx = next(tree.rglob("janeaustenr/data/Rdata.rdx"), None)
    if rdx is None:
        raise DataError("unpacked r-cran-janeaustenr lacks janeaustenr/data/Rdata.rdx")
    objects = read_lazyload_db(rdx)
    docs: list[Doc] = []
    for key, (title, n_chapters) in AUSTEN_NOVELS.items():
        if key not in objects:
            raise DataError(f"{rdx}: no object {key!r} ({title}); found {sorted(objects)}")
        chapters = austen_chapters([str(x) for x in np.asarray(objects[key]).ravel()])
        if len(chapters) != n_chapters:
            raise DataError(f"{title}: found {len(chapters)} chapters, expected {n_chapters}")
        docs.extend(Doc(f"{key}-{i:02d}", title, text) for i, text in enumerate(chapters, 1))
    return docs


def load_austen(root: Path) -> tuple[list[str], list[str], list[str]]:
    """(names, texts, novel titles) of the 269 chapters, one document per chapter, extracted from the Debian package
    into <root>/austen (with a verified manifest) when missing."""
    return unzip_docs(stored("austen", root, lambda d: from_debs(d, AUSTEN_PACKAGES, _austen_from_tree)))
