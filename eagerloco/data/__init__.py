"""Real text for training: named corpora, Hugging Face datasets or the user's own text files.

Sources are loaded into a verified cache (``default_data_dir``), split into whole train / eval
documents (``load_corpus``), tokenized (``get_tokenizer``, ``encode_corpus``) and cut into one
independent, resumable stream per worker (``worker_streams``) plus fixed ``eval_batches``. A named
corpus is whatever is registered under ``CORPORA_GROUP`` (``named_corpora``): eagerloco's lab
registers Brown, the King James Bible and Austen, and fetches them.
"""

from eagerloco.data.cache import DataError, default_data_dir
from eagerloco.data.corpus import (
    CORPORA_GROUP,
    SINGLE_FILE_PIECES,
    Corpus,
    Loader,
    load_corpus,
    named_corpora,
    split_sources,
)
from eagerloco.data.streams import TokenStream, eval_batches, stream_seed, worker_streams
from eagerloco.data.tokenizer import (
    TOKENIZER_NAMES,
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    bpe_key,
    get_tokenizer,
    parse_tokenizer_name,
)
from eagerloco.data.tokens import DOC_SEPARATOR, EncodedDocs, encode_corpus, encode_docs

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "CORPORA_GROUP",
    "Corpus",
    "DOC_SEPARATOR",
    "DataError",
    "EncodedDocs",
    "Loader",
    "SINGLE_FILE_PIECES",
    "TOKENIZER_NAMES",
    "TokenStream",
    "Tokenizer",
    "bpe_key",
    "default_data_dir",
    "encode_corpus",
    "encode_docs",
    "eval_batches",
    "get_tokenizer",
    "load_corpus",
    "named_corpora",
    "parse_tokenizer_name",
    "split_sources",
    "stream_seed",
    "worker_streams",
]
