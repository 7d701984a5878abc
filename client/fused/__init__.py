"""kvpool.fused: a Llama-family model's forward with its layers' small kernels fused.

    import kvpool.fused
    kvpool.fused.install(paged_model, max_positions=4096)   # PagedModel.run_batch now runs FusedLlama

The engine installs it itself (``EngineConfig.fused_layers``).  What it
changes and why: ``kvpool.fused.llama``; the fused steps: ``kvpool.fused.ops``
(Triton on CUDA, plain torch on the CPU, where no Triton is imported).
"""

from __future__ import annotations

import logging

from ..errors import InvalidArgument
from .llama import FusedLlama, UnsupportedFusion, fusion_blocker

__all__ = ["FusedLlama", "UnsupportedFusion", "fusion_blocker", "install"]

log = logging.getLogger("kvpool.fused")


def install(paged_model, *, max_positions: int, mode: bool | None = True) -> bool:
    """Run ``paged_model``'s forwards through ``FusedLlama``; returns whether it now does.

    Args:
        paged_model: a ``kvpool.hf.PagedModel``.
        max_positions: the longest sequence it will run.
        mode: ``True``: fuse, and refuse a model that cannot be; ``None``: fuse
            on a GPU where the model can be, else leave it; ``False``: leave it.

    Raises:
        InvalidArgument: ``mode`` is ``True`` and the model cannot be fused (the message says why).
    """
    paged_model.fused = None
    if mode is False or (mode is None and paged_model.device.type != "cuda"):
        return False
    reason = fusion_blocker(paged_model.model)
    if reason is not None:
        if mode:
            raise InvalidArgument(f"fused layers cannot run {type(paged_model.model).__name__}: {reason}")
        log.info("running transformers' own layers: %s", reason)
        return False
    try:
        paged_model.fused = FusedLlama(paged_model.model, max_positions)
    except UnsupportedFusion as exc:
        if mode:
            raise InvalidArgument(f"fused layers cannot run it: {exc}") from None
        log.info("running transformers' own layers: %s", exc)
        return False
    return True
