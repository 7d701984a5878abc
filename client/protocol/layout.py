"""What makes a layout valid, and its block's size: one rule for ``kvpool.Layout`` and the daemon's ``Geometry``.

Standard library only, so the daemon's core applies the very checks the client did.
"""

from __future__ import annotations

from .errors import InvalidArgument

#: the dtypes a KV cache may hold -> bytes per element: exactly those a kernel of ``kvpool.kernels``
#: reads and writes (the names are torch's, ``torch.<name>``); a pool of any other could not be used
KV_DTYPE_ITEMSIZE: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
}

#: any single dimension above this is certainly a mistake
MAX_DIMENSION = 1 << 20

DIMENSIONS = ("num_layers", "num_kv_heads", "head_dim", "block_size")


def check_layout(layout, *, where: str = "") -> None:
    """Raise ``InvalidArgument`` unless ``layout``'s dimensions and dtype make a pool a kernel can use.

    Args:
        layout: anything with ``num_layers``, ``num_kv_heads``, ``head_dim``, ``block_size`` and ``dtype``.
        where: what to name the fields after in messages ("Layout." for the client's class).
    """
    for name in DIMENSIONS:
        value = getattr(layout, name)
        if type(value) is not int or not 0 < value <= MAX_DIMENSION:
            raise InvalidArgument(f"{where}{name} must be a positive integer up to {MAX_DIMENSION}, got {value!r}")
    if layout.dtype not in KV_DTYPE_ITEMSIZE:
        raise InvalidArgument(
            f"{where}dtype must be one of the dtypes a kernel takes, {sorted(KV_DTYPE_ITEMSIZE)}, got {layout.dtype!r}"
        )


def block_shape(layout) -> tuple[int, int, int, int, int]:
    """Element shape of one block: [layer][k|v][kv head][token][dim], the byte order inside a block."""
    return (layout.num_layers, 2, layout.num_kv_heads, layout.block_size, layout.head_dim)


def block_bytes(layout) -> int:
    """K and V of every layer for ``block_size`` tokens, in bytes."""
    n = KV_DTYPE_ITEMSIZE[layout.dtype]
    for d in block_shape(layout):
        n *= d
    return n
