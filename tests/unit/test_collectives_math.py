"""The pure parts of ``bench/collectives.py`` against hand-computed values: nccl-tests' size sweep,
per-op counts and size column, the algbw / busbw formulas (and that a wrong formula is caught), the
check values against a brute-force model of each collective, the table, JSON, and the environment
report. Nothing here starts a process group."""

from __future__ import annotations

import json
import sys

import pytest

from bench import collectives_lib as lib

GB = 10**9


# ---- sizes --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("8", 8), ("64K", 65536), ("64k", 65536), ("128M", 128 * 2**20), ("1G", 2**30), ("0.5M", 2**19), ("2KB", 2048),
])
def test_parse_size_is_bytes_with_1024_suffixes(text, expected):
    assert lib.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "M", "-8", "1.2.3K", "8X"])
def test_parse_size_rejects_garbage(text):
    with pytest.raises(ValueError, match="bad size"):
        lib.parse_size(text)


def test_size_sweep_multiplies_by_the_factor_up_to_max_inclusive():
    assert lib.size_sweep(8, 64 * 1024, 4) == [8, 32, 128, 512, 2048, 8192, 32768]
    assert lib.size_sweep(8, 128, 2) == [8, 16, 32, 64, 128]
    assert lib.size_sweep(1024, 1024, 2) == [1024]


def test_size_sweep_adds_stepbytes_when_the_factor_is_1():
    assert lib.size_sweep(2**20, 4 * 2**20, 1, 2**20) == [2**20, 2 * 2**20, 3 * 2**20, 4 * 2**20]


@pytest.mark.parametrize(("args", "match"), [
    ((64, 8, 2, 0), "minbytes <= maxbytes"),
    ((8, 64, 1, 0), "never advances"),
    ((0, 64, 2, 0), "minbytes 0"),
])
def test_size_sweep_rejects_sweeps_that_never_end(args, match):
    with pytest.raises(ValueError, match=match):
        lib.size_sweep(*args)


# ---- counts and the size column -----------------------------------------------------------------

# (op, swept count, nranks) -> (send, recv, param), from nccl-tests' <op>GetCollByteCount by hand.
COUNTS = [
    ("all_reduce", 250, 3, (250, 250, 250)),
    ("broadcast", 250, 3, (250, 250, 250)),
    ("sendrecv", 250, 3, (250, 250, 250)),
    ("all_gather", 250, 3, (83, 249, 83)),
    ("reduce_scatter", 250, 3, (249, 83, 83)),
    ("all_to_all", 250, 3, (249, 249, 83)),
    ("all_gather", 1000, 4, (250, 1000, 250)),
]


@pytest.mark.parametrize(("op", "count", "n", "expected"), COUNTS)
def test_coll_counts_match_nccl_tests(op, count, n, expected):
    assert lib.coll_counts(op, count, n) == lib.Counts(*expected)


@pytest.mark.parametrize(("op", "size_col", "count_col"), [
    # 1000 B of float on 3 ranks: 250 elements; ops that split across ranks round down to 249.
    ("all_reduce", 1000, 250), ("broadcast", 1000, 250), ("sendrecv", 1000, 250),
    ("all_gather", 996, 83),      # size = the whole receive buffer, count = per-rank send count
    ("reduce_scatter", 996, 83),  # size = the whole send buffer, count = per-rank receive count
    ("all_to_all", 996, 83),      # size = either whole buffer, count = the per-peer block
])
def test_plan_rows_size_and_count_columns(op, size_col, count_col):
    (row,) = lib.plan_rows(op, [1000], 4, 3)
    assert (row.size, row.count) == (size_col, count_col)


def test_plan_rows_skips_sizes_with_no_element_per_rank():
    # 8 B of float on 8 ranks: 2 elements, 0 per rank for the split ops.
    assert lib.plan_rows("all_gather", [8, 64], 4, 8)[0].size == 64
    assert [r.size for r in lib.plan_rows("all_reduce", [8, 64], 4, 8)] == [8, 64]


# ---- bandwidth ----------------------------------------------------------------------------------

