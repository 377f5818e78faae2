"""The sparse exchanges: the k values of largest magnitude of every chunk, their positions packed beside
them (:class:`TopKCodec`), or k values at positions every worker draws alike, sent without positions
(:class:`SharedSupportCodec`); the values in any dense codec (2 bits by default).
"""

from __future__ import annotations

import torch

from eagerloco.codec_sizes import chunk_position_bits, sparse_counts, sparse_nbytes
from eagerloco.codecs.dense import Codec, as_rows, as_vector, pack_codes

_BYTE_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """A vector of 0/1 values as bytes, eight a byte, the first in the lowest bit (zeros pad the last)."""
    return pack_codes(bits.to(torch.uint8), 1)


def unpack_bits(buf: torch.Tensor, count: int) -> torch.Tensor:
    """The first count bits of a byte stream written by :func:`pack_bits`, as bools."""
    weights = _BYTE_WEIGHTS.to(buf.device)
    return ((buf[:, None] & weights) != 0).view(-1)[:count]


def _uint_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative integers as ``width`` bits each (lowest first), one value after the other."""
    shifts = torch.arange(width, device=values.device, dtype=torch.int64)
    return ((values.to(torch.int64)[..., None] >> shifts) & 1).view(-1)


def _bits_uint(bits: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of :func:`_uint_bits`: every ``width`` bits (lowest first) as one int64."""
    shifts = torch.arange(width, device=bits.device, dtype=torch.int64)
    return (bits.view(-1, width).to(torch.int64) << shifts).sum(1)


