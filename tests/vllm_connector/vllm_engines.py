"""A vLLM engine process (run_engine.py) driven over its stdin/stdout, for the tests and bench_vllm.py."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


class Engine:
    """run_engine.py (or another ``script`` of the same protocol) in a subprocess: JSON commands in,
    ``RESULT`` lines out (``llm_args`` go to it as ``--llm JSON``); ``env`` overrides the engine's
    environment (e.g. ``VLLM_CPU_KVCACHE_SPACE``, GiB, 1 here).
    """

    def __init__(self, name: str, model: str, socket: str | None, log_dir: Path, python: str = sys.executable,
                 llm_args: dict | None = None, *, script: Path = HERE / "run_engine.py",
                 env: dict | None = None):
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_LOGGING_STREAM": "ext://sys.stderr", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.name, self.log = name, log_dir / f"engine-{name}.log"
        args = [python, str(script), model] + ([socket] if socket else [])
        if llm_args:
            args += ["--llm", json.dumps(llm_args)]
        # a session of its own: vLLM's engine-core and worker processes are killed with it (below)
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(self.log, "w"), text=True, env=env, cwd="/",
                                     start_new_session=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _wait_for(self, prefix: str, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                line = None
            if line is None:
                raise AssertionError(f"engine {self.name}: no {prefix.strip()} line; its log:\n"
                                     + self.log.read_text()[-6000:])
            if line.startswith(prefix):
                return json.loads(line[len(prefix):])

    def ready(self, timeout: float = 400) -> float:
        self.ready_info = self._wait_for("READY ", timeout)
        return self.ready_info["startup_seconds"]

    def call(self, cmd: dict, timeout: float = 300):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._wait_for("RESULT ", timeout)

    def generate(self, prompts: list[list[int]], **kw) -> list[dict]:
        return self.call({"prompts": prompts, **kw})

    def metrics(self) -> dict[str, float]:
        return self.call({"metrics": True})

    def exit(self) -> None:
        """Asks the engine to stop (``close`` waits for it)."""
        if self.proc.poll() is None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.write('{"exit": true}\n')
                self.proc.stdin.close()
            except OSError:
                pass  # already gone

    def close(self) -> None:
        if self.proc.poll() is None:
            self.exit()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # not just the main process: no orphans left
                self.proc.wait()
