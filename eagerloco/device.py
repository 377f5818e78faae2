"""Where the inner steps run and in what arithmetic: device, precision, compile, fused AdamW, MFU's peak.

Everything CUDA-only is behind the device's type, so a CPU run takes the path it always took (fp32, the default
AdamW); on CUDA the defaults are GPU training's: bf16 autocast (weights, gradients and optimizer states stay
FP32), fused AdamW, and scaled_dot_product_attention's FlashAttention kernel.
"""

from __future__ import annotations

import platform
import re
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from eagerloco.flops import peak_for

PRECISIONS = ("auto", "fp32", "bf16")
DEVICE_PATTERN = r"auto|cpu|cuda(:\d+)?"


class DeviceError(ValueError):
    """A device setting this machine cannot honour (config turns it into a ConfigError)."""


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The torch device of a ``--device`` setting (auto: the local rank's GPU when CUDA is available); DeviceError
    for an unknown name or cuda without CUDA."""
    if not isinstance(name, str) or not re.fullmatch(DEVICE_PATTERN, name):
        raise DeviceError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(f"--device {name} needs CUDA, which is not available here; use --device cpu (or auto)")
    if name == "cuda":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    index = int(name.split(":")[1])
    if index >= torch.cuda.device_count():
        raise DeviceError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", index)


def resolve_precision(precision: str, device: torch.device) -> str:
    """fp32 or bf16: auto is bf16 on CUDA and fp32 elsewhere (bf16 matmuls crawl on CPUs without
    AVX-512 BF16, such as the ones CI runs on)."""
    if precision not in PRECISIONS:
        raise DeviceError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def autocast(device: torch.device, precision: str) -> AbstractContextManager[Any]:
    """The context the forward pass runs in: bf16 autocast, or nothing at all for fp32."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


def inner_optimizer(params: Iterable[nn.Parameter], device: torch.device, **kwargs: Any) -> torch.optim.AdamW:
    """The inner AdamW: fused (one kernel for every tensor) on CUDA; PyTorch's default elsewhere, so
    that CPU runs keep their numbers."""
    if device.type == "cuda":
        kwargs["fused"] = True
    return torch.optim.AdamW(params, **kwargs)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA kernels run asynchronously; a CPU has nothing queued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    """What the device is, for summaries: the GPU's name, or the CPU's."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def peak_tflops(device: torch.device, precision: str, override: float | None = None) -> float | None:
    """The peak TFLOP/s MFU is measured against: ``--peak-tflops`` when given, else the table of
    known accelerators (:data:`eagerloco.flops.PEAK_TFLOPS`); None for a CPU or an unknown GPU."""
    if override is not None:
        return float(override)
    if device.type != "cuda":
        return None
    return peak_for(device_name(device), precision)


def compile_model(model: nn.Module) -> nn.Module:
    """The model compiled for the inner steps; it shares the module's parameters, so the outer
    algorithm, checkpoints and evaluation keep working on the plain module."""
    return torch.compile(model)  # type: ignore[return-value]
