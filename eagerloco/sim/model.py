"""What is simulated: model presets, step times, the method rows and the bytes they put on the link.

Arithmetic on sizes only, without torch (``eagerloco simulate`` starts instantly): payload sizes follow the
layout the runtime codecs pack (:mod:`eagerloco.codec_sizes`); the timing lives in :mod:`eagerloco.sim.engine`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from eagerloco.codec_sizes import SCALE_BYTES, shard_numel, sparse_counts
from eagerloco.config import METHODS, ConfigError
from eagerloco.schedule import block_groups


@dataclass(frozen=True)
class ModelSpec:
    """A model as the simulator sees it: parameters spread evenly over its blocks (embeddings and head folded in,
    as the papers' simulation does); step_time is one inner step of one worker."""

    name: str
    params: float
    layers: int
    step_time: float


#: The papers' presets: 60% MFU step times for 1B, 10B and 100B models (docs/algorithms.md, section 9).
PRESETS: dict[str, ModelSpec] = {
    "1b": ModelSpec("1b", 1e9, 24, 0.1),
    "10b": ModelSpec("10b", 1e10, 48, 0.8),
    "100b": ModelSpec("100b", 1e11, 108, 4.9),
}


@dataclass(frozen=True)
class Variant:
    """One row of the tables: a method of :data:`eagerloco.config.METHODS` with its settings.

    ``fragmented``: the exchange is split into the P fragments (streaming always; delayed and eager when asked).
    ``topk``: only the top k of every ``topk_chunk`` values travel, at ``bits`` a value, with their positions;
    ``shared``: at positions every worker draws alike, values only, reduce-scattered.
    """

    key: str
    label: str
    method: str
    bits: int
    fragmented: bool = False
    overlap_steps: int = 0
    eager_rounds: int = 1
    topk: int | None = None
    topk_chunk: int = 4096
    shared: bool = False

    @property
    def sparse(self) -> bool:
        return self.topk is not None


def payload_label(values: str, topk: int | None = None, topk_chunk: int = 4096, shared: bool = False) -> str:
    """An exchange format in words: its values' format ("4-bit", "e2m1"), then for a sparse one "top64/4096"
    (shared64/4096)."""
    return values + (f" {'shared' if shared else 'top'}{topk}/{topk_chunk}" if topk is not None else "")


def default_variants(bits: int = 32, dp_bits: int = 16, low_bits: int = 4, taus: tuple[int, ...] = (1,),
                     delayed_rounds: tuple[int, ...] = (1,), eager_rounds: tuple[int, ...] = (1, 2),
                     eager_fragmented: bool = False, topk: int | None = None, topk_chunk: int = 4096,
                     shared: bool = False) -> list[Variant]:
    """The rows of the papers' comparison, parameterized by the CLI flags: data-parallel, DiLoCo, Streaming
    (blocking, each tau of overlap, the first tau at low_bits), naive delayed and eager; topk (and shared) make
    the rows at ``bits`` sparse, data-parallel and the low_bits row stay dense.
    """
    sp = {"topk": topk, "topk_chunk": topk_chunk, "shared": shared and topk is not None}
    fmt = payload_label(f"{bits}-bit", topk, topk_chunk, shared and topk is not None)
    rows = [
        Variant("dp", f"data-parallel {dp_bits}-bit", "dp", dp_bits),
        Variant("diloco", f"DiLoCo {fmt}", "diloco", bits, **sp),
        Variant("streaming", f"Streaming {fmt}", "streaming", bits, fragmented=True, **sp),
    ]
    for tau in taus:
        if tau > 0:
            rows.append(Variant(f"streaming-tau{tau}", f"Streaming tau={tau} {fmt}", "streaming", bits, True, tau,
                                **sp))
    if taus and low_bits != bits:
        tau = taus[0]
        suffix = f"-tau{tau}" if tau > 0 else ""
        label = f"Streaming tau={tau} {low_bits}-bit" if tau > 0 else f"Streaming {low_bits}-bit"
        rows.append(Variant(f"streaming{suffix}-{low_bits}bit", label, "streaming", low_bits, True, tau))
    for method, ks, name in (("delayed", delayed_rounds, "naive delayed"), ("eager", eager_rounds, "eager")):
        for k in ks:
            label = f"{name} k={k} {fmt}" + (" streamed" if eager_fragmented else "")
            rows.append(Variant(f"{method}-k{k}", label, method, bits, eager_fragmented, 0, k, **sp))
    return rows


def select_variants(rows: list[Variant], wanted: list[str] | None) -> list[Variant]:
    """Keep the rows named by --method: a method name (all its rows) or a row key."""
    if not wanted:
        return rows
    keys = {r.key for r in rows}
    for w in wanted:
        if w not in METHODS and w not in keys:
            raise ConfigError(f"--method must be one of {', '.join(METHODS)} or a row key "
                              f"({', '.join(sorted(keys))}); got {w!r}")
    return [r for r in rows if r.method in wanted or r.key in wanted]


def fragment_count(layers: int, fragment_layers: int) -> int:
    """P = ceil(layers / fragment_layers): the papers use 3 blocks per fragment at every scale."""
    return max(1, math.ceil(layers / fragment_layers))


def fragment_layers(layers: int, fragments: int, pattern: str = "strided") -> list[tuple[int, ...]]:
    """Blocks (0-based) of each fragment: "strided" (fragment p holds p, p+P, ...) or "sequential" (contiguous
    runs, the first fragments one block longer); P is capped at L."""
    return [tuple(g) for g in block_groups(layers, max(1, min(fragments, layers)), pattern)]


def fragment_layer_counts(layers: int, fragments: int) -> list[int]:
    """Blocks per fragment under the strided pattern; the largest holds ceil(layers / P), so more fragments never
    enlarge the peak."""
    return [len(g) for g in fragment_layers(layers, fragments)]


def payload_bytes(numel: float, bits: int, block: int = 32, scale_bytes: int = SCALE_BYTES) -> float:
    """Encoded size of numel values: bits per value, plus one scale per block below 16 bits."""
    body = numel * bits / 8
    if bits >= 16:
        return body
    return body + math.ceil(numel / block) * scale_bytes


def exchange_payload_bytes(numel: float, variant: Variant, block: int = 32, scale_bytes: int = SCALE_BYTES) -> float:
    """Encoded size of one outer exchange of numel values in the variant's format: dense, or the kept values of a
    sparse one (a shared support's without positions; top-k's with them, as
    :func:`eagerloco.codec_sizes.sparse_nbytes` packs them, ``scale_bytes`` changing the scales as for a dense one)."""
    if variant.topk is None:
        return payload_bytes(numel, variant.bits, block, scale_bytes)
    kept, position_bytes = sparse_counts(round(numel), variant.topk_chunk, variant.topk)
    if variant.shared:
        return payload_bytes(kept, variant.bits, block, scale_bytes)
    return math.ceil(payload_bytes(kept, variant.bits, block, scale_bytes)) + position_bytes


def bits_per_value(variant: Variant, block: int = 32, scale_bytes: int = SCALE_BYTES) -> float:
    """Bits on the link per value of the vector of a long exchange in the variant's format (scales and
    positions included): 16 for bf16, 4.5 for e2m1 with a 2-byte scale per 32, about 0.23 for 2-bit
    top 64 of 4096."""
    numel = 1024 * (variant.topk_chunk if variant.topk is not None else block)
    return 8 * exchange_payload_bytes(numel, variant, block, scale_bytes) / numel


def wire_bytes(payload: float, workers: int, bits: int, transport: str = "ring", sparse: bool = False) -> float:
    """Bytes one worker sends for one exchange of payload bytes: ``ring`` 2(M-1)/M of it for every format (the
    papers' model); ``allgather`` (M-1) payloads for quantized ones, FP32 still on the ring; ``sparse`` payloads
    are all-gathered whatever the transport.
    """
    if workers <= 1:
        return 0.0
    if sparse or (transport == "allgather" and bits < 32):
        return (workers - 1) * payload
    return 2 * (workers - 1) / workers * payload


def exchange_wire_bytes(numel: float, variant: Variant, workers: int, block: int = 32,
                        scale_bytes: int = SCALE_BYTES, transport: str = "ring") -> float:
    """Bytes one worker sends for one outer exchange of numel values: :func:`wire_bytes` of its payload, or under
    reduce-scatter (and for a shared-support row whatever the transport)
    :func:`eagerloco.codec_sizes.reduce_scatter_wire_bytes`; FP32 and top-k payloads go as under ring.
    """
    if workers <= 1:
        return 0.0
    flat = transport in ("reduce-scatter", "shared-support") and not variant.sparse and variant.bits < 32
    if variant.shared or flat:
        kept = sparse_counts(round(numel), variant.topk_chunk, variant.topk)[0] if variant.shared else round(numel)
        shard = shard_numel(kept, workers, block if variant.bits < 16 else 1)
        return 2 * (workers - 1) * payload_bytes(shard, variant.bits, block, scale_bytes)
    ring_or_gather = "ring" if transport in ("reduce-scatter", "shared-support") else transport
    return wire_bytes(exchange_payload_bytes(numel, variant, block, scale_bytes), workers, variant.bits,
                      ring_or_gather, variant.sparse)


@dataclass(frozen=True)
class Traffic:
    """Link traffic of one variant on one model, per worker."""

    transfers: list[float]  # wire bytes of each transfer of one period (a step for dp, a round else)
    period_steps: int  # inner steps in that period
    #: Blocks whose share each transfer carries (same order as transfers); a block's share of a
    #: transfer is transfers[i] / len(layers[i]), put on the link when its weight gradient exists.
    layers: tuple[tuple[int, ...], ...] = ()

    @property
    def bytes_per_step(self) -> float:
        return sum(self.transfers) / self.period_steps

    @property
    def peak_bytes(self) -> float:
        return max(self.transfers, default=0.0)


def traffic(model: ModelSpec, variant: Variant, workers: int, inner_steps: int, fragments: int, block: int = 32,
            scale_bytes: int = SCALE_BYTES, transport: str = "ring", pattern: str = "strided") -> Traffic:
    """Sizes of the transfers one period puts on the link, and the blocks each carries: dp one gradient exchange per
    block per step (never sparse); outer methods one exchange per fragment per round of H steps."""
    per_layer = model.params / model.layers
    if variant.method == "dp":
        one = exchange_wire_bytes(per_layer, variant, workers, block, scale_bytes, transport)
        return Traffic([one] * model.layers, 1, tuple((i,) for i in range(model.layers)))
    groups = (
        fragment_layers(model.layers, fragments, pattern)
        if variant.fragmented
        else [tuple(range(model.layers))]
    )
    counts = [len(g) for g in groups]
    sizes = [exchange_wire_bytes(c * per_layer, variant, workers, block, scale_bytes, transport) for c in counts]
    return Traffic(sizes, inner_steps, tuple(groups))


def with_name(model: ModelSpec, **changes: Any) -> ModelSpec:
    """A preset with some fields overridden (a custom model keeps the preset's name plus a mark)."""
    if not changes:
        return model
    return replace(model, name=model.name if model.name == "custom" else f"{model.name}*", **changes)
