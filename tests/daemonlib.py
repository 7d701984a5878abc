"""A kvpoold in a real process, for tests/conftest.py's fixtures and for tests that need one of their own scope."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class Daemon:
    """A kvpoold subprocess on a temporary Unix socket."""

    def __init__(self, *args: str, env: dict | None = None, nofile: int | None = None) -> None:
        """``nofile``: the daemon's limit on open files (soft and hard), to run it out of descriptors."""
        self.dir = tempfile.mkdtemp(prefix="kvpool-test-")
        self.socket = os.path.join(self.dir, "kvpoold.sock")
        self.args = ["--socket", self.socket, "--pool-bytes", "64MiB", "--chunk-bytes", "64KiB",
                     "--grace-seconds", "1", *args]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.env.pop("KVPOOL_CONFIG", None)
        self.proc: subprocess.Popen | None = None
        self.log = os.path.join(self.dir, "kvpoold.log")
        self.nofile = nofile

    def start(self, timeout: float = 30.0) -> "Daemon":
        self._out = open(self.log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpoold", *self.args], stdout=self._out, stderr=subprocess.STDOUT,
            env=self.env, cwd=ROOT, preexec_fn=None if self.nofile is None else self._limit_files,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "kvpoold ready" in self.output():
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvpoold exited with {self.proc.returncode}:\n{self.output()}")
            time.sleep(0.05)
        raise RuntimeError(f"kvpoold did not become ready:\n{self.output()}")

    def start_refused(self, timeout: float = 120.0) -> str:
        """Start it expecting a refusal: exit 2 with one line on stderr (asserted); returns that line.

        A daemon that starts instead is stopped, and the assertion shows its output.
        """
        err_path = os.path.join(self.dir, "kvpoold.err")
        with open(self.log, "w") as out, open(err_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvpoold", *self.args], stdout=out, stderr=err,
                                         env=self.env, cwd=ROOT)
            deadline = time.monotonic() + timeout
            while self.proc.poll() is None and time.monotonic() < deadline:
                if "kvpoold ready" in self.output():
                    self.proc.terminate()
                time.sleep(0.05)
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
        with open(err_path) as f:
            stderr = f.read()
        assert self.proc.returncode == 2, f"exit {self.proc.returncode}:\n{self.output()}{stderr}"
        assert stderr.count("\n") == 1 and stderr.startswith("kvpoold: "), stderr
        return stderr

    def _limit_files(self) -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

    def output(self) -> str:
        with open(self.log) as f:
            return f.read()

    def stop(self, sig=signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
