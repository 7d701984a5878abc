"""One request's state inside the engine, and what it hands back to the caller."""

from __future__ import annotations

import enum
import secrets
import time
from dataclasses import dataclass

from .detok import TextTracker
from .params import SamplingParams
from .stream import RequestStream


class Status(enum.Enum):
    WAITING = "waiting"  # no sequence in the pool: new, or preempted by freeing (recompute)
    RUNNING = "running"  # a sequence in the pool, prefilling or decoding
    SWAPPED = "swapped"  # preempted to the host tier
    FINISHED = "finished"


@dataclass(frozen=True)
class RequestOutput:
    """One streamed update of a request.

    ``new_token_ids`` / ``new_text``: what this update adds; ``token_ids`` /
    ``text``: everything so far.  ``finish_reason``: ``None`` while running,
    else ``"stop"`` (eos, a stop id or string), ``"length"`` (max_tokens or
    the model's length), ``"abort"`` (cancelled) or ``"error"`` (``error``
    says why).
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None
    time_to_first_token: float | None = None  # seconds, on the final update
    time_per_output_token: float | None = None  # seconds between tokens after the first, on the final update

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Request:
    """A request's tokens, sequence and timing; touched by the engine thread only."""

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams, stream: RequestStream,
                 text: TextTracker | None) -> None:
        self.id = request_id
        self.prompt = prompt
        self.params = params
        self.stream = stream
        self.text = text
        self.output: list[int] = []
        self.status = Status.WAITING
        self.seq = None  # kvpool.Sequence while in the pool (running or swapped)
        self.num_computed = 0  # tokens whose K/V is in the pool and final (or queued on the device)
        self.unread = 0  # tokens sampled on the device and not read back yet (0, or 1-2 with overlapped steps)
        self.write_from = 0  # the first position whose K/V it writes (those below were found in the pool)
        self.num_cached_tokens = 0  # of the prompt, found in the pool at the first admission
        self.first_admitted = False
        self.finish_reason: str | None = None
        self.arrival = time.monotonic()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.num_preemptions = 0
        # a request's draws depend on its seed and output position only (``sampler.exponential_noise``)
        self.seed = params.seed if params.seed is not None else secrets.randbits(64)

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.output

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_tokens[start:end]`` without joining the prompt and the output first (a decode step's one token)."""
        n = len(self.prompt)
        if end <= start:
            return []
        if start >= n:
            return self.output[start - n:end - n]
        if end <= n:
            return self.prompt[start:end]
        return self.prompt[start:] + self.output[:end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def in_prefill(self) -> bool:
        """Its next forward computes more than one token (a prompt, or a recompute after preemption)."""
        return self.num_computed < self.num_tokens - 1

    def snapshot(self, new_tokens: list[int], new_text: str, error: str | None = None) -> RequestOutput:
        ttft = tpot = None
        if self.finish_time is not None and self.first_token_time is not None:
            ttft = self.first_token_time - self.arrival
            if len(self.output) > 1:
                tpot = (self.finish_time - self.first_token_time) / (len(self.output) - 1)
        return RequestOutput(
            request_id=self.id, new_token_ids=tuple(new_tokens), new_text=new_text,
            token_ids=tuple(self.output), text=self.text.text if self.text else "",
            finish_reason=self.finish_reason, num_prompt_tokens=len(self.prompt),
            num_cached_tokens=self.num_cached_tokens, error=error, time_to_first_token=ttft, time_per_output_token=tpot,
        )
