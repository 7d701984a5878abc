"""What the client and the daemon agree on, and nothing else: the shared vocabulary.

* ``kvpool.protocol.kvpool_pb2`` / ``kvpool_pb2_grpc``: the gRPC code generated
  from ``protos/kvpool.proto`` at build time (``scripts/gen_protos.py``; never
  edited or committed);
* ``kvpool.protocol.wire``: packed little-endian arrays, numpy <-> bytes;
* ``kvpool.protocol.arena``: ``ArenaDescriptor`` (how a client finds an arena's
  memory) and the dtype names a layout may use;
* ``kvpool.protocol.stats``: the operator figures (class, tier, device, daemon,
  client), defined once: the daemon's core builds them, both sides convert
  them to and from their wire messages by field name;
* ``kvpool.protocol.sizes``: ``cdiv`` (blocks for tokens, chunks for bytes).

Both sides import from here; nothing here imports either side.
"""

from .arena import DTYPE_ITEMSIZE, ArenaDescriptor

__all__ = ["DTYPE_ITEMSIZE", "ArenaDescriptor"]
