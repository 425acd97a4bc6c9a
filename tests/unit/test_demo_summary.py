"""The launcher's end of a run (``elasticrl run`` / ``make demo``): the summary of what the run did,
from its ``metrics.jsonl``, and the snapshots a run that did not finish leaves in host memory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from elasticrl.demo import Child
from elasticrl.run_summary import leftover_snapshots, summarize
from elasticrl.train.snapshot_plan import run_root

pytestmark = pytest.mark.timeout(60)


def finished_node(tmp_path, rc: int = 0) -> Child:
    proc = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({rc})"])
    proc.wait(30)
    log = tmp_path / "node-0.log"
    log.write_text("the node's last words\n")
    return Child("node-0", proc, str(log))


def write_run(tmp_path, records: list[dict]) -> str:
    run_dir = tmp_path / "run"
    checkpoint = run_dir / "checkpoints" / "iter-2"
    checkpoint.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps({"world_size": 1, "reward_mean": 0.1, "checkpoint": str(checkpoint), **r}) + "\n")
    return str(run_dir)


def summary(tmp_path, capsys, records, **kw) -> tuple[int, str, str]:
    rc = summarize(write_run(tmp_path, records), [finished_node(tmp_path, kw.pop("node_rc", 0))], 2, 5.0, killed=False,
                    no_plot=True, **kw)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_env_errors_are_reported_for_single_turn_runs_too(tmp_path, capsys):
    # Found by a user's run: 8 env errors in metrics.jsonl, none in the summary (the line was
    # printed for multi-turn runs only).
    records = [{"iteration": i, "turns_mean": 1.0, "exact_fraction": 0.5, "env_errors": 4, "groups_failed": 1} for i in (1, 2)]
    rc, out, _ = summary(tmp_path, capsys, records)
    assert rc == 0 and "exact match" in out
    assert "env errors   8 episode(s); 2 training group(s) dropped" in out
    rc, out, _ = summary(tmp_path, capsys, [{**r, "env_errors": 0, "groups_failed": 0} for r in records])
    assert rc == 0 and "env errors" not in out


def test_a_multi_turn_summary_says_the_env_ended_episodes_not_that_they_were_solved(tmp_path, capsys):
    records = [{"iteration": i, "turns_mean": 2.5, "truncated_fraction": 0.25, "env_errors": 0} for i in (1, 2)]
    rc, out, _ = summary(tmp_path, capsys, records)
    assert rc == 0 and "solved" not in out
    assert "ended        75% -> 75% of episodes by the env" in out and "turns        2.50 -> 2.50 per episode" in out


def test_a_failed_run_is_named_by_the_command_that_ran_it(tmp_path, capsys):
    rc, _, err = summary(tmp_path, capsys, [{"iteration": 1}], node_rc=1, label="elasticrl run")
    assert rc == 1 and "elasticrl run: training failed after 1/2 iterations" in err and "the node's last words" in err


def test_an_unfinished_runs_snapshots_are_freed_unless_the_user_named_the_run(tmp_path, capsys):
    # Found by a user: a failed `elasticrl run` left its snapshots in /dev/shm, under a run id
    # made from the time, which no later run uses: host memory lost until reboot.
    run_dir = str(tmp_path / "run")
    made, named = run_root(run_dir, "cfg-20261127-101500"), run_root(run_dir, "my-run")
    try:
        for root in (made, named):
            os.makedirs(os.path.join(root, "node-0"))
        leftover_snapshots(run_dir, "cfg-20261127-101500", kept=False)
        assert not os.path.exists(made) and capsys.readouterr().out == ""
        leftover_snapshots(run_dir, "my-run", kept=True)
        assert os.path.isdir(named)
        assert f"snapshots: {named} (host memory) is kept: started again with run.run_id = 'my-run'" in capsys.readouterr().out
        shutil.rmtree(named)
        leftover_snapshots(run_dir, "my-run", kept=True)  # a finished run freed its own: nothing to say
        assert capsys.readouterr().out == ""
    finally:
        for root in (made, named):
            shutil.rmtree(root, ignore_errors=True)


TORCH_TAIL = """Traceback (most recent call last):
  File "torch/distributed/elastic/agent/server/api.py", line 528, in _rendezvous
    rdzv_info = spec.rdzv_handler.next_rendezvous()
  File "elasticrl/rendezvous/handler.py", line 347, in _stop_if_asked
    raise RendezvousClosedError(f"run {cfg.run_id!r}: node {cfg.node_id} stops, its worker failed in a way "
torch.distributed.elastic.rendezvous.api.RendezvousClosedError: run 'r': node vm-1 stops, its worker failed in a way \
restarts do not fix: node-0 rank 1: EnvError: iteration 1: 32 of 32 groups failed; last error: env bad.py:Bad.reset() raised \
RuntimeError: no site
"""


@pytest.mark.parametrize("log, reason", [
    (TORCH_TAIL, "node-0 rank 1: EnvError: iteration 1: 32 of 32 groups failed; last error: env bad.py:Bad.reset() raised RuntimeError: no site"),
    ("2026-11-27 12:00:00 ERROR x: training failed\nTraceback (most recent call last):\n  File \"a.py\"\nRuntimeError: boom\n",
     "RuntimeError: boom"),
])
def test_a_failed_node_is_reported_by_what_stopped_it_not_by_its_last_lines(tmp_path, capsys, log, reason):
    # Found by a user's run: each failed node printed its log's last 25 lines, torch's traceback
    # of its agent, with the reason last.
    node = finished_node(tmp_path, 1)
    with open(node.log_path, "w") as f:
        f.write(log)
    rc = summarize(write_run(tmp_path, [{"iteration": 1}]), [node], 2, 5.0, killed=False, no_plot=True, label="elasticrl run")
    err = capsys.readouterr().err
    assert rc == 1 and f"node-0 exited with status 1: {reason}\n  (its log: {node.log_path})" in err, err
    assert "Traceback" not in err and "File " not in err


def test_the_reward_plot_frames_returns_past_one_and_below_zero():
    # Found by a researcher: the frame was fixed to [0, 1.02], and the agent demo's returns reach 1.2.
    from elasticrl.plot import y_range

    assert y_range([0.1, 0.9]) == (0.0, 1.02)
    low, high = y_range([0.39, 1.2])
    assert low == 0.0 and high >= 1.2
    assert y_range([-0.5, 0.5])[0] <= -0.5


def test_lines_that_are_not_iteration_records_are_skipped(tmp_path):
    from elasticrl.run_summary import last_records

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = ['{"iteration": 1, "reward_mean": 0.1}', "[1, 2]", '"text"', "7", '{"note": "no iteration"}',
             '{"iteration": "2"}', '{"iteration": 2.5}', '{"iteration": true}', '{"iteration": 2, "reward_mean": 0.2}',
             '{"iteration": 1, "reward_mean": 0.3}', '{"iteration": 3, "rew']  # redone, then torn by a crash
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert last_records(str(run_dir)) == [{"iteration": 1, "reward_mean": 0.3}, {"iteration": 2, "reward_mean": 0.2}]
