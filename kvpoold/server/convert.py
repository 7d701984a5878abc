"""Protobuf messages <-> the service's types: one converter per message, nothing else.

Requests become the arguments of one service call (numpy arrays for packed
columns, ``Geometry`` for a layout, ``StepCall`` for a step); results become
reply messages.  The operator figures convert by field name
(``kvpool.protocol.stats``).  A request that cannot be converted raises
``InvalidArgument``.
"""

from __future__ import annotations

import json

import numpy as np

from kvpool.protocol import kvpool_pb2 as pb
from kvpool.protocol.stats import to_message
from kvpool.protocol.wire import I32, I64, U32, unpack
from kvpoold.config import LIVE_KEYS, Config, config_as_dict
from kvpoold.core import Geometry, InvalidArgument
from kvpoold.core.results import LookupResult, PageTable

from .calls import AttachResult, DrainState, PoolResize, StepCall, StepResult


def tokens(data: bytes) -> np.ndarray:
    return unpack(data, U32, "tokens")


# -- sessions ------------------------------------------------------------------------------------
def attach_request(msg: pb.AttachRequest) -> tuple[str, str, Geometry, int, str]:
    """(name, model key ``model@revision``, geometry, pid, the client GPU's bus id)."""
    if not msg.HasField("layout"):
        raise InvalidArgument("attach needs a layout")
    lay = msg.layout
    if not lay.model_id:
        raise InvalidArgument("layout.model_id must be a non-empty string")
    geometry = Geometry(num_layers=lay.num_layers, num_kv_heads=lay.num_kv_heads, head_dim=lay.head_dim,
                        dtype=lay.dtype, block_size=lay.block_size or 16)
    model_key = f"{lay.model_id}@{lay.revision}" if lay.revision else lay.model_id
    return msg.name, model_key, geometry, msg.pid, msg.device_bus_id


def attach_reply(r: AttachResult, config: Config, version: str) -> pb.AttachReply:
    d = r.descriptor
    return pb.AttachReply(
        session=r.session.token,
        session_id=r.session.id,
        class_id=r.session.class_id,
        arena=pb.Arena(kind=d.kind, nbytes=d.nbytes, handle=d.handle, device=d.device, device_id=d.device_id,
                       chunk_bytes=d.chunk_bytes),
        num_blocks=r.num_blocks,
        block_bytes=r.block_bytes,
        max_reserve_blocks=config.max_reserve_blocks,
        grace_seconds=config.grace_seconds,
        daemon_version=version,
        backend=r.backend,
        max_blocks_per_session=config.max_blocks_per_session,
        lease_seconds=config.lease_seconds,
    )


# -- sequences -------------------------------------------------------------------------------------
def prompts(msg: pb.CreateRequest) -> list[tuple[np.ndarray, str]]:
    return [(tokens(p.tokens), p.extra_key) for p in msg.prompts]


def step_request(msg: pb.StepRequest) -> StepCall:
    claims_given = bool(msg.claim_counts) or bool(msg.claims)
    return StepCall(
        seq_ids=unpack(msg.seq_ids, I64, "seq_ids"),
        counts=unpack(msg.token_counts, I32, "token_counts").astype(np.int64) if msg.token_counts else None,
        tokens=tokens(msg.tokens),
        claim_counts=unpack(msg.claim_counts, I32, "claim_counts").astype(np.int64) if claims_given else None,
        claims=unpack(msg.claims, I32, "claims").astype(np.int64) if claims_given else None,
        free_ids=list(msg.free_seq_ids),
        free_written=not msg.free_unwritten,
        reserve_target=msg.reserve_target,
        reserve_return=unpack(msg.reserve_return, I32, "reserve_return").tolist(),
    )


