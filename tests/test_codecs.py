"""Tests of the exchange codecs: grids, rounding, byte counts, stochastic rounding, FP32 sums.

The reference below is deliberately independent of the implementation: the grids are written out
by hand (fp8's comes from PyTorch's own float8_e4m3fn decoding) and nearest rounding is a
brute-force search over the grid.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eagerloco.codecs import CODEC_NAMES, Codec, get_codec
from eagerloco.comm.base import encode, mean_of_payloads

BLOCK_FORMATS = ("fp8", "e2m1", "e3m0", "int8", "int4")
#: Every format with a scale per block: the nearest-level ones above and 2bit (sign and 1/2 or 1, no zero).
SCALED_FORMATS = (*BLOCK_FORMATS, "2bit")
BITS = {"fp32": 32, "bf16": 16, "fp8": 8, "e2m1": 4, "e3m0": 4, "int8": 8, "int4": 4, "2bit": 2}
SCALE_BYTES = 2  # one bfloat16 scale per block


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """The tensors here are small: intra-op threads only add synchronization, which costs dearly
    when the cores are busy elsewhere. Restored afterwards so other test files are unaffected."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _fp8_levels() -> list[float]:
    codes = torch.arange(0, 127, dtype=torch.uint8)  # 0x7F is NaN in e4m3fn
    return codes.view(torch.float8_e4m3fn).to(torch.float32).tolist()


# Non-negative magnitudes of each block format, relative to the block scale, ascending.
LEVELS: dict[str, torch.Tensor] = {
    name: torch.tensor(v, dtype=torch.float64)
    for name, v in {
        "e2m1": [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0],
        "e3m0": [0.0] + [2.0**k for k in range(-6, 1)],
        "int8": [float(k) for k in range(128)],
        "int4": [float(k) for k in range(8)],
        "fp8": _fp8_levels(),
    }.items()
}


def _heavy_tailed(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) / torch.rand(n, generator=g).clamp_min(1e-3)).mul_(1e-3)


