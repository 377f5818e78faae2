"""Formats of the outer gradient on the wire, with real packed payloads: dense and sparse codecs."""

from __future__ import annotations

from eagerloco.codec_sizes import CODEC_NAMES
from eagerloco.codecs.dense import Codec, Fp32Codec, dense_codec
from eagerloco.codecs.sparse import SharedSupportCodec, TopKCodec


def get_codec(name: str, block_size: int = 32, stochastic: bool = False, *, topk: int | None = None,
              chunk: int = 4096, shared: bool = False, guided: float = 0.0) -> Codec:
    """The exchange's codec: the dense codec ``name``, or with ``topk`` the sparse exchange keeping that many values
    of every chunk of ``chunk`` (``shared``: at positions chosen alike, :class:`SharedSupportCodec`, ``guided`` of
    them from the last mean), in that codec."""
    dense = dense_codec(name, block_size, stochastic)
    if topk is None:
        return dense
    return SharedSupportCodec(dense, chunk, topk, guided=guided) if shared else TopKCodec(dense, chunk, topk)


__all__ = ["CODEC_NAMES", "Codec", "Fp32Codec", "SharedSupportCodec", "TopKCodec", "dense_codec", "get_codec"]