def keep_largest(rows: torch.Tensor, k: int) -> torch.Tensor:
    """The mask of the k largest |x| in every row, ties to the lower index (the same mask on every machine)."""
    mag = rows.abs()
    threshold = torch.topk(mag, k, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
    keep = mag >= threshold
    counts = keep.sum(dim=1)
    tied = (counts != k).nonzero()[:, 0]  # rows with more than k at or above their k-th value
    if tied.numel():  # rare with real data: settle those rows' ties by index, lower first
        sub, thr = mag[tied], threshold[tied]
        above = sub > thr
        tie = sub == thr
        room = k - above.sum(dim=1, keepdim=True)
        keep[tied] = above | (tie & (tie.cumsum(dim=1) <= room))
    return keep


class _SparseCodec(Codec):
    """What the sparse exchanges share: k values of every chunk of ``chunk``, in the dense codec ``values``."""

    def __init__(self, values: Codec, chunk: int, k: int, kind: str) -> None:
        if chunk < 1 or not 1 <= k <= chunk:
            raise ValueError(f"a sparse exchange keeps 1 <= k <= chunk values of each chunk, got k={k}, chunk={chunk}")
        super().__init__(values.block_size, values.stochastic)
        self.values, self.chunk, self.k = values, chunk, k
        self.name = f"{kind}{k}of{chunk}+{values.name}"
        self.bits = values.bits


class TopKCodec(_SparseCodec):
    """Keep the k entries of largest magnitude of every chunk of ``chunk`` values; send them and where they are.

    Ties go to the lower index; the payload is the kept values as one payload of ``values`` (scales first), then
    the positions as one bit stream, per chunk k indices or a mask, whichever is smaller
    (:func:`~eagerloco.codec_sizes.chunk_position_bits`), padded to a byte at the end (docs/algorithms.md, 10).
    Encoding is vectorized over chunks; encoding what a payload decodes to gives the same values again.
    """

    def __init__(self, values: Codec, chunk: int, k: int) -> None:
        super().__init__(values, chunk, k, "top")

    def __repr__(self) -> str:
        return f"TopKCodec({self.values!r}, chunk={self.chunk}, k={self.k})"

    def packed_nbytes(self, numel: int) -> int:
        return sparse_nbytes(self.values.name, numel, self.chunk, self.k, self.values.block_size)

    def _position_bits(self, mask: torch.Tensor, k: int) -> torch.Tensor:
        """Rows of a keep-mask as their position bits (indices or the mask itself, per the rule)."""
        rows, length = mask.shape
        if length == 1:
            return mask.new_zeros(0)
        if chunk_position_bits(length, k) == length:
            return mask.reshape(-1)
        index = mask.nonzero()[:, 1]  # row-major: each row's positions, increasing
        return _uint_bits(index, (length - 1).bit_length())

    def _positions(self, bits: torch.Tensor, rows: int, length: int, k: int) -> torch.Tensor:
        """The keep-mask of ``rows`` chunks of ``length`` values back from their position bits."""
        if length == 1:  # one value, kept: no bits needed
            return torch.ones(rows, 1, dtype=torch.bool, device=bits.device)
        if chunk_position_bits(length, k) == length:
            return bits.view(rows, length)
        index = _bits_uint(bits, (length - 1).bit_length()).view(rows, k)
        mask = torch.zeros(rows, length, dtype=torch.bool, device=bits.device)
        return mask.scatter_(1, index, True)

    def pack(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        v = as_vector(x)
        kept, position_bits = [], []
        for rows in as_rows(v, self.chunk):  # the full chunks at once, then the partial one
            k = min(self.k, rows.shape[1])
            mask = keep_largest(rows, k)
            kept.append(rows[mask])
            position_bits.append(self._position_bits(mask, k))
        empty = v.new_zeros(0)
        values = self.values.pack(torch.cat(kept) if kept else empty, generator)
        positions = pack_bits(torch.cat(position_bits) if position_bits else empty.to(torch.uint8))
        return torch.cat((values, positions))

    def unpack(self, buf: torch.Tensor, numel: int) -> torch.Tensor:
        self._check_buf(buf, numel)
        (full, last), kept = divmod(numel, self.chunk), sparse_counts(numel, self.chunk, self.k)[0]
        k_last = min(self.k, last)
        values_nbytes = self.values.packed_nbytes(kept)
        values = self.values.unpack(buf[:values_nbytes], kept)
        full_bits = full * chunk_position_bits(self.chunk, self.k)
        bits = unpack_bits(buf[values_nbytes:], full_bits + (chunk_position_bits(last, k_last) if last else 0))
        masks = [self._positions(bits[:full_bits], full, self.chunk, self.k).view(-1)] if full else []
        if last:
            masks.append(self._positions(bits[full_bits:], 1, last, k_last).view(-1))
        out = torch.zeros(numel, dtype=torch.float32, device=buf.device)
        if masks:
            out[torch.cat(masks)] = values
        return out


class SharedSupportCodec(_SparseCodec):
    """k values of every chunk at positions every worker chooses alike, sent without positions, so the values can
    be summed on the way whatever M (docs/algorithms.md, 7). The positions are drawn from the exchange's step
    (:meth:`for_step`); with ``guided`` above 0, that share of each chunk's k goes first to the largest entries of
    ``guide``, the last mean every worker received alike, and the rest is drawn among the others."""

    def __init__(self, values: Codec, chunk: int, k: int, seed: int = 0, guided: float = 0.0,
                 guide: torch.Tensor | None = None) -> None:
        super().__init__(values, chunk, k, "shared")
        self.seed, self.guided, self.guide = seed, guided, guide
        self._support: tuple[int, torch.Tensor] | None = None

    def __repr__(self) -> str:
        return (f"SharedSupportCodec({self.values!r}, chunk={self.chunk}, k={self.k}, seed={self.seed}, "
                f"guided={self.guided})")

    def for_step(self, step: int, guide: torch.Tensor | None = None) -> SharedSupportCodec:
        return SharedSupportCodec(self.values, self.chunk, self.k, step, self.guided,
                                  guide if self.guided else None)

    def support(self, numel: int) -> torch.Tensor:
        """The kept positions of a vector of numel values, increasing (int64, on the CPU)."""
        if self._support is None or self._support[0] != numel:
            g = torch.Generator().manual_seed(self.seed)
            guide = None if self.guide is None else self.guide.detach().reshape(-1).to("cpu", torch.float32)
            if guide is not None and guide.numel() != numel:
                raise ValueError(f"the support's guide holds {guide.numel()} values, the exchange {numel}")
            parts = []
            for rows in as_rows(torch.arange(numel), self.chunk):  # each chunk's positions
                score = torch.rand(rows.shape, generator=g)
                k = min(self.k, rows.shape[1])
                if guide is not None and int(self.guided * k):
                    # The guide's largest nonzero entries outrank every draw (scores in [0, 1)).
                    weights = guide[rows]
                    score += 2.0 * (keep_largest(weights, int(self.guided * k)) & (weights != 0))
                parts.append(rows.gather(1, score.topk(k, dim=1).indices.sort(dim=1).values).view(-1))
            self._support = numel, torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
        return self._support[1]

    def packed_nbytes(self, numel: int) -> int:
        return self.values.packed_nbytes(sparse_counts(numel, self.chunk, self.k)[0])

    def pack(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        v = as_vector(x)
        return self.values.pack(v[self.support(v.numel()).to(v.device)], generator)

    def unpack(self, buf: torch.Tensor, numel: int) -> torch.Tensor:
        self._check_buf(buf, numel)
        return self.spread(self.values.unpack(buf, sparse_counts(numel, self.chunk, self.k)[0]), numel)

    def spread(self, kept: torch.Tensor, numel: int) -> torch.Tensor:
        """The vector of numel values holding ``kept`` at the support and zeros elsewhere."""
        out = torch.zeros(numel, dtype=torch.float32, device=kept.device)
        out[self.support(numel).to(kept.device)] = kept
        return out
