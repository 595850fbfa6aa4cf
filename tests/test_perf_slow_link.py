"""A slow link named from one run: `portspeed compare --perf RUN` sets groups moving the same bytes against each other.

``tests/data/perf_two_links.py``: three ranks on Gloo, groups [0, 1] and [1, 2] each all_reducing 64 KiB five times an
iteration (an own loop marked with ``portspeed.perf.iteration``), timed with ``portspeed run --perf``. Planted
(TEST-ONLY, ``--slow-ms 60``): each call of group [1, 2] ends about 60 ms after both its ranks arrived. The one run
names that group, against group [0, 1], and no slow rank (neither of its ranks arrives late); the same script
without the plant names no slow link. The finding reads the groups' best calls, not a time bound. The planted
group alone (rank 0's recording left out) is set against the bandwidth measured for its link instead.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

from helpers.launch import free_port, run_python
from portspeed.parity import compare as compare_cli
from portspeed.perf.reading import links, slow_links
from portspeed.perf.reading.recordings import read_run

pytestmark = [pytest.mark.multiproc]

SCRIPT = "tests/data/perf_two_links.py"


def _compare(folder: Path, table: Path) -> tuple[int, str]:
    out = io.StringIO()
    code = compare_cli.main(["--perf", str(folder), "--bandwidth", str(table)], out=out, err=io.StringIO())
    return code, out.getvalue()


def _record(folder: Path, *plant: str) -> tuple[int, str]:
    run_python(["-m", "portspeed.cli", "run", "--perf", str(folder), "--perf-iterations", "2:4", "--nproc-per-node",
                "3", "--master-addr", "127.0.0.1", "--master-port", str(free_port()), SCRIPT, *plant], timeout=180,
               env={"PORTSPEED_ACCELERATOR": "cpu"}, drop=("PORTSPEED_*",)).check()
    return _compare(folder, folder.parent / "no-table.json")  # no bandwidth measured: groups against each other


@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    """The planted run, recorded once: its folder, and `compare --perf` on it (exit status, output)."""
    folder = tmp_path_factory.mktemp("links") / "slow"
    return (folder, *_record(folder, "--slow-ms", "60"))


def test_a_group_slower_than_another_moving_the_same_bytes_is_named(slow: tuple[Path, int, str]) -> None:
    folder, code, out = slow
    said = [line for line in out.splitlines() if line.startswith("slow link: ")]
    assert code == 1 and out.startswith("no slow rank: "), out[:3000]
    assert len(said) == 1 and said[0].startswith("slow link: group [1, 2] moves all_reduce of 64.0 KiB at "), out[:3000]
    assert "below group [0, 1] (" in said[0], said
    # each call also on the recording's clock (device events where the device has them; here the host's): the
    # planted group's at least its 60 ms, and a part's collective time is its calls' on that clock
    for line in (json.loads(t) for t in (folder / "rank1.jsonl").read_text().splitlines()):
        calls = line["collectives"]
        assert calls and all(c["device_ms"] >= 60 for c in calls if c["group"] == [1, 2]), calls
        for part in line["parts"]:
            mine = [c["device_ms"] for c in calls if (c["module"], c["phase"]) == (part["path"], part["phase"])]
            assert part["collective_ms"] == pytest.approx(sum(mine), abs=1e-3), (part, mine)


def test_a_group_alone_is_set_against_the_bandwidth_measured_for_its_link(slow: tuple[Path, int, str],
                                                                          tmp_path: Path) -> None:
    """Group [1, 2] with no other group to set it against (rank 0's recording left out, as ``--perf-ranks 1,2``
    records): named against the link's table. The table's one row is the bus bandwidth group [0, 1] achieved at
    best in the same run, on the same host: what `portspeed conformance --suites bandwidth` would have measured
    (its rows and arithmetic: tests/test_perf_bandwidth.py)."""
    folder = slow[0]
    alone = tmp_path / "alone"
    alone.mkdir()
    for name in ("rank1.jsonl", "rank2.jsonl"):
        shutil.copy(folder / name, alone / name)
    run = read_run(str(folder))
    fast = next(g for g in slow_links.group_speeds(run) if g.group == (0, 1))
    adapter, backend, host = links.run_link(run)
    table = tmp_path / "bandwidth.json"
    links.write_link(str(table), {"adapter": adapter, "backend": backend, "host": host, "measured": "in this test",
                                  "rows": [{"op": "all_reduce", "ranks": 2, "bytes": fast.nbytes,
                                            "algbw_gbs": fast.gbps, "busbw_gbs": fast.gbps}]})
    code, out = _compare(alone, table)
    said = [line for line in out.splitlines() if line.startswith("slow link: ")]
    assert code == 1 and len(said) == 1, out[:3000]
    assert said[0].startswith("slow link: group [1, 2] moves all_reduce of 64.0 KiB at ") and \
        "below the bus bandwidth measured for this link (" in said[0], said
    code, out = _compare(alone, tmp_path / "no-table.json")  # without the table: nothing to set it against
    assert code == 0 and "no two groups moved the same bytes" in out, out[:3000]


def test_the_same_groups_without_the_plant_name_no_slow_link(tmp_path: Path) -> None:
    code, out = _record(tmp_path / "clean")
    assert code == 0 and "\nno slow link: 1 collective(s) and size(s) moved by two or more groups, none 4x slower" \
        in out, out[:3000]
