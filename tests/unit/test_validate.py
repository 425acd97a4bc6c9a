"""Field checks (``coordinator/validate.py``): ids and names found valid once are remembered (a set
lookup instead of the regex, per member per request), which must never let an invalid one through."""

from __future__ import annotations

import pytest

from elasticrl._proto import coordinator_pb2 as pb
from elasticrl.coordinator import validate as v
from elasticrl.errors import InvalidRequestError


def test_remembered_ids_and_names_are_kept_apart_and_an_invalid_one_is_still_refused(monkeypatch):
    monkeypatch.setattr(v, "_VALID_IDS", set())
    monkeypatch.setattr(v, "_VALID_NAMES", set())
    assert v.name("name", "iter-3/rollout") == "iter-3/rollout"
    assert v.name("name", "iter-3/rollout") == "iter-3/rollout"  # remembered
    with pytest.raises(InvalidRequestError, match=r"run_id: 'iter-3/rollout' is not a valid id"):
        v.ident("run_id", "iter-3/rollout")  # a valid name is not a valid id
    assert v.ident("run_id", "r-1") == "r-1" and "r-1" in v._VALID_IDS
    for bad in ("", "-r", "r 1", "x" * 129):
        with pytest.raises(InvalidRequestError, match="run_id"):
            v.ident("run_id", bad)
    assert v._VALID_IDS == {"r-1"} and v._VALID_NAMES == {"iter-3/rollout"}


def test_the_remembered_set_is_bounded(monkeypatch):
    monkeypatch.setattr(v, "_VALID_IDS", set())
    monkeypatch.setattr(v, "_VALID_MAX", 3)
    for i in range(10):
        v.ident("member_id", f"m{i}")
        assert len(v._VALID_IDS) <= 3


def test_member_ref_names_the_field_of_a_bad_id_or_incarnation():
    assert v.member_ref("member", pb.MemberRef(member_id="rank-0", incarnation=2)) == ("rank-0", 2)
    with pytest.raises(InvalidRequestError, match=r"member\.member_id: 'rank 0'"):
        v.member_ref("member", pb.MemberRef(member_id="rank 0", incarnation=2))
    with pytest.raises(InvalidRequestError, match=r"member\.incarnation: must be the positive incarnation"):
        v.member_ref("member", pb.MemberRef(member_id="rank-0", incarnation=0))


def test_task_ids_are_checked_but_not_remembered(monkeypatch):
    from elasticrl._proto import scheduler_pb2 as spb
    from elasticrl.scheduler.convert import task_from_pb

    monkeypatch.setattr(v, "_VALID_IDS", set())
    task_from_pb("tasks[0]", spb.TaskSpec(task_id="t-000001", num_samples=1, prompt_ids=[1]), keep_wire=True)
    assert v._VALID_IDS == set()  # seen once: it would only push out the member ids that recur
    with pytest.raises(InvalidRequestError, match=r"tasks\[0\]\.task_id"):
        task_from_pb("tasks[0]", spb.TaskSpec(task_id="t 1", num_samples=1, prompt_ids=[1]))
