"""The systemd unit files, the sysusers snippet and the default config are valid.

``systemd-analyze`` and ``systemd-sysusers`` come with Debian's ``systemd``
package; without them these tests skip and say so.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvpoold.config import LIVE_KEYS, load_config

ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = ROOT / "systemd"
UNITS = ["kvpoold.service", "kvpoold@.service"]

needs_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is not installed (Debian/Ubuntu: apt-get install -y systemd)",
)


def _installed_units(tmp_path: Path) -> Path:
    """The units with ExecStart pointing at this machine's kvpoold (verify checks that it exists)."""
    kvpoold = shutil.which("kvpoold") or str(Path(sys.executable).parent / "kvpoold")
    if not Path(kvpoold).exists():
        pytest.skip("the kvpoold entry point is not installed (pip install -e .)")
    for name in UNITS:
        text = (SYSTEMD / name).read_text().replace("/opt/kvpool/bin/kvpoold", kvpoold)
        (tmp_path / name).write_text(text)
    return tmp_path


@needs_analyze
@pytest.mark.parametrize("unit", ["kvpoold.service", "kvpoold@0.service"])
def test_systemd_analyze_verify(tmp_path, unit):
    d = _installed_units(tmp_path)
    out = subprocess.run(["systemd-analyze", "verify", "--man=no", f"./{unit}"], cwd=d,
                         capture_output=True, text=True, timeout=120)
    # verify exits 0 on settings it merely ignores, so any complaint about our files fails the test
    complaints = [ln for ln in (out.stdout + out.stderr).splitlines() if "kvpoold" in ln]
    assert out.returncode == 0 and not complaints, out.stdout + out.stderr


@needs_analyze
def test_unit_is_hardened(tmp_path):
    d = _installed_units(tmp_path)
    out = subprocess.run(["systemd-analyze", "security", "--offline=yes", "./kvpoold.service"], cwd=d,
                         capture_output=True, text=True, timeout=120)
    if "--offline" in out.stderr and out.returncode:
        pytest.skip("this systemd-analyze has no --offline security check")
    m = re.search(r"Overall exposure level for kvpoold.service: ([0-9.]+)", out.stdout)
    assert m, out.stdout + out.stderr
    assert float(m.group(1)) <= 3.0, out.stdout


def test_unit_promises():
    """What the issue asks of the unit, line by line (also where systemd-analyze is missing)."""
    for name in UNITS:
        text = (SYSTEMD / name).read_text()
        settings = {ln.split("=", 1)[0] for ln in text.splitlines() if "=" in ln and not ln.startswith("#")}
        for key in ("Type", "WatchdogSec", "RuntimeDirectory", "StateDirectory", "User", "Group", "DeviceAllow",
                    "NoNewPrivileges", "ProtectSystem", "ReadWritePaths", "PrivateTmp", "ProtectHome", "ExecReload"):
            assert key in settings, f"{name} lacks {key}="
        assert "Type=notify\n" in text and "ProtectSystem=strict\n" in text
        for bad in ("PrivateIPC=", "PrivateDevices=", "ProtectProc=", "MemoryDenyWriteExecute=", "PrivateNetwork="):
            assert not any(ln.startswith(bad) for ln in text.splitlines()), f"{name} sets {bad}: breaks clients"


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None,
                    reason="systemd-sysusers is not installed (Debian/Ubuntu: apt-get install -y systemd)")
def test_sysusers_creates_user_and_group(tmp_path):
    (tmp_path / "etc").mkdir()
    out = subprocess.run(["systemd-sysusers", f"--root={tmp_path}", str(SYSTEMD / "kvpoold.sysusers")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    passwd = (tmp_path / "etc" / "passwd").read_text()
    group = (tmp_path / "etc" / "group").read_text()
    user = next(ln for ln in passwd.splitlines() if ln.startswith("kvpoold:")).split(":")
    gid = next(ln for ln in group.splitlines() if ln.startswith("kvpool:")).split(":")[2]
    assert user[3] == gid and user[5] == "/var/lib/kvpoold"  # primary group kvpool: it owns the socket
    unit = (SYSTEMD / "kvpoold.service").read_text()
    assert "User=kvpoold\n" in unit and "Group=kvpool\n" in unit


def test_default_config_file_is_valid():
    cfg = load_config(path=str(SYSTEMD / "kvpoold.toml"), env={}, flags={})
    assert cfg.socket == "/run/kvpoold/kvpoold.sock" and cfg.socket_mode == 0o660
    assert cfg.admin_socket_path() == "/run/kvpoold/kvpoold-admin.sock" and cfg.admin_socket_mode == 0o600
    text = (SYSTEMD / "kvpoold.toml").read_text()
    for key in LIVE_KEYS:  # every live key is marked as such where it is set
        line = next((ln for ln in text.splitlines() if re.match(rf"#? ?{key} =", ln)), None)
        assert line and "[live]" in line, key
    unit = (SYSTEMD / "kvpoold.service").read_text()
    stop = int(re.search(r"TimeoutStopSec=(\d+)s", unit).group(1))
    assert stop > cfg.shutdown_timeout  # systemd must not SIGKILL while clients are given time


def test_readme_documents_installation():
    text = (SYSTEMD / "README.md").read_text()
    for step in ("sysusers.d", "systemctl daemon-reload", "systemctl enable --now kvpoold", "kvpoold@",
                 "/etc/kvpoold/kvpoold.toml", "systemctl reload kvpoold", "kvpoolctl"):
        assert step in text, step
