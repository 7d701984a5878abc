"""Integer arithmetic on sizes that both sides and the kernels' host code share (standard library only)."""


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` in exact integer arithmetic, for ``b > 0``: blocks for tokens, chunks for bytes."""
    return -(-a // b)
