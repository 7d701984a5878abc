"""Running the test client (client_proc.py) as a separate process."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = str(Path(__file__).with_name("client_proc.py"))


def run_client(socket: str, action: str, **args) -> dict:
    out = subprocess.run(
        [sys.executable, SCRIPT, socket, action, json.dumps(args)],
        capture_output=True, text=True, timeout=180,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def wait_for(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False
