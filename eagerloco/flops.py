"""Model FLOPs per token, the peak of known accelerators, and MFU; torch-free arithmetic.

MFU (model FLOPs utilization, PaLM appendix B) counts the FLOPs the model needs, not the FLOPs the
kernels happen to run: 6 N per token for the weight matmuls of a forward and backward (2 N forward,
4 N backward; N counts a tied embedding once, since the output head is a matmul and the lookup is
free), plus 12 L d T for attention's score and value matmuls over a context of T (PaLM's
convention: the full T x T square, as nanoGPT and most published MFUs count it, although a causal
kernel skips half of it). Recomputation, norms, softmax and the optimizer are not counted.
"""

from __future__ import annotations

import math

#: Dense peak TFLOP/s by accelerator and precision (vendor datasheets, without 2:4 sparsity).
#: fp32 is the plain FP32 pipe (PyTorch leaves TF32 matmuls off by default, so fp32 runs use it).
#: Longest name first where one contains another ("H100 NVL" before "H100").
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200 NVL": {"bf16": 835.5, "fp32": 60.0},
    "H200": {"bf16": 989.4, "fp32": 66.9},  # SXM: the same chip and clocks as the H100 SXM
    "H100 NVL": {"bf16": 835.5, "fp32": 60.0},
    "H100 PCIe": {"bf16": 756.5, "fp32": 51.2},
    "H100": {"bf16": 989.4, "fp32": 66.9},  # SXM (names like "NVIDIA H100 80GB HBM3")
    "A100": {"bf16": 312.0, "fp32": 19.5},
}


def flops_per_token(num_params: int, n_layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token (forward and backward): 6 N + 12 L d T.

    Args:
        num_params: N, distinct parameters (a tied embedding counted once).
        n_layers: L, transformer blocks.
        d_model: d, the width (heads x head size).
        seq_len: T, tokens per sequence (the attention context).
    """
    for name, v in (("num_params", num_params), ("n_layers", n_layers), ("d_model", d_model), ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return 6.0 * num_params + 12.0 * n_layers * d_model * seq_len


def peak_for(device_name: str, precision: str) -> float | None:
    """The dense peak TFLOP/s of a known accelerator at a precision, or None (unknown, or a CPU).

    device_name: as ``torch.cuda.get_device_name`` says it, e.g. ``NVIDIA H100 80GB HBM3``.
    """
    name = device_name.upper()
    for key, peaks in PEAK_TFLOPS.items():
        if key.upper() in name:
            return peaks.get(precision)
    return None


def mfu(tokens_per_s: float, per_token: float, peak_tflops: float | None, devices: int = 1) -> float | None:
    """Achieved model FLOP/s over the peak of ``devices`` accelerators; None without a known peak."""
    if peak_tflops is None or not math.isfinite(tokens_per_s) or peak_tflops <= 0 or devices < 1:
        return None
    return tokens_per_s * per_token / (peak_tflops * 1e12 * devices)


__all__ = ["PEAK_TFLOPS", "flops_per_token", "mfu", "peak_for"]
