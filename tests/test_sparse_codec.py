"""The sparse exchange's payload (top-k of every chunk, packed positions) and the 2-bit values: sizes
against the formula, the kept entries, exact round trips on the grid."""

from __future__ import annotations

import math

import pytest
import torch

from eagerloco.codec_sizes import chunk_position_bits, sparse_nbytes
from eagerloco.codecs import TopKCodec, get_codec
from eagerloco.codecs.sparse import pack_bits, unpack_bits

CASES = [(4096, 64, 10_000), (4096, 1024, 9_000), (16, 4, 37), (16, 16, 35), (8, 3, 1), (5, 1, 11), (1, 1, 7),
         (100, 7, 1000), (3, 2, 3)]


def _formula(values_codec: str, n: int, c: int, k: int, block: int = 32) -> int:
    """The documented size, written out: kept values in the codec, then each chunk's positions."""
    lengths = [c] * (n // c) + ([n % c] if n % c else [])
    kept = sum(min(k, L) for L in lengths)
    bits_per_value = {"fp32": 32, "2bit": 2, "e2m1": 4, "int8": 8}[values_codec]
    values = math.ceil(kept * bits_per_value / 8) + (0 if values_codec == "fp32" else 2 * math.ceil(kept / block))
    positions = sum(min(min(k, L) * math.ceil(math.log2(L)) if L > 1 else 0, L) for L in lengths)
    return values + math.ceil(positions / 8)


@pytest.mark.parametrize("values", ["fp32", "2bit", "e2m1", "int8"])
@pytest.mark.parametrize(("c", "k", "n"), CASES)
def test_packed_size_is_the_formula_and_the_payload_that_size(values: str, c: int, k: int, n: int) -> None:
    codec = get_codec(values, topk=k, chunk=c)
    assert isinstance(codec, TopKCodec)
    assert codec.packed_nbytes(n) == sparse_nbytes(values, n, c, k) == _formula(values, n, c, k)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    assert codec.pack(x).numel() == codec.packed_nbytes(n)


def test_positions_take_indices_or_a_mask_whichever_is_smaller() -> None:
    assert chunk_position_bits(4096, 64) == 64 * 12  # indices
    assert chunk_position_bits(4096, 1024) == 4096  # 12 * 1024 bits of indices would be more: the mask
    assert chunk_position_bits(4096, 341) == 4092 and chunk_position_bits(4096, 342) == 4096
    assert chunk_position_bits(5, 1) == 3 and chunk_position_bits(1, 1) == 0
    # SparseLoCo's 64 of 4096 in 2 bits with a scale per 32 kept values: 141x fewer bytes than FP32.
    assert 32 / (8 * sparse_nbytes("2bit", 4096 * 1024, 4096, 64) / (4096 * 1024)) == pytest.approx(141.2, abs=0.1)


@pytest.mark.parametrize(("c", "k", "n"), CASES)
def test_keeps_at_most_k_a_chunk_at_the_largest_magnitudes(c: int, k: int, n: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(7 + n))
    y = get_codec("fp32", topk=k, chunk=c).unpack(get_codec("fp32", topk=k, chunk=c).pack(x), n)
    for start in range(0, n, c):
        xs, ys = x[start:start + c], y[start:start + c]
        kept = ys != 0
        assert int(kept.sum()) == min(k, xs.numel())
        assert torch.equal(ys[kept], xs[kept])  # FP32 values: sent as they are
        if kept.sum() < xs.numel():
            assert xs[kept].abs().min() >= xs[~kept].abs().max()


def test_ties_go_to_the_lower_index() -> None:
    x = torch.tensor([1.0, -2.0, 2.0, 2.0, -2.0, 0.5, 3.0, 2.0])
    y = get_codec("fp32", topk=3, chunk=8).unpack(get_codec("fp32", topk=3, chunk=8).pack(x), 8)
    assert y.tolist() == [0.0, -2.0, 2.0, 0.0, 0.0, 0.0, 3.0, 0.0]


@pytest.mark.parametrize("values", ["fp32", "2bit", "e2m1"])
@pytest.mark.parametrize(("c", "k", "n"), CASES)
def test_values_already_on_the_grid_decode_to_themselves(values: str, c: int, k: int, n: int) -> None:
    codec = get_codec(values, topk=k, chunk=c)
    x = torch.randn(n, generator=torch.Generator().manual_seed(3 * n))
    on_grid = codec.unpack(codec.pack(x), n)
    again = codec.unpack(codec.pack(on_grid), n)
    assert torch.equal(again, on_grid)
    assert codec.pack(on_grid).equal(codec.pack(again))


def test_two_bit_values_are_sign_and_half_or_whole_scale() -> None:
    codec = get_codec("2bit", block_size=4)
    x = torch.tensor([1.0, 0.74, -0.76, 0.0, -3.0, 2.0, 1.0, -1.6])
    y = codec.unpack(codec.pack(x), 8)
    # Block 1: scale 1 (absmax 1, a bfloat16): |q| >= 3/4 to 1, below (zero included) to 1/2.
    assert y[:4].tolist() == [1.0, 0.5, -1.0, 0.5]
    # Block 2: scale 3: 2/3 and 1/3 go to 1/2 of it, 1.6/3 too.
    assert y[4:].tolist() == [-3.0, 1.5, 1.5, -1.5]
    assert codec.packed_nbytes(8) == 2 + 2 * 2  # four codes a byte, one bfloat16 scale a block
    assert get_codec("2bit").unpack(get_codec("2bit").pack(torch.zeros(5)), 5).eq(0).all()


def test_two_bit_stochastic_rounding_is_unbiased_between_half_and_whole() -> None:
    codec = get_codec("2bit", block_size=2, stochastic=True)
    x = torch.tensor([1.0, 0.6] * 20_000)
    y = codec.unpack(codec.pack(x, torch.Generator().manual_seed(0)), x.numel())
    assert y[1::2].mean().item() == pytest.approx(0.6, abs=0.005)


def test_bit_streams_round_trip() -> None:
    bits = torch.tensor([1, 0, 1, 1, 0, 0, 0, 1, 1, 1], dtype=torch.uint8)
    packed = pack_bits(bits)
    assert packed.tolist() == [0b10001101, 0b11]
    assert unpack_bits(packed, 10).tolist() == bits.bool().tolist()


def test_invalid_k_is_refused() -> None:
    with pytest.raises(ValueError, match="1 <= k <= chunk"):
        get_codec("2bit", topk=65, chunk=64)
