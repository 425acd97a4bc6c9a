"""Rules the package's source keeps, checked on its syntax tree."""

from __future__ import annotations

import ast
import pathlib

import elasticrl

PACKAGE = pathlib.Path(elasticrl.__file__).parent


def _calls_of(name: str) -> list[str]:
    module, attr = name.rsplit(".", 1)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr == attr and isinstance(node.value, ast.Name)
                    and node.value.id == module):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return found


def test_no_asyncio_wait_for():
    # On Python 3.11 (the oldest we support), wait_for drops a cancel that lands as the awaited
    # thing finishes (CPython gh-86296, fixed in 3.12), and a task that loops on it never ends
    # when cancelled (the episode runner's batcher did, and its close waits for that task).
    # ``async with asyncio.timeout(...)`` has no such race.
    assert _calls_of("asyncio.wait_for") == []
