"""What a caller may ask of the engine: per-request sampling, and the engine's own limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import InvalidArgument


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops.

    ``temperature`` 0 is greedy (top-k / top-p then do nothing).  ``top_k`` 0
    and ``top_p`` 1 keep the whole vocabulary.  ``seed`` makes a request's
    draws reproducible whatever else runs beside it; ``None`` draws a fresh
    seed.  ``stop`` strings need the engine's tokenizer; the text returned
    ends before the stop string.  ``stop_token_ids`` end a request like the
    model's eos tokens (kept in ``token_ids``, not in the text); with
    ``ignore_eos`` only ``stop_token_ids`` and ``stop`` end it early.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be >= 1; got {self.max_tokens}")
        if not self.temperature >= 0:
            raise InvalidArgument(f"temperature must be >= 0; got {self.temperature}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0 (0: off); got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgument(f"top_p must be in (0, 1]; got {self.top_p}")
        if any(not s for s in self.stop):
            raise InvalidArgument("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class EngineConfig:
    """The engine's limits per step and per sequence.

    ``max_num_batched_tokens``: tokens one forward computes (decode tokens
    first, then prefill chunks fill what is left).  ``max_num_seqs``:
    sequences in one forward.  ``max_model_len``: prompt plus output of one
    request (``None``: the model's ``max_position_embeddings``).
    ``flush_every``: the client's steps between daemon calls (see
    ``kvpool.Client``).  ``cuda_graphs``: on a GPU, decode steps replay CUDA
    graphs captured per batch-size bucket (``GraphRunner``); off, every step
    runs eagerly.  No effect on the CPU.  ``fused_layers``: run a
    Llama-family model (Llama, Mistral, Qwen2) through ``kvpool.fused``
    (merged QKV and gate/up matmuls, RMSNorm with the residual add, RoPE and
    SiLU-gate each one kernel); ``True``: always, refusing a model it cannot
    run; ``None`` (the default): on a GPU where the model is one it computes,
    off elsewhere (on an H100 it took 24-42% off a decode step's GPU time:
    benchmarks/NOTES-offline.md); ``False``: off.  ``overlap_steps``: read each
    step's tokens back after the next step is queued on the device
    (``StepLoop``), so host work runs beside the GPU; ``None`` (the default):
    on a GPU, off on the CPU (where the forward runs on the same cores; on an
    H100 the offline trace ran 1.42x faster: benchmarks/NOTES-offline.md);
    ``True``: always; ``False``: off.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    flush_every: int = 32
    eos_token_ids: tuple[int, ...] = field(default=())
    cuda_graphs: bool = True
    fused_layers: bool | None = None
    overlap_steps: bool | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise InvalidArgument("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise InvalidArgument("max_num_batched_tokens must be >= max_num_seqs (one decode token each)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidArgument("max_model_len must be >= 2")
