"""Token ids: per-document arrays, joined on demand, cached as memory-mapped .npy files."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagerloco.atomic import atomic_file, atomic_write
from eagerloco.data.cache import ReadOnlyCacheError, built_once, default_data_dir, file_entry, matches, note
from eagerloco.data.corpus import Corpus
from eagerloco.data.tokenizer import ByteTokenizer, Tokenizer

DOC_SEPARATOR = "\n\n"
TOKEN_CACHE_VERSION = 1


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
    """Token ids of documents back to back, with offsets (memory-mapped from the cache), so any order of them
    is a concatenation of slices rather than a re-encode."""

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
    """Documents separated by a blank line, as one 1-D tensor in the smallest dtype the vocabulary allows (for
    bytes, the encoding of the joined text; a BPE encodes each document alone)."""
    return EncodedDocs.encode(docs, tokenizer).join()


def _save_npy(path: Path, array: np.ndarray) -> dict[str, Any]:
    """Atomically write ``array`` as .npy (under the cache's lock); returns its size and sha256 for the manifest."""
    with atomic_file(path) as f:
        np.save(f, np.ascontiguousarray(array), allow_pickle=False)
    return file_entry(path)


_TOKEN_FILES = ("train_tokens", "train_offsets", "eval_tokens", "eval_offsets", "separator")


def token_cache_dir(corpus: Corpus, tokenizer: Tokenizer) -> Path:
    """<data_dir>/tokens/<corpus hash>-<tokenizer hash>: where ``encode_corpus`` caches this pair's ids."""
    # Keyed by (corpus, tokenizer) so a run with a trained BPE starts in seconds instead of re-encoding.
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
            path = directory / f"{name}.npy"
            if not matches(path, manifest["files"][name]):
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
    """(train, eval) token ids, cached under <data_dir>/tokens/<corpus hash>-<tokenizer hash>/; the byte
    tokenizer and a corpus without ``data_dir`` are encoded in memory (no faster from disk)."""
    if corpus.data_dir is None or isinstance(tokenizer, ByteTokenizer):
        return EncodedDocs.encode(corpus.train_docs, tokenizer), EncodedDocs.encode(corpus.eval_docs, tokenizer)
    directory = token_cache_dir(corpus, tokenizer)
    try:
        return built_once(directory, "these token ids", lambda: _read_token_cache(directory),
                          lambda: _write_token_cache(directory, corpus, tokenizer))
    except ReadOnlyCacheError:  # token ids are only a cache: a read-only one costs an encoding in memory
        note(f"the token cache {directory.parent} cannot be written: encoding {corpus.name} in memory")
        return EncodedDocs.encode(corpus.train_docs, tokenizer), EncodedDocs.encode(corpus.eval_docs, tokenizer)


def _write_token_cache(directory: Path, corpus: Corpus, tokenizer: Tokenizer) -> None:
    """Encode the corpus and write its token ids and manifest (the manifest last)."""
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
    atomic_write(directory / "manifest.json", (json.dumps(manifest, indent=1) + "\n").encode())
