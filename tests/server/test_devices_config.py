"""``--devices``: parsing, clear errors for bad lists, and what the CPU backend does with it."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvpool
from kvpoold.config import ConfigError, load_config


@pytest.mark.parametrize("value, want", [
    ("0", (0,)), ("0,1", (0, 1)), (" 1, 0 ", (1, 0)), ([2, 3], (2, 3)), (1, (1,)),
])
def test_device_lists(value, want):
    assert load_config(env={}, flags={"devices": value}).devices == want


@pytest.mark.parametrize("value, why", [
    ("0,0", "GPU 0 is listed twice"),
    ("0,x", "expected GPU ordinals"),
    ("-1", "expected GPU ordinals"),
    ("0-3", "no ranges"),
    ("", "expected GPU ordinals"),
    ("0,,1", "no gaps"),
    (True, "expected GPU ordinals"),
])
def test_bad_device_lists_name_key_value_and_source(value, why):
    with pytest.raises(ConfigError, match=why) as e:
        load_config(env={}, flags={"devices": value})
    assert str(e.value).startswith(f"devices = {value!r} (from --devices)")


def test_devices_from_the_file_and_the_environment(tmp_path):
    f = tmp_path / "k.toml"
    f.write_text("devices = [0, 1]\n")
    assert load_config(path=str(f), env={}, flags={}).devices == (0, 1)
    with pytest.raises(ConfigError, match=r"\(from \$KVPOOL_DEVICES\): GPU 1 is listed twice"):
        load_config(path=str(f), env={"KVPOOL_DEVICES": "1,1"}, flags={})


def test_help_says_devices_are_per_gpu_and_ignored_on_cpu():
    out = subprocess.run([sys.executable, "-m", "kvpoold", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    assert "one pool per GPU" in text and "Ignored by the cpu backend" in text


def test_bad_devices_stop_the_daemon_with_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvpoold", "--socket", str(tmp_path / "s.sock"), "--backend", "cuda",
                          "--devices", "0,0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "GPU 0 is listed twice" in out.stderr and out.stderr.count("\n") == 1


def test_cpu_backend_keeps_one_pool_whatever_devices_says(daemon_factory):
    d = daemon_factory("--devices", "0,1")
    assert "ignored by the cpu backend" in d.output()
    layout = kvpool.Layout("dev", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)
    with kvpool.connect(d.socket, name="cpu", layout=layout) as c:
        c.create_sequence(range(5))
        st = c.stats()
        (dev,) = st.devices
        assert (dev.device, dev.bus_id, dev.clients, dev.sequences) == (-1, "", 1, 1)
        assert dev.classes == st.classes and dev.pool_bytes == st.pool_bytes == 64 << 20
        with kvpool.Connection(d.socket) as conn:
            (info,) = conn.clients()
        assert info.device == "cpu"
