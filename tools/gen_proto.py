"""Generate elasticrl/_proto from proto/elasticrl/v1/*.proto (the one command behind `make proto`).

protoc sees each file under the virtual path ``elasticrl/_proto/`` so the generated gRPC module
imports its messages as ``elasticrl._proto.<name>_pb2``; the protobuf package stays
``elasticrl.v1``. ``tests/unit/test_proto_drift.py`` runs this into a temporary directory and fails
when the committed code differs.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto" / "elasticrl" / "v1"


def generate(out_root: pathlib.Path) -> list[pathlib.Path]:
    """Write the generated modules under ``out_root/elasticrl/_proto`` and return their paths."""
    from grpc_tools import protoc  # dev dependency, pinned in setup.cfg [options.extras_require]
    import grpc_tools

    protos = sorted(PROTO_DIR.glob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_DIR}")
    out_dir = out_root / "elasticrl" / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-Ielasticrl/_proto={PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[f"elasticrl/_proto/{p.name}" for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed: " + " ".join(args))
    return sorted(p for p in out_dir.iterdir() if p.name.endswith((".py", ".pyi")) and p.name != "__init__.py")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT, help="root to write elasticrl/_proto under")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
