"""Block geometry of a layout class.

A *layout class* is everything that decides a block's size and byte order.
Models with the same geometry share one class (one arena, one id space) but
never blocks: the model id is part of every block hash.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidArgument

#: bytes per element of each dtype the pool can hold
DTYPE_SIZES = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

_LIMIT = 1 << 20  # any single dimension above this is certainly a mistake


@dataclass(frozen=True)
class Geometry:
    """The part of a layout that decides block size; the key of a layout class."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int = 16
    # who may share the class (its arena, blocks and prefix cache): decided by the daemon from the
    # client's kernel credentials (``tenant_by``), never by the client; "" when nobody is told apart
    tenant: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if type(value) is not int or not 0 < value <= _LIMIT:
                raise InvalidArgument(f"{name} must be a positive integer up to {_LIMIT}, got {value!r}")
        if self.dtype not in DTYPE_SIZES:
            raise InvalidArgument(f"dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}")

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """K and V of every layer for ``block_size`` tokens."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.block_size * self.itemsize

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Element shape of one block: [layer][k|v][head][token][dim] (head-major)."""
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    def describe(self) -> str:
        return (
            f"L{self.num_layers}-H{self.num_kv_heads}-D{self.head_dim}-"
            f"{self.dtype}-bs{self.block_size}"
        ) + (f" [{self.tenant}]" if self.tenant else "")
