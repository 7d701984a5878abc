#!/usr/bin/env python3
"""Generate the Python gRPC code from protos/kvpool.proto into client/_generated/.

The only way the generated files are made; they are never edited or committed.
Run by scripts/setup.sh; run it again after changing the .proto.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
OUT = ROOT / "client" / "_generated"


def main() -> int:
    try:
        from grpc_tools import protoc
    except ImportError:
        print("gen_protos: grpcio-tools is missing; install it with: pip install grpcio-tools", file=sys.stderr)
        return 1
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={OUT}",
        f"--pyi_out={OUT}",
        f"--grpc_python_out={OUT}",
        str(PROTO_DIR / "kvpool.proto"),
    ]
    if protoc.main(args) != 0:
        print("gen_protos: protoc failed", file=sys.stderr)
        return 1
    # protoc writes a top-level import; the package needs a relative one
    grpc_file = OUT / "kvpool_pb2_grpc.py"
    text = re.sub(r"^import kvpool_pb2 as", "from . import kvpool_pb2 as", grpc_file.read_text(), flags=re.M)
    grpc_file.write_text(text)
    print(f"gen_protos: wrote {OUT.relative_to(ROOT)}/kvpool_pb2*.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
