"""What a caller holds of the client's sequences, and the checks on what it passes in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence as Seq

import numpy as np

from .errors import InvalidArgument
from .protocol.wire import U32

if TYPE_CHECKING:
    from .client import Client
    from .mirror import SeqState

Tokens = Seq[int] | np.ndarray

_MAX_TOKEN = 0xFFFFFFFF


@dataclass(frozen=True)
class ExtendResult:
    """What an ``extend`` did.

    ``copies`` are the copy-on-write (src, dst) block copies; with
    ``run_copies=True`` (the default) they were already run on the pool.
    ``rpc`` says whether the daemon was called.
    """

    copies: tuple[tuple[int, int], ...]
    rpc: bool


class Sequence:
    """A handle on one of this client's sequences (reads the client's mirror)."""

    __slots__ = ("_client", "id")

    def __init__(self, client: "Client", seq_id: int) -> None:
        self._client = client
        self.id = seq_id

    def _state(self) -> "SeqState":
        return self._client._mirror.state(self.id)

    @property
    def block_table(self) -> np.ndarray:
        """Physical block ids, one per ``block_size`` tokens (a copy)."""
        return np.asarray(self._state().blocks, np.int32)

    @property
    def num_tokens(self) -> int:
        return self._state().num_tokens

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens that were already in the prefix cache at creation (their KV is present).

        After ``swap_in``: the tokens whose KV came back (all of them, unless
        bytes were lost, e.g. a bad checksum on disk: recompute from there).
        """
        return self._state().num_cached

    @property
    def swapped(self) -> bool:
        """Swapped out (``Client.swap_out``): no block table until ``Client.swap_in``."""
        return self.id in self._client._mirror.swapped

    @property
    def arriving(self) -> list[int]:
        """Block-table positions whose bytes are still on their way (``wait=False``); ``Client.wait`` them."""
        return list(self._state().arriving)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and other.id == self.id and other._client is self._client

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"Sequence(id={self.id}, num_tokens={self.num_tokens})"


def seq_ids(seqs) -> list[int]:
    """Sequence ids of one sequence or id, or of an iterable of them."""
    if isinstance(seqs, (Sequence, int)):
        seqs = [seqs]
    return [s.id if isinstance(s, Sequence) else int(s) for s in seqs]


def token_array(values, what: str = "token ids") -> np.ndarray:
    """Token ids as a checked ``uint32`` array (the wire's type)."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise InvalidArgument(f"{what} must be a flat sequence of integers")
    if arr.size == 0:
        return np.zeros(0, U32)
    if arr.dtype.kind not in "iu":
        raise InvalidArgument(f"{what} must be integers, got {arr.dtype}")
    if arr.min() < 0 or arr.max() > _MAX_TOKEN:
        raise InvalidArgument(f"{what} must be in [0, 2**32)")
    return arr.astype(U32, copy=False)


def token_list(values) -> list[int]:
    """Token ids as a list of Python ints, checked; cheap for the short lists of a decode step."""
    if type(values) is list:
        for t in values:
            if type(t) is not int or not 0 <= t <= _MAX_TOKEN:
                break
        else:
            return values
    return token_array(values).tolist()
