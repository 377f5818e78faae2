"""Real text for training: Brown, the King James Bible, Austen, Hugging Face datasets or the user's own.

Sources are fetched once into a verified cache (``default_data_dir``), split into whole train / eval
documents (``load_corpus``), tokenized (``get_tokenizer``, ``encode_corpus``) and cut into one
independent, resumable stream per worker (``worker_streams``) plus fixed ``eval_batches``.
"""

from eagerloco.data.austen import austen_chapters, fetch_austen, read_lazyload_db
from eagerloco.data.brown import detag, fetch_brown
from eagerloco.data.cache import BUILTIN_SOURCES, DataError, default_data_dir
from eagerloco.data.corpus import SINGLE_FILE_PIECES, Corpus, fetch_source, load_corpus
from eagerloco.data.kjv import fetch_kjv, parse_kjv
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
    "BUILTIN_SOURCES",
    "ByteTokenizer",
    "Corpus",
    "DOC_SEPARATOR",
    "DataError",
    "EncodedDocs",
    "SINGLE_FILE_PIECES",
    "TOKENIZER_NAMES",
    "TokenStream",
    "Tokenizer",
    "austen_chapters",
    "bpe_key",
    "default_data_dir",
    "detag",
    "encode_corpus",
    "encode_docs",
    "eval_batches",
    "fetch_austen",
    "fetch_brown",
    "fetch_kjv",
    "fetch_source",
    "get_tokenizer",
    "load_corpus",
    "parse_kjv",
    "parse_tokenizer_name",
    "read_lazyload_db",
    "stream_seed",
    "worker_streams",
]