def _normal(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * 1e-4


def _scales(codec: Codec, buf: torch.Tensor, n: int) -> torch.Tensor:
    """The per-element FP32 scale (each block's scale repeated over its values)."""
    return codec.block_scales(buf, n).repeat_interleave(codec.block_size)[:n]


def _neighbours(name: str, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grid points below-or-at and above-or-at |q| (clamped to the grid's top)."""
    levels = LEVELS[name]
    a = q.abs().double().clamp(max=levels[-1].item())
    hi = torch.searchsorted(levels, a, right=False)
    lo = torch.searchsorted(levels, a, right=True) - 1
    return levels[lo], levels[hi]


def _reference_nearest(name: str, q: torch.Tensor) -> torch.Tensor:
    """Nearest grid value to q (saturating); a tie goes to the neighbour that is an even multiple
    of the gap between the two neighbours (ties-to-even of the significand)."""
    lo, hi = _neighbours(name, q)
    a = q.abs().double().clamp(max=LEVELS[name][-1].item())
    gap = hi - lo
    pick = torch.where(a - lo < hi - a, lo, hi)
    tie = (a - lo == hi - a) & (gap > 0)
    even_lo = torch.remainder(lo / torch.where(gap > 0, gap, 1.0), 2) == 0
    pick = torch.where(tie, torch.where(even_lo, lo, hi), pick)
    return (pick * torch.sign(q.double())).float()


# ----------------------------------------------------------------------------- construction


def test_names_attributes_and_summability() -> None:
    assert CODEC_NAMES == ("fp32", "bf16", "fp8", "e2m1", "e3m0", "int8", "int4", "2bit")
    for name in CODEC_NAMES:
        c = get_codec(name, block_size=16, stochastic=True)
        assert (c.name, c.bits, c.block_size, c.stochastic) == (name, BITS[name], 16, True)
        assert c.summable is (name == "fp32")


def test_get_codec_rejects_unknown_names() -> None:
    with pytest.raises(ValueError) as info:
        get_codec("fp4")
    msg = str(info.value)
    assert "--codec" in msg and "'fp4'" in msg
    assert all(name in msg for name in CODEC_NAMES)


@pytest.mark.parametrize("bad", [0, -3, 2.5, "32", True, None])
def test_get_codec_rejects_bad_block_sizes(bad: object) -> None:
    with pytest.raises(ValueError, match="--codec-block must be a positive integer"):
        get_codec("e2m1", block_size=bad)  # type: ignore[arg-type]


def test_bad_inputs_are_rejected() -> None:
    c = get_codec("int4")
    with pytest.raises(ValueError, match="1-D"):
        c.pack(torch.zeros(4, 4))
    with pytest.raises(TypeError, match="floating-point"):
        c.pack(torch.zeros(4, dtype=torch.int64))
    buf = c.pack(torch.ones(40))
    with pytest.raises(ValueError, match="expected"):
        c.unpack(buf[:-1], 40)
    with pytest.raises(ValueError, match="expected"):
        c.unpack(buf, 41)


# ----------------------------------------------------------------------------- byte counts


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 1000, 1001])
def test_payload_length_is_the_closed_form(name: str, n: int) -> None:
    c = get_codec(name)
    buf = c.pack(_normal(n, n))
    blocks = math.ceil(n / 32) if name in SCALED_FORMATS else 0
    expected = math.ceil(n * BITS[name] / 8) + blocks * SCALE_BYTES
    assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous()
    assert buf.numel() == c.packed_nbytes(n) == expected
    assert c.unpack(buf, n).shape == (n,)


@pytest.mark.parametrize("name", BLOCK_FORMATS)
@pytest.mark.parametrize("block_size", [1, 7, 33, 1000])
def test_odd_block_sizes_across_internal_chunks(name: str, block_size: int) -> None:
    """Sizes spanning several internal chunks, odd blocks (nibbles straddle blocks), partial tail."""
    n = 70_001
    c = get_codec(name, block_size=block_size)
    x = _heavy_tailed(n, 3)
    buf = c.pack(x)
    assert buf.numel() == math.ceil(n * BITS[name] / 8) + math.ceil(n / block_size) * SCALE_BYTES
    s = _scales(c, buf, n)
    q = x / torch.where(s > 0, s, 1.0)
    assert torch.equal(c.unpack(buf, n), _reference_nearest(name, q) * s)


@pytest.mark.parametrize("name", BLOCK_FORMATS)
@pytest.mark.parametrize("stochastic", [False, True])
def test_a_block_longer_than_the_vector_is_the_vector(name: str, stochastic: bool) -> None:
    """A block longer than the values is encoded as long as the values, never padded to the block size (a
    block of 10**9 for 1000 values once allocated 4 GB a payload): the same bytes as a block of exactly them."""
    x = _heavy_tailed(1000, 5)
    short = get_codec(name, block_size=1000, stochastic=stochastic)
    huge = get_codec(name, block_size=10**9, stochastic=stochastic)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(huge.pack(x, g2), short.pack(x, g1))


# ----------------------------------------------------------------------------- exact grids


def _grid_vector(name: str, scale: float, block_size: int) -> torch.Tensor:
    """Every grid value of the format with both signs, times a power-of-two scale; each block holds
    the top of the grid so that the block scale is exactly `scale`."""
    levels = LEVELS[name].float()
    vals = torch.cat((levels, -levels))
    per = block_size - 1
    vals = torch.cat((vals, vals.new_zeros(-len(vals) % per))).view(-1, per)
    top = torch.full((vals.shape[0], 1), levels[-1].item())
    return (torch.cat((top, vals), dim=1).view(-1) * scale).contiguous()


@pytest.mark.parametrize("name", BLOCK_FORMATS)
@pytest.mark.parametrize("scale", [2.0**-30, 2.0**-7, 1.0, 2.0**20])
@pytest.mark.parametrize("block_size", [8, 32, 300])
def test_block_formats_are_exact_on_their_grid(name: str, scale: float, block_size: int) -> None:
    x = _grid_vector(name, scale, block_size)
    for stochastic in (False, True):  # grid values have nothing to round, in either mode
        c = get_codec(name, block_size=block_size, stochastic=stochastic)
        buf = c.pack(x, torch.Generator().manual_seed(0))
        assert torch.equal(c.block_scales(buf, x.numel()), torch.full((c.num_blocks(x.numel()),), scale))
        assert torch.equal(c.unpack(buf, x.numel()), x)


def test_fp32_is_lossless_and_bf16_exact_on_bf16_values() -> None:
    x = _heavy_tailed(1001, 0)
    x[:3] = torch.tensor([0.0, -1e-40, 3e38])  # zero, an FP32 subnormal, near the top of the range
    fp32 = get_codec("fp32")
    assert torch.equal(fp32.unpack(fp32.pack(x), x.numel()).view(torch.int32), x.view(torch.int32))
    xb = x.to(torch.bfloat16).float()
    for stochastic in (False, True):
        bf16 = get_codec("bf16", stochastic=stochastic)
        assert torch.equal(bf16.unpack(bf16.pack(xb), xb.numel()), xb)


def test_bit_layouts() -> None:
    """e2m1 codes are OCP MX FP4 nibbles (first value in the low nibble); fp8 codes are the bytes of
    PyTorch's float8_e4m3fn; int4 codes are two's complement nibbles."""
    e2m1 = get_codec("e2m1", block_size=4)
    buf = e2m1.pack(torch.tensor([6.0, -0.5, 0.0, 3.0]))
    assert buf[:2].tolist() == [0x80, 0x3F]  # scale 1.0 as bfloat16 (0x3F80), little-endian
    assert buf[2:].tolist() == [0x7 | 0x9 << 4, 0x0 | 0x5 << 4]
    int4 = get_codec("int4", block_size=3)
    assert int4.pack(torch.tensor([7.0, -7.0, -1.0]))[2:].tolist() == [0x7 | 0x9 << 4, 0xF]
    fp8 = get_codec("fp8", block_size=4096)
    x = _heavy_tailed(4096, 1)
    buf = fp8.pack(x)
    s = fp8.block_scales(buf, x.numel())
    expected = (x / s).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(buf[SCALE_BYTES:], expected)


# ----------------------------------------------------------------------------- nearest rounding


@pytest.mark.parametrize("name", BLOCK_FORMATS)
@pytest.mark.parametrize("data", [_normal, _heavy_tailed])
def test_nearest_matches_brute_force_and_error_bound(name: str, data: Callable[[int, int], torch.Tensor]) -> None:
    """Each decoded value is the nearest grid point, so |x - x_hat| <= gap(q) / 2 * s, where s is the
    block scale, q = x / s and gap(q) is the spacing of the grid around |q|: e2m1 0.5 below 2, 1 up to
    4, 2 up to 6; e3m0 2^-6 below 2^-6, then 2^k in [2^k, 2^(k+1)); int 1; fp8 2^(max(e, -6) - 3) for
    e = floor(log2 |q|). The scale maps the block absmax to the top of the grid, rounded up to
    bfloat16 (at most 2^-7 above), so nothing saturates."""
    n = 4099
    x = data(n, 11)
    c = get_codec(name, block_size=32)
    buf = c.pack(x)
    y = c.unpack(buf, n)
    s = _scales(c, buf, n)
    q = x / s
    assert torch.equal(y, _reference_nearest(name, q) * s)

    lo, hi = _neighbours(name, q)
    bound = ((hi - lo) / 2 * s.double() + x.abs().double() * 2.0**-22).float()
    assert bool(((y - x).abs() <= bound).all())
    assert bool(((y - x).abs() <= LEVELS[name].diff().max() / 2 * s * (1 + 2.0**-14)).all())

    amax = x[: n // 32 * 32].abs().view(-1, 32).amax(1)
    exact = amax / LEVELS[name][-1].item()
    scales = c.block_scales(buf, n)[: n // 32]
    assert bool((scales >= exact).all()) and bool((scales <= exact * (1 + 2.0**-7)).all())


def test_ties_go_to_even() -> None:
    e2m1 = get_codec("e2m1", block_size=9)
    x = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0])
    assert e2m1.unpack(e2m1.pack(x), 9).tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0]
    int4 = get_codec("int4", block_size=5)
    x = torch.tensor([7.0, 0.5, 1.5, 2.5, -6.5])
    assert int4.unpack(int4.pack(x), 5).tolist() == [7.0, 0.0, 2.0, 2.0, -6.0]
    e3m0 = get_codec("e3m0", block_size=4)  # no mantissa: ties between powers of two go up
    x = torch.tensor([1.0, 0.75, 2.0**-7, 1.5 * 2.0**-4])
    assert e3m0.unpack(e3m0.pack(x), 4).tolist() == [1.0, 1.0, 0.0, 2.0**-3]


