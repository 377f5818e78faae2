"""Model FLOPs per token, the peak of known accelerators, and MFU; torch-free arithmetic.

MFU (PaLM appendix B) counts the FLOPs the model needs: 6 N per token for the weight matmuls (a tied embedding
counted once) plus 12 L d T for attention over the full T x T square, as nanoGPT and most published MFUs count it.
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
    """Training FLOPs per token, 6 N + 12 L d T (N distinct parameters, L blocks, d the width, T the context)."""
    for name, v in (("num_params", num_params), ("n_layers", n_layers), ("d_model", d_model), ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return 6.0 * num_params + 12.0 * n_layers * d_model * seq_len


def peak_for(device_name: str, precision: str) -> float | None:
    """The dense peak TFLOP/s of an accelerator named as ``torch.cuda.get_device_name`` does, or None (unknown, CPU)."""
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
