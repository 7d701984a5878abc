"""The model layout a client registers when it attaches."""

from __future__ import annotations

from dataclasses import dataclass

from .protocol import layout as rules
from .protocol.errors import InvalidArgument


@dataclass(frozen=True)
class Layout:
    """What a model's KV cache looks like.

    Blocks are shared between processes only when ``model_id`` and
    ``revision`` are equal (and the geometry, which follows from them).
    One block holds K and V of every layer for ``block_size`` tokens.
    ``dtype`` is one a kernel takes (``kvpool.protocol.layout.KV_DTYPE_ITEMSIZE``).
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    block_size: int = 16
    revision: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise InvalidArgument("Layout.model_id must be a non-empty string")
        rules.check_layout(self, where="Layout.")

    @property
    def itemsize(self) -> int:
        return rules.KV_DTYPE_ITEMSIZE[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """[layer][k|v][kv head][token][dim]: the byte order inside a block."""
        return rules.block_shape(self)

    @property
    def block_bytes(self) -> int:
        return rules.block_bytes(self)
