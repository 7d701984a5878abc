"""A step whose forward and sampling are queued on the device: what it computes, and its tokens once read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import Request
from .scheduler import Plan


@dataclass
class Launched:
    """One step in flight.

    ``rows``: the rows of ``plan`` that sample a token (their last token
    completes what they know), in the order of ``tokens``, the sampled ids on
    the device.  ``host`` is their copy in host memory, complete once ``ready``
    (a CUDA event; ``None`` on the CPU, where ``host`` is ``tokens``).
    ``prefilled``: requests whose prompt this step completes.
    """

    plan: Plan
    rows: list[int]
    tokens: torch.Tensor | None
    host: torch.Tensor | None
    ready: torch.cuda.Event | None
    prefilled: list[Request]

    @classmethod
    def queue(cls, plan: Plan, rows: list[int], tokens: torch.Tensor | None, prefilled: list[Request]) -> "Launched":
        """Start the copy of ``tokens`` to the host; nothing waits for the device."""
        if tokens is None or tokens.device.type == "cpu":
            return cls(plan, rows, tokens, tokens, None, prefilled)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tokens.device))  # the copy's stream, whichever GPU is current
        return cls(plan, rows, tokens, host, ready, prefilled)

    @property
    def sampling(self) -> list[Request]:
        """The requests whose next token this step samples, in ``tokens``' order."""
        return [self.plan.requests[r] for r in self.rows]

    def read(self) -> list[int]:
        """The sampled ids (waits for the step on the device)."""
        if self.host is None:
            return []
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()
