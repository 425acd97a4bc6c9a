"""The arithmetic of ``bench/collectives.py``, importable without torch: nccl-tests' size sweep and
per-op buffer counts, its algorithm/bus bandwidth formulas, the check values, the table, the JSON
summary, the environment report (NCCL_* variables, nodes, InfiniBand ports from sysfs) and the plot.

Semantics follow nccl-tests (src/common.cu and src/<op>.cu): a swept ``size`` of S bytes is
``count = S // wordsize`` elements, which each op turns into (send, recv, param) element counts;
the table's *size* column is ``max(send, recv) * wordsize`` (for all_gather the whole receive
buffer, for reduce_scatter the whole send buffer, for all_to_all either), *count* is ``param`` (the
per-rank count the NCCL call takes: for all_gather / reduce_scatter / all_to_all the per-rank
chunk), ``algbw = size / time`` and ``busbw = algbw * factor`` with nccl-tests' factors, in GB/s of
1e9 bytes/s. Counts that do not split evenly across ranks are rounded down to a multiple of the
rank count, as nccl-tests does; sizes that round to zero elements are skipped (nccl-tests prints
them as empty rows).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pathlib
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "sendrecv")
REDOPS = ("sum", "min", "max")
REDUCING_OPS = ("all_reduce", "reduce_scatter")


@dataclasses.dataclass(frozen=True)
class DType:
    """One element type: the torch attribute name, the name nccl-tests prints, bytes per element,
    and the largest integer the type holds exactly (what the check's sums must stay under)."""

    torch_name: str
    nccl_name: str
    wordsize: int
    exact_int_max: int


DTYPES = {
    "float": DType("float32", "float", 4, 2**24),
    "half": DType("float16", "half", 2, 2**11),
    "bfloat16": DType("bfloat16", "bfloat16", 2, 2**8),
    "double": DType("float64", "double", 8, 2**53),
    "int8": DType("int8", "int8", 1, 2**7 - 1),
    "uint8": DType("uint8", "uint8", 1, 2**8 - 1),
    "int32": DType("int32", "int32", 4, 2**31 - 1),
    "int64": DType("int64", "int64", 8, 2**63 - 1),
}
DTYPE_ALIASES = {"float32": "float", "fp32": "float", "float16": "half", "fp16": "half", "bf16": "bfloat16",
                 "float64": "double", "fp64": "double", "char": "int8", "int": "int32", "long": "int64"}


def parse_dtype(name: str) -> DType:
    """``float32`` / ``float`` / ``bf16`` ... -> DType; an unknown name lists the valid ones."""
    key = DTYPE_ALIASES.get(name.lower(), name.lower())
    if key not in DTYPES:
        valid = ", ".join(sorted(set(DTYPES) | set(DTYPE_ALIASES)))
        raise ValueError(f"unknown --dtype {name!r}; valid: {valid}")
    return DTYPES[key]


def parse_ops(spec: str) -> list[str]:
    """``all`` or a comma-separated list of ops (order kept, duplicates dropped)."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if names == ["all"]:
        return list(OPS)
    unknown = [n for n in names if n not in OPS]
    if unknown or not names:
        raise ValueError(f"unknown --op {','.join(unknown) or spec!r}; valid: all, {', '.join(OPS)}")
    return list(dict.fromkeys(names))


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """nccl-tests' sizes: a byte count with an optional K/M/G/T suffix in powers of 1024
    (``8``, ``64K``, ``128M``, ``1G``, ``0.5M``)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"bad size {text!r}: expected bytes with an optional K/M/G/T suffix, e.g. 8, 64K, 128M")
    mult = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def size_sweep(minbytes: int, maxbytes: int, stepfactor: int = 2, stepbytes: int = 0) -> list[int]:
    """Sizes from ``minbytes`` to ``maxbytes`` inclusive: times ``stepfactor`` when it is > 1, else
    plus ``stepbytes`` (nccl-tests' -f / -i)."""
    if minbytes < 0 or maxbytes < minbytes:
        raise ValueError(f"need 0 <= minbytes <= maxbytes, got {minbytes} and {maxbytes}")
    if stepfactor <= 1 and stepbytes <= 0:
        raise ValueError(f"the sweep never advances: stepfactor {stepfactor} <= 1 and stepbytes {stepbytes} <= 0")
    if stepfactor > 1 and minbytes == 0:
        raise ValueError("minbytes 0 with a step factor never advances; start at 1 byte or more")
    sizes, size = [], minbytes
    while size <= maxbytes:
        sizes.append(size)
        size = size * stepfactor if stepfactor > 1 else size + stepbytes
    return sizes


