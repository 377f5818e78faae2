"""Real text for training: named corpora (registered under ``CORPORA_GROUP``), Hugging Face datasets or the
user's own text files; cached and verified, split into whole train / eval documents, tokenized and cut
into one resumable stream per worker plus fixed eval batches."""

from eagerloco.data.cache import DataError, default_data_dir
from eagerloco.data.corpus import (
    CORPORA_GROUP,
    SINGLE_FILE_PIECES,
    Corpus,
    load_corpus,
    named_corpora,
    split_sources,
)
from eagerloco.data.streams import TokenStream, eval_batches, worker_streams
from eagerloco.data.tokenizer import BPETokenizer, ByteTokenizer, bpe_key, get_tokenizer
from eagerloco.data.tokens import DOC_SEPARATOR, encode_corpus, encode_docs

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "CORPORA_GROUP",
    "Corpus",
    "DOC_SEPARATOR",
    "DataError",
    "SINGLE_FILE_PIECES",
    "TokenStream",
    "bpe_key",
    "default_data_dir",
    "encode_corpus",
    "encode_docs",
    "eval_batches",
    "get_tokenizer",
    "load_corpus",
    "named_corpora",
    "split_sources",
    "worker_streams",
]
