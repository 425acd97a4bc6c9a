"""The bench scripts still run end to end, at a toy size: a broken bench is found by the tests,
not by the next person who measures. Their numbers are not checked here (speed goals live in the
benches themselves)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

REPO = pathlib.Path(__file__).resolve().parents[2]


def bench(script: str, tmp_path, *args: str) -> dict:
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), *args, "--json-out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_scheduler_bench_streams_at_a_toy_size(tmp_path):
    doc = bench("scheduler.py", tmp_path, "--sections", "stream", "--stream-groups", "8", "--stream-samples", "2",
                "--stream-tokens", "64", "--stream-repeats", "1")
    rows = {(r["path"], r["state"]) for r in doc["stream"]}
    assert rows == {("raw grpc.aio", "-"), ("coordinator", "memory"), ("coordinator", "durable")}, doc["stream"]
    assert all(r["mb_per_s"] > 0 for r in doc["stream"])


def test_the_scheduler_bench_times_a_submit_and_the_keep_alives_beside_it_at_a_toy_size(tmp_path):
    doc = bench("scheduler.py", tmp_path, "--sections", "submit", "--submit-tasks", "50", "--submit-prompt-tokens", "4",
                "--submit-repeats", "2")
    assert [r["state"] for r in doc["submit"]] == ["memory", "durable"]
    for r in doc["submit"]:
        assert r["repeats"] == 2 and r["submit_ms"] > 0 and r["idle_keep_alive_max_ms"] > 0, r


def test_the_scheduler_scale_bench_measures_each_worker_count_at_a_toy_size(tmp_path):
    doc = bench("scheduler_scale.py", tmp_path, "--workers", "2,8", "--tasks-per-worker", "2", "--iterations", "1", "--warmup", "1",
                "--tokens", "4", "--submit-tasks", "5,20", "--prompt-tokens", "3", "--gc-iterations", "2", "--gc-tasks", "500")
    assert [(r["state"], r["workers"]) for r in doc["scale"]] == [("memory", 2), ("memory", 8), ("durable", 2), ("durable", 8)]
    assert all(r["us_per_batch"] > 0 and r["batches"] == 2 * r["workers"] for r in doc["scale"]), doc["scale"]
    assert [(r["state"], r["tasks"]) for r in doc["submit"]] == [("memory", 5), ("memory", 20), ("durable", 5), ("durable", 20)]
    assert all(r["ms"] > 0 for r in doc["submit"]), doc["submit"]
    # held tasks: the coordinator's copy of a spec is three objects the garbage collector tracks
    # (task, spec, prompt array), not eight with every prompt id among them
    assert [(r["state"], r["tasks"]) for r in doc["held"]] == [("memory", 1000), ("durable", 1000)]
    assert all(r["tracked_per_task"] <= 3.5 and r["full_gc_ms"] > 0 for r in doc["held"]), doc["held"]


def test_the_coordinator_bench_measures_a_barrier_at_a_toy_size(tmp_path):
    doc = bench("coordinator.py", tmp_path, "--members", "8", "--rounds", "2", "--warmup", "1", "--transports", "session,batched",
                "--modes", "memory", "--patterns", "burst,last", "--baselines", "rawgrpc", "--skip-failure", "--workers", "2")
    assert [(row["impl"], row["transport"], row["pattern"]) for row in doc["latency"]] == [
        ("coordinator", "session", "burst"), ("coordinator", "batched", "burst"), ("coordinator", "session", "last"),
        ("coordinator", "batched", "last"), ("rawgrpc", "-", "burst"), ("rawgrpc", "-", "last")]
    for row in doc["latency"]:
        assert row["members"] == 8 and row["p50_ms"] > 0 and row["server_cpu_ms_per_round"] is not None, row
        assert row["impl"] == "rawgrpc" or row["x_rawgrpc"] > 0, row


def test_the_async_bench_overlaps_rollout_and_update_at_a_toy_size(tmp_path):
    doc = bench("async.py", tmp_path, "--ks", "0,1", "--iterations", "3", "--rollout-s", "0.1", "--update-s", "0.1",
                "--workers", "2", "--tasks", "4", "--timeout-s", "30")
    rows = {r["max_staleness"]: r for r in doc["async"]}
    assert set(rows) == {0, 1} and all(r["iterations_per_s"] > 0 for r in rows.values()), doc
    assert rows[0]["policy_lag"] == {"0": 2 * 4 * 4}, doc  # on-policy: 2 timed iterations x 4 groups x 4 samples
    assert rows[1]["stale_dropped"] == 0, doc
    assert "sleeps" in rows[1]["simulated"]


def test_the_weights_bench_moves_a_blob_on_every_path_at_a_toy_size(tmp_path):
    doc = bench("weights.py", tmp_path, "--mb", "4", "--workers", "1,2", "--repeats", "1")
    rows = {(r["path"], r["workers"]): r for r in doc["weights"]}
    assert set(rows) == {(p, k) for p in ("coordinator", "relay", "gloo") for k in (1, 2)}, doc
    assert all(r["seconds"] > 0 for r in rows.values())
    # The relay's chain: the second worker reads from the first, not from the trainer.
    assert rows[("relay", 2)]["sources_last"] == {"w0": ["trainer"], "w1": ["w0"]} or \
        rows[("relay", 2)]["sources_last"] == {"w0": ["w1"], "w1": ["trainer"]}, rows[("relay", 2)]
    assert rows[("relay", 2)]["busiest_sender_mb"] == 4 and rows[("coordinator", 2)]["busiest_sender_mb"] == 8
    assert set(doc["codec"]) == {"pack", "safetensors_save", "unpack", "safetensors_load"}, doc["codec"]


def test_the_recovery_bench_measures_a_snapshot_against_dcps_writer_at_a_toy_size(tmp_path):
    doc = bench("recovery.py", tmp_path, "--sections", "snapshot", "--state-gb", "0.125", "--world", "2")
    s = doc["snapshot"]
    assert doc["demo"] == [] and s["world"] == 2 and 0 < s["shard_bytes"] < s["bytes"], s
    assert all(s[k] >= 0 for k in ("stage_stall_s", "shard_write_stall_s", "dcp_write_stall_s", "read_stall_s")), s


def test_the_engine_sleep_bench_times_the_engine_and_module_to_on_the_same_model(tmp_path):
    doc = bench("engine_sleep.py", tmp_path, "--width", "64", "--layers", "2", "--vocab", "128", "--cycles", "2", "--device", "cpu")
    assert [r["path"] for r in doc["rows"]] == ["engine (pinned, unfilled wake)", "baseline module.to"], doc
    assert doc["device"] == "cpu" and doc["parameters"] > 0 and all(r["update_s"] > 0 for r in doc["rows"]), doc


def test_the_coordinator_bench_compares_each_coordinator_row_with_the_baselines_of_the_same_size_and_pattern():
    from bench.coordinator import compare_baselines

    rows = [dict(impl="coordinator", members=64, pattern="burst", p50_ms=1.8), dict(impl="coordinator", members=64, pattern="last", p50_ms=1.0),
            dict(impl="coordinator", members=512, pattern="burst", p50_ms=20.0), dict(impl="tcpstore", members=64, pattern="burst", p50_ms=1.5),
            dict(impl="tcpstore", members=512, pattern="burst", p50_ms=10.0), dict(impl="rawgrpc", members=64, pattern="burst", p50_ms=0.9)]
    compare_baselines(rows)
    assert [(r.get("x_tcpstore"), r.get("tcpstore_goal", {}).get("status"), r.get("x_rawgrpc")) for r in rows] == [
        (1.2, "PASS", 2.0), (None, None, None), (2.0, "MISS", None), (None, None, None), (None, None, None), (0.6, None, None)]


def test_a_bench_stopped_with_sigterm_stops_the_processes_it_started_and_removes_its_directory(tmp_path):
    import os
    import signal
    import time

    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the bench's own directory lands here
    driver = subprocess.Popen([sys.executable, str(REPO / "bench" / "coordinator.py"), "--members", "4", "--rounds", "100000",
                               "--transports", "batched", "--modes", "memory", "--patterns", "burst", "--skip-baselines",
                               "--skip-failure", "--workers", "1"], cwd=REPO, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    listing = pathlib.Path(f"/proc/{driver.pid}/task/{driver.pid}/children")
    try:
        if not listing.exists():
            pytest.skip("this kernel does not list a process's children (CONFIG_PROC_CHILDREN)")
        children: list[int] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(children) < 2:  # the coordinator and the members' process
            children = [int(p) for p in listing.read_text().split()]
            time.sleep(0.05)
        assert len(children) >= 2, children
        time.sleep(0.2)  # while they start: a coordinator not yet serving is stopped too
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if driver.poll() is None:
            driver.kill()
    # stopped and reaped by the driver, not left running under init (killed here if they were)
    def running(pid: int) -> bool:
        try:
            return "zombie" not in pathlib.Path(f"/proc/{pid}/status").read_text().lower()
        except FileNotFoundError:
            return False

    left = [pid for pid in children if running(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("elasticrl-bench-")]
