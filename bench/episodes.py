"""Multi-turn episodes through the episode runner: lock-step batching against one episode at a time.

    python bench/episodes.py [--groups 32] [--group-size 8] [--env-latency-ms 0,5] [--json-out FILE]

The engine is the demo's tiny transformer on CPU (``TinyEngine``, untrained: its actions are random,
so episodes run to the turn limit) and the env is the bundled guessing game. The same episodes are
played twice in the same run:

* ``lockstep``: every group handed to the runner at once, as an engine worker does: each turn of
  every live episode goes to the engine in one ``generate`` call;
* ``one_at_a_time``: the baseline of an agent loop that drives one episode to its end before the
  next (a ``generate`` call per turn per episode).

``--env-latency-ms`` adds a sleep to every env step (simulated I/O: a browser, a tool server;
labelled as such in the output) to show that slow envs overlap instead of adding up.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.benchmain import run_main  # noqa: E402


def make_env(latency_s: float):
    from elasticrl.env.guess import GuessEnv

    class SlowGuess(GuessEnv):
        def step(self, action):
            if latency_s:
                time.sleep(latency_s)  # simulated env I/O
            return super().step(action)

    return SlowGuess


def play(args, latency_s: float, mode: str) -> dict:
    import torch

    from elasticrl.config import ModelConfig
    from elasticrl.policy.codec import CharCodec
    from elasticrl.policy.tiny import TinyCausalLM
    from elasticrl.rollout.engine import SamplingSpec
    from elasticrl.rollout.episodes import EpisodeRunner, EpisodeSettings, GroupTask
    from elasticrl.rollout.render import PlainRenderer
    from elasticrl.rollout.tiny_engine import TinyEngine

    torch.manual_seed(0)
    codec = CharCodec()
    engine = TinyEngine(TinyCausalLM(ModelConfig(max_seq_len=64), codec.vocab_size), codec.vocab)
    runner = EpisodeRunner(engine, PlainRenderer(codec.encode), make_env(latency_s),
                           EpisodeSettings(max_turns=args.max_turns, episodes_in_flight=args.in_flight), decode=codec.decode)
    spec = SamplingSpec(max_new_tokens=1)
    tasks = [GroupTask(task_id=f"t{k}", row={"instance": k}, episodes=args.group_size, seed=k, sampling=spec)
             for k in range(args.groups)]
    try:
        runner.play(tasks[:1])  # warm-up: threads, first forward pass
        calls0, rows0 = runner.generate_calls, runner.generated_rows
        start = time.perf_counter()
        if mode == "lockstep":
            outcomes = runner.play(tasks)
        else:
            outcomes = [o for t in tasks for j in range(t.episodes) for o in runner.play([
                GroupTask(task_id=t.task_id, row=t.row, episodes=1, seed=t.seed * 1000 + j, sampling=spec)])]
        seconds = time.perf_counter() - start
        calls, rows = runner.generate_calls - calls0, runner.generated_rows - rows0
    finally:
        runner.close()
    episodes = [e for o in outcomes for e in o.episodes or []]
    turns = sum(e.turns for e in episodes)
    return {
        "mode": mode, "env_latency_ms": latency_s * 1000, "episodes": len(episodes), "turns": turns,
        "seconds": round(seconds, 4), "episodes_per_s": round(len(episodes) / seconds, 1),
        "turns_per_s": round(turns / seconds, 1), "generate_calls": calls, "rows_per_call": round(rows / max(calls, 1), 1),
    }


def run(args, tmp: pathlib.Path, cleanup: contextlib.ExitStack) -> dict:
    rows = []
    for latency_ms in args.env_latency_ms:
        for mode in ("lockstep", "one_at_a_time"):
            rows.append(play(args, latency_ms / 1000, mode))
            print(f"  {mode:>14} env latency {latency_ms:g} ms: {rows[-1]['episodes_per_s']} episodes/s", file=sys.stderr)
    speedups = {}
    for latency_ms in args.env_latency_ms:
        lock, seq = (next(r for r in rows if r["env_latency_ms"] == latency_ms and r["mode"] == m)
                     for m in ("lockstep", "one_at_a_time"))
        speedups[f"{latency_ms:g}"] = round(lock["episodes_per_s"] / seq["episodes_per_s"], 2)
    return {
        "setup": {"groups": args.groups, "group_size": args.group_size, "max_turns": args.max_turns,
                  "episodes_in_flight": args.in_flight, "engine": "tiny (CPU, untrained)", "env": "guess",
                  "env_latency": "simulated with time.sleep per step"},
        "episodes": rows,
        "speedup_lockstep_over_one_at_a_time": speedups,
    }


def render(doc: dict) -> str:
    lines = ["mode            env ms  episodes  turns  seconds  episodes/s  generate calls  rows/call"]
    for r in doc["episodes"]:
        lines.append(f"{r['mode']:<15} {r['env_latency_ms']:>6g}  {r['episodes']:>8}  {r['turns']:>5}  {r['seconds']:>7.3f}  "
                     f"{r['episodes_per_s']:>10}  {r['generate_calls']:>14}  {r['rows_per_call']:>9}")
    lines.append("speedup of lock step: " + ", ".join(f"{v}x at {k} ms" for k, v in doc["speedup_lockstep_over_one_at_a_time"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=32, help="GRPO groups (tasks) played (default: %(default)s)")
    p.add_argument("--group-size", type=int, default=8, help="episodes per group (default: %(default)s)")
    p.add_argument("--max-turns", type=int, default=5, help="turn limit per episode (default: %(default)s)")
    p.add_argument("--in-flight", type=int, default=256, help="env.episodes_in_flight (default: %(default)s)")
    p.add_argument("--env-latency-ms", default="0,5", help="comma-separated simulated env step latencies, ms (default: %(default)s)")
    p.add_argument("--json-out", metavar="FILE", help="write the JSON here (the table goes to stdout)")
    args = p.parse_args(argv)
    args.env_latency_ms = [float(x) for x in args.env_latency_ms.split(",") if x.strip()]
    return run_main("bench/episodes.py", args.json_out, lambda tmp, cleanup: run(args, tmp, cleanup), render, prefix="bench-episodes-")


if __name__ == "__main__":
    sys.exit(main())
