"""What the client and the daemon agree on, and nothing else: the shared vocabulary.

* ``kvpool.protocol.kvpool_pb2`` / ``kvpool_pb2_grpc``: the gRPC code generated
  from ``protos/kvpool.proto`` at build time (``scripts/gen_protos.py``; never
  edited or committed);
* ``kvpool.protocol.wire``: packed little-endian arrays, numpy <-> bytes;
* ``kvpool.protocol.errors``: the error classes, each with the name of the gRPC
  status it travels as (no gRPC import: the client maps statuses back in
  ``kvpool.errors``, the daemon's server maps errors to statuses);
* ``kvpool.protocol.layout``: what makes a layout valid (``check_layout``), the
  dtypes a kernel takes (``KV_DTYPE_ITEMSIZE``, the one table) and a block's
  shape and size: ``kvpool.Layout`` and the daemon's ``Geometry`` both use them;
* ``kvpool.protocol.arena``: ``ArenaDescriptor`` (how a client finds an arena's
  memory) and the dtype names a view of one may use;
* ``kvpool.protocol.stats``: the operator figures (class, tier, device, daemon,
  client), defined once: the daemon's core builds them, both sides convert
  them to and from their wire messages by field name;
* ``kvpool.protocol.sizes``: ``cdiv`` (blocks for tokens, chunks for bytes).

Both sides import from here; nothing here imports either side, nor gRPC or
Numba (the generated ``kvpool_pb2_grpc`` aside, which only gRPC users import).
"""

from .arena import DTYPE_ITEMSIZE, ArenaDescriptor

__all__ = ["DTYPE_ITEMSIZE", "ArenaDescriptor"]
