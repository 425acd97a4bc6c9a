"""bench/profiling.py's summary of py-spy's collapsed stacks: self and total shares per function,
the line number dropped so one function is one row."""

from __future__ import annotations

from bench.profiling import render_top, top_functions

COLLAPSED = """\
main (server.py:10);serve (service.py:20);accept (core.py:30) 6
main (server.py:10);serve (service.py:21);accept (core.py:31);write_shard (store.py:5) 3
main (server.py:10);tick (core.py:90) 1
garbage line
"""


def test_self_and_total_shares_per_function():
    top = top_functions(COLLAPSED)
    assert top["samples"] == 10
    own = {r["function"]: r["share"] for r in top["self"]}
    assert own == {"accept (core.py)": 0.6, "write_shard (store.py)": 0.3, "tick (core.py)": 0.1}
    total = {r["function"]: r["share"] for r in top["total"]}
    assert total["main (server.py)"] == 1.0 and total["serve (service.py)"] == 0.9 and total["accept (core.py)"] == 0.9
    text = render_top("case", top)
    assert " 60.0%  accept (core.py)" in text and "10 samples" in text


def test_no_samples_is_an_empty_summary():
    assert top_functions("") == {"samples": 0, "self": [], "total": []}
