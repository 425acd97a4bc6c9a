"""The hf engine's sleep and weight update around each training step, against ``module.to``.

With ``engine.sleep_during_update`` (the default on a GPU) a node's hf engine gives the GPU back
to the trainer before the update and takes the new weights after it, every iteration. This bench
builds a random Llama of ``--layers`` layers of width ``--width`` (no download) as an ``HFEngine``
on ``--device`` and times, over ``--cycles`` iterations (the first reported apart: it allocates):

* ``engine``: ``sleep()`` (to pinned host buffers kept from the first sleep, ``HostOffload``),
  then ``update_weights`` with every tensor from device memory, as the trainer streams them
  (``push_full_tensors``): the device memory comes back unfilled and the update writes it;
* baseline, the same run: ``module.to("cpu")`` + ``empty_cache`` (what ``sleep`` did before),
  then ``module.to(device)`` and a ``copy_`` of each tensor.

On a CPU both are (nearly) free: the engine sleeps by state only. GB/s are of the model's bytes.

    python bench/engine_sleep.py                      # 240M parameters on cuda:0, ~1 min
    python bench/engine_sleep.py --width 256 --layers 4 --device cpu --json-out /tmp/s.json
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchmain import run_main  # noqa: E402


def timed(fn, device) -> float:
    import torch

    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def cycles(sleep, update, n: int, device) -> dict:
    rows = [(timed(sleep, device), timed(update, device)) for _ in range(n)]
    later = rows[1:] or rows
    return {"first_sleep_s": round(rows[0][0], 4), "first_update_s": round(rows[0][1], 4),
            "sleep_s": round(statistics.median(r[0] for r in later), 4),
            "update_s": round(statistics.median(r[1] for r in later), 4)}


def run(args, tmp: pathlib.Path) -> dict:
    import torch

    from elasticrl.rollout.hf import HFEngine
    from elasticrl.rollout.tiny_llama import write_tiny_llama

    device = torch.device(args.device)
    w = args.width
    model_dir = write_tiny_llama(tmp / "model", vocab_size=args.vocab, hidden_size=w, intermediate_size=4 * w,
                                 num_hidden_layers=args.layers, num_attention_heads=max(1, w // 64),
                                 num_key_value_heads=max(1, w // 256), initializer_range=0.02)
    with HFEngine(model_dir, device=device, load_tokenizer=False) as engine:
        model = engine._model  # noqa: SLF001 (the bench times the engine's own module)
        # The trainer's full tensors on the device: what push_full_tensors hands the engine.
        new = {k: v.detach().clone().add_(1e-3) for k, v in model.state_dict().items()}
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        ours = cycles(engine.sleep, lambda: engine.update_weights(new.items(), version=1), args.cycles, device)

        def to_cpu() -> None:
            model.to("cpu")
            if device.type == "cuda":
                torch.cuda.empty_cache()

        def to_device_and_copy() -> None:
            model.to(device)
            targets = model.state_dict(keep_vars=True)
            with torch.no_grad():
                for name, t in new.items():
                    targets[name].copy_(t)

        base = cycles(to_cpu, to_device_and_copy, args.cycles, device)
    gb = nbytes / 1e9
    rows = []
    for path, r in (("engine (pinned, unfilled wake)", ours), ("baseline module.to", base)):
        rows.append({"path": path, **r, "sleep_gb_s": round(gb / r["sleep_s"], 2) if r["sleep_s"] else None,
                     "update_gb_s": round(gb / r["update_s"], 2) if r["update_s"] else None})
    return {"device": str(device), "parameters": sum(p.numel() for p in model.parameters()), "bytes": nbytes,
            "cycles": args.cycles, "rows": rows}


def render(doc: dict) -> str:
    lines = [f"hf engine of {doc['parameters'] / 1e6:.0f}M parameters ({doc['bytes'] / 1e9:.2f} GB) on {doc['device']}; "
             f"median of {doc['cycles'] - 1} cycles after the first",
             f"{'path':<32} {'sleep s':>8} {'GB/s':>7} {'update s':>9} {'GB/s':>7} {'1st sleep':>10} {'1st update':>11}"]
    for r in doc["rows"]:
        lines.append(f"{r['path']:<32} {r['sleep_s']:>8.4f} {r['sleep_gb_s'] or '-':>7} {r['update_s']:>9.4f} "
                     f"{r['update_gb_s'] or '-':>7} {r['first_sleep_s']:>10.4f} {r['first_update_s']:>11.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1024, help="hidden size (default: %(default)s)")
    p.add_argument("--layers", type=int, default=16, help="decoder layers (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default: %(default)s)")
    p.add_argument("--cycles", type=int, default=6, help="sleep + update cycles, the first apart (default: %(default)s)")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu", help="the engine's device (default: %(default)s)")
    p.add_argument("--json-out", metavar="PATH", help="write the JSON here (the table then goes to stdout)")
    args = p.parse_args(argv)
    if args.cycles < 1 or args.width < 1 or args.layers < 1:
        p.error("--cycles, --width and --layers must be at least 1")
    return run_main("bench/engine_sleep.py", args.json_out, lambda tmp, cleanup: run(args, tmp), render, prefix="elasticrl-engine-sleep-")


if __name__ == "__main__":
    sys.exit(main())
