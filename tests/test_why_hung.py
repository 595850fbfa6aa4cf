"""`portspeed why-hung`'s analyser on synthetic dumps: each divergence is named, with its rank, op, group,
sequence number and call site; no divergence is exit 1; unreadable input is exit 2.

The dumps are written in the format ``portspeed.trace.flight_recorder`` writes (torch's flight-recorder pickle), and one
in the bare form torch itself writes (no ``ps_*`` fields), so both readers' paths are covered.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from portspeed.cli.main import main as portspeed_main
from portspeed.trace.cli import why_hung

WORLD = "[0, 1]"


def entry(seq: int, op: str = "all_reduce", *, line: int = 10, sizes: list | None = None, dtype: str = "Float",
          t: float = 0.0, p2p: int = 0, peer: int = -1, rank: int = 0, state: str = "completed",
          torch_style: bool = False) -> dict:
    sizes = sizes if sizes is not None else [[4]]
    prof = f"nccl:{op}"
    if op == "send":
        prof += f" {rank}->{peer}"
    elif op == "recv":
        prof += f" {rank}<-{peer}"
    e = {"record_id": seq + p2p, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": seq,
         "p2p_seq_id": p2p, "op_id": seq + p2p, "profiling_name": prof, "time_created_ns": int((100 + t) * 1e9),
         "input_sizes": sizes, "input_dtypes": [dtype] * len(sizes), "output_sizes": sizes,
         "output_dtypes": [dtype] * len(sizes), "state": state, "time_discovered_started_ns": None,
         "time_discovered_completed_ns": None, "retired": state == "completed", "timeout_ms": 600000,
         "is_p2p": op in ("send", "recv"), "frames": [{"name": "<module>", "filename": "/x/train.py", "line": line}]}
    if not torch_style:
        e.update(ps_op=op, ps_peer=peer, ps_ranks=[0, 1])
    return e


def write(folder: Path, per_rank: dict[int, list[dict]], name: str = "portspeed_trace_rank_") -> Path:
    folder.mkdir(exist_ok=True)
    for rank, entries in per_rank.items():
        data = {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": WORLD}},
                "pg_status": {}, "entries": entries}
        if name.startswith("portspeed"):
            data.update(ps_rank=rank, ps_reason="SIGUSR1")
        (folder / f"{name}{rank}").write_bytes(pickle.dumps(data))
    return folder


def ask(folder: Path, capsys: pytest.CaptureFixture) -> tuple[int, list[str]]:
    code = portspeed_main(["why-hung", str(folder)])
    out = capsys.readouterr()
    return code, (out.out or out.err).splitlines()


def loop(n: int, line: int = 10, **kw: object) -> list[dict]:
    return [entry(s, line=line, t=s, **kw) for s in range(1, n + 1)]


def test_op_mismatch(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    d = write(tmp_path / "d", {0: loop(3) + [entry(4, line=20, state="scheduled")],
                               1: loop(3) + [entry(4, "all_gather", line=22, state="scheduled")]})
    code, lines = ask(d, capsys)
    assert code == 0
    assert lines[0].startswith("op mismatch: rank 1 issued all_gather as collective #4 of group 0 (default_pg) "
                               "at train.py:22"), lines
    assert "rank 0 all_reduce" in lines[0] and "train.py:20" in lines[0]


def test_shape_and_dtype_mismatch(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    d = write(tmp_path / "d", {0: loop(2) + [entry(3, "_all_gather_base", line=30, sizes=[[4]])],
                               1: loop(2) + [entry(3, "_all_gather_base", line=30, sizes=[[3]])],
                               2: loop(2) + [entry(3, "_all_gather_base", line=30, sizes=[[4]])]})
    code, lines = ask(d, capsys)
    assert code == 0 and lines[0].startswith("shape/dtype mismatch: rank 1 issued _all_gather_base in [[3]]"), lines
    assert "collective #3 of group 0" in lines[0]
    d2 = write(tmp_path / "d2", {0: loop(2) + [entry(3, dtype="Float")], 1: loop(2) + [entry(3, dtype="BFloat16")]})
    code, lines = ask(d2, capsys)
    assert code == 0 and "shape/dtype mismatch" in lines[0] and "BFloat16" in lines[0], lines


def test_desync_that_did_not_hang_names_the_rank_that_skipped(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Rank 1 skipped its 3rd all_reduce in the loop: its last call (another line) paired with rank 0's 4th."""
    d = write(tmp_path / "d", {0: loop(4) + [entry(5, line=40)], 1: loop(3) + [entry(4, line=40)]})
    code, lines = ask(d, capsys)
    assert code == 0
    assert lines[0].startswith("desync: rank 1 issued all_reduce collective #4 of group 0 (default_pg) from "
                               "train.py:40, the others from train.py:10"), lines
    assert any("rank 0: issued up to #5" in x for x in lines) and any("rank 1: issued up to #4" in x for x in lines)


