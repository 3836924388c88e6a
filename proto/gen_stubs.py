"""Generate the Python stubs for our protos (proto/psrl/_proto/*.proto -> psrl/_proto/).

The .proto files sit under a path that mirrors the Python package, so the generated `_grpc` modules import
`psrl._proto.x_pb2` correctly. Run `make proto` after editing a .proto; tests/spec/test_proto_stubs.py checks
that the committed stubs match a fresh generation.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_DIR = PROTO_ROOT / "psrl" / "_proto"


def generate(out_root: Path) -> list[Path]:
    """Write the stubs under out_root/psrl/_proto and return the files written."""
    from grpc_tools import protoc

    sources = sorted(PROTO_DIR.glob("*.proto"))
    include = Path(protoc.__file__).resolve().parent / "_proto"
    (out_root / "psrl" / "_proto").mkdir(parents=True, exist_ok=True)
    for src in sources:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            str(src.relative_to(PROTO_ROOT)),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {src}")
    return sorted((out_root / "psrl" / "_proto").glob("*_pb2*.py*"))


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT.parent
    for path in generate(out):
        print(path)
