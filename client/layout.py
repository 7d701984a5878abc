"""The model layout a client registers when it attaches."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidArgument

DTYPES = ("float16", "bfloat16", "float32", "float8_e4m3fn")


@dataclass(frozen=True)
class Layout:
    """What a model's KV cache looks like.

    Blocks are shared between processes only when ``model_id`` and
    ``revision`` are equal (and the geometry, which follows from them).
    One block holds K and V of every layer for ``block_size`` tokens.
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
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise InvalidArgument(f"Layout.{name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"Layout.dtype must be one of {DTYPES}, got {self.dtype!r}")

    @property
    def itemsize(self) -> int:
        return 1 if self.dtype.startswith("float8") else 4 if self.dtype == "float32" else 2

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """[layer][k|v][kv head][token][dim]: the byte order inside a block."""
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def block_bytes(self) -> int:
        n = self.itemsize
        for d in self.block_shape:
            n *= d
        return n
