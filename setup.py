"""Build hook: the gRPC code of ``kvpool.protocol`` is generated at build time.

Everything else is in pyproject.toml.  ``build_py`` runs
``scripts/gen_protos.py`` (the one generator) so that every wheel, ``pip
install .`` and ``pip install -e .`` carry ``kvpool/protocol/kvpool_pb2*.py``:
a regular build writes them into the build folder (the checkout stays as it
is), an editable install into ``client/protocol/`` where the editable
``kvpool`` is imported from.  grpcio-tools comes from ``[build-system].requires``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTOCOL_PACKAGE = "kvpool.protocol"


def _generator():
    spec = importlib.util.spec_from_file_location("kvpool_gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithProtos(build_py):
    """``build_py`` that also generates the gRPC code from protos/kvpool.proto."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            out = Path(self.get_package_dir(PROTOCOL_PACKAGE))
            if not out.is_absolute():
                out = ROOT / out
        else:
            out = Path(self.build_lib, *PROTOCOL_PACKAGE.split("."))
        self._generated = [str(p) for p in _generator().generate(out)]

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        if self.editable_mode:
            return outputs
        return outputs + [p for p in getattr(self, "_generated", []) if p not in outputs]


setup(cmdclass={"build_py": BuildPyWithProtos})
