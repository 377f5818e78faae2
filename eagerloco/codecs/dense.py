"""The dense codecs: every value of the outer gradient in a low-precision format (see :class:`Codec`)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from eagerloco.codec_sizes import CODEC_NAMES, SCALE_BYTES, packed_nbytes

_CHUNK = 1 << 15  # values encoded per pass of the block codecs
_BF16_MAX_BITS = 0x7F7F0000  # largest finite bfloat16 as FP32 bits
_FP32_MAX = torch.finfo(torch.float32).max


def _bits_to_float(bits: int) -> float:
    return torch.tensor(bits, dtype=torch.int32).view(torch.float32).item()


_BF16_MAX = _bits_to_float(_BF16_MAX_BITS)
_LOW16 = 0xFFFF
_HIGH16 = -0x10000  # int32 mask keeping the upper 16 bits


def as_vector(x: torch.Tensor) -> torch.Tensor:
    """Validate the input of pack and return it as a contiguous FP32 vector."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"codecs encode a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1:
        raise ValueError(f"codecs encode 1-D tensors (flatten first), got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"codecs encode floating-point tensors, got {x.dtype}")
    return x.detach().to(torch.float32).contiguous()


def _pow2(exponents: torch.Tensor) -> torch.Tensor:
    """2**e for integer tensors e within FP32's normal range, built from the bits (exact and fast)."""
    return ((exponents + 127) << 23).view(torch.float32)


def _stochastic_floor(t: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Round t down or up to an integer, up with probability frac(t): unbiased. Overwrites t. Comparing u with
    the fraction avoids floor(t + u), whose FP32 addition rounds up too often (100 + 0.99999994 == 101)."""
    low = t.floor()
    return low.add_(u < t.sub_(low))


class Codec(ABC):
    """A number format for the exchange: pack FP32 values into bytes and back.

    Every codec turns a 1-D FP32 vector into one contiguous ``uint8`` tensor of exactly :meth:`packed_nbytes`,
    so the bytes a transport moves are the bytes the format costs; sums happen in FP32 after decoding (only
    :class:`Fp32Codec` is summable as is). Block-scaled payloads (fp8, e2m1, e3m0, int8, int4, 2bit) are
    ``[scales: 2 bytes per block][codes: ceil(numel * bits / 8) bytes]``, native byte order.

    The scale is the block absmax over the format's largest magnitude, rounded up to bfloat16: an absmax scale
    uses the whole grid (e2m1 in blocks of 32: relative RMS error 0.101 against 0.115 for an E8M0 power of two on
    normal data, 0.095 against 0.135 on Student-t(3)); bfloat16 keeps FP32's exponent range, so tiny outer
    gradients keep a nonzero scale; rounding up never maps the absmax beyond the grid, at most 2^-7 above exact.

    Inputs must be finite (infinities saturate, NaN is not supported). An all-zero block stores scale 0 and
    decodes to zeros. 4-bit codes are packed two per byte, first in the low nibble (2-bit four per byte, first
    in the lowest bits), unpadded per block. Rounding is to nearest, ties to the even significand (e3m0: a tie
    between powers of two goes up, between 0 and 2^-6 to 0), or with ``stochastic=True`` unbiased stochastic
    rounding driven by the given generator, on the tensors' device.
    """

    name: str
    bits: int
    block_size: int
    stochastic: bool
    summable: bool = False

    def __init__(self, block_size: int = 32, stochastic: bool = False) -> None:
        self.block_size = block_size
        self.stochastic = stochastic

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_size={self.block_size}, stochastic={self.stochastic})"

    @abstractmethod
    def pack(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Encode a 1-D float tensor into a new contiguous uint8 tensor of packed_nbytes(x.numel()); ``generator``
        drives stochastic rounding (same seed, same bytes)."""

    @abstractmethod
    def unpack(self, buf: torch.Tensor, numel: int) -> torch.Tensor:
        """Decode a payload of numel values into a new 1-D FP32 tensor."""

    def packed_nbytes(self, numel: int) -> int:
        """Exact payload size in bytes for numel values (codes and scales; :mod:`eagerloco.codec_sizes`)."""
        return packed_nbytes(self.name, numel, self.block_size)

    def for_step(self, step: int, guide: torch.Tensor | None = None) -> Codec:
        """The codec of the exchange launched at this inner step: itself, unless its positions change per step
        (``guide``: the flat mean every worker last received of this exchange, which a guided support reads)."""
        return self

    def _check_buf(self, buf: torch.Tensor, numel: int) -> None:
        if numel < 0:
            raise ValueError(f"numel must be non-negative, got {numel}")
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise ValueError(f"{self.name} payload must be a 1-D uint8 tensor, got {buf.dtype} {tuple(buf.shape)}")
        expected = self.packed_nbytes(numel)
        if buf.numel() != expected:
            raise ValueError(
                f"{self.name} payload of {buf.numel()} bytes does not hold {numel} values (expected {expected} bytes)"
            )


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes of ``bits`` bits (1, 2, 4 or 8), 8 // bits a byte, the first in the lowest bits (zeros pad the
    last byte); as the codes' dtype, to be stored as bytes."""
    per = 8 // bits
    if codes.numel() % per:
        codes = torch.cat((codes, codes.new_zeros(-codes.numel() % per)))
    packed = codes[0::per]
    for j in range(1, per):
        packed = packed | (codes[j::per] << (bits * j))
    return packed


def as_rows(v: torch.Tensor, length: int) -> list[torch.Tensor]:
    """A vector as rows of ``length`` values, then its last, partial row as a row of its own (views, no padding)."""
    full = v.numel() // length
    rows = [v[: full * length].view(full, length)] if full else []
    return rows + [v[full * length :].view(1, -1)] if v.numel() > full * length else rows


def _bytes_as(buf: torch.Tensor, dtype: torch.dtype, count: int) -> torch.Tensor:
    """Copy raw bytes into a fresh, aligned tensor of `count` elements of dtype."""
    out = torch.empty(count, dtype=dtype, device=buf.device)
    out.view(torch.uint8).copy_(buf)
    return out


class Fp32Codec(Codec):
    """The raw FP32 bytes: lossless, and summable by a plain all-reduce."""

    name = "fp32"
    bits = 32
    summable = True

    def pack(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return as_vector(x).clone().view(torch.uint8)

    def unpack(self, buf: torch.Tensor, numel: int) -> torch.Tensor:
        self._check_buf(buf, numel)
        return _bytes_as(buf, torch.float32, numel)

    def values(self, buf: torch.Tensor, numel: int) -> torch.Tensor:
        """The payload's values without a copy where its bytes are aligned (read-only use: it shares
        memory with buf); a decoded copy otherwise."""
        self._check_buf(buf, numel)
        if buf.is_contiguous() and buf.data_ptr() % 4 == 0:
            return buf.view(torch.float32)
        return _bytes_as(buf, torch.float32, numel)


class Bf16Codec(Codec):
    """Each value rounded to bfloat16 (no scale: FP32's exponent range); values beyond its largest finite saturate."""

    name = "bf16"
    bits = 16

    def pack(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        v = as_vector(x).clamp(-_BF16_MAX, _BF16_MAX)
        if not self.stochastic:
            return v.to(torch.bfloat16).view(torch.uint8)
        # Adding a uniform 16-bit integer to the magnitude bits and truncating rounds up with
        # probability equal to the discarded fraction of a bfloat16 ulp (normals and subnormals alike,
        # because bfloat16 and FP32 share their exponent layout). The clamp keeps the carry finite.
        noise = torch.randint(0, _LOW16 + 1, v.shape, generator=generator, dtype=torch.int32, device=v.device)
        bits = (v.view(torch.int32) + noise) >> 16
        return bits.to(torch.int16).view(torch.uint8)

    def unpack(self, buf: torch.Tensor, numel: int) -> torch.Tensor:
        self._check_buf(buf, numel)
        return _bytes_as(buf, torch.bfloat16, numel).to(torch.float32)


class _BlockCodec(Codec):
    """Shared machinery of the block-scaled formats: a subclass defines ``max_level`` (largest magnitude relative to
    the scale), :meth:`_encode` (scaled values to integer codes) and :meth:`_code_values` (value of every code)."""

    max_level: float

    def __init__(self, block_size: int = 32, stochastic: bool = False) -> None:
        super().__init__(block_size, stochastic)
        table = self._code_values()
        self._table = table
        bits = _BF16_MAX_BITS  # largest bfloat16 scale whose top grid value is a finite FP32
        while _bits_to_float(bits) * self.max_level > _FP32_MAX:
            bits -= 0x10000
        self._max_scale_bits = bits
        #: Codes per byte: 2 for the 4-bit formats (the first in the low nibble), 4 for 2-bit ones.
        self.per_byte = 8 // self.bits
        if self.per_byte > 1:  # one lookup per byte decodes every code in it
            b, mask = torch.arange(256), (1 << self.bits) - 1
            self._byte_table = torch.stack(
                [table[(b >> (self.bits * j)) & mask] for j in range(self.per_byte)], dim=1
            ).contiguous()
        self._tables: dict[torch.device, torch.Tensor] = {}  # the decode table on each device, copied once

    def _decode_table(self, device: torch.device) -> torch.Tensor:
        """The decode table on device (copied there once: a copy per decode would make a GPU's host
        wait for its queue every time)."""
        table = self._tables.get(device)
        if table is None:
            table = self._tables[device] = (self._byte_table if self.per_byte > 1 else self._table).to(device)
        return table

    @abstractmethod
    def _encode(self, q: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        """Codes (int32, in [0, 2**bits)) for values q already divided by the block scale."""

    @abstractmethod
    def _code_values(self) -> torch.Tensor:
        """FP32 value (relative to the scale) of each of the 2**bits codes."""

    def num_blocks(self, numel: int) -> int:
        return -(-numel // self.block_size)

    def _scales(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-block scales as (bf16 bit patterns as int16, the same scales as FP32), x blocked."""
        amax = x.abs().amax(dim=1)
        s = amax / self.max_level
        # Round up to bfloat16 (positive values: add just under one bf16 ulp, truncate), capped so
        # that max_level * scale stays finite (blocks near the top of the FP32 range saturate by
        # at most 2^-7 instead). A block whose absmax underflowed the division still gets the
        # smallest positive scale, so it does not silently decode to zero.
        bits = ((s.view(torch.int32) + _LOW16) & _HIGH16).clamp(max=self._max_scale_bits)
        bits = torch.where((amax > 0) & (bits == 0), 0x10000, bits)
        return (bits >> 16).to(torch.int16), bits.view(torch.float32)

    def _chunk_blocks(self, device: torch.device, num_blocks: int) -> int:
        """Blocks per chunk: about _CHUNK values (cache-sized), whole bytes of codes; on a GPU, which
        has no cache to fit and pays a kernel launch per pass, every block at once."""
        if device.type != "cpu":
            return max(1, num_blocks + num_blocks % 2)
        k = max(1, _CHUNK // self.block_size)
        while (k * self.block_size) % self.per_byte:
            k += 1
        return k

    def pack(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        v = as_vector(x)
        n, bs = v.numel(), self.block_size
        nb = self.num_blocks(n)
        out = torch.empty(self.packed_nbytes(n), dtype=torch.uint8, device=v.device)
        scale_out, code_out = out[: nb * SCALE_BYTES], out[nb * SCALE_BYTES :]
        step = self._chunk_blocks(v.device, nb)
        # Work chunk by chunk so the dozen elementwise passes stay in cache (several times faster
        # than whole-vector passes on 10M values); noise is drawn in chunk order, so a seeded
        # generator still gives the same bytes.
        for b0 in range(0, nb, step):
            b1 = min(nb, b0 + step)
            i0, i1 = b0 * bs, min(n, b1 * bs)
            full = (i1 - i0) // bs
            # The last block may be partial: it is encoded as a row of its own length, not padded to the
            # block size (a padded copy would cost a whole block's memory whatever the vector's length).
            rows = as_rows(v[i0:i1], bs)
            u = torch.rand(i1 - i0, generator=generator, device=v.device) if self.stochastic else None
            parts, at = [], 0
            for j, blocks in enumerate(rows):
                scale_bits, scales = self._scales(blocks)
                scale_out[(b0 + j * full) * SCALE_BYTES : (b0 + j * full + len(blocks)) * SCALE_BYTES] = (
                    scale_bits.view(torch.uint8))
                # Division (not multiplication by a reciprocal) because 1/scale overflows for tiny scales.
                # A zero scale only occurs for an all-zero block, whose codes are zero: divide by 1.
                q = blocks / torch.where(scales > 0, scales, 1.0)[:, None]
                noise = None if u is None else u[at : at + q.numel()].view(q.shape)
                parts.append(self._encode(q, noise).view(-1))
                at += q.numel()
            # Only the last chunk may end in a partly empty byte.
            packed = pack_codes(parts[0] if len(parts) == 1 else torch.cat(parts), self.bits)
            code_out[i0 // self.per_byte : i0 // self.per_byte + packed.numel()] = packed
        return out

    def block_scales(self, buf: torch.Tensor, numel: int) -> torch.Tensor:
        """The FP32 scale of each block of a payload (for diagnostics and tests)."""
        self._check_buf(buf, numel)
        nb = self.num_blocks(numel)
        raw = _bytes_as(buf[: nb * SCALE_BYTES], torch.int16, nb)
        return (raw.to(torch.int32) << 16).view(torch.float32)

    def unpack(self, buf: torch.Tensor, numel: int) -> torch.Tensor:
        scales = self.block_scales(buf, numel)
        nb, bs = scales.numel(), self.block_size
        code_in = buf[nb * SCALE_BYTES :]
        table = self._decode_table(buf.device)
        out = torch.empty(numel, dtype=torch.float32, device=buf.device)
        step = self._chunk_blocks(buf.device, nb)
        for b0 in range(0, nb, step):
            b1 = min(nb, b0 + step)
            i0, i1 = b0 * bs, min(numel, b1 * bs)
            if self.per_byte > 1:
                codes = code_in[i0 // self.per_byte : -(-i1 // self.per_byte)]
                rel = torch.index_select(table, 0, codes.to(torch.int32)).view(-1)[: i1 - i0]
            else:
                rel = torch.index_select(table, 0, code_in[i0:i1].to(torch.int32))
            full = (i1 - i0) // bs
            dst = out[i0:i1]
            torch.mul(
                rel[: full * bs].view(full, bs),
                scales[b0 : b0 + full, None],
                out=dst[: full * bs].view(full, bs),
            )
            if b0 + full < b1:  # the last, partial block
                torch.mul(rel[full * bs :], scales[b0 + full], out=dst[full * bs :])
        return out


class _MinifloatCodec(_BlockCodec):
    """Sign-magnitude floats with `mantissa` bits, smallest normal exponent `emin` and no inf/NaN.

    Codes follow the usual bit layout, so fp8 codes are float8_e4m3fn bytes and e2m1 the OCP MX FP4 ones. The
    ulp of |q| is 2^(max(e, emin) - mantissa), e = floor(log2 |q|); n = q / ulp is an integer and the code is
    (max(e, emin) - emin) * 2^mantissa + n, the bit pattern of n * ulp.
    """

    mantissa: int
    emin: int

    def __init__(self, block_size: int = 32, stochastic: bool = False) -> None:
        super().__init__(block_size, stochastic)
        self._max_code = int(torch.nonzero(self._table == self.max_level)[0])

    def _encode(self, q: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        mag = q.abs().clamp_(max=self.max_level)
        e = ((mag.view(torch.int32) >> 23) - 127).clamp_(min=self.emin)  # zero and tiny: emin
        scaled = mag * _pow2(self.mantissa - e)  # exact: multiplication by a power of two
        n = scaled.round_() if u is None else _stochastic_floor(scaled, u)
        code = (((e - self.emin) << self.mantissa) + n.to(torch.int32)).clamp_(max=self._max_code)
        return code | ((q < 0).to(torch.int32) << (self.bits - 1))

    def _code_values(self) -> torch.Tensor:
        half = 1 << (self.bits - 1)
        c = torch.arange(half)
        field, mant = c >> self.mantissa, c & ((1 << self.mantissa) - 1)
        significand = torch.where(field > 0, mant + (1 << self.mantissa), mant).to(torch.float64)
        exponent = (field.clamp(min=1) - 1 + self.emin - self.mantissa).to(torch.float64)
        mag = (significand * torch.pow(2.0, exponent)).to(torch.float32)
        return torch.cat((mag, -mag))


class Fp8Codec(_MinifloatCodec):
    """float8 e4m3fn (max 448) with a per-block scale: outer gradients lie far below its smallest subnormal, so
    the scale (absmax to 448, as in MXFP8) places each block at the top of the range; values saturate at +-448."""

    name = "fp8"
    bits = 8
    mantissa = 3
    emin = -6
    max_level = 448.0


class E2m1Codec(_MinifloatCodec):
    """OCP MX FP4: magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} times the block scale (absmax maps to 6)."""

    name = "e2m1"
    bits = 4
    mantissa = 1
    emin = 0
    max_level = 6.0


class E3m0Codec(_MinifloatCodec):
    """Sign and a power of two: magnitudes {0, 2^-6, ..., 2^0} times the block scale (absmax maps to 1)."""

    name = "e3m0"
    bits = 4
    mantissa = 0
    emin = -6
    max_level = 1.0


class _IntCodec(_BlockCodec):
    """Symmetric integers in [-max_level, max_level] times the block scale (absmax maps to max_level)."""

    def _encode(self, q: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        r = q.round() if u is None else _stochastic_floor(q.clone(), u)
        k = r.clamp_(-self.max_level, self.max_level).to(torch.int32)
        return k & ((1 << self.bits) - 1)  # two's complement in `bits` bits

    def _code_values(self) -> torch.Tensor:
        c = torch.arange(1 << self.bits)
        return torch.where(c >= (1 << (self.bits - 1)), c - (1 << self.bits), c).to(torch.float32)


class Int8Codec(_IntCodec):
    """int8 codes in [-127, 127] with a per-block absmax scale."""

    name = "int8"
    bits = 8
    max_level = 127.0


class Int4Codec(_IntCodec):
    """int4 codes in [-7, 7] with a per-block absmax scale, two codes per byte."""

    name = "int4"
    bits = 4
    max_level = 7.0


class TwoBitCodec(_BlockCodec):
    """Sign and one bit of magnitude: {+-1/2, +-1} times the block scale, four codes a byte (bit 0 the magnitude,
    bit 1 the sign), for the values a sparse exchange keeps (docs/algorithms.md, 10). Nearest sends |q| >= 3/4
    to 1 and the rest to 1/2; stochastic sends |q| in [1/2, 1] to 1 with probability 2|q| - 1, below to 1/2.
    """

    name = "2bit"
    bits = 2
    max_level = 1.0

    def _encode(self, q: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        mag = q.abs()
        big = mag >= 0.75 if u is None else u < mag.mul_(2.0).sub_(1.0)
        return big.to(torch.int32) | ((q < 0).to(torch.int32) << 1)

    def _code_values(self) -> torch.Tensor:
        return torch.tensor([0.5, 1.0, -0.5, -1.0])


_CODECS: dict[str, type[Codec]] = {
    c.name: c for c in (Fp32Codec, Bf16Codec, Fp8Codec, E2m1Codec, E3m0Codec, Int8Codec, Int4Codec, TwoBitCodec)
}
assert tuple(_CODECS) == CODEC_NAMES


def dense_codec(name: str, block_size: int = 32, stochastic: bool = False) -> Codec:
    """Build the codec called name (see CODEC_NAMES); block_size is validated even where unused."""
    if name not in _CODECS:
        raise ValueError(f"unknown --codec {name!r}; choose one of: {', '.join(CODEC_NAMES)}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"--codec-block must be a positive integer (values per scale), got {block_size!r}")
    return _CODECS[name](block_size=block_size, stochastic=bool(stochastic))
