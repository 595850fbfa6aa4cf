"""torch's functional collectives in the flight recorder (portspeed.trace.funcol): real Gloo groups on CPU.

Two jobs under `portspeed run --hang-timeout` (tests/data/trace_funcol_faults.py, 2 ranks): rank 1 skips one
functional all_reduce, and `why-hung`'s first line names the desync (op, group, sequence number, both call
sites); a control run dumped at exit shows functional and torch.distributed calls on one group in one
numbering, the same sums as without recording, and a DTensor redistribute recorded at the user's line. One
child on one rank checks the entry shapes of each functional form, a group torch cannot resolve (the same
error as unrecorded), torch.compile passing straight through, and that nothing is installed when tracing is off.
Each runs with torch's own recording off (TORCH_FR_BUFFER_SIZE=0): from torch 2.15 Gloo records its collectives,
funcol's included, itself, and portspeed then leaves those entries to it (tests/test_trace.py checks that path).
"""

from __future__ import annotations

import pickle
from pathlib import Path

from helpers.launch import REPO, free_port, run_python, run_snippet

from portspeed.trace.cli import why_hung

SCRIPT = REPO / "tests" / "data" / "trace_funcol_faults.py"
HANG_S = 10
#: torch >= 2.15 records Gloo's collectives itself unless told not to: these tests are about portspeed's recording
TORCH_FR_OFF = {"TORCH_FR_BUFFER_SIZE": "0"}
BOUND = 240  # kill bound of one run: start-up of 2 ranks on a loaded 2-core machine + HANG_S + dumps


def _line(tag: str) -> int:
    for n, line in enumerate(SCRIPT.read_text().splitlines(), 1):
        if line.rstrip().endswith(f"# site: {tag}"):
            return n
    raise AssertionError(f"no '# site: {tag}' in {SCRIPT}")


