"""Document stores: a directory of .txt documents with a manifest (sizes, sha256, groups) written last."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagerloco.atomic import atomic_write
from eagerloco.data.cache import MANIFEST_VERSION, built_once


@dataclass
class Doc:
    """One stored document: its name, its group (genre, book, novel, source) and its text."""

    name: str
    group: str
    text: str


def slug(text: str) -> str:
    """``text`` reduced to a safe file-name part: runs of other characters become one underscore."""
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_") or "doc"


def _read_store(directory: Path, source: str) -> list[Doc] | None:
    """The documents when the manifest and every file it lists check out, else None (rebuild)."""
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
        if manifest.get("version") != MANIFEST_VERSION or manifest.get("source") != source:
            return None
        docs = []
        for meta in manifest["docs"]:
            raw = (directory / meta["file"]).read_bytes()
            if len(raw) != meta["size"] or hashlib.sha256(raw).hexdigest() != meta["sha256"]:
                return None
            docs.append(Doc(meta["name"], meta["group"], raw.decode("utf-8")))
        return docs or None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_store(directory: Path, source: str, docs: list[Doc], extra: dict[str, Any]) -> None:
    entries = []
    for i, d in enumerate(docs):
        raw = d.text.encode("utf-8")
        file = f"{i:04d}-{slug(d.name)}.txt"
        atomic_write(directory / file, raw)
        entries.append({"name": d.name, "group": d.group, "file": file, "size": len(raw),
                        "sha256": hashlib.sha256(raw).hexdigest()})
    manifest = {"version": MANIFEST_VERSION, "source": source, **extra, "docs": entries}
    # Written last: a manifest on disk means every file it lists was complete.
    atomic_write(directory / "manifest.json", (json.dumps(manifest, indent=1) + "\n").encode())


def stored(source: str, root: Path, build: Callable[[Path], tuple[list[Doc], dict[str, Any]]]) -> list[Doc]:
    """The verified documents of ``source`` under root/source, built (once, under a lock) when missing."""
    directory = root / source
    return built_once(directory, f"the documents of {source}", lambda: _read_store(directory, source),
                      lambda: _write_store(directory, source, *build(directory)))


def unzip_docs(docs: list[Doc]) -> tuple[list[str], list[str], list[str]]:
    """(names, texts, groups) of ``docs``: what a source loader returns."""
    return [d.name for d in docs], [d.text for d in docs], [d.group for d in docs]