@dataclasses.dataclass(frozen=True)
class Counts:
    """Element counts of one op at one swept size (nccl-tests' getCollByteCount)."""

    send: int
    """elements in each rank's send buffer"""
    recv: int
    """elements in each rank's receive buffer"""
    param: int
    """the count the NCCL call takes (per-rank chunk for all_gather / reduce_scatter / all_to_all)"""


def coll_counts(op: str, count: int, nranks: int) -> Counts:
    """nccl-tests' (send, recv, param) element counts for ``count`` swept elements on ``nranks``."""
    per = count // nranks
    if op in ("all_reduce", "broadcast", "sendrecv"):
        return Counts(count, count, count)
    if op == "all_gather":
        return Counts(per, per * nranks, per)
    if op == "reduce_scatter":
        return Counts(per * nranks, per, per)
    if op == "all_to_all":
        return Counts(per * nranks, per * nranks, per)
    raise ValueError(f"unknown op {op!r}; valid: {', '.join(OPS)}")


def bus_factor(op: str, nranks: int) -> float:
    """busbw / algbw, nccl-tests' factors: what one rank's link must carry relative to ``size``."""
    n = nranks
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "sendrecv"):
        return 1.0
    raise ValueError(f"unknown op {op!r}; valid: {', '.join(OPS)}")


def bandwidth(op: str, size_bytes: int, seconds: float, nranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes/s) for the table's ``size_bytes`` moved in ``seconds``."""
    if seconds <= 0:
        return 0.0, 0.0
    algbw = size_bytes / 1e9 / seconds
    return algbw, algbw * bus_factor(op, nranks)


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """One table row before it runs: the printed size/count and the buffers to allocate."""

    size: int
    """bytes, the table's size column: max(send, recv) * wordsize"""
    count: int
    """elements, the table's count column (Counts.param)"""
    counts: Counts


