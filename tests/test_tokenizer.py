"""Tokenizers: the byte-level BPE (trained on train docs only, exact round trip, cached) and the token cache."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from eagerloco import data
from eagerloco.data import (
    BPETokenizer,
    ByteTokenizer,
    Corpus,
    bpe_key,
    encode_corpus,
    eval_batches,
    get_tokenizer,
    tokenizer,
    worker_streams,
)

VOCAB = 600
SECRET = "zqxvkwjq"  # appears only in the eval documents


def word_soup(seed: int, n_docs: int, words_per_doc: int = 400) -> list[str]:
    """Documents of pseudo-words with a Zipf-like frequency: enough repeated pairs for a few hundred merges."""
    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgk"
    lexicon = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(1500)]
    weights = [1 / (i + 1) for i in range(len(lexicon))]
    docs = []
    for _ in range(n_docs):
        words = rng.choices(lexicon, weights, k=words_per_doc)
        lines = [" ".join(words[i : i + 12]).capitalize() + "." for i in range(0, len(words), 12)]
        docs.append("\n".join(lines) + "\n")
    return docs


def make_corpus(data_dir: Path | None, train: list[str] | None = None, eval_docs: list[str] | None = None) -> Corpus:
    train = word_soup(0, 40) if train is None else train
    eval_docs = [f"The {SECRET} met a {SECRET} by the {SECRET}.\n" * 60] * 2 if eval_docs is None else eval_docs
    return Corpus(
        train_docs=train,
        eval_docs=eval_docs,
        name="soup",
        train_names=[f"t{i}" for i in range(len(train))],
        eval_names=[f"e{i}" for i in range(len(eval_docs))],
        data_dir=data_dir,
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Corpus, BPETokenizer]:
    root = tmp_path_factory.mktemp("tok")
    corpus = make_corpus(root)
    tok = get_tokenizer(f"bpe:{VOCAB}", corpus)
    assert isinstance(tok, BPETokenizer)
    return corpus, tok


def forbid_training(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the BPE must come from the cache, not be trained again")

    monkeypatch.setattr(tokenizer, "train_bpe", fail)


# ---------------------------------------------------------------------------------- names


def test_tokenizer_names() -> None:
    assert isinstance(get_tokenizer("byte"), ByteTokenizer) and isinstance(data.get_tokenizer(), ByteTokenizer)
    assert tokenizer.parse_tokenizer_name("bpe") == ("bpe", 8192)
    assert tokenizer.parse_tokenizer_name("bpe:4096") == ("bpe", 4096)
    for bad in ("bpe:100", "bpe:x", "wordpiece"):
        with pytest.raises(ValueError, match="bpe"):
            get_tokenizer(bad)
    with pytest.raises(ValueError, match="corpus="):
        get_tokenizer("bpe")


# ---------------------------------------------------------------------------------- BPE


def test_bpe_vocab_size_and_exact_round_trip(trained: tuple[Corpus, BPETokenizer]) -> None:
    corpus, tok = trained
    assert tok.vocab_size == VOCAB
    ids = tok.encode(corpus.train_docs[0])
    assert max(ids) < VOCAB and len(ids) < len(corpus.train_docs[0]) / 2  # merges learnt: < 2 bytes a token
    for text in [
        corpus.train_docs[3],
        "  leading spaces, trailing tabs\t\t\nCRLF line\r\nand a blank line\n\n",
        "Ünïcödé — “quotes”, 中文, emoji 🙂👍🏽, combining é, NUL \x00 and \x7f",
        "",
        " ",
    ]:
        assert tok.decode(tok.encode(text)) == text
    assert isinstance(tok, tokenizer.Tokenizer)


def test_bpe_is_learnt_from_train_docs_only(trained: tuple[Corpus, BPETokenizer], tmp_path: Path) -> None:
    corpus, tok = trained
    assert len(tok.encode(" " + SECRET)) > 2  # frequent in eval text, unseen by training: no merge for it
    leaky = make_corpus(tmp_path, train=corpus.train_docs + corpus.eval_docs)
    assert len(get_tokenizer(f"bpe:{VOCAB}", leaky).encode(" " + SECRET)) == 1  # same text in train: one token


def test_bpe_key_depends_on_train_docs_not_eval_docs(
    trained: tuple[Corpus, BPETokenizer], monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus, tok = trained
    key = bpe_key(corpus.train_docs, VOCAB)
    assert bpe_key(corpus.train_docs[:-1], VOCAB) != key
    assert bpe_key(corpus.train_docs[:-1] + [corpus.train_docs[-1] + "!"], VOCAB) != key
    assert bpe_key(corpus.train_docs, VOCAB + 1) != key
    forbid_training(monkeypatch)
    other_eval = make_corpus(corpus.data_dir, train=corpus.train_docs, eval_docs=["entirely different\n"] * 3)
    assert get_tokenizer(f"bpe:{VOCAB}", other_eval).fingerprint == tok.fingerprint


def test_bpe_cache_hit_and_damaged_file(
    trained: tuple[Corpus, BPETokenizer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus, tok = trained
    files = sorted((corpus.data_dir / "tokenizers").glob(f"bpe-{VOCAB}-*.json"))
    model_file = next(f for f in files if not f.name.endswith(".meta.json"))
    meta = json.loads(model_file.with_suffix(".meta.json").read_text())
    assert meta["train_docs"] == len(corpus.train_docs) and meta["vocab_size"] == VOCAB
    with monkeypatch.context() as m:
        forbid_training(m)
        again = get_tokenizer(f"bpe:{VOCAB}", corpus)
        assert again.fingerprint == tok.fingerprint and again.encode("hello there") == tok.encode("hello there")

    small = make_corpus(tmp_path, train=word_soup(1, 6, 200))
    trained_calls: list[int] = []
    real = tokenizer.train_bpe

    def counting(docs: list[str], vocab: int) -> Any:
        trained_calls.append(vocab)
        return real(docs, vocab)

    monkeypatch.setattr(tokenizer, "train_bpe", counting)
    first = get_tokenizer("bpe:300", small)
    path = next(p for p in (tmp_path / "tokenizers").glob("bpe-300-*.json") if not p.name.endswith(".meta.json"))
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b'"merges"', b'"mergez"', 1))  # same size, still JSON: only the checksum tells
    rebuilt = get_tokenizer("bpe:300", small)
    assert trained_calls == [300, 300] and rebuilt.fingerprint == first.fingerprint
    assert path.read_bytes() == raw


# ---------------------------------------------------------------------------------- token cache


def test_token_cache_memory_maps_on_second_call(trained: tuple[Corpus, BPETokenizer], monkeypatch) -> None:
    corpus, tok = trained
    train, ev = encode_corpus(corpus, tok)
    assert train.tokens.dtype == np.uint16 and len(train) == len(corpus.train_docs) and len(ev) == 2
    assert train.doc(5).tolist() == tok.encode(corpus.train_docs[5])
    assert tok.decode(ev.join().tolist()) == data.DOC_SEPARATOR.join(corpus.eval_docs)

    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the second call must not encode")

    monkeypatch.setattr(tok, "encode_batch", fail)
    monkeypatch.setattr(tok, "encode", fail)
    train2, ev2 = encode_corpus(corpus, tok)
    assert isinstance(train2.tokens, np.memmap) and isinstance(ev2.tokens, np.memmap)
    assert np.array_equal(train2.tokens, train.tokens) and np.array_equal(train2.offsets, train.offsets)
    streams = worker_streams(corpus, tok, workers=2, batch_size=3, seq_len=32, seed=0)
    x, y = streams[0].next_batch()
    assert x.shape == (3, 32) and int(x.max()) < VOCAB and torch.equal(x[:, 1:], y[:, :-1])
    assert streams[0].tokens.dtype == torch.uint16
    assert len(eval_batches(corpus, tok, seq_len=32, batch_size=2, max_batches=3)) == 3


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest"])
def test_damaged_token_cache_is_rebuilt(
    trained: tuple[Corpus, BPETokenizer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    _, tok = trained
    corpus = make_corpus(tmp_path, train=word_soup(2, 8, 300))
    good = encode_corpus(corpus, tok)[0].tokens.copy()
    directory = data.tokens.token_cache_dir(corpus, tok)
    victim = directory / "train_tokens.npy"
    raw = bytearray(victim.read_bytes())
    if damage == "flip":
        raw[-7] ^= 0x01  # one token id changed, same size: the sha256 catches it
        victim.write_bytes(bytes(raw))
    elif damage == "truncate":
        victim.write_bytes(bytes(raw[:-10]))
    else:
        (directory / "manifest.json").write_text("{not json")
    damaged = victim.read_bytes() if damage != "manifest" else b""
    calls: list[int] = []
    real = tok.encode_batch

    def counting(texts: list[str]) -> list[list[int]]:
        calls.append(len(texts))
        return real(texts)

    monkeypatch.setattr(tok, "encode_batch", counting)
    rebuilt = encode_corpus(corpus, tok)[0].tokens
    assert calls == [8, 2]  # train and eval encoded again
    assert np.array_equal(rebuilt, good) and victim.read_bytes() != damaged
    encode_corpus(corpus, tok)
    assert calls == [8, 2]  # and the rebuilt cache is used


def test_token_cache_keyed_by_tokenizer(trained: tuple[Corpus, BPETokenizer], tmp_path: Path) -> None:
    _, tok = trained
    corpus = make_corpus(tmp_path, train=word_soup(3, 6, 200))
    other = get_tokenizer("bpe:300", corpus)
    encode_corpus(corpus, tok)
    encode_corpus(corpus, other)
    assert len(list((tmp_path / "tokens").iterdir())) == 2
    assert encode_corpus(corpus, other)[0].tokens.max() < 300
    assert not (tmp_path / "tokens").joinpath("x").exists()
    byte_train, _ = encode_corpus(corpus, ByteTokenizer())  # bytes are never written to disk
    assert len(list((tmp_path / "tokens").iterdir())) == 2 and byte_train.tokens.dtype == np.uint8