# (op, nranks, size B, seconds) -> (algbw, busbw) GB/s, computed by hand.
BANDWIDTH = [
    ("all_reduce", 8, GB, 1.0, 1.0, 1.75),          # 2(n-1)/n = 14/8
    ("all_reduce", 2, 4 * GB, 2.0, 2.0, 2.0),       # 2(1)/2 = 1
    ("all_reduce", 1, GB, 1.0, 1.0, 0.0),           # one rank moves nothing
    ("all_gather", 4, 4 * GB, 2.0, 2.0, 1.5),       # (n-1)/n = 3/4
    ("reduce_scatter", 2, GB, 0.5, 2.0, 1.0),       # 1/2
    ("all_to_all", 8, 8 * GB, 1.0, 8.0, 7.0),       # 7/8
    ("broadcast", 8, 3 * GB, 1.0, 3.0, 3.0),        # 1
    ("sendrecv", 8, GB, 0.25, 4.0, 4.0),            # 1
    ("all_reduce", 8, 1024 * 1024, 100e-6, 10.48576, 18.35008),
]


@pytest.mark.parametrize(("op", "n", "size", "seconds", "algbw", "busbw"), BANDWIDTH)
def test_bandwidth_matches_hand_computed_values(op, n, size, seconds, algbw, busbw):
    got = lib.bandwidth(op, size, seconds, n)
    assert got == pytest.approx((algbw, busbw), rel=1e-12, abs=1e-12)


def test_algbw_equals_nccl_tests_formula_on_the_param_count():
    # nccl-tests' <op>GetBw takes the param count: count*typesize*nranks/1e9/sec for the split ops,
    # count*typesize/1e9/sec for the others; with the size column that is size/time for every op.
    n, wordsize, seconds = 3, 4, 1e-3
    for op in lib.OPS:
        (row,) = lib.plan_rows(op, [1000], wordsize, n)
        mult = n if op in ("all_gather", "reduce_scatter", "all_to_all") else 1
        nccl_tests_algbw = row.count * wordsize * mult / 1e9 / seconds
        assert lib.bandwidth(op, row.size, seconds, n)[0] == pytest.approx(nccl_tests_algbw)


WRONG_FORMULAS = {
    "all_reduce with the all_gather factor": lambda op, n: (n - 1) / n,
    "all_reduce with factor 2": lambda op, n: 2.0,
    "every op with factor 1": lambda op, n: 1.0,
    "split ops with 2(n-1)/n": lambda op, n: 2 * (n - 1) / n,
    "split ops over n-1 of n ranks": lambda op, n: (n - 1) / n if op == "all_reduce" else n / (n - 1),
}


@pytest.mark.parametrize("name", sorted(WRONG_FORMULAS))
def test_hand_values_catch_a_wrong_bus_factor(name):
    wrong = WRONG_FORMULAS[name]
    mismatches = [row for row in BANDWIDTH if row[1] > 1 and
                  not row[4] * wrong(row[0], row[1]) == pytest.approx(row[5], rel=1e-9)]
    assert mismatches, f"the hand-computed table would not notice {name}"


def test_bandwidth_of_zero_time_is_zero_not_an_error():
    assert lib.bandwidth("all_reduce", GB, 0.0, 8) == (0.0, 0.0)


def test_time_average_combines_per_rank_times():
    times = [3.0, 1.0, 2.0]
    assert [lib.time_average(times, h) for h in ("max", "avg", "min", "rank0")] == [3.0, 2.0, 1.0, 3.0]


# ---- check values against a brute-force model ----------------------------------------------------

def _simulate(op: str, n: int, per: int, m: int, redop: str) -> list[list[int]]:
    """Each rank's receive buffer after one correct call, by moving lists around."""
    red = {"sum": sum, "min": min, "max": max}[redop]
    count = per * n if op in ("all_gather", "reduce_scatter", "all_to_all") else per
    c = lib.coll_counts(op, count, n)
    send = [[lib.check_value(i, r, m) for i in range(c.send)] for r in range(n)]
    if op == "all_reduce":
        return [[red(send[j][i] for j in range(n)) for i in range(c.recv)] for _ in range(n)]
    if op == "broadcast":
        return [list(send[0]) for _ in range(n)]
    if op == "all_gather":
        return [[x for j in range(n) for x in send[j]] for _ in range(n)]
    if op == "reduce_scatter":
        return [[red(send[j][r * per + k] for j in range(n)) for k in range(per)] for r in range(n)]
    if op == "all_to_all":
        return [[x for j in range(n) for x in send[j][r * per:(r + 1) * per]] for r in range(n)]
    if op == "sendrecv":
        return [list(send[(r - 1) % n]) for r in range(n)]
    raise AssertionError(op)


