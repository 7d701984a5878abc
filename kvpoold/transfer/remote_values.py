"""The remote tier's keys and values: a layout's namespace, a value's header and check, the write protocol.

A block's key is ``<prefix>:<layout tag>:<block name>``; a value is a header
(magic, version, check, payload bytes, the layout it was written with) and the
block's bytes.  Without a secret the name is the block hash in hex and the
check an xxh3-64 checksum; with one, tag, name and check are HMAC-SHA256 with
keys derived from the secret and the layout (``remote`` says why).
"""

from __future__ import annotations

import hmac
import struct

import xxhash

MAGIC = b"KVPR"
CHECKSUMMED = 1  # the version of a value written without a secret: an xxh3-64 checksum of the payload
AUTHENTICATED = 2  # the version of a value written with one: an HMAC-SHA256 tag of its key and payload
_PROLOGUE = struct.Struct("<4sB")  # magic, version
_HEADERS = {  # magic, version, the check, payload bytes, layout length
    CHECKSUMMED: struct.Struct("<4sBxxxQQH"),
    AUTHENTICATED: struct.Struct("<4sBxxx32sQH"),
}
NAME_BYTES = 16  # of a keyed block name: as many as a block hash has, unguessable without the secret


class Namespace:
    """The keys of one layout (geometry and tenant) in the store, and the header and check of its values.

    With a ``secret``, three keys are derived from it and the layout (so one set per tenant): one names the
    layout's tag, one the blocks (``key``), one seals the values (``head``, ``decode``).
    """

    __slots__ = ("prefix", "layout", "block_bytes", "_name_key", "_seal_key")

    def __init__(self, key_prefix: str, layout: str, block_bytes: int, secret: bytes | None = None) -> None:
        self.layout = layout.encode()
        self.block_bytes = block_bytes
        if secret is None:
            self._name_key = self._seal_key = None
            tag = xxhash.xxh3_64_hexdigest(self.layout)
        else:
            self._name_key = derive_key(secret, b"name", self.layout)
            self._seal_key = derive_key(secret, b"seal", self.layout)
            tag = derive_key(secret, b"tag", self.layout)[:8].hex()
        self.prefix = f"{key_prefix}:{tag}:".encode()

    @property
    def authenticated(self) -> bool:
        """Whether values are sealed with a secret's tag (else checksummed)."""
        return self._seal_key is not None

    def key(self, digest: bytes) -> bytes:
        if self._name_key is None:
            return self.prefix + digest.hex().encode()
        return self.prefix + hmac.digest(self._name_key, digest, "sha256")[:NAME_BYTES].hex().encode()

    def tag(self, key: bytes, view: memoryview) -> bytes:
        """The HMAC-SHA256 tag of the value of ``key`` holding ``view``: it binds the payload to that key
        (a value copied to another key of the tenant does not verify there)."""
        mac = hmac.new(self._seal_key, len(key).to_bytes(2, "little") + key, "sha256")
        mac.update(view)
        return mac.digest()

    def head(self, key: bytes, view: memoryview) -> bytes:
        """What the value of ``key`` holds before its payload ``view`` (bytes): the header and the layout."""
        if self._seal_key is None:
            check, version = xxhash.xxh3_64_intdigest(view), CHECKSUMMED
        else:
            check, version = self.tag(key, view), AUTHENTICATED
        return _HEADERS[version].pack(MAGIC, version, check, len(view), len(self.layout)) + self.layout


def derive_key(secret: bytes, purpose: bytes, layout: bytes) -> bytes:
    """A key for one ``purpose`` in one layout's namespace: HMAC-SHA256(secret, purpose NUL layout)."""
    return hmac.digest(secret, b"kvpool-remote/1 " + purpose + b"\0" + layout, "sha256")


def layout_string(geometry: dict) -> str:
    """A canonical text of a geometry dict (the block format version first)."""
    return "kvpool-block/1 " + " ".join(f"{k}={geometry[k]}" for k in sorted(geometry))


def encode(ns: Namespace, key: bytes, payload) -> bytes:
    """The value of ``key``: header, layout, payload (one copy of the payload; the single-server write path
    sends the head and the payload as separate buffers instead, ``pack_sets``)."""
    view = memoryview(payload).cast("B")
    return ns.head(key, view) + view


def pack_sets(batch: list, ttl: int) -> tuple[list, int]:
    """``SET key value [EX ttl]`` for every (key, namespace, payload) of ``batch``, in the wire protocol (RESP),
    without copying a payload: a list of buffers (bytes holding the protocol, each value's head and the
    command's tail, and a view of each payload between them) and the value bytes it holds.

    A value is exactly ``encode``'s: the server stores the head and the payload as one string.
    """
    tail = b"\r\n$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(ttl)), ttl) if ttl > 0 else b"\r\n"
    start = b"*5\r\n$3\r\nSET\r\n$" if ttl > 0 else b"*3\r\n$3\r\nSET\r\n$"
    out = []
    before = b""  # the previous command's tail goes with this one's start: one small buffer per block
    sent = 0
    for k, ns, payload in batch:
        view = memoryview(payload).cast("B")
        h = ns.head(k, view)
        n = len(h) + len(view)
        out.append(b"%s%s%d\r\n%s\r\n$%d\r\n%s" % (before, start, len(k), k, n, h))
        out.append(view)
        before = tail
        sent += n
    out.append(before)
    return out, sent


def decode(ns: Namespace, key: bytes, value: bytes) -> memoryview | None:
    """The payload of the value of ``key``, or None when it is not a whole block of ``ns``'s layout whose
    check verifies (with a secret: a tag made with it for this key, compared in constant time)."""
    if value is None or len(value) < _PROLOGUE.size:
        return None
    magic, version = _PROLOGUE.unpack_from(value)
    if magic != MAGIC or version != (AUTHENTICATED if ns.authenticated else CHECKSUMMED):
        return None
    header = _HEADERS[version]
    if len(value) < header.size:
        return None
    _, _, check, nbytes, nlayout = header.unpack_from(value)
    start = header.size + nlayout
    if nbytes != ns.block_bytes or len(value) != start + nbytes:
        return None
    if nlayout != len(ns.layout) or not value.startswith(ns.layout, header.size):
        return None
    payload = memoryview(value)[start:]
    if ns.authenticated:
        return payload if hmac.compare_digest(check, ns.tag(key, payload)) else None
    return payload if xxhash.xxh3_64_intdigest(payload) == check else None
