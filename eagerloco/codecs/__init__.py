"""Formats of the outer gradient on the wire, with real packed payloads: dense low-precision codecs
(:mod:`eagerloco.codecs.dense`).
"""

from eagerloco.codecs.dense import (
    CODEC_NAMES,
    Bf16Codec,
    Codec,
    E2m1Codec,
    E3m0Codec,
    Fp8Codec,
    Fp32Codec,
    Int4Codec,
    Int8Codec,
    get_codec,
)

__all__ = ["CODEC_NAMES", "Bf16Codec", "Codec", "E2m1Codec", "E3m0Codec", "Fp32Codec", "Fp8Codec", "Int4Codec",
           "Int8Codec", "get_codec"]
