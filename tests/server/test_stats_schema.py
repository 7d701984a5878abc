"""The operator figures have one schema: the dataclasses of ``kvpool.protocol.stats`` and their wire messages."""

from __future__ import annotations

from dataclasses import fields

import pytest

from kvpool.protocol import kvpool_pb2 as pb
from kvpool.protocol.stats import (
    MESSAGE_NAMES,
    ClassStats,
    ClientInfo,
    DeviceStats,
    PoolStats,
    TierStats,
    from_message,
    to_message,
)


@pytest.mark.parametrize("cls", list(MESSAGE_NAMES), ids=lambda c: c.__name__)
def test_each_message_has_exactly_the_dataclass_fields(cls):
    message = getattr(pb, MESSAGE_NAMES[cls])
    assert {f.name for f in fields(cls)} == set(message.DESCRIPTOR.fields_by_name)


def _figures() -> PoolStats:
    cls = ClassStats(class_id=1, geometry="g", models=("a", "b"), block_bytes=4096, capacity_blocks=9,
                     total_blocks=8, used_blocks=7, reserved_blocks=1, cached_blocks=2, free_blocks=3,
                     cow_copies=4, evictions=5, prefix_queries=6, prefix_hits=7, prefix_query_tokens=80,
                     prefix_hit_tokens=40, promoted_blocks=1, demoted_blocks=2, swapped_out_blocks=3,
                     swapped_in_blocks=4, swapped_sequences=5, lost_blocks=6, mapped_bytes=8192,
                     released_bytes=4096, reserved_bytes=1 << 30, remote_hit_blocks=2, tenant="uid 7",
                     taken_bytes=12288, commit_seconds=0.125, release_seconds=0.0625)
    tier = TierStats("host", 1 << 20, 4096, 1, pinned_bytes=1, blocks_in=2, blocks_out=3, dropped_blocks=4,
                     corrupt_blocks=5, bytes_written=6, write_seconds=0.5, bytes_read=7, read_seconds=0.25,
                     failed_writes=8, failed_reads=9)
    dev = DeviceStats(index=0, device=-1, bus_id="", pool_bytes=1 << 22, free_bytes=1 << 21, sequences=3,
                      clients=2, classes=(cls,), tiers=(tier,), max_pool_bytes=1 << 23, memory="vmm",
                      physical_bytes=1 << 21, draining_bytes=1 << 20, freed_bytes=1 << 22, free_seconds=0.5)
    return PoolStats(backend="cpu", version="0", pool_bytes=1 << 22, chunk_bytes=1 << 16, free_bytes=1 << 21,
                     sequences=3, clients=2, uptime_seconds=1.5, rpcs=10, classes=(cls,), tiers=(tier,),
                     draining=True, devices=(dev,))


def test_figures_survive_the_wire_unchanged():
    st = _figures()
    assert from_message(PoolStats, pb.StatsReply.FromString(to_message(st, pb.StatsReply()).SerializeToString())) == st
    c = ClientInfo(1, "n", 2, "m@r", 0, 3, 4, True, 5.5, device="cpu")
    assert from_message(ClientInfo, to_message(c, pb.ClientInfo())) == c
