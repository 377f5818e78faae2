"""Error feedback for compressed exchanges (section 10 of docs/algorithms.md): what a worker's exchanges
have not sent yet, carried into its next ones."""

from __future__ import annotations

import torch


class ErrorFeedback:
    """One worker's FP32 error-feedback buffers, one list per fragment, zero at the start (docs/algorithms.md, 10):
    :meth:`add` makes e <- beta * e + Delta, what is sent; :meth:`sent` takes the decoded payload away, e <- e - C."""

    def __init__(self, fragments: list[list[torch.Tensor]], beta: float) -> None:
        self.beta = beta
        self.buffers = [[torch.zeros_like(t, dtype=torch.float32) for t in frag] for frag in fragments]

    @torch.no_grad()
    def add(self, p: int, delta: list[torch.Tensor]) -> list[torch.Tensor]:
        """e <- beta * e + Delta for fragment p; returns the buffer (the exchange copies it at launch)."""
        for e, d in zip(self.buffers[p], delta, strict=True):
            e.mul_(self.beta).add_(d)
        return self.buffers[p]

    @torch.no_grad()
    def sent(self, p: int, payload: list[torch.Tensor]) -> None:
        """e <- e - C: what fragment p's exchange sent, as the others decode it, leaves the buffer."""
        for e, c in zip(self.buffers[p], payload, strict=True):
            e.sub_(c)

    @torch.no_grad()
    def clear(self) -> None:
        """Empty every buffer (a worker that joins with another's state: that worker's unsent rest is its own)."""
        for frag in self.buffers:
            for e in frag:
                e.zero_()

    def state(self) -> list[list[torch.Tensor]]:
        """Copies of the buffers, for a checkpoint."""
        return [[e.clone() for e in frag] for frag in self.buffers]

    @torch.no_grad()
    def load(self, saved: list[list[torch.Tensor]]) -> None:
        """Take the buffers of :meth:`state` (ValueError: shapes that do not match, or values not finite)."""
        if [[s.shape for s in frag] for frag in saved] != [[e.shape for e in frag] for frag in self.buffers]:
            raise ValueError("the saved error-feedback buffers do not match this model's fragments")
        if not all(bool(s.isfinite().all()) for frag in saved for s in frag):
            raise ValueError("the saved error-feedback buffers are not finite (NaN or inf): the state was saved "
                             "after the run diverged")
        for frag, frag_saved in zip(self.buffers, saved, strict=True):
            for e, s in zip(frag, frag_saved, strict=True):
                e.copy_(s)