@pytest.mark.parametrize("op", lib.OPS)
@pytest.mark.parametrize("redop", lib.REDOPS)
def test_expected_values_match_a_brute_force_model(op, redop):
    for n in range(1, 12):
        for m in (2, 4, 5):
            per = 7
            want = _simulate(op, n, per, m, redop)
            for r in range(n):
                got = [lib.expected_value(op, k, r, n, per, m, redop) for k in range(len(want[r]))]
                assert got == want[r], (op, redop, n, m, r)


def test_check_modulus_keeps_sums_exact_and_avoids_multiples_of_3():
    bf16, half, int8 = lib.DTYPES["bfloat16"], lib.DTYPES["half"], lib.DTYPES["int8"]
    assert lib.check_modulus(bf16, 64, "sum") == 5     # 4 * 64 = 256 fits bf16's exact integers
    assert lib.check_modulus(bf16, 80, "sum") == 4     # 3 * 80 = 240
    assert lib.check_modulus(bf16, 200, "sum") == 2
    assert lib.check_modulus(half, 512, "sum") == 5
    assert lib.check_modulus(bf16, 1000, "max") == 5
    assert lib.check_is_exact(bf16, 200, "sum", 2) and not lib.check_is_exact(bf16, 300, "sum", 2)
    assert lib.check_is_exact(int8, 300, "sum", 2)    # integers wrap identically on both sides


def test_check_values_differ_between_neighbouring_ranks():
    # sendrecv / all_to_all mix-ups between ranks r-1, r, r+1 must show as wrong elements.
    for m in (2, 4, 5):
        for i in range(10):
            assert lib.check_value(i, 0, m) != lib.check_value(i, 1, m)


# ---- parsing and the table ----------------------------------------------------------------------

def test_parse_ops_and_dtypes():
    assert lib.parse_ops("all") == list(lib.OPS)
    assert lib.parse_ops("sendrecv, all_reduce,sendrecv") == ["sendrecv", "all_reduce"]
    with pytest.raises(ValueError, match="valid: all, all_reduce"):
        lib.parse_ops("allreduce")
    assert lib.parse_dtype("float32") is lib.DTYPES["float"] and lib.parse_dtype("bf16").wordsize == 2
    with pytest.raises(ValueError, match="valid:"):
        lib.parse_dtype("float8")


@pytest.mark.parametrize(("us", "text"), [(12.3456, "  12.35"), (123.456, "  123.5"), (12345.6, "  12346")])
def test_time_column_is_formatted_like_nccl_tests(us, text):
    assert lib.format_time_us(us) == text


def _row(**kw):
    return {"size": 1024, "count": 256, "type": "float", "redop": "sum", "root": -1, "time_us": 12.5,
            "algbw": 0.08192, "busbw": 0.14336, "wrong": 0} | kw


def test_format_row_columns():
    line = lib.format_row(_row())
    assert line.split() == ["1024", "256", "float", "sum", "-1", "12.50", "0.08", "0.14", "0"]
    assert lib.format_row(_row(wrong=None)).split()[-1] == "N/A"


def test_op_table_has_header_rows_and_average_busbw():
    result = {"op": "all_reduce", "impl": "native", "impl_note": "x", "rows": [_row(busbw=1.0), _row(busbw=3.0)]}
    text = lib.format_op_table(result)
    lines = text.splitlines()
    assert lines[0] == "# all_reduce  impl: native  (x)" and "#wrong" in lines[2] and "(GB/s)" in lines[3]
    assert [ln.split()[-2] for ln in lines[4:6]] == ["1.00", "3.00"]
    assert text.splitlines()[-1] == "# Avg bus bandwidth    : 2 GB/s"
    summary = lib.format_summary([result])
    assert "all_reduce" in summary and "3.000" in summary


def test_report_is_json_and_counts_wrong_elements():
    results = [{"op": "sendrecv", "impl": "native", "impl_note": "", "rows": [_row(wrong=2), _row(wrong=3)]}]
    report = lib.build_report({"iters": 3}, {"backend": "gloo"}, results)
    assert report["wrong_total"] == 5 and report["results"][0]["avg_busbw"] == pytest.approx(0.14336)
    json.dumps(report)


