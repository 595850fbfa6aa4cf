"""torch's own flight recorder next to portspeed's: turned on for NCCL before the group exists, read by why-hung.

What CI can check without an NVIDIA GPU: the settings ``portspeed.trace.torch_recorder`` chooses (NCCL
only, the user's own never overridden, dumps into PORTSPEED_TRACE_DIR under the name why-hung
reads); that ``init_process_group`` sets them before torch creates the group (a CPU torch, the CPU
adapter told its backend is NCCL: the group cannot be made, the settings are already there); and that
`portspeed why-hung` reads dumps written by torch's own writer (its Gloo recorder, 2 ranks, a real
desync); and that it reads a real NCCL dump (one rank on an H200, kept in tests/data). Not checked: torch's
own dump on an NCCL timeout (docs/reliability.md says so).
"""

from __future__ import annotations

from pathlib import Path

from helpers.launch import REPO, child_json, torchrun

from portspeed.trace.cli import why_hung
from portspeed.trace.flight_recorder import TORCH_DUMP_PREFIX
from portspeed.trace.torch_recorder import TORCH_FR_ENV, torch_recorder_env

SCRIPT = REPO / "tests" / "data" / "torch_fr_desync.py"


def _site(tag: str) -> str:
    for n, line in enumerate(SCRIPT.read_text().splitlines(), 1):
        if line.rstrip().endswith(f"# site: {tag}"):
            return f"torch_fr_desync.py:{n}"
    raise AssertionError(tag)


def test_settings_only_for_nccl_and_never_over_the_users() -> None:
    env: dict[str, str] = {}
    assert torch_recorder_env("gloo", 100, "/d", env) == {} and env == {}
    assert torch_recorder_env("standin", 100, "/d", env) == {} and env == {}
    got = torch_recorder_env("cpu:gloo,cuda:nccl", 100, "/d", env)
    assert set(got) == set(TORCH_FR_ENV) and env == got
    assert env["TORCH_FR_BUFFER_SIZE"] == env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "100"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == f"/d/{TORCH_DUMP_PREFIX}" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    mine = {"TORCH_FR_BUFFER_SIZE": "7"}
    got = torch_recorder_env("nccl", 100, "/d", mine)
    assert mine["TORCH_FR_BUFFER_SIZE"] == "7" and "TORCH_FR_BUFFER_SIZE" not in got


def test_settings_are_in_place_before_torch_makes_the_nccl_group(tmp_path: Path) -> None:
    got = child_json(f'''
        import json, os, torch.distributed as dist
        import portspeed
        from portspeed.adapters.cpu import CpuAccelerator
        from patches.torch_distributed import PATCHES
        portspeed.set_accelerator(CpuAccelerator(backend="nccl"))  # the CPU adapter told its CCL is NCCL
        m = portspeed.PatchManager(); m.register(PATCHES); m.apply()
        before = {{k: os.environ.get(k) for k in {TORCH_FR_ENV!r}}}
        try:  # a CPU build of torch has no NCCL: the group cannot be made, after the settings were set
            dist.init_process_group("nccl", rank=0, world_size=1, init_method="tcp://127.0.0.1:1")
            error = ""
        except Exception as exc:
            error = type(exc).__name__ + ": " + str(exc)[:200]
        from portspeed.trace import flight_recorder as trace
        print(json.dumps({{"before": before, "after": {{k: os.environ.get(k) for k in {TORCH_FR_ENV!r}}},
                          "error": error, "torch_fr": trace.recorder().torch_fr}}))
    ''', timeout=180, env={"PORTSPEED_TRACE": "64", "PORTSPEED_TRACE_DIR": str(tmp_path)},
        drop=list(TORCH_FR_ENV))
    assert got["before"] == {k: None for k in TORCH_FR_ENV}, got
    assert "NCCL" in got["error"] or "nccl" in got["error"], got  # the group was really asked for, on NCCL
    assert got["after"]["TORCH_FR_BUFFER_SIZE"] == "64" and got["torch_fr"], got
    assert got["after"]["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / TORCH_DUMP_PREFIX), got


def test_why_hung_reads_dumps_written_by_torchs_own_recorder(tmp_path: Path) -> None:
    res = torchrun(str(SCRIPT), 2, timeout=180, env={"TORCH_FR_BUFFER_SIZE": "100", "DUMP_DIR": str(tmp_path)})
    res.check()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{TORCH_DUMP_PREFIX}0", f"{TORCH_DUMP_PREFIX}1"]
    code, lines = why_hung.answer(str(tmp_path))
    assert code == 0, lines
    assert lines[0].startswith(f"desync: rank 1 issued all_reduce collective #4 of group 0 (default_pg) from "
                               f"{_site('after')}, the others from {_site('loop')}"), lines
    assert f"rank 1 issued 1 all_reduce fewer from {_site('loop')}" in lines[0], lines
    assert lines[-1].strip() == "dumps: rank 0: torch dump, rank 1: torch dump", lines


NCCL_DUMP = REPO / "tests" / "data" / "nccl_dump_h200" / f"{TORCH_DUMP_PREFIX}0"


def test_why_hung_reads_a_real_nccl_dump(tmp_path: Path) -> None:
    """torch's NCCL recorder, turned on by portspeed and dumped by it (one rank, NVIDIA H200, torch 2.11, NCCL
    2.28.9: benchmarks/check_trace_nccl.py). Read as it is, then as the first rank of a two-rank job whose
    second rank's dump is this one with its collective #3 removed (a skip planted in the file; NCCL's own
    format and frames kept)."""
    import pickle
    import shutil

    faults = REPO / "tests" / "data" / "trace_faults.py"

    def site(tag: str) -> str:
        n = next(i for i, ln in enumerate(faults.read_text().splitlines(), 1) if ln.rstrip().endswith(f"# site: {tag}"))
        return f"trace_faults.py:{n}"

    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(NCCL_DUMP, alone)
    code, lines = why_hung.answer(str(alone))
    assert code == 1 and lines[0].startswith("no divergence"), lines
    assert lines[-1].strip() == "dumps: rank 0: torch dump", lines
    data = pickle.loads(NCCL_DUMP.read_bytes())
    assert data["comm_lib_version"] == "2.28.9"
    assert {e["profiling_name"] for e in data["entries"]} == {"nccl:all_reduce"}
    # the call site through torch's NCCL frames (innermost first: c10d, its logger, portspeed's router)
    from portspeed.trace.dumps import call_site

    assert [call_site(e) for e in data["entries"]] == [site("loop")] * 4 + [site("last")]

    pair = tmp_path / "pair"
    pair.mkdir()
    two = dict(data, pg_config={k: dict(v, ranks="[0, 1]") for k, v in data["pg_config"].items()})
    (pair / f"{TORCH_DUMP_PREFIX}0").write_bytes(pickle.dumps(two))
    skipped = [dict(e, collective_seq_id=e["collective_seq_id"] - (e["collective_seq_id"] > 3))
               for e in data["entries"] if e["collective_seq_id"] != 3]
    (pair / f"{TORCH_DUMP_PREFIX}1").write_bytes(pickle.dumps(dict(two, entries=skipped)))
    code, lines = why_hung.answer(str(pair))
    assert code == 0, lines
    assert lines[0].startswith(f"desync: rank 1 issued all_reduce collective #4 of group 0 (default_pg) from "
                               f"{site('last')}, the others from {site('loop')}"), lines
    assert f"rank 1 issued 1 all_reduce fewer from {site('loop')}" in lines[0], lines
