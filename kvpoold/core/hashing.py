"""Chained block hashes for the prefix cache.

hash(block i) = xxh3_128(hash(block i-1) || token bytes of block i), and the
chain starts at root = xxh3_128(model id, extra key).  A block's hash thus
names its whole prefix, so equal hashes mean equal prefixes (up to 2^-128
collisions), and blocks are only shared between identical model ids and extra
keys (e.g. a LoRA id).  Hashes are 16-byte ``bytes``: cheap dict keys, stable
across processes and restarts (the disk tier's index relies on that).

Token ids are packed as little-endian uint32 through ``array('I')``, which
also rejects non-integers and out-of-range ids in C.
"""

from __future__ import annotations

import sys
from array import array

import xxhash

from .errors import InvalidArgument

_digest = xxhash.xxh3_128_digest
_SWAP = sys.byteorder != "little"
HASH_BYTES = 16


def root_hash(model_id: str, extra_key: str = "") -> bytes:
    """The parent of a sequence's first block."""
    if not isinstance(model_id, str) or not model_id:
        raise InvalidArgument(f"model_id must be a non-empty string, got {model_id!r}")
    if not isinstance(extra_key, str):
        raise InvalidArgument(f"extra_key must be a string, got {type(extra_key).__name__}")
    return _digest(b"kvpool/1\0" + model_id.encode() + b"\0" + extra_key.encode())


def pack_tokens(tokens) -> array:
    """Validate token ids (ints in [0, 2^32)) and pack them; raises InvalidArgument."""
    if isinstance(tokens, (str, bytes, bytearray)):
        raise InvalidArgument("token ids must be a sequence of integers, not a string")
    try:
        packed = array("I", tokens)
    except OverflowError:
        raise InvalidArgument("token ids must be in [0, 2**32)") from None
    except TypeError as exc:
        raise InvalidArgument(f"token ids must be integers ({exc})") from None
    if _SWAP:
        packed.byteswap()
    return packed


def chain_hashes(parent: bytes, packed: array, block_size: int) -> list[bytes]:
    """Hashes of every *full* block of ``packed`` (partial tail ignored)."""
    raw = memoryview(packed).cast("B")
    step = block_size * 4
    out = []
    for start in range(0, (len(packed) // block_size) * step, step):
        parent = _digest(parent + raw[start : start + step])
        out.append(parent)
    return out
