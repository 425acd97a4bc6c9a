"""A PNG of reward per iteration from a run's metrics.jsonl (matplotlib, optional).

    python -m elasticrl.plot runs/<run>/metrics.jsonl [OUT.png]
"""

from __future__ import annotations

import json
import os
import sys


def y_range(values: list[float]) -> tuple[float, float]:
    """Rewards in [0, 1] keep that frame; an env's returns (the agent demo's reach 1.2) or a
    negative reward widen it."""
    return min(0.0, min(values) * 1.05), max(1.02, max(values) * 1.05)


def plot_rewards(metrics_path: str, png_path: str) -> str | None:
    """Write the plot; returns None, or why it could not (matplotlib missing, no records)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib, or pip install -e '.[demo]')"
    records = []
    try:
        with open(metrics_path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # blank, or torn by a kill mid-write
    except OSError as exc:
        return f"cannot read {metrics_path}: {exc.strerror or exc}"
    records = [r for r in records if isinstance(r, dict) and "iteration" in r and "reward_mean" in r]
    if not records:
        return f"{metrics_path} has no records (lines with iteration and reward_mean)"
    by_iteration = {r["iteration"]: r for r in records}  # a redone iteration: its last record wins
    its = sorted(by_iteration)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    curves = [("reward_mean", "mean reward", {"marker": "o", "ms": 3}),
              ("exact_fraction", "exact-match fraction (reward = 1)", {"ls": "--"}),
              ("eval_reward", "held-out reward", {"marker": "s", "ms": 4, "ls": ":"})]
    values: list[float] = []
    for key, label, style in curves:
        ys = [by_iteration[i].get(key) for i in its]
        shown = [(i, y) for i, y in zip(its, ys) if isinstance(y, (int, float)) and y == y]  # y == y: not NaN
        if shown:
            ax.plot([i for i, _ in shown], [y for _, y in shown], label=label, **style)
            values += [y for _, y in shown]
    worlds = [by_iteration[i].get("world_size") for i in its]
    for k in range(1, len(its)):
        if worlds[k] != worlds[k - 1]:
            ax.axvline(its[k] - 0.5, color="grey", lw=0.8)
            ax.annotate(f"world {worlds[k - 1]} -> {worlds[k]}", (its[k] - 0.5, 0.02), fontsize=8, color="grey")
    ax.set_xlabel("iteration")
    ax.set_ylabel("reward")
    ax.set_ylim(*y_range(values))
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    ax.set_title(os.path.basename(os.path.dirname(os.path.abspath(metrics_path))))
    fig.tight_layout()
    try:
        fig.savefig(png_path, format="png")
    except OSError as exc:
        return f"cannot write {png_path}: {exc.strerror or exc}"
    finally:
        plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    out = args[1] if len(args) == 2 else os.path.join(os.path.dirname(args[0]), "reward.png")
    problem = plot_rewards(args[0], out)
    if problem:
        print(f"elasticrl.plot: {problem}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
