"""Bytes on the wire of each exchange format, without importing torch: the codecs pack exactly these, and
the simulator and planning code start without torch."""

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
    "2bit": 2,
}

CODEC_NAMES: tuple[str, ...] = tuple(CODEC_BITS)

#: Codecs that store one scale per block of values (all formats below 16 bits).
BLOCK_SCALED: frozenset[str] = frozenset(name for name, bits in CODEC_BITS.items() if bits < 16)

SCALE_BYTES = 2  # every block format stores one bfloat16 scale per block
DEFAULT_BLOCK_SIZE = 32  # values per scale block unless --codec-block says otherwise


def packed_nbytes(codec: str, numel: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes of one packed payload: ceil(numel * bits / 8), plus SCALE_BYTES per block for block formats."""
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


def shard_numel(numel: int, workers: int, align: int = 1) -> int:
    """Values in each of ``workers`` equal shards of numel values: rounded up to a multiple of ``align`` (a scale
    block, so each shard quantizes as its part of the whole); the last shard is padded with zeros."""
    blocks = -(-numel // align)
    return -(-blocks // max(workers, 1)) * align


def shard_align(codec: str, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """What a reduce-scatter's shards of the named codec are a multiple of: its scale block, or 1."""
    return block_size if codec in BLOCK_SCALED else 1


def reduce_scatter_wire_bytes(codec: str, numel: int, workers: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes one worker sends for one reduce-scatter exchange: M-1 quantized shards, then its requantized shard
    to the M-1 others; about two payloads whatever M, 0 alone."""
    if workers <= 1:
        return 0
    shard = shard_numel(numel, workers, shard_align(codec, block_size))
    return 2 * (workers - 1) * packed_nbytes(codec, shard, block_size)


def chunk_position_bits(length: int, k: int) -> int:
    """Bits that say which k of a chunk's ``length`` values a sparse payload keeps: k indices of ceil(log2 length)
    bits, or a mask of length bits, whichever is smaller (the mask on a tie)."""
    index_bits = (length - 1).bit_length()  # ceil(log2 length): 0 for a chunk of one value
    return min(k * index_bits, length)


def sparse_nbytes(codec: str, numel: int, chunk: int, k: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes of one sparse (top-k) payload: the kept values (min(k, length) per chunk) as one payload of ``codec``,
    then every chunk's :func:`chunk_position_bits` as one bit stream padded to a byte."""
    kept, position_bytes = sparse_counts(numel, chunk, k)
    return packed_nbytes(codec, kept, block_size) + position_bytes


def sparse_counts(numel: int, chunk: int, k: int) -> tuple[int, int]:
    """How many values a sparse payload keeps and the bytes of their positions (the codec-free parts)."""
    if chunk < 1 or k < 1:
        raise ValueError(f"chunk and k must be >= 1, got chunk={chunk}, k={k}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    full, last = divmod(numel, chunk)
    kept = full * min(k, chunk) + min(k, last)
    bits = full * chunk_position_bits(chunk, min(k, chunk)) + (chunk_position_bits(last, min(k, last)) if last else 0)
    return kept, -(-bits // 8)