def plan_rows(op: str, sizes: Sequence[int], wordsize: int, nranks: int) -> list[RowPlan]:
    """The rows an op runs for the swept ``sizes``; sizes that give zero elements are skipped."""
    rows = []
    for size in sizes:
        c = coll_counts(op, size // wordsize, nranks)
        if c.param == 0:
            continue
        rows.append(RowPlan(size=max(c.send, c.recv) * wordsize, count=c.param, counts=c))
    return rows


def check_modulus(dtype: DType, nranks: int, redop: str) -> int:
    """Check values are ``(i + 3 * rank) % m`` with m in (5, 4, 2), all coprime to 3; for a sum the
    largest m whose sum over ``nranks`` stays exact in ``dtype`` (bf16 holds integers only to 256)."""
    if redop != "sum":
        return 5
    return next((m for m in (5, 4) if (m - 1) * nranks <= dtype.exact_int_max), 2)


def check_is_exact(dtype: DType, nranks: int, redop: str, m: int) -> bool:
    """Whether a correct result equals the expected values bit for bit (integer types wrap the same
    way in the collective and in the expectation); if not, floats are compared with a tolerance."""
    return redop != "sum" or (m - 1) * nranks <= dtype.exact_int_max or dtype.nccl_name.startswith(("int", "uint"))


def check_value(i, rank: int, m: int):
    """What ``rank`` puts at flat index ``i`` of its send buffer (``i`` an int or an int64 tensor)."""
    return (i + 3 * rank) % m


def reduced_value(i, nranks: int, m: int, redop: str, minimum=min, maximum=max):
    """The reduction over ranks 0..nranks-1 of ``check_value(i, rank, m)`` in O(m) operations: ranks
    j and j+m hold the same values (3m = 0 mod m), and m coprime to 3 makes any m consecutive ranks
    hold every residue once. ``minimum``/``maximum`` are ``torch.minimum``/``maximum`` for tensors."""
    full, rem = divmod(nranks, m)
    if redop == "sum":
        acc = i * 0 + full * (m * (m - 1) // 2)
        for j in range(rem):
            acc = acc + check_value(i, j, m)
        return acc
    if full:
        return i * 0 + (0 if redop == "min" else m - 1)
    pick = minimum if redop == "min" else maximum
    acc = check_value(i, 0, m)
    for j in range(1, rem):
        acc = pick(acc, check_value(i, j, m))
    return acc


def expected_value(op: str, k, rank: int, nranks: int, per: int, m: int, redop: str, minimum=min, maximum=max):
    """Element ``k`` of ``rank``'s receive buffer after one correct call on check values; ``per`` is
    Counts.param (the per-rank chunk of all_gather / reduce_scatter / all_to_all)."""
    if op == "all_reduce":
        return reduced_value(k, nranks, m, redop, minimum, maximum)
    if op == "broadcast":
        return check_value(k, root_of(op), m)
    if op == "all_gather":  # block j is rank j's send buffer
        return check_value(k % per, k // per, m)
    if op == "reduce_scatter":  # chunk `rank` of everyone's send buffer, reduced
        return reduced_value(rank * per + k, nranks, m, redop, minimum, maximum)
    if op == "all_to_all":  # block j is block `rank` of rank j's send buffer
        return check_value(rank * per + k % per, k // per, m)
    if op == "sendrecv":  # the ring: from rank - 1
        return check_value(k, (rank - 1) % nranks, m)
    raise ValueError(f"unknown op {op!r}; valid: {', '.join(OPS)}")


def root_of(op: str) -> int:
    """The root column: broadcast's root rank, -1 for ops without one (as nccl-tests prints)."""
    return 0 if op == "broadcast" else -1


def redop_of(op: str, redop: str) -> str:
    return redop if op in REDUCING_OPS else "none"


def time_average(times_s: Sequence[float], how: str) -> float:
    """Combine per-rank average iteration times: ``max`` (the slowest rank bounds a collective),
    ``avg`` (nccl-tests' default -a 1), ``min``, or ``rank0``."""
    if how == "max":
        return max(times_s)
    if how == "min":
        return min(times_s)
    if how == "avg":
        return sum(times_s) / len(times_s)
    if how == "rank0":
        return times_s[0]
    raise ValueError(f"unknown time average {how!r}; valid: max, avg, min, rank0")


# ---- the table --------------------------------------------------------------------------------

_HEADER = ("#       size         count      type   redop    root     time   algbw   busbw  #wrong\n"
           "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)")


def format_time_us(us: float) -> str:
    """nccl-tests' time column: 7 wide, fewer decimals as it grows."""
    if us >= 10000:
        return f"{us:7.0f}"
    if us >= 100:
        return f"{us:7.1f}"
    return f"{us:7.2f}"


def format_row(row: Mapping) -> str:
    wrong = "N/A" if row["wrong"] is None else f"{row['wrong']:g}"
    return (f"{row['size']:12d}  {row['count']:12d}  {row['type']:>8s}  {row['redop']:>6s}  {row['root']:6d}  "
            f"{format_time_us(row['time_us'])}  {row['algbw']:6.2f}  {row['busbw']:6.2f}  {wrong:>6s}")


def avg_busbw(rows: Sequence[Mapping]) -> float:
    """nccl-tests' "Avg bus bandwidth": the plain mean of busbw over the rows."""
    return sum(r["busbw"] for r in rows) / len(rows) if rows else 0.0


def format_op_header(result: Mapping) -> str:
    """One op's title line and the nccl-tests column header."""
    return f"# {result['op']}  impl: {result['impl']}  ({result['impl_note']})\n#\n{_HEADER}"


def format_op_footer(result: Mapping) -> str:
    return f"# Avg bus bandwidth    : {avg_busbw(result['rows']):.6g} GB/s"


def format_op_table(result: Mapping) -> str:
    """One op's whole block: header, rows, the average-busbw line."""
    return "\n".join([format_op_header(result), *(format_row(r) for r in result["rows"]), format_op_footer(result)])


def format_summary(results: Sequence[Mapping]) -> str:
    """One line per op: impl, peak and average busbw, total wrong elements."""
    lines = [f"{'op':<15} {'impl':<12} {'peak busbw (GB/s)':>18} {'at size (B)':>12} {'avg busbw (GB/s)':>17} {'#wrong':>7}"]
    for res in results:
        rows = res["rows"]
        peak = max(rows, key=lambda r: r["busbw"]) if rows else {"busbw": 0.0, "size": 0}
        wrong = "N/A" if any(r["wrong"] is None for r in rows) else str(sum(r["wrong"] for r in rows))
        lines.append(f"{res['op']:<15} {res['impl']:<12} {peak['busbw']:>18.3f} {peak['size']:>12d} "
                     f"{avg_busbw(rows):>17.3f} {wrong:>7}")
    return "\n".join(lines)


def total_wrong(results: Sequence[Mapping]) -> int:
    return sum(r["wrong"] or 0 for res in results for r in res["rows"])


# ---- the environment ----------------------------------------------------------------------------

REPORTED_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "UCX_", "FI_", "GLOO_")
REPORTED_ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE",
                      "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


def relevant_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables that change which fabric and how collectives run (NCCL_*, TORCH_NCCL_*, ...)."""
    return {k: env[k] for k in sorted(env) if k.startswith(REPORTED_ENV_PREFIXES) or k in REPORTED_ENV_NAMES}


def torchrun_layout(env: Mapping[str, str]) -> dict:
    """Nodes and ranks per node as torchrun's environment describes this worker's round."""
    def get(name: str) -> int | None:
        value = env.get(name)
        return int(value) if value not in (None, "") else None

    return {"nnodes": get("GROUP_WORLD_SIZE"), "ranks_per_node": get("LOCAL_WORLD_SIZE"),
            "node_rank": get("GROUP_RANK"), "world_size": get("WORLD_SIZE") or 1}


def _read(path: pathlib.Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def ib_devices(sysfs: pathlib.Path = pathlib.Path("/sys/class/infiniband")) -> list[dict]:
    """InfiniBand / RoCE ports from sysfs: device, port, state, rate, link layer (empty when none)."""
    if not sysfs.is_dir():
        return []
    out = []
    for dev in sorted(p for p in sysfs.iterdir()):
        for port in sorted((dev / "ports").glob("*"), key=lambda p: int(p.name) if p.name.isdigit() else 0):
            out.append({
                "device": dev.name, "port": int(port.name) if port.name.isdigit() else port.name,
                "state": _read(port / "state"), "rate": _read(port / "rate"),
                "link_layer": _read(port / "link_layer"),
            })
    return out


def ibv_devinfo_list(timeout_s: float = 5.0) -> str | None:
    """``ibv_devinfo -l`` output when the tool is on PATH, else None."""
    exe = shutil.which("ibv_devinfo")
    if exe is None:
        return None
    try:
        return subprocess.run([exe, "-l"], capture_output=True, text=True, timeout=timeout_s).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"failed: {e}"


def format_env_report(env: Mapping) -> str:
    """The ``--report`` block: what the bandwidth numbers depend on."""
    lay = env["layout"]
    nodes = lay["nnodes"] if lay["nnodes"] is not None else "?"
    rpn = lay["ranks_per_node"] if lay["ranks_per_node"] is not None else "?"
    lines = [
        "# Environment",
        f"#   backend {env['backend']}  torch {env['torch']}  NCCL {env['nccl_version'] or 'n/a'}  dtype {env['dtype']}",
        f"#   world {env['world_size']} ranks; torchrun nodes: {nodes}, ranks per node: {rpn}; "
        f"hosts seen: {len(env['hosts'])} ({', '.join(f'{h}: {c} ranks' for h, c in env['hosts'].items())})",
    ]
    devices = sorted({r["device"] for r in env["ranks"]})
    lines.append(f"#   devices: {'; '.join(devices)}")
    nccl = {k: v for k, v in env["env"].items() if k.startswith(("NCCL_", "TORCH_NCCL_"))}
    lines.append("#   NCCL_* / TORCH_NCCL_* set: " + (" ".join(f"{k}={v}" for k, v in nccl.items()) if nccl else "none"))
    for host, ports in env["ib"].items():
        if not ports:
            lines.append(f"#   IB on {host}: none in /sys/class/infiniband")
        for p in ports:
            lines.append(f"#   IB on {host}: {p['device']} port {p['port']} {p['state']} {p['rate']} {p['link_layer']}")
    for host, listing in env.get("ibv_devinfo", {}).items():
        if listing is not None:
            lines.append(f"#   ibv_devinfo -l on {host}: {' '.join(listing.split()) or '(empty)'}")
    return "\n".join(lines)


def format_devices(ranks: Sequence[Mapping]) -> str:
    """nccl-tests' "Using devices" block, one line per rank."""
    lines = ["# Using devices"]
    for r in ranks:
        lines.append(f"#  Rank {r['rank']:3d} Group {r['node_rank']:3d} Pid {r['pid']:7d} on {r['host']:>12s} "
                     f"device {r['local_rank']:2d} {r['device']}")
    return "\n".join(lines)


# ---- JSON and plot ------------------------------------------------------------------------------

def build_report(settings: Mapping, env: Mapping, results: Sequence[Mapping]) -> dict:
    """The JSON document: settings, environment, one entry per op with its rows and average busbw."""
    return {
        "tool": "elasticrl bench/collectives.py",
        "units": {"size": "bytes", "count": "elements", "time_us": "microseconds", "algbw": "GB/s (1e9 B/s)",
                  "busbw": "GB/s (1e9 B/s)"},
        "settings": dict(settings),
        "env": dict(env),
        "results": [dict(r, avg_busbw=avg_busbw(r["rows"])) for r in results],
        "wrong_total": total_wrong(results),
    }


def write_json(report: Mapping, path: str) -> None:
    """``path`` ``-`` is stdout."""
    text = json.dumps(report, indent=2)
    if path == "-":
        print(text, flush=True)
    else:
        pathlib.Path(path).write_text(text + "\n")


def matplotlib_missing() -> str | None:
    """None when matplotlib imports, else the message telling the user how to get it."""
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        return "--plot needs matplotlib, which is not installed here: pip install matplotlib"
    return None


def plot_busbw(results: Sequence[Mapping], path: str, title: str) -> None:
    """busbw against size, one line per op, log2 x axis, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for res in results:
        rows = res["rows"]
        ax.plot([r["size"] for r in rows], [r["busbw"] for r in rows], marker="o", label=f"{res['op']} ({res['impl']})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def host_counts(ranks: Sequence[Mapping]) -> dict[str, int]:
    """host -> ranks on it, in rank order of first appearance."""
    out: dict[str, int] = {}
    for r in ranks:
        out[r["host"]] = out.get(r["host"], 0) + 1
    return out


def log2_label(n: int) -> str:
    """Human size for titles: 1024 -> 1K, 3 -> 3."""
    for unit, mult in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)