# ---- environment --------------------------------------------------------------------------------

def test_relevant_env_and_torchrun_layout():
    env = {"NCCL_IB_HCA": "mlx5_0", "NCCL_DEBUG": "INFO", "HOME": "/root", "GROUP_WORLD_SIZE": "4",
           "LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "32", "GROUP_RANK": "1"}
    assert set(lib.relevant_env(env)) == {"NCCL_IB_HCA", "NCCL_DEBUG", "GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE", "WORLD_SIZE"}
    assert lib.torchrun_layout(env) == {"nnodes": 4, "ranks_per_node": 8, "node_rank": 1, "world_size": 32}
    assert lib.torchrun_layout({}) == {"nnodes": None, "ranks_per_node": None, "node_rank": None, "world_size": 1}


def test_ib_devices_reads_ports_from_sysfs(tmp_path):
    port = tmp_path / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
    (port / "link_layer").write_text("InfiniBand\n")
    assert lib.ib_devices(tmp_path) == [{"device": "mlx5_0", "port": 1, "state": "4: ACTIVE",
                                         "rate": "400 Gb/sec (4X NDR)", "link_layer": "InfiniBand"}]
    assert lib.ib_devices(tmp_path / "missing") == []


def test_env_report_names_nodes_nccl_variables_and_ib_ports():
    env = {"backend": "nccl", "torch": "2.13.0", "nccl_version": "2.27.3", "dtype": "float", "world_size": 16,
           "layout": {"nnodes": 2, "ranks_per_node": 8, "node_rank": 0, "world_size": 16},
           "hosts": {"a": 8, "b": 8}, "env": {"NCCL_IB_HCA": "mlx5_0", "OMP_NUM_THREADS": "1"},
           "ib": {"a": [{"device": "mlx5_0", "port": 1, "state": "4: ACTIVE", "rate": "400 Gb/sec (4X NDR)",
                         "link_layer": "InfiniBand"}], "b": []},
           "ranks": [{"device": "NVIDIA H100 80GB HBM3"}]}
    text = lib.format_env_report(env)
    assert "torchrun nodes: 2, ranks per node: 8" in text and "NCCL 2.27.3" in text
    assert "NCCL_IB_HCA=mlx5_0" in text and "OMP_NUM_THREADS" not in text.split("TORCH_NCCL_* set:")[1]
    assert "mlx5_0 port 1 4: ACTIVE 400 Gb/sec (4X NDR)" in text and "IB on b: none" in text


# ---- the command line (parsed before torch is imported) ------------------------------------------

def test_parse_args_turns_sizes_and_ops_into_values():
    from bench import collectives

    args = collectives.parse_args(["--op", "all", "-b", "8", "-e", "64K", "-f", "4", "-d", "bf16"])
    assert args.ops == list(lib.OPS) and (args.minbytes, args.maxbytes) == (8, 65536)
    assert args.dtype.nccl_name == "bfloat16" and args.check == 1 and args.average == "max"


@pytest.mark.parametrize("argv", [["--op", "allreduce"], ["-b", "1M", "-e", "1K"], ["-d", "float8"], ["-n", "0"]])
def test_parse_args_rejects_bad_values_with_a_message(argv, capsys):
    from bench import collectives

    with pytest.raises(SystemExit):
        collectives.parse_args(argv)
    assert "error:" in capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch, capsys):
    from bench import collectives

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(SystemExit):
        collectives.parse_args(["--plot", "/tmp/x.png"])
    assert "pip install matplotlib" in capsys.readouterr().err


def test_reduce_scatter_is_a_ring_under_gloo_only_by_default():
    from bench.collectives import choose_impl

    assert choose_impl("reduce_scatter", "auto", "gloo") == "p2p"
    assert choose_impl("reduce_scatter", "auto", "nccl") == "native"
    assert choose_impl("all_reduce", "p2p", "gloo") == "native"  # no send/recv form
    assert choose_impl("all_to_all", "p2p", "nccl") == "p2p"


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    result = {"op": "all_reduce", "impl": "native", "rows": [_row(size=8), _row(size=1024, busbw=2.0)]}
    lib.plot_busbw([result], str(tmp_path / "p.png"), "t")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