def test_rank_that_never_issued_and_what_it_did_instead(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    d = write(tmp_path / "d", {0: loop(4) + [entry(5, line=50, state="scheduled")],
                               1: loop(4) + [entry(0, "recv", line=77, p2p=1, peer=0, rank=1, state="scheduled")],
                               2: loop(4) + [entry(5, line=50, state="scheduled")]})
    # rank 1's recv has a matching send on rank 0? no: the p2p check names it first
    code, lines = ask(d, capsys)
    assert code == 0, lines
    assert lines[0].startswith("point-to-point: rank 1 issued a recv from rank 0 with no matching send"), lines
    d2 = write(tmp_path / "d2", {0: loop(4) + [entry(5, line=50, state="scheduled")], 1: loop(4),
                                 2: loop(4) + [entry(5, line=50, state="scheduled")]})
    code, lines = ask(d2, capsys)
    assert code == 0
    assert lines[0].startswith("rank 1 never issued collective #5 of group 0 (default_pg): all_reduce at train.py:50, "
                               "which rank 0 issued"), lines
    assert any(x.strip().startswith("rank 1: issued up to #4") and "train.py:10, completed" in x for x in lines)


def test_send_without_recv_and_p2p_shape(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    send = [entry(2, "send", line=60, p2p=1, peer=1, rank=0), entry(2, "send", line=61, p2p=2, peer=1, rank=0,
                                                                     sizes=[[8]], state="scheduled")]
    recv = [entry(2, "recv", line=70, p2p=1, peer=0, rank=1)]
    d = write(tmp_path / "d", {0: loop(2) + send, 1: loop(2) + recv})
    code, lines = ask(d, capsys)
    assert code == 0
    assert lines[0].startswith("point-to-point: rank 0 issued a send to rank 1 with no matching recv on rank 1: "
                               "send [[8]] ['Float'] (p2p #2 of group 0 (default_pg)) at train.py:61"), lines
    recv_other = [entry(2, "recv", line=70, p2p=1, peer=0, rank=1, sizes=[[2, 2]])]
    d2 = write(tmp_path / "d2", {0: loop(2) + send[:1], 1: loop(2) + recv_other})
    code, lines = ask(d2, capsys)
    assert code == 0 and lines[0].startswith("point-to-point shape mismatch in group 0"), lines
    assert "[[4]]" in lines[0] and "[[2, 2]]" in lines[0]
    # each side's own p2p sequence number and call site
    assert "(rank 0's p2p #1, at train.py:60)" in lines[0] and "(rank 1's p2p #1, at train.py:70)" in lines[0], lines


def test_straggler(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    late = [entry(s, line=10, t=s + (4.5 if s == 3 else 0)) for s in range(1, 5)]
    d = write(tmp_path / "d", {0: loop(4), 1: late})
    code, lines = ask(d, capsys)
    assert code == 0
    assert lines[0] == ("straggler: rank 1 entered collective #3 of group 0 (default_pg) (all_reduce at train.py:10) "
                        "4.5 s after the other ranks"), lines


def test_no_divergence_is_exit_1_and_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    d = write(tmp_path / "d", {0: loop(5), 1: [entry(s, t=s + 0.01) for s in range(1, 6)]})
    code, lines = ask(d, capsys)
    assert code == 1 and lines[0].startswith("no divergence"), lines


def test_torch_dumps_and_write_through_are_read(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """torch's own dump names (``nccl_trace_rank_<R>``, no ps_* fields); a rank with only its write-through file."""
    d = write(tmp_path / "d", {0: [entry(s, t=s, torch_style=True) for s in range(1, 4)]}, name="nccl_trace_rank_")
    lines = [repr((e["record_id"], "0", "default_pg", e["collective_seq_id"], 0, e["profiling_name"], [[4]],
                   ["Float"], [[4]], ["Float"], e["time_created_ns"], False, -1, [0, 1], "all_reduce", "<module>",
                   "/x/train.py", 10)) for e in loop(2)]
    (d / "portspeed_last_calls_1.txt").write_text("".join(x + "\n" for x in lines) + lines[-1][:30])  # cut by death
    code, lines = ask(d, capsys)
    assert code == 0 and lines[0].startswith("rank 1 never issued collective #3 of group 0"), lines
    assert "rank 1: write-through (no dump)" in lines[-1] and "rank 0: torch dump" in lines[-1]


def test_a_rank_with_nothing_to_read_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    d = write(tmp_path / "d", {0: loop(3)})
    code, lines = ask(d, capsys)
    assert code == 0 and lines[0].startswith("rank 1 left no dump and no write-through file"), lines


@pytest.mark.parametrize("case", ["missing", "empty", "garbage"])
def test_unreadable_input_is_exit_2(case: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    d = tmp_path / "d"
    if case != "missing":
        d.mkdir()
    if case == "garbage":
        (d / "portspeed_trace_rank_0").write_text("not a pickle")
    code = portspeed_main(["why-hung", str(d)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("portspeed why-hung: error: ") and len(err.splitlines()) == 1, err
    assert str(d) in err


def test_usage_is_exit_2(capsys: pytest.CaptureFixture) -> None:
    assert why_hung.main([]) == 2 and "usage: portspeed why-hung DIR" in capsys.readouterr().err


def test_a_ccls_staging_group_is_evidence_never_the_cause(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Rank 1 skipped collective #5; rank 0's CCL is stuck in a ring step of its inner group (a send no one
    receives): the user's skip is the cause, the inner send only evidence."""
    inner = {"process_group": ("0/staging", "staging group of standin under group 0 (default_pg)"),
             "ps_staging": "standin", "is_p2p": True}
    stuck = dict(entry(5, "send", line=50, p2p=0, peer=1, rank=0, state="scheduled"), **inner)
    done = dict(entry(4, "recv", line=10, p2p=0, peer=1, rank=0), **inner)
    d = write(tmp_path / "d", {0: loop(4) + [done, entry(5, line=50, state="scheduled"), stuck], 1: loop(4)})
    code, lines = ask(d, capsys)
    assert code == 0 and lines[0].startswith("rank 1 never issued collective #5 of group 0 (default_pg)"), lines
    assert any("rank 0: inside its CCL's staging group: send to rank 1" in x and "scheduled" in x for x in lines)
    assert not any("staging" in x for x in lines[:1])
