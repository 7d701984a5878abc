"""Client strings: bounded at the service boundary and escaped in the daemon's log."""

from __future__ import annotations

import numpy as np
import pytest

import kvpool
from kvpoold.server.logsafe import printable


def _layout(model: str = "m", **kw) -> kvpool.Layout:
    return kvpool.Layout(model, num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_size=4, **kw)


def test_printable_escapes_and_truncates():
    assert printable("a\nERROR forged\x1b[31m") == "a\\nERROR forged\\x1b[31m"
    assert printable("x" * 1000, 10) == "x" * 10 + "...[990 more chars]"
    assert printable("Mistral-7B") == "Mistral-7B"


def test_newline_in_model_id_does_not_forge_a_log_line(daemon):
    c = kvpool.connect(daemon.socket, layout=_layout("evil\nERROR kvpoold: forged line"), name="a\rb")
    c.close()
    lines = daemon.output().splitlines()
    assert not any(line.startswith("ERROR kvpoold: forged") for line in lines), lines
    assert any("evil\\nERROR kvpoold: forged line" in line for line in lines)


@pytest.mark.parametrize("field", ["name", "model_id", "revision"])
def test_long_strings_are_refused_and_not_logged(daemon, field):
    big = "n" * (8 << 20)
    kw = {"name": "ok"}
    layout = _layout()
    if field == "name":
        kw["name"] = big
    elif field == "model_id":
        layout = _layout(big)
    else:
        layout = _layout(revision=big)
    with pytest.raises(kvpool.InvalidArgument, match="max_string_bytes"):
        kvpool.connect(daemon.socket, layout=layout, **kw)
    assert len(daemon.output()) < 100_000


def test_long_extra_key_is_refused(daemon):
    c = kvpool.connect(daemon.socket, layout=_layout(), name="extra")
    try:
        with pytest.raises(kvpool.InvalidArgument, match="extra_key"):
            c.create_sequences([np.arange(8, dtype=np.uint32)], extra_key="k" * 5000)
        c.create_sequences([np.arange(8, dtype=np.uint32)], extra_key="k" * 4000)  # under 4 x max_string_bytes
    finally:
        c.close()