def test_bf16_nearest_and_saturation() -> None:
    x = _heavy_tailed(1000, 4)
    c = get_codec("bf16")
    y = c.unpack(c.pack(x), x.numel())
    assert torch.equal(y, x.to(torch.bfloat16).float())
    assert bool(((y - x).abs() <= x.abs() * 2.0**-8).all())  # half an ulp: unit roundoff 2^-8
    big = torch.tensor([3.4e38, -3.4e38])
    for stochastic in (False, True):
        c = get_codec("bf16", stochastic=stochastic)
        out = c.unpack(c.pack(big, torch.Generator().manual_seed(0)), 2)
        assert bool(torch.isfinite(out).all()) and out[0] > 3.3e38


@pytest.mark.parametrize("name", BLOCK_FORMATS)
@pytest.mark.parametrize("stochastic", [False, True])
def test_zero_tiny_and_huge_blocks(name: str, stochastic: bool) -> None:
    """All-zero blocks decode to exact zeros with no NaN; FP32 subnormals and values near the top of
    the FP32 range neither vanish, overflow nor saturate to NaN."""
    c = get_codec(name, block_size=4, stochastic=stochastic)
    assert torch.equal(c.unpack(c.pack(torch.zeros(9)), 9), torch.zeros(9))
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, 1e-40, -3e-41, 0.0, 1e-45, 3.4e38, -2e38, 0.0, 2.0, 1e-3])
    y = c.unpack(c.pack(x, torch.Generator().manual_seed(0)), x.numel())
    assert bool(torch.isfinite(y).all())
    assert torch.equal(y[:4], torch.zeros(4))
    assert y[4] > 0 and y[8] > 3e38 and y[9] < -1e38
    assert (y[8] - x[8]).abs() <= 3.4e38 * 2.0**-7


