"""Preemption through the tiers: swap sequences out, back in, and wait for bytes still arriving."""

from __future__ import annotations

import numpy as np

from .errors import FailedPrecondition
from .mapping import PoolMapping
from .mirror import Mirror
from .protocol import kvpool_pb2 as pb
from .session import Session
from .steps import Stepper


class Swaps:
    """``Client.swap_out``, ``swap_in`` and ``wait`` (the caller holds the client's lock)."""

    def __init__(self, session: Session, mirror: Mirror, mapping: PoolMapping, stepper: Stepper) -> None:
        self._session, self._mirror, self._mapping, self._stepper = session, mirror, mapping, stepper

    def swap_out(self, ids: list[int]) -> int:
        mirror = self._mirror
        for sid in ids:
            if sid in mirror.swapped:
                raise FailedPrecondition(f"sequence {sid} is already swapped out")
            mirror.state(sid)
        if any(mirror.seqs[sid].pending for sid in ids):
            self._stepper.step()  # the daemon knows every token before it copies the blocks
        self._mapping.sync_device()
        r = self._session.call("SwapOut", pb.SwapRequest(session=self._session.token, seq_ids=ids))
        mirror.swapped_out(ids)
        return r.blocks

    def swap_in(self, ids: list[int], *, wait: bool) -> list[np.ndarray]:
        mirror = self._mirror
        for sid in ids:
            if sid not in mirror.swapped:
                mirror.state(sid)
                raise FailedPrecondition(f"sequence {sid} is not swapped out")
        r = self._session.call("SwapIn", pb.SwapRequest(session=self._session.token, seq_ids=ids, no_wait=not wait))
        return [mirror.swapped_in(t) for t in r.sequences]

    def wait(self, ids: list[int] | None) -> dict[int, int]:
        mirror = self._mirror
        if ids is None:
            ids = [sid for sid, st in mirror.seqs.items() if st.arriving]
        if not ids:
            return {}
        r = self._session.call("Wait", pb.WaitRequest(session=self._session.token, seq_ids=ids))
        return {t.seq_id: mirror.arrived(t) for t in r.sequences if t.seq_id in mirror.seqs}
