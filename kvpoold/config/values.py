"""Configuration values as written (TOML, environment, flags) -> Python values: sizes, numbers, GPU lists."""

from __future__ import annotations

import math
import re
from typing import Any

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3, "ti": 1024**4, "tib": 1024**4,
}



def parse_bytes(value: Any) -> int:
    """``2GiB``, ``512MiB``, ``1.5G``, ``4096`` -> bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a size like 2GiB")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("sizes cannot be negative")
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError("expected a size like 2GiB, 512MiB, 1.5G or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_float(value: Any) -> float:
    """A finite number: NaN compares false with every bound and infinity overflows timers."""
    if isinstance(value, bool):
        raise ValueError("expected a number")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError("must be a finite number (not nan or inf)")
    return out


def parse_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("expected an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("expected an integer")
        return int(value)
    return int(value)


def parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def parse_devices(value: Any) -> tuple[int, ...]:
    """``0``, ``0,1``, ``[0, 1]`` -> (0, 1): the GPUs one daemon serves, one pool each (cuda backend)."""
    if isinstance(value, bool):
        raise ValueError("expected GPU ordinals like 0 or 0,1")
    if isinstance(value, int):
        items = [value]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        items = str(value).split(",")
    texts = [str(v).strip() for v in items]
    if not texts or any(not t.isdigit() for t in texts) or any(isinstance(v, bool) for v in items):
        raise ValueError("expected GPU ordinals like 0 or 0,1 (comma-separated, no gaps, no ranges)")
    out = tuple(int(t) for t in texts)
    dup = sorted({d for d in out if out.count(d) > 1})
    if dup:
        raise ValueError(f"GPU {dup[0]} is listed twice: each GPU gets one pool")
    return out


def parse_mode(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return int(str(value), 8)