# ----------------------------------------------------------------------------- stochastic rounding


@pytest.mark.parametrize("name", ["bf16", *BLOCK_FORMATS])
def test_stochastic_rounding_is_unbiased(name: str) -> None:
    """Each draw lands on one of the two grid neighbours lo <= |x| <= hi, on hi with probability
    p = (|x| - lo) / (hi - lo) if unbiased, so a draw has variance p (1 - p) gap^2. With K draws:
    every element's mean is within 6 sigma of x, and the signed deviations summed over all elements,
    divided by their standard deviation, form a z-score within 5 (this catches a 1% bias in p)."""
    bs, blocks, draws = 32, 8, 1000
    g = torch.Generator().manual_seed(5)
    x = torch.randn(blocks * bs, generator=g) * 3e-3
    c = get_codec(name, block_size=bs, stochastic=True)
    tiled = x.repeat(draws)  # each copy has the same blocks, hence the same scales: K draws
    buf = c.pack(tiled, torch.Generator().manual_seed(1))
    y = c.unpack(buf, tiled.numel()).view(draws, -1).double()
    a, sign = x.double().abs(), torch.sign(x.double())
    if name == "bf16":
        ulp = torch.pow(2.0, torch.floor(torch.log2(a)) - 7)
        lo, hi = torch.floor(a / ulp) * ulp, (torch.floor(a / ulp) + 1) * ulp
    else:
        s = _scales(c, buf, tiled.numel())[: x.numel()].double()
        lo, hi = _neighbours(name, x / s.float())
        lo, hi = lo * s, hi * s
    assert bool(((y.abs() == lo) | (y.abs() == hi)).all()) and bool(((y * sign) >= 0).all())
    gap = hi - lo
    p = torch.where(gap > 0, (a - lo) / torch.where(gap > 0, gap, 1.0), 0.0)
    assert bool(((p > 0.05) & (p < 0.95)).sum() > x.numel() // 2)  # most values really round
    sigma_mean = (p * (1 - p)).sqrt() * gap / math.sqrt(draws)
    dev = (y.mean(0) - x.double()) * sign
    assert bool((dev.abs() <= 6 * sigma_mean + 1e-15).all())
    z = dev.sum() / sigma_mean.square().sum().sqrt()
    assert abs(float(z)) < 5
    # Nearest rounding is biased on the same data wherever x is off the grid.
    near = get_codec(name, block_size=bs)
    y_near = near.unpack(near.pack(x), x.numel()).double()
    assert (y_near - x.double()).abs().sum() > 4 * dev.abs().sum()


@pytest.mark.parametrize("name", ["bf16", *BLOCK_FORMATS])
def test_rounding_is_reproducible(name: str) -> None:
    x = _heavy_tailed(1001, 6)
    sr = get_codec(name, stochastic=True)
    a = sr.pack(x, torch.Generator().manual_seed(7))
    b = sr.pack(x, torch.Generator().manual_seed(7))
    other = sr.pack(x, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, other)
    nearest = get_codec(name)
    assert torch.equal(nearest.pack(x), nearest.pack(x, torch.Generator().manual_seed(9)))


# ----------------------------------------------------------------------------- FP32 accumulation


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_fp32_accumulation_of_dequantized_payloads(name: str) -> None:
    """Summing M = 4 decoded payloads in FP32 equals the FP32 sum of the individually dequantized
    vectors (each worker quantized once), and differs from quantizing the sum."""
    n, workers = 1001, 4
    c = get_codec(name)
    xs = [_heavy_tailed(n, 20 + m) for m in range(workers)]
    payloads = [c.pack(x) for x in xs]

    total = torch.zeros(n)
    for buf in payloads:
        total += c.unpack(buf, n)

    expected = torch.zeros(n)
    for x, buf in zip(xs, payloads, strict=True):
        if name == "2bit":  # |q| >= 3/4 to 1, the rest (zero included) to 1/2, with q's sign
            s = _scales(c, buf, n)
            q = x / s
            expected += torch.where(q.abs() >= 0.75, 1.0, 0.5) * torch.where(q < 0, -1.0, 1.0) * s
        elif name in BLOCK_FORMATS:
            s = _scales(c, buf, n)
            expected += _reference_nearest(name, x / s) * s
        elif name == "bf16":
            expected += x.to(torch.bfloat16).float()
        else:
            expected += x
    assert torch.equal(total, expected)

    requantized = c.unpack(c.pack(sum(xs)), n)
    if name == "fp32":
        assert torch.equal(requantized, total)
    else:
        assert not torch.equal(requantized, total)


def test_payload_does_not_alias_the_input() -> None:
    for name in CODEC_NAMES:
        c = get_codec(name)
        x = _normal(100, 0)
        buf = c.pack(x)
        before = buf.clone()
        x.mul_(2)
        assert torch.equal(buf, before), name
        y = c.unpack(buf, 100)
        y.zero_()
        assert torch.equal(buf, before), name


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_fp32_mean_sums_views_with_the_same_bits_and_leaves_payloads_alone(workers: int) -> None:
    """The FP32 mean reads the payloads in place (no decoding copies): same bits as summing decoded
    copies in worker order, and the payloads, the caller's values, are not written."""
    n = 1001
    c = get_codec("fp32")
    xs = [_heavy_tailed(n, 40 + m) for m in range(workers)]
    payloads = [c.pack(x) for x in xs]
    before = [b.clone() for b in payloads]
    total = c.unpack(payloads[0], n)
    for buf in payloads[1:]:
        total += c.unpack(buf, n)
    expected = total / workers
    got = mean_of_payloads(c, payloads, n)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    assert all(torch.equal(b, a) for b, a in zip(payloads, before, strict=True))
    got.zero_()  # the mean is fresh memory
    assert all(torch.equal(b, a) for b, a in zip(payloads, before, strict=True))


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("name", CODEC_NAMES)
def test_mean_into_out_is_the_same_mean(name: str, workers: int) -> None:
    c = get_codec(name)
    payloads = [c.pack(_heavy_tailed(257, 60 + m)) for m in range(workers)]
    fresh = mean_of_payloads(c, payloads, 257)
    out = torch.full((257,), float("nan"))
    got = mean_of_payloads(c, payloads, 257, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got.view(torch.int32), fresh.view(torch.int32))


def test_fp32_values_is_a_view_only_when_aligned() -> None:
    c = get_codec("fp32")
    x = _normal(64, 1)
    buf = c.pack(x)
    v = c.values(buf, 64)
    assert v.data_ptr() == buf.data_ptr() and torch.equal(v, x)
    shifted = torch.empty(4 * 64 + 1, dtype=torch.uint8)[1:]  # misaligned by one byte
    shifted.copy_(buf)
    w = c.values(shifted, 64)
    assert w.data_ptr() != shifted.data_ptr() and torch.equal(w, x)
    with pytest.raises(ValueError, match="does not hold"):
        c.values(buf[:-4], 64)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_encode_gives_the_payload_and_what_the_others_decode(name: str) -> None:
    c = get_codec(name)
    flat = _heavy_tailed(300, 5)
    payload, own = encode(c, flat)
    assert torch.equal(payload, c.pack(flat))
    assert torch.equal(own, c.unpack(payload, 300))
    # fp32 is its own encoding: no copy at all (flat is the caller's private vector).
    assert (payload.data_ptr() == flat.data_ptr()) == (name == "fp32")


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(BLOCK_FORMATS),
    block_size=st.integers(1, 70),
    values=st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=0, max_size=200),
)
def test_property_nearest_is_the_brute_force_nearest(name: str, block_size: int, values: list[float]) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    c = get_codec(name, block_size=block_size)
    buf = c.pack(x)
    assert buf.numel() == c.packed_nbytes(x.numel())
    s = _scales(c, buf, x.numel())
    ref = _reference_nearest(name, x / torch.where(s > 0, s, 1.0)) * s
    assert torch.equal(c.unpack(buf, x.numel()), ref)
