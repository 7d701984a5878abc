"""The engine's figures, and what it reads about its model and daemon at start."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

_GAUGE = {"gauge": True}


@dataclass(frozen=True)
class EngineStats:
    """Queue lengths now (gauges), and counters since the engine started.

    ``after - before`` of two snapshots is the work done between them: each
    counter's difference, with the gauges (``waiting``, ``running``,
    ``swapped``) as ``after`` has them::

        before = engine.stats()
        engine.generate(prompts, params)
        delta = engine.stats() - before   # delta.generation_tokens: this call's tokens (if nothing else ran)
    """

    waiting: int = field(metadata=_GAUGE)
    running: int = field(metadata=_GAUGE)
    swapped: int = field(metadata=_GAUGE)
    preemptions: int  # swaps + recomputes
    swaps: int
    recomputes: int
    prefix_hit_tokens: int  # prompt tokens found in the pool at a request's first admission
    prompt_tokens: int
    generation_tokens: int
    finished_requests: int
    steps: int
    steps_ahead: int = 0  # steps planned before the last step's tokens were read back (overlapped steps)

    def __sub__(self, before: "EngineStats") -> "EngineStats":
        if not isinstance(before, EngineStats):
            return NotImplemented
        return replace(self, **{f.name: getattr(self, f.name) - getattr(before, f.name)
                                for f in fields(self) if not f.metadata.get("gauge")})


def has_host_tier(client) -> bool:
    """Whether the daemon keeps a host tier to swap preempted sequences into (its stats say)."""
    return any(t.tier == "host" and t.capacity_bytes > 0 for t in client.stats().tiers)


def eos_token_ids(model, tokenizer) -> set[int]:
    """The end-of-sequence ids of the model's generation config and of the tokenizer."""
    found: set[int] = set()
    for value in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                  getattr(tokenizer, "eos_token_id", None)):
        if value is None:
            continue
        found.update([value] if isinstance(value, int) else value)
    return found
