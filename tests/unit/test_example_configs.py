"""Every config the repository ships parses and validates: the bundled demo, the examples and the
one the deploy/ launchers use."""

from __future__ import annotations

import pytest

from elasticrl.config import load_config
from tests.conftest import REPO

CONFIGS = sorted(
    [*REPO.glob("elasticrl/configs/*.toml"), *REPO.glob("examples/configs/*.toml"), *REPO.glob("deploy/**/*.toml")]
)


def test_there_are_configs():
    assert REPO / "elasticrl" / "configs" / "demo.toml" in CONFIGS and len(CONFIGS) >= 3


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(REPO)))
def test_config_loads(path):
    cfg = load_config(path).resolved({"ELASTICRL_COORDINATOR": "127.0.0.1:50051"})
    assert cfg.run.iterations >= 1 and cfg.engine_name in ("tiny", "hf", "vllm")
