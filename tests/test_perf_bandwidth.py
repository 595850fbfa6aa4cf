"""Link bandwidth: `portspeed conformance --suites bandwidth` writes the table `portspeed compare --perf` reads.

Real parts: the suite's two ranks on Gloo (the CPU adapter, through portspeed's router with "nccl" requested)
measure every collective at 1, 4 and 16 KiB, while a two-rank own loop is recorded with `portspeed run --perf`
(its gradient all_reduces and one of 256 KiB). The checks read structure and arithmetic, never a speed: the
table holds every collective at every size, its bus bandwidth is nccl-tests' factor times the algorithm
bandwidth, the recording names the adapter, backend and host the table is keyed by, and `compare --perf`'s
collectives table prints, for each recorded size, the bandwidth measured at the nearest measured size. Bad
switches and a damaged table exit 2 with one line.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import math
import re
import socket
import textwrap
from pathlib import Path
from typing import Any

import pytest

from helpers.launch import Result, free_port, run_python
from portspeed.parity import compare as compare_cli
from portspeed.perf.reading.links import FAMILIES, bus_factor

pytestmark = [pytest.mark.multiproc]

SIZES = [1024, 4096, 16384]
TIMEOUT = 240
#: a two-rank own loop: each timed iteration all-reduces the gradients (256 and 16384 bytes) and 256 KiB
LOOP = textwrap.dedent("""
    import torch, torch.distributed as dist
    import portspeed.megatron_adaptor
    import portspeed.perf
    dist.init_process_group("nccl")
    model = torch.nn.Linear(64, 64)
    for n in range(1, 4):
        with portspeed.perf.iteration(n, model):
            model(torch.randn(8, 64)).sum().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            dist.all_reduce(torch.ones(65536))
    dist.destroy_process_group()
""")
ENV = {"PORTSPEED_ACCELERATOR": "cpu"}


def compare(*args: Any) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = compare_cli.main(["--perf", *map(str, args)], out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The suite's table and a recording, made side by side."""
    root = tmp_path_factory.mktemp("bandwidth")
    (root / "loop.py").write_text(LOOP)
    table, rec = root / "bw.json", root / "rec"
    suite = ["-m", "portspeed.conformance", "--adapter", "cpu", "--suites", "bandwidth", "--bandwidth", str(table),
             "--bandwidth-bytes", "1K:16K"]
    run = ["-m", "portspeed.cli", "run", "--perf", str(rec), "--perf-iterations", "2:3", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(root / "loop.py")]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(run_python, cmd, TIMEOUT, ENV, drop=("PORTSPEED_*",)) for cmd in (suite, run)]
        got: list[Result] = [j.result() for j in jobs]
    return {"suite": got[0], "run": got[1], "table": table, "rec": rec}


def test_the_suite_measures_every_collective_at_every_size(measured: dict[str, Any]) -> None:
    out = measured["suite"].check().stdout
    assert "conformance: 16 passed, 0 failed" in out, out[-3000:]
    data = json.loads(measured["table"].read_text())
    assert data["format"] == "portspeed-bandwidth" and len(data["links"]) == 1, data
    link = data["links"][0]
    assert (link["adapter"], link["backend"], link["host"]) == ("cpu", "gloo", socket.gethostname()), link
    assert sorted((r["op"], r["ranks"], r["bytes"]) for r in link["rows"]) == sorted(
        (op, 2, size) for op in FAMILIES for size in SIZES)
    for r in link["rows"]:  # the arithmetic of nccl-tests: algbw = bytes / time, busbw = algbw x factor
        assert r["time_us"] > 0, r
        assert math.isclose(r["algbw_gbs"], r["bytes"] / (r["time_us"] * 1e-6) / 1e9, rel_tol=1e-3, abs_tol=1e-6), r
        assert math.isclose(r["busbw_gbs"], r["algbw_gbs"] * bus_factor(r["op"], 2), rel_tol=1e-3, abs_tol=1e-6), r
        assert f"bandwidth: {r['op']:<14} 2 ranks {r['bytes']:>10} bytes:" in out, r


def test_compare_prints_the_link_bandwidth_beside_the_achieved(measured: dict[str, Any]) -> None:
    measured["run"].check()
    rec, table = measured["rec"], measured["table"]
    line = json.loads((rec / "rank0.jsonl").read_text().splitlines()[0])
    assert (line["adapter"], line["backend"], line["host"]) == ("cpu", "gloo", socket.gethostname()), line
    code, out, err = compare(rec, rec, "--bandwidth", table)
    assert code == 0 and not err, err
    rows = {int(m.group(1)): m.groups()[1:] for m in re.finditer(
        r"^  all_reduce\s+2\s+(\d+)\s+float32\s+\d+(?:\s+[\d.]+){4}\s+([\d.]+)\s+(\d+)\s+(\d+)%$", out, re.M)}
    assert sorted(rows) == [256, 16384, 262144], out
    link = {r["bytes"]: r for r in json.loads(table.read_text())["links"][0]["rows"] if r["op"] == "all_reduce"}
    for nbytes, (bw, at, _) in rows.items():
        nearest = min(SIZES, key=lambda s: abs(math.log2(s / nbytes)))
        assert int(at) == nearest and float(bw) == pytest.approx(link[nearest]["busbw_gbs"], abs=6e-4), (nbytes, out)
    assert f"link: {table}, measured {json.loads(table.read_text())['links'][0]['measured']}" in out, out

    code, out, err = compare(rec, "--bandwidth", table)  # one run: the slow rank, then the same table
    assert code in (0, 1) and f"  link: {table}" in out, out  # 1 when a loaded machine starves one rank
    assert re.search(r"^  all_reduce\s+2\s+262144 .*%$", out, re.M), out

    code, out, err = compare(rec, rec, "--bandwidth", table.parent / "none.json")
    assert code == 0 and "link: no bandwidth measured for adapter cpu, backend gloo on host" in out, out
    assert "run `portspeed conformance --adapter cpu --suites bandwidth` on that host" in out, out


def test_bad_bandwidth_input_exits_2_with_one_line(measured: dict[str, Any], tmp_path: Path) -> None:
    res = run_python(["-m", "portspeed.conformance", "--adapter", "cpu", "--suites", "bandwidth",
                      "--bandwidth-bytes", "64K:1K"], 60, ENV, drop=("PORTSPEED_*",))
    assert res.returncode == 2 and "--bandwidth-bytes '64K:1K': LO must be" in res.stderr.splitlines()[-1], res.stderr
    res = run_python(["-m", "portspeed.conformance", "--adapter", "cpu", "--suites", "bandwidth",
                      "--bandwidth", str(tmp_path)], 60, ENV, drop=("PORTSPEED_*",))
    assert res.returncode == 2 and "is a folder" in res.stderr.splitlines()[-1], res.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    code, out, err = compare(measured["rec"], measured["rec"], "--bandwidth", bad)
    assert code == 2 and not out and err.count("\n") == 1 and "not a portspeed link bandwidth table" in err, err
    out, err = io.StringIO(), io.StringIO()
    assert compare_cli.main(["a.log", "b.log", "--bandwidth", str(bad)], out=out, err=err) == 2
    assert "apply to --perf recordings only" in err.getvalue(), err.getvalue()