def step_reply(r: StepResult) -> pb.StepReply:
    e = r.extend
    pairs = [x for c in e.copies for x in (c.src, c.dst)]
    return pb.StepReply(
        delta_seq_ids=e.delta_seq_ids.astype(I64).tobytes(),
        delta_first=e.delta_first.astype(I32).tobytes(),
        delta_counts=e.delta_counts.astype(I32).tobytes(),
        delta_blocks=e.delta_blocks.astype(I32).tobytes(),
        copies=np.asarray(pairs, I32).tobytes(),
        reserve_added=np.asarray(r.reserve_added, I32).tobytes(),
        blocks_released=r.blocks_released,
    )


def page_table(t: PageTable) -> pb.SequenceTable:
    return pb.SequenceTable(
        seq_id=t.seq_id,
        block_table=np.asarray(t.block_table, I32).tobytes(),
        num_tokens=t.num_tokens,
        num_cached_tokens=t.num_cached_tokens,
        swapped=t.swapped,
    )


def page_tables(tables: list[PageTable]) -> list[pb.SequenceTable]:
    return [page_table(t) for t in tables]


def tracked_tables(tracked) -> list[pb.SequenceTable]:
    """Tables with the tokens whose KV is there (or arriving) and the positions still arriving
    (``tier_pending.Tracked``)."""
    out = []
    for t in tracked:
        table = page_table(t.info)
        table.num_cached_tokens = t.valid_tokens
        arriving = t.arriving
        if arriving:
            table.arriving = np.asarray(arriving, I32).tobytes()
        out.append(table)
    return out


def lookup_reply(r: LookupResult) -> pb.LookupReply:
    return pb.LookupReply(num_cached_tokens=r.num_cached_tokens, device_tokens=r.device_tokens,
                          host_tokens=r.host_tokens, disk_tokens=r.disk_tokens, remote_tokens=r.remote_tokens)


def swap_out_reply(host_disk: tuple[int, int]) -> pb.SwapOutReply:
    host, disk = host_disk
    return pb.SwapOutReply(blocks=host + disk, host_blocks=host, disk_blocks=disk)


# -- operators -----------------------------------------------------------------------------------------
def stats_reply(st) -> pb.StatsReply:
    return to_message(st, pb.StatsReply())


def clients_reply(clients) -> pb.ClientsReply:
    reply = pb.ClientsReply()
    for c in clients:
        to_message(c, reply.clients.add())
    return reply


def evict_request(msg: pb.EvictRequest) -> tuple[int | None, int | None]:
    """(class id or None: every class, at most this many blocks or None: all)."""
    return (None if msg.class_id < 0 else msg.class_id), (msg.max_blocks or None)


def drain_reply(d: DrainState) -> pb.DrainReply:
    return pb.DrainReply(draining=d.draining, sessions=d.sessions, sequences=d.sequences)


def reset_reply(counts: tuple[int, int, int]) -> pb.ResetReply:
    sessions, released, evicted = counts
    return pb.ResetReply(sessions_dropped=sessions, blocks_released=released, cached_evicted=evicted)


def config_reply(config: Config) -> pb.GetConfigReply:
    return pb.GetConfigReply(config_json=json.dumps(config_as_dict(config), allow_nan=False), live_keys=sorted(LIVE_KEYS),
                             admin_socket=config.admin_socket_path())


def resize_request(msg: pb.ResizeRequest) -> tuple[int, int | None]:
    return msg.pool_bytes, None if msg.device < 0 else msg.device


def resize_reply(results: list[PoolResize]) -> pb.ResizeReply:
    return pb.ResizeReply(pools=[
        pb.PoolResize(device=r.device, target_bytes=r.target_bytes, pool_bytes=r.pool_bytes, met=r.met,
                      freed_bytes=r.freed_bytes, evicted_blocks=r.evicted_blocks, max_pool_bytes=r.max_pool_bytes)
        for r in results
    ])


def kv_event(ev) -> pb.KvEvent:
    """An ``events.KvEvent`` on the wire."""
    return pb.KvEvent(seq=ev.seq, kind=ev.kind, tier=ev.tier, from_tier=ev.from_tier, model_ids=ev.model_ids,
                      layout=ev.layout, block_hashes=ev.block_hashes, dropped=ev.dropped, time=ev.time,
                      device=ev.device)
