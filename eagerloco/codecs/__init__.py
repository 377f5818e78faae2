"""Formats of the outer gradient on the wire, with real packed payloads: dense low-precision codecs
(:mod:`eagerloco.codecs.dense`) and the sparse top-k exchange (:mod:`eagerloco.codecs.sparse`).
"""

from __future__ import annotations

from eagerloco.codec_sizes import CODEC_NAMES
from eagerloco.codecs.dense import (
    Bf16Codec,
    Codec,
    E2m1Codec,
    E3m0Codec,
    Fp8Codec,
    Fp32Codec,
    Int4Codec,
    Int8Codec,
    TwoBitCodec,
    dense_codec,
)
from eagerloco.codecs.sparse import SharedSupportCodec, TopKCodec


def get_codec(name: str, block_size: int = 32, stochastic: bool = False, *, topk: int | None = None,
              chunk: int = 4096, shared: bool = False) -> Codec:
    """The exchange's codec: the dense codec called name, or, with ``topk``, the sparse exchange keeping
    that many values of every chunk of ``chunk`` values, in that dense codec.

    Args:
        name: one of :data:`CODEC_NAMES` (the values' format).
        block_size: values sharing one scale in the block formats (validated even where unused).
        stochastic: stochastic instead of nearest rounding.
        topk: values kept per chunk (None: every value is sent).
        chunk: values per chunk of the sparse exchange.
        shared: with ``topk``, keep positions every worker draws alike per step, sent without them
            (:class:`SharedSupportCodec`), instead of the largest.

    Raises:
        ValueError: an unknown name, a block size below 1, or k outside 1..chunk.
    """
    dense = dense_codec(name, block_size, stochastic)
    if topk is None:
        return dense
    return SharedSupportCodec(dense, chunk, topk) if shared else TopKCodec(dense, chunk, topk)


__all__ = ["CODEC_NAMES", "Bf16Codec", "Codec", "E2m1Codec", "E3m0Codec", "Fp32Codec", "Fp8Codec", "Int4Codec",
           "Int8Codec", "SharedSupportCodec", "TopKCodec", "TwoBitCodec", "dense_codec", "get_codec"]