def _launch(mode: str, folder: Path) -> tuple[int, list[str], str]:
    res = run_python(["-m", "portspeed.cli", "run", "--hang-timeout", str(HANG_S), "--nproc-per-node", "2",
                      "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(SCRIPT), mode],
                     timeout=BOUND, env={"PORTSPEED_ACCELERATOR": "cpu", "PORTSPEED_FRAMEWORK_MODULES": "__main__",
                                         "PORTSPEED_TRACE_DIR": str(folder), "PORTSPEED_TRACE_ON_EXIT": "1",
                                         **TORCH_FR_OFF},
                     drop=["PORTSPEED_TRACE", "PORTSPEED_BACKEND"])
    lines = [x for x in res.stderr.splitlines() if x.startswith("portspeed run:")]
    return res.returncode, lines, res.stdout + res.stderr


def _dump(folder: Path, rank: int) -> dict:
    return pickle.loads((folder / f"portspeed_trace_rank_{rank}").read_bytes())


def _nothing_left(folder: Path) -> None:
    for rank in (0, 1):
        pid = _dump(folder, rank)["ps_pid"]
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower(), \
            f"rank process {pid} still running"


def test_skipped_functional_all_reduce_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "dumps"
    code, lines, text = _launch("skip", folder)
    assert code == 1, text[-4000:]
    why = [x for x in lines if x.startswith("portspeed run: why-hung: ")]
    assert why, text[-4000:]
    funcol, c10d = f"trace_funcol_faults.py:{_line('funcol')}", f"trace_funcol_faults.py:{_line('c10d')}"
    # rank 1's torch.distributed all_reduce took the number of rank 0's 4th functional one: one numbering
    assert f"desync: rank 1 issued all_reduce collective #4 of group 0 (default_pg) from {c10d}" in why[0], why[0]
    assert f"the others from {funcol}" in why[0] and f"1 all_reduce fewer from {funcol}" in why[0], why[0]
    assert lines[-1].startswith(f"portspeed run: flight-recorder dumps in {folder}"), lines[-3:]
    d = _dump(folder, 0)
    assert [e.get("ps_via") for e in d["entries"]] == ["funcol.all_reduce"] * 4 + [None]
    assert d["entries"][-1]["state"] == "scheduled" and d["entries"][-2]["state"] == "completed"
    _nothing_left(folder)


def test_control_run_one_numbering_same_results_and_dtensor(tmp_path: Path) -> None:
    folder = tmp_path / "dumps"
    code, lines, text = _launch("none", folder)
    assert code == 0, text[-4000:]
    assert not any("why-hung" in x for x in lines), lines
    for rank in (0, 1):  # ones(4), 5 all_reduces over 2 ranks: 4 x 2**5, as unrecorded
        assert f"rank {rank} sum 128.0" in text, text[-3000:]
        assert f"rank {rank} dtensor [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]" in text, text[-3000:]
    for rank in (0, 1):
        entries = _dump(folder, rank)["entries"]
        assert [(e["process_group"][0], e["collective_seq_id"]) for e in entries] == [("0", n) for n in range(1, 7)]
        assert [e.get("ps_via") for e in entries] == ["funcol.all_reduce"] * 4 + [None, "funcol.all_gather_single"]
        assert [e["frames"][0]["line"] for e in entries] == [_line("funcol")] * 4 + [_line("c10d"), _line("dtensor")]
        assert all(e["frames"][0]["filename"].endswith("trace_funcol_faults.py") for e in entries)
        assert all(e["state"] == "completed" for e in entries), [e["state"] for e in entries]
        gather = entries[-1]  # the DTensor redistribute Shard(0) -> Replicate()
        assert gather["profiling_name"].endswith(":_all_gather_base") and gather["input_sizes"] == [[4]] \
            and gather["output_sizes"] == [[8]], gather
    code, out = why_hung.answer(str(folder))
    assert code == 1 and out[0].startswith("no divergence"), out
    _nothing_left(folder)


def test_functional_forms_unresolved_group_compile_and_off(tmp_path: Path) -> None:
    """One rank, Gloo: each form's entry; a group of unknown ranks fails as unrecorded; compile is not recorded."""
    res = run_snippet(f'''
        import json, warnings, torch, torch.distributed as dist
        import portspeed
        from portspeed.adapters.cpu import CpuAccelerator
        from patches.torch_distributed import PATCHES
        portspeed.set_accelerator(CpuAccelerator())
        warnings.simplefilter("ignore")

        def error(f):
            try:
                f()
            except Exception as exc:
                return [type(exc).__name__, str(exc)]

        def main():
            m = portspeed.PatchManager(); m.register(PATCHES); m.apply()
            dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:{free_port()}")
            import torch.distributed._functional_collectives as funcol
            from portspeed.trace import flight_recorder as trace
            pg, x = dist.group.WORLD, torch.arange(8.0).view(4, 2)
            got = [funcol.all_reduce(x, "sum", pg), funcol.broadcast(x, 0, "0"),
                   funcol.all_gather_tensor(x, 1, [0]), funcol.reduce_scatter_single(x, "sum", 1, pg),
                   funcol.all_to_all_single(x, [4], [4], pg), *funcol.all_reduce_coalesced([x, x[0]], "sum", pg),
                   *funcol.all_gather_single_coalesced([x], pg), funcol.all_gather_single_autograd(x, 0, pg)]
            equal = all(torch.equal(g, x if i != 6 else x[0]) for i, g in enumerate(got))
            bad = error(lambda: funcol.all_reduce(x, "sum", [0, 5]))
            compiled = torch.compile(lambda t: funcol.all_reduce(t, "sum", pg) + 1, backend="eager")
            c_ok = bool(torch.equal(compiled(x), x + 1))
            entries = [dict(op=e["profiling_name"], seq=e["collective_seq_id"], pg=e["process_group"][0],
                            ins=e["input_sizes"], outs=e["output_sizes"], via=e.get("ps_via"), state=e["state"],
                            caller=e["frames"][0]["name"], arg=e.get("ps_group_arg"), err=e.get("ps_error"))
                       for e in trace.recorder().entries]
            m.revert()
            unrecorded = error(lambda: funcol.all_reduce(x, "sum", [0, 5]))
            print(json.dumps(dict(entries=entries, equal=equal, bad=bad, unrecorded=unrecorded, compiled=c_ok)))
            dist.destroy_process_group()
        main()
    ''', timeout=180, env={"PORTSPEED_TRACE": "50", "PORTSPEED_TRACE_DIR": str(tmp_path), **TORCH_FR_OFF})
    got = res.check().last_json()
    assert got["equal"] and got["compiled"]
    assert got["bad"] == got["unrecorded"] and got["bad"][0] == "ValueError", got
    e = got["entries"]
    assert [(x["seq"], x["pg"]) for x in e] == [(n, "0") for n in range(1, 9)] + [(1, "?")], e
    assert [x["op"].split(":")[1] for x in e] == ["all_reduce", "broadcast", "_all_gather_base", "_reduce_scatter_base",
                                                  "all_to_all_single", "all_reduce", "_all_gather_base",
                                                  "_all_gather_base", "all_reduce"]
    assert [x["via"] for x in e] == [f"funcol.{n}" for n in (  # a deprecated alias: one entry, its own name
        "all_reduce", "broadcast", "all_gather_tensor", "reduce_scatter_single", "all_to_all_single",
        "all_reduce_coalesced", "all_gather_single_coalesced", "all_gather_single_autograd", "all_reduce")]
    assert e[5]["ins"] == [[4, 2], [2]] and e[5]["outs"] == [[4, 2], [2]]
    assert all(x["ins"] == [[4, 2]] and x["outs"] == [[4, 2]] for x in e[:5] + e[6:8]), e  # one rank: same sizes
    assert all(x["state"] == "completed" and x["caller"] == "main" for x in e[:8]), e
    assert e[8]["state"] == "scheduled" and e[8]["arg"] == "[0, 5]" and e[8]["err"].startswith("ValueError"), e[8]
    off = run_snippet('''
        from patches.torch_distributed import PATCHES
        print(sorted(p.name for p in PATCHES if "functional" in p.name or p.name.endswith(".trace")))
    ''', timeout=120, env={"PORTSPEED_TRACE": "0"})
    assert off.check().stdout.strip().splitlines()[-1] == "[]", off.stdout
