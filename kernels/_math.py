"""Integer arithmetic the kernels' host code shares (standard library only)."""


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` in exact integer arithmetic, for ``b > 0``."""
    return -(-a // b)
