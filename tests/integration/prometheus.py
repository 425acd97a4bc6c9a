"""A strict reader of the Prometheus text exposition, shared by the tests that scrape the coordinator."""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')

Samples = dict[tuple[str, frozenset], float]


def parse_exposition(text: str) -> Samples:
    """Every sample of ``text`` keyed by (name, labels). Strict enough to catch format slips: every
    sample belongs to a family announced by a TYPE line, and every line parses."""
    typed: dict[str, str] = {}
    samples: Samples = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            typed[name] = kind
            continue
        if line.startswith("# HELP "):
            continue
        m = _SAMPLE.match(line)
        assert m, f"unparseable line: {line!r}"
        name, labels, value = m.groups()
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in typed else name
        assert family in typed, f"{name} has no # TYPE line before it"
        pairs = frozenset((k, v) for k, v, _ in _LABEL.findall(labels or ""))
        samples[(name, pairs)] = float(value)
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; 0 when absent (a labelled counter appears at its first increment)."""
    return samples.get((name, frozenset(labels.items())), 0.0)
