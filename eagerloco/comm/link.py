"""Link arithmetic of the multi-process runtimes: what their communicator emulates, and whether one exchange fits
within the time after which peers are declared dead.
"""

from __future__ import annotations

from eagerloco.codec_sizes import packed_nbytes, reduce_scatter_wire_bytes, sparse_counts
from eagerloco.config import ConfigError, LinkConfig, OuterConfig


def emulated_link(link: LinkConfig, kernel_gbps: float | None) -> LinkConfig:
    """What the communicator emulates of the run's link: all of it, or only latency and jitter when the kernel shapes
    the bandwidth (``eagerloco launch --kernel-link-gbps``, at ``kernel_gbps``)."""
    if kernel_gbps is None:
        return link
    return LinkConfig(latency_ms=link.latency_ms, jitter_ms=link.jitter_ms)


def check_exchange_fits(link: LinkConfig, outer: OuterConfig, workers: int, num_params: int,
                        timeout_s: float) -> None:
    """ConfigError when one exchange of ``num_params`` among ``workers`` would outlast ``timeout_s``
    (``--dist-timeout``) on ``link``: its size, its time and the two ways out."""
    numel = -(-num_params // outer.fragments)
    payload = packed_nbytes(outer.codec, numel, outer.codec_block)
    if outer.transport == "reduce-scatter" and outer.topk is None and outer.codec != "fp32":
        wire = reduce_scatter_wire_bytes(outer.codec, numel, workers, outer.codec_block)
    elif outer.transport == "shared-support" and outer.topk is not None:
        kept = sparse_counts(numel, outer.topk_chunk, outer.topk)[0]
        wire = reduce_scatter_wire_bytes(outer.codec, kept, workers, outer.codec_block)
    else:
        wire = payload * max(1, workers - 1)
    seconds = link.transfer_seconds(wire)
    if seconds > timeout_s:
        raise ConfigError(
            f"one exchange ({payload / 1e6:.3g} MB per worker, {workers} workers) takes {seconds:.3g} s on a "
            f"{link.bandwidth_gbps:g} Gbit/s link, longer than --dist-timeout {timeout_s:g} s, after which peers "
            "are declared dead: raise --bandwidth-gbps or --dist-timeout"
        )
