"""A ``Step`` call's request and reply on the wire: packed arrays of ids, counts, tokens and blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from .protocol import kvpool_pb2 as pb
from .protocol.wire import I32, I64, U32, unpack


def step_request(token: str, *, pending, remote, written: Iterable[int], free_ids: list[int], free_written: bool,
                 reserve_target: int, reserve_return: list[int]) -> pb.StepRequest:
    """Pack one ``Step``: first the queued tokens (with the reserve blocks assigned to them), then the tokens
    whose copy-on-write is the daemon's call, then the sequences ``written`` names with no tokens.

    Args:
        pending: ``(seq id, SeqState)`` of the sequences with queued tokens.
        remote: ``(seq id, SeqState, tokens)`` sent without local blocks.
        written: more sequences whose KV is written.
        free_ids, free_written, reserve_target, reserve_return: as the request's fields.
    """
    ids, counts, toks_out, claim_counts, claims = [], [], [], [], []
    for sid, st in pending:
        ids.append(sid)
        counts.append(len(st.pending))
        toks_out.extend(st.pending)
        claim_counts.append(len(st.claims))
        claims.extend(st.claims)
    for sid, st, toks in remote:
        ids.append(sid)
        counts.append(len(toks))
        toks_out.extend(toks)
        claim_counts.append(0)
    named = set(ids)
    for sid in written:
        if sid not in named:
            named.add(sid)
            ids.append(sid)
            counts.append(0)
            claim_counts.append(0)
    return pb.StepRequest(
        session=token,
        seq_ids=np.asarray(ids, I64).tobytes(),
        token_counts=b"" if all(c == 1 for c in counts) else np.asarray(counts, I32).tobytes(),
        tokens=np.array(toks_out, U32).tobytes(),
        claim_counts=np.asarray(claim_counts, I32).tobytes() if claims else b"",
        claims=np.asarray(claims, I32).tobytes(),
        free_seq_ids=free_ids,
        free_unwritten=not free_written,
        reserve_target=reserve_target,
        reserve_return=np.asarray(reserve_return, I32).tobytes(),
    )


@dataclass
class StepReply:
    """A ``Step`` reply unpacked.

    ``changes``: per sequence whose table the daemon changed, ``(seq id,
    first position, count)``, the new ids taking ``count`` of ``blocks`` in
    order.  ``reserve_added``: new reserve blocks, lowest first.
    ``copies``: the copy-on-write (src, dst) pairs.
    """

    changes: list[tuple[int, int, int]]
    blocks: np.ndarray
    reserve_added: np.ndarray
    copies: tuple[tuple[int, int], ...]


def step_reply(r: pb.StepReply) -> StepReply:
    changes = zip(unpack(r.delta_seq_ids, I64).tolist(), unpack(r.delta_first, I32).tolist(),
                  unpack(r.delta_counts, I32).tolist())
    pairs = unpack(r.copies, I32).reshape(-1, 2)
    return StepReply(changes=list(changes), blocks=unpack(r.delta_blocks, I32),
                     reserve_added=unpack(r.reserve_added, I32),
                     copies=tuple((int(a), int(b)) for a, b in pairs))
