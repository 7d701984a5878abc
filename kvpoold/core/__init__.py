"""The pure core of kvpoold: block pool, page tables, prefix cache, placement.

Nothing here imports torch, CuPy, Numba, gRPC or touches files: it is
integers, token ids and hashes, testable on its own.
"""

from .block_pool import DEFAULT_CHUNK_BYTES, ChunkBudget, LayoutClass
from .errors import (
    InvalidArgument,
    KvpoolError,
    LayoutDoesNotFit,
    NotOwner,
    OutOfBlocks,
    TooManyClasses,
    UnknownSequence,
    WrongState,
)
from .layout import Geometry
from .manager import KVCacheManager
from .results import (
    BlockCopy,
    ClassStats,
    ExtendItem,
    ExtendDeltas,
    LookupResult,
    ManagerStats,
    SeqDelta,
    PageTable,
    ResizeResult,
    TierStats,
)
from .tiers import Move, Tier, TierPlacement

__all__ = [
    "DEFAULT_CHUNK_BYTES", "ChunkBudget", "LayoutClass", "InvalidArgument", "KvpoolError",
    "LayoutDoesNotFit", "NotOwner", "OutOfBlocks", "TooManyClasses", "UnknownSequence", "WrongState",
    "Geometry", "KVCacheManager", "BlockCopy", "ClassStats", "ExtendItem", "ExtendDeltas",
    "LookupResult", "ManagerStats", "SeqDelta", "PageTable", "ResizeResult", "TierStats", "Move", "Tier",
    "TierPlacement",
]
