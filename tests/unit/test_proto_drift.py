"""The committed elasticrl/_proto must be exactly what `make proto` generates from proto/."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_generated_code_matches_proto(tmp_path):
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip("grpcio-tools not installed (pip install -e '.[dev]')")
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import gen_proto
    finally:
        sys.path.pop(0)
    fresh = gen_proto.generate(tmp_path)
    committed = REPO / "elasticrl" / "_proto"
    assert fresh, "generator produced nothing"
    for path in fresh:
        mine = committed / path.name
        assert mine.exists(), f"{path.name} is generated but not committed: run `make proto`"
        assert mine.read_bytes() == path.read_bytes(), f"{path.name} differs from proto/: run `make proto`"
    extra = {p.name for p in committed.glob("*_pb2*")} - {p.name for p in fresh}
    assert not extra, f"stale generated files {sorted(extra)}: delete them and run `make proto`"
