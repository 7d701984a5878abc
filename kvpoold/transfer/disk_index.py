"""The disk tier's index: ADD/DEL records, each with its own xxh32, appended to ``index.log`` and replayed at start."""

from __future__ import annotations

import struct

import xxhash

MAGIC = b"KVPIDX01"
RECORD = struct.Struct("<B3xI16sQQQ")  # op, layout id, hash, slot offset, block bytes, checksum
RECORD_CRC = struct.Struct("<I")
REC_BYTES = RECORD.size + RECORD_CRC.size
ADD, DEL = 1, 2


def record(op: int, gid: int, digest: bytes, offset: int, nbytes: int, csum: int) -> bytes:
    body = RECORD.pack(op, gid, digest, offset, nbytes, csum)
    return body + RECORD_CRC.pack(xxhash.xxh32_intdigest(body))


def replay(data: bytes) -> tuple[dict[tuple, tuple], int]:
    """The blocks an index log (``data``, after ``MAGIC``) leaves live, ``(layout id, digest) -> (slot offset,
    block bytes, checksum)``, and the bytes of a torn or damaged tail that were ignored.

    A later ADD for a slot supersedes an earlier one; a DEL forgets its block.
    """
    live: dict[tuple, tuple] = {}
    by_slot: dict[tuple, tuple] = {}
    pos = len(MAGIC)
    while pos + REC_BYTES <= len(data):
        body = data[pos:pos + RECORD.size]
        (crc,) = RECORD_CRC.unpack_from(data, pos + RECORD.size)
        if xxhash.xxh32_intdigest(body) != crc:
            break
        op, gid, digest, offset, nbytes, csum = RECORD.unpack(body)
        key = (gid, digest)
        if op == ADD:
            old = by_slot.get((gid, offset))
            if old is not None:
                live.pop(old, None)
            prev = live.pop(key, None)
            if prev is not None:
                by_slot.pop((gid, prev[0]), None)
            live[key] = (offset, nbytes, csum)
            by_slot[(gid, offset)] = key
        elif op == DEL:
            prev = live.pop(key, None)
            if prev is not None and by_slot.get((gid, prev[0])) == key:
                del by_slot[(gid, prev[0])]
        pos += REC_BYTES
    return live, max(0, len(data) - pos)
