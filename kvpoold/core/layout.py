"""Block geometry of a layout class.

A *layout class* is everything that decides a block's size and byte order.
Models with the same geometry share one class (one arena, one id space) but
never blocks: the model id is part of every block hash.  What makes one valid
is the client's rule too (``kvpool.protocol.layout``): a dtype no kernel takes
is refused here, not when a kernel first meets the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.protocol import layout as rules


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
        rules.check_layout(self)

    @property
    def itemsize(self) -> int:
        return rules.KV_DTYPE_ITEMSIZE[self.dtype]

    @property
    def block_bytes(self) -> int:
        """K and V of every layer for ``block_size`` tokens."""
        return rules.block_bytes(self)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Element shape of one block: [layer][k|v][head][token][dim] (head-major)."""
        return rules.block_shape(self)

    def describe(self) -> str:
        return (
            f"L{self.num_layers}-H{self.num_kv_heads}-D{self.head_dim}-"
            f"{self.dtype}-bs{self.block_size}"
        ) + (f" [{self.tenant}]" if self.tenant else "")
