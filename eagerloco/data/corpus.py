"""Corpora: which sources to load (named corpora, Hugging Face datasets, user text), split into train and eval."""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

import torch

from eagerloco.data.cache import DataError, default_data_dir
from eagerloco.data.hf import hf_label, load_hf

SINGLE_FILE_PIECES = 20  # a lone text file is cut into this many documents so some can be held out
#: The share of a user's --data bytes that may be other than UTF-8 (trained on as U+FFFD, with a
#: warning); beyond it the file is refused as binary or in another encoding.
MAX_UNDECODABLE = 0.01
#: The entry-point group of the named corpora: ``--data NAME`` loads the entry point NAME of this group, a
#: ``Loader``. The library names no corpus: each fetcher registers its own (pyproject.toml registers the lab's
#: brown, kjv and austen; another package can add more), so the library never calls up into what fetches.
CORPORA_GROUP = "eagerloco.corpora"

#: A named corpus: (the cache root) -> (document names, texts, groups), fetching into the cache on first use.
Loader = Callable[[Path], tuple[list[str], list[str], list[str]]]


@dataclass
class Corpus:
    """Documents split into train / eval; ``*_groups`` (genre or source) drive non-iid sharding; ``data_dir``,
    the cache it came from, holds its tokenizers and token ids too."""

    train_docs: list[str]
    eval_docs: list[str]
    name: str
    train_groups: list[str] = field(default_factory=list)
    eval_groups: list[str] = field(default_factory=list)
    train_names: list[str] = field(default_factory=list)
    eval_names: list[str] = field(default_factory=list)
    data_dir: Path | None = None

    def fingerprint(self) -> str:
        """sha256 of the train and eval texts in order: the key of cached token ids."""
        h = hashlib.sha256(b"eagerloco-corpus-v1")
        for docs in (self.train_docs, self.eval_docs):
            h.update(len(docs).to_bytes(8, "little"))
            for d in docs:
                h.update(hashlib.sha256(d.encode("utf-8")).digest())
        return h.hexdigest()


def named_corpora() -> dict[str, EntryPoint]:
    """The corpora registered by name (entry points of CORPORA_GROUP), sorted by name."""
    return {ep.name: ep for ep in sorted(entry_points(group=CORPORA_GROUP), key=lambda ep: ep.name)}


def split_sources(source: str) -> list[str]:
    """"brown,kjv" -> ["brown", "kjv"]; an existing path or an hf: name is one source even with commas."""
    source = source.strip()
    if source.startswith("hf:") or Path(source).expanduser().exists() or "," not in source:
        return [source]
    parts = [p.strip() for p in source.split(",") if p.strip()]
    if len(set(parts)) != len(parts):
        raise DataError(f"--data {source!r} names a source twice")
    return parts


def _source_label(spec: str, named: dict[str, EntryPoint]) -> str:
    if spec.startswith("hf:"):
        return hf_label(spec)
    if spec in named:
        return spec
    return Path(spec).expanduser().name or spec


