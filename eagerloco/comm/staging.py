"""Payloads between the parameters' device and the outer group's transport, without making the compute stream or
the training thread wait.

gloo: the encoded payload goes to pinned host memory on a copy stream, the communication thread waits on its
event, and the mean comes back pinned to move to the device asynchronously. NCCL: the payload stays on the device
and the communication thread's stream waits for the encode's event. On a CPU the payload is the tensor itself.
"""

from __future__ import annotations

from typing import Any

import torch


class Staging:
    """One communicator's streams for moving payloads off and onto ``device``; ``on_device``: the transport works on
    device tensors (NCCL), else on host tensors (gloo)."""

    def __init__(self, device: torch.device | str | None, on_device: bool) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.on_device = on_device and self.cuda
        self.stream: Any = torch.cuda.Stream(self.device) if self.cuda else None

    def enter_thread(self) -> None:
        """Called first on the communication thread: its device and (NCCL) its own stream."""
        if self.cuda:
            torch.cuda.set_device(self.device)
            if self.on_device:
                torch.cuda.set_stream(self.stream)

    def send(self, payload: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """(what the transport moves, the event it waits for first, or None); nothing here waits on the host."""
        if payload.device.type != "cuda":
            return payload.cpu(), None
        compute = torch.cuda.current_stream(payload.device)
        ready = torch.cuda.Event()
        if self.on_device:
            ready.record(compute)  # the communication thread's stream waits for the encode
            return payload, ready
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            host = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=True)
            host.copy_(payload, non_blocking=True)
            ready.record(self.stream)
        payload.record_stream(self.stream)  # not reused by the compute stream before the copy read it
        return host, ready

    def before_collective(self, ready: Any) -> None:
        """On the communication thread: order the collective after the payload is in place."""
        if ready is None:
            return
        if self.on_device:
            torch.cuda.current_stream(self.device).wait_event(ready)
        else:
            ready.synchronize()  # the copy to pinned memory: only this thread waits

    def received(self, mean: torch.Tensor | None) -> tuple[torch.Tensor | None, Any]:
        """On the communication thread: (the mean, its event or None; None for a barrier's); a host mean bound for
        a GPU is pinned here, so that its copy to the device can be asynchronous."""
        if mean is None or not self.cuda:
            return mean, None
        if mean.device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            return mean, done
        return (mean if mean.is_pinned() else mean.pin_memory()), None

    def deliver(self, mean: torch.Tensor, done: Any, device: torch.device) -> torch.Tensor:
        """On the training thread: the mean on the parameters' device, ordered on its current stream."""
        if mean.device.type == "cuda":
            stream = torch.cuda.current_stream(mean.device)
            if done is not None:
                stream.wait_event(done)
            mean.record_stream(stream)
            return mean if mean.device == device else mean.to(device)
        if device.type == "cuda":
            return mean.to(device, non_blocking=mean.is_pinned())
        return mean
