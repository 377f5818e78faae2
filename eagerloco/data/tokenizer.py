"""Tokenizers: UTF-8 bytes, or a byte-level BPE trained on the corpus's training split and cached."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from eagerloco.atomic import atomic_write
from eagerloco.data.cache import DataError, built_once, default_data_dir, file_entry, matches, note
from eagerloco.extras import require

if TYPE_CHECKING:
    from eagerloco.data.corpus import Corpus

DEFAULT_BPE_VOCAB = 8192
#: What the missing-tokenizers message names (tokenizers comes with the [bpe] extra).
BPE_NEEDS = "the BPE tokenizer (--tokenizer bpe)"
MIN_BPE_VOCAB = 256  # the byte alphabet: a smaller vocabulary could not encode every text
#: Past this the BPE trainer only allocates: no corpus this tool trains on has a million distinct merges.
MAX_BPE_VOCAB = 1 << 20
BPE_SETTINGS: dict[str, Any] = {
    "format": 1,
    "model": "bpe",
    "pre_tokenizer": "byte_level",
    "add_prefix_space": False,
    "use_regex": True,
    "min_frequency": 2,
}
TOKENIZER_NAMES = ("byte", "bpe", "bpe:<vocab>")


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and the evals need; ``fingerprint`` keys the token cache."""

    vocab_size: int
    fingerprint: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids: no training, no unknown tokens, vocabulary 256."""

    vocab_size: int = 256
    fingerprint: str = "byte-utf8-v1"
    name: str = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class BPETokenizer:
    """A Hugging Face ``tokenizers`` byte-level BPE behind the Tokenizer interface: no unknown token, exact
    decoding, sequences ~4x shorter than bytes."""

    def __init__(self, tok: Any, name: str = "bpe") -> None:
        self.tok = tok
        self.name = name
        self.vocab_size: int = tok.get_vocab_size()
        # Hash of the full serialized model: two tokenizers share cached token ids only if identical.
        self.fingerprint: str = "bpe-" + hashlib.sha256(tok.to_str().encode()).hexdigest()

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tok.encode(text).ids
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many documents at once: the Rust side spreads them over all cores."""
        return [e.ids for e in self.tok.encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        text: str = self.tok.decode(list(ids))
        return text

    @classmethod
    def from_file(cls, path: str | Path, name: str = "bpe") -> BPETokenizer:
        tokenizers = require("tokenizers", BPE_NEEDS)
        return cls(tokenizers.Tokenizer.from_file(str(path)), name=name)


def parse_tokenizer_name(name: str) -> tuple[str, int | None]:
    """"byte" -> ("byte", None); "bpe" -> ("bpe", 8192); "bpe:4096" -> ("bpe", 4096)."""
    if name == "byte":
        return "byte", None
    if name == "bpe":
        return "bpe", DEFAULT_BPE_VOCAB
    if name.startswith("bpe:"):
        raw = name[4:]
        if not raw.isdigit() or int(raw) < MIN_BPE_VOCAB:
            raise ValueError(f"tokenizer {name!r}: the vocabulary must be an integer >= {MIN_BPE_VOCAB}, e.g. bpe:8192")
        if int(raw) > MAX_BPE_VOCAB:
            raise ValueError(f"tokenizer {name!r}: the vocabulary must be at most {MAX_BPE_VOCAB:,} (the BPE trainer "
                             "would only allocate past it), e.g. bpe:8192")
        return "bpe", int(raw)
    raise ValueError(f"unknown tokenizer {name!r}; available: {', '.join(TOKENIZER_NAMES)}")


def bpe_key(train_docs: list[str], vocab_size: int) -> str:
    """Cache key of a BPE: training documents in order, vocabulary, settings and library version (eval
    documents left out: holding out others must not retrain)."""
    tokenizers = require("tokenizers", BPE_NEEDS)
    h = hashlib.sha256()
    h.update(json.dumps({**BPE_SETTINGS, "vocab_size": vocab_size, "tokenizers": tokenizers.__version__}).encode())
    h.update(len(train_docs).to_bytes(8, "little"))
    for doc in train_docs:
        h.update(hashlib.sha256(doc.encode("utf-8")).digest())
    return h.hexdigest()


def train_bpe(train_docs: list[str], vocab_size: int) -> Any:
    """A fresh byte-level BPE (a ``tokenizers.Tokenizer``) learnt from ``train_docs``."""
    tokenizers = require("tokenizers", BPE_NEEDS)
    decoders, models, pre_tokenizers, trainers = (
        tokenizers.decoders, tokenizers.models, tokenizers.pre_tokenizers, tokenizers.trainers)

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(
        add_prefix_space=BPE_SETTINGS["add_prefix_space"], use_regex=BPE_SETTINGS["use_regex"]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=BPE_SETTINGS["min_frequency"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(train_docs, trainer=trainer, length=len(train_docs))
    return tok


def _cached_bpe(path: Path, meta_path: Path) -> BPETokenizer | None:
    """The cached tokenizer when its file matches the checksum written beside it, else None."""
    try:
        meta = json.loads(meta_path.read_text())
        return BPETokenizer.from_file(path, name=meta["name"]) if matches(path, meta) else None
    except Exception:  # any damage (missing, truncated, edited, unparsable) means: train again
        return None


def load_or_train_bpe(corpus: Corpus, vocab_size: int, data_dir: str | Path | None = None) -> BPETokenizer:
    """The BPE for ``corpus.train_docs``, loaded from <data_dir>/tokenizers or trained and cached; trained on
    training documents only, so held-out words do not leak into the evaluation as cheap tokens."""
    if not corpus.train_docs:
        raise DataError(f"{corpus.name}: no training documents to learn a BPE from")
    root = default_data_dir(data_dir if data_dir is not None else corpus.data_dir) / "tokenizers"
    key = bpe_key(corpus.train_docs, vocab_size)
    name = f"bpe:{vocab_size}"
    path = root / f"bpe-{vocab_size}-{key[:24]}.json"
    meta_path = path.with_suffix(".meta.json")

    def train() -> None:
        t0 = time.perf_counter()
        note(f"training a {vocab_size}-token BPE on the training split of {corpus.name} (once; cached in {root})")
        tok = train_bpe(corpus.train_docs, vocab_size)
        seconds = time.perf_counter() - t0
        atomic_write(path, tok.to_str().encode())
        meta = {
            "name": name,
            "key": key,
            **file_entry(path),
            "vocab_size": tok.get_vocab_size(),
            "requested_vocab_size": vocab_size,
            "corpus": corpus.name,
            "train_docs": len(corpus.train_docs),
            "train_chars": sum(map(len, corpus.train_docs)),
            "train_seconds": round(seconds, 3),
            "settings": BPE_SETTINGS,
        }
        atomic_write(meta_path, (json.dumps(meta, indent=1) + "\n").encode())

    return built_once(root, f"the {name} tokenizer of {corpus.name} ({path.name})",
                      lambda: _cached_bpe(path, meta_path), train)


def get_tokenizer(
    name: str = "byte", corpus: Corpus | None = None, data_dir: str | Path | None = None
) -> ByteTokenizer | BPETokenizer:
    """"byte", or "bpe" / "bpe:<vocab>" trained on ``corpus``'s training split, cached under data_dir
    (default: the corpus's, then $EAGERLOCO_DATA_DIR, then ~/.cache/eagerloco)."""
    kind, vocab = parse_tokenizer_name(name)
    if kind == "byte":
        return ByteTokenizer()
    if corpus is None:
        raise ValueError(f"tokenizer {name!r} is learnt from the training text: pass corpus=")
    assert vocab is not None
    return load_or_train_bpe(corpus, vocab, data_dir)
