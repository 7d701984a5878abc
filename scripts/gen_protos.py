#!/usr/bin/env python3
"""Generate the Python gRPC code from protos/kvpool.proto (``kvpool.protocol.kvpool_pb2*``).

The one generator of that code: the build (``setup.py``'s ``build_py``) calls
``generate`` for every wheel, ``pip install .`` and ``pip install -e .`` (the
editable install writes into ``client/protocol/``).  The files are never
edited or committed.  Run this by hand only after changing the .proto in an
editable checkout: ``python scripts/gen_protos.py [OUT_DIR]``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "protos" / "kvpool.proto"
OUT = ROOT / "client" / "protocol"  # the package kvpool.protocol
#: the files ``generate`` writes into its output folder
GENERATED = ("kvpool_pb2.py", "kvpool_pb2.pyi", "kvpool_pb2_grpc.py")


def generate(out: Path = OUT, proto: Path = PROTO) -> list[Path]:
    """Write ``GENERATED`` into ``out``; returns their paths (RuntimeError if protoc fails)."""
    try:
        import grpc_tools
        from grpc_tools import protoc
    except ImportError:
        raise RuntimeError("gen_protos: grpcio-tools is missing; install it with: pip install grpcio-tools") from None

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{proto.parent}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        str(proto),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"gen_protos: protoc failed on {proto}")
    # protoc writes a top-level import; the package needs a relative one
    grpc_file = out / "kvpool_pb2_grpc.py"
    text = re.sub(r"^import kvpool_pb2 as", "from . import kvpool_pb2 as", grpc_file.read_text(), flags=re.M)
    grpc_file.write_text(text)
    return [out / name for name in GENERATED]


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else OUT
    try:
        generate(out)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    print(f"gen_protos: wrote {out}/kvpool_pb2*.py")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