def load_corpus(
    source: str = "brown",
    data_dir: str | Path | None = None,
    eval_fraction: float = 0.05,
    seed: int = 0,
) -> Corpus:
    """Load, cache and split a corpus into whole train / eval documents.

    ``source``: a named corpus (``named_corpora``), a Hugging Face dataset ("hf:NAME[:CONFIG][@DOCS]"), a .txt
    file (cut at lines into up to SINGLE_FILE_PIECES documents), a directory of .txt files (grouped by
    top-level subfolder, or by file), or a comma list of those, each one group, each holding out
    ``eval_fraction`` of its documents as it would alone."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    root = default_data_dir(data_dir)
    specs = split_sources(source)
    named = named_corpora()
    parts = []
    for spec in specs:
        label = _source_label(spec, named)
        part = _split(label, *_load_source(spec, root, named), eval_fraction, seed)
        if len(specs) > 1:  # each source of a mix is one group: non-iid workers get different sources
            part.train_names = [f"{label}:{n}" for n in part.train_names]
            part.eval_names = [f"{label}:{n}" for n in part.eval_names]
            part.train_groups = [label] * len(part.train_docs)
            part.eval_groups = [label] * len(part.eval_docs)
        parts.append(part)

    def joined(key: str) -> list[str]:
        return [x for p in parts for x in getattr(p, key)]

    return Corpus(joined("train_docs"), joined("eval_docs"), "+".join(p.name for p in parts), joined("train_groups"),
                  joined("eval_groups"), joined("train_names"), joined("eval_names"), root)


def _load_source(spec: str, root: Path, named: dict[str, EntryPoint]) -> tuple[list[str], list[str], list[str]]:
    if spec in named:
        loader: Loader = named[spec].load()
        return loader(root)
    if spec.startswith("hf:"):
        return load_hf(spec, root)
    path = Path(spec).expanduser()
    if not path.exists():
        names = ", ".join(named) or "none: eagerloco is not installed"
        raise FileNotFoundError(
            f"--data {spec!r}: no such file or directory; pass a .txt file, a directory of .txt files, one of "
            f"the named corpora ({names}), hf:NAME[:CONFIG] for a Hugging Face dataset, "
            "or several of these separated by commas"
        )
    return _load_user_text(path)


def _split(name: str, names: list[str], docs: list[str], groups: list[str], eval_fraction: float, seed: int) -> Corpus:
    # Evaluation holds out whole documents (a Brown text, a Bible book, an Austen chapter): windows cut
    # from the training documents would leak.
    n_eval = max(1, round(eval_fraction * len(docs))) if eval_fraction > 0 else 0
    if len(docs) - n_eval < 1:
        raise DataError(f"{name}: found {len(docs)} document(s); need at least 2 to hold whole documents out for eval")
    n_eval = min(n_eval, len(docs) - 1)
    gen = torch.Generator().manual_seed(seed)
    held = set(torch.randperm(len(docs), generator=gen)[:n_eval].tolist())
    tr = [i for i in range(len(docs)) if i not in held]
    ev = sorted(held)
    return Corpus(
        train_docs=[docs[i] for i in tr],
        eval_docs=[docs[i] for i in ev],
        name=name,
        train_groups=[groups[i] for i in tr],
        eval_groups=[groups[i] for i in ev],
        train_names=[names[i] for i in tr],
        eval_names=[names[i] for i in ev],
    )


def _read_text(path: Path) -> tuple[str, int, int]:
    """A user file as UTF-8 with errors replaced: (text, bytes that are not UTF-8, total bytes), so the caller
    can warn, or refuse a file that is mostly not UTF-8."""
    data = path.read_bytes()
    text = data.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - data.count("\ufffd".encode())  # replacements, not U+FFFD in the file
    return text, bad, len(data)


def check_encoding(spec: str, bad: int, total: int, first: Path | None = None) -> None:
    """Warn about the ``bad`` of ``total`` bytes of --data ``spec`` that are not UTF-8 (``first``: the first
    such file); DataError when they are more than MAX_UNDECODABLE."""
    if not bad:
        return
    share = bad / max(1, total)
    where = f" (first in {first})" if first is not None and str(first) != spec else ""
    what = f"{bad:,} of its {total:,} bytes ({share:.1%}) are not UTF-8{where}"
    if share > MAX_UNDECODABLE:
        raise DataError(
            f"--data {spec!r}: {what}: binary, or text in another encoding (Latin-1, UTF-16, ...); "
            f"convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8 FILE > FILE.txt) or pass a text file"
        )
    print(f"eagerloco: warning: --data {spec!r}: {what}; they are trained on as U+FFFD (replacement "
          "characters): convert the text to UTF-8 to train on the real characters", file=sys.stderr, flush=True)


def _load_user_text(path: Path) -> tuple[list[str], list[str], list[str]]:
    if path.is_file():
        text, bad, total = _read_text(path)
        check_encoding(str(path), bad, total)
        if not text.strip():
            raise DataError(f"--data {str(path)!r} is empty")
        pieces = _cut_text(text, SINGLE_FILE_PIECES)
        return (
            [f"{path.name}#{i}" for i in range(len(pieces))],
            pieces,
            [f"part{i:02d}" for i in range(len(pieces))],
        )
    files = sorted(
        p for p in path.rglob("*.txt") if p.is_file() and not any(s.startswith(".") for s in p.relative_to(path).parts)
    )
    if not files:
        raise DataError(f"--data {str(path)!r}: directory has no .txt files")
    names, docs, groups = [], [], []
    bad_all, total_all, first_bad = 0, 0, None
    for f in files:
        text, bad, total = _read_text(f)
        bad_all, total_all = bad_all + bad, total_all + total
        if bad and first_bad is None:
            first_bad = f
        if not text.strip():
            continue
        rel = f.relative_to(path)
        names.append(rel.as_posix())
        docs.append(text)
        groups.append(rel.parts[0] if len(rel.parts) > 1 else rel.stem)
    if not docs:
        raise DataError(f"--data {str(path)!r}: all {len(files)} .txt files are empty")
    check_encoding(str(path), bad_all, total_all, first_bad)
    return names, docs, groups


def _cut_text(text: str, pieces: int) -> list[str]:
    """Contiguous pieces of about equal length, cut after a newline when one is near."""
    target = max(1, len(text) // pieces)
    out, start = [], 0
    while start < len(text):
        end = min(len(text), start + target)
        if len(text) - end < target // 2:  # no tiny tail piece
            end = len(text)
        else:
            nl = text.find("\n", end)
            if nl != -1 and nl - end < target // 2:
                end = nl + 1
        piece = text[start:end]
        if piece.strip():
            out.append(piece)
        start = end
    return out
