"""Bytes on the wire of each exchange format, without importing torch.

The codecs in :mod:`eagerloco.codecs` pack exactly this many bytes (values, then one bfloat16 scale
per block for the block-scaled formats); the simulator and any planning code use these numbers so
that they start without torch.
"""

from __future__ import annotations

import math

#: Bits per value of every codec, in the order the CLI lists them.
CODEC_BITS: dict[str, int] = {
    "fp32": 32,
    "bf16": 16,
    "fp8": 8,
    "e2m1": 4,
    "e3m0": 4,
    "int8": 8,
    "int4": 4,
}

CODEC_NAMES: tuple[str, ...] = tuple(CODEC_BITS)

#: Codecs that store one scale per block of values (all formats below 16 bits).
BLOCK_SCALED: frozenset[str] = frozenset(name for name, bits in CODEC_BITS.items() if bits < 16)

SCALE_BYTES = 2  # every block format stores one bfloat16 scale per block
DEFAULT_BLOCK_SIZE = 32  # values per scale block unless --codec-block says otherwise


def packed_nbytes(codec: str, numel: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes of one packed payload of numel values in the named codec.

    Args:
        codec: one of :data:`CODEC_NAMES`.
        numel: number of values encoded (>= 0).
        block_size: values per scale block (block-scaled codecs only; >= 1).

    Returns:
        ceil(numel * bits / 8), plus SCALE_BYTES per block of block_size values for block formats.

    Raises:
        ValueError: unknown codec, negative numel or block_size below 1.
    """
    if codec not in CODEC_BITS:
        raise ValueError(f"unknown codec {codec!r}; choose one of: {', '.join(CODEC_NAMES)}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    body = -(-numel * CODEC_BITS[codec] // 8)
    if codec not in BLOCK_SCALED:
        return body
    return body + math.ceil(numel / block_size) * SCALE_BYTES
