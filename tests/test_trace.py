"""The flight recorder and `portspeed run --hang-timeout`, on planted faults: 2 ranks, CPU/Gloo, real process groups.

Each fault (tests/data/trace_faults.py) runs under `portspeed run`; the job must end (the run's own
kill bound is the hang timeout plus start-up, not a timed assertion), its closing lines must name the
rank and the collective (op, group, sequence number, call site) and the dump folder, and no rank may be
left running (on the CPU adapter's Gloo, on the stand-in vendor backend, and, marked testdev, on the
test device's testccl). The script imports no framework (plain torch): the worker sets the adaptor up at
launch, so recording starts there (tests/test_trace_unrecorded.py: the ranks that never record). A control
run with no fault, dumped at exit, leaves `why-hung` with exit 1. One child
checks the recorder itself: torch's fields, the ring bound, results untouched, a dump on SIGUSR1.

On torch >= 2.15 (CI leg 2 runs the cases marked torch_hooks) torch records Gloo's collectives and testccl's
calls itself: the same faults must give the same first line from torch's entries and portspeed's together, no
call may be in both (read back merged, every group's sequence numbers once per rank), and torch's own analyser
(fr_trace) must read torch's dump of the run.
"""

from __future__ import annotations

import inspect
import os
import pickle
import re
from pathlib import Path

import pytest
import torch.distributed as dist

from helpers.launch import REPO, free_port, run_python, run_snippet

from portspeed.trace.cli import why_hung
from portspeed.trace import dumps as trace_dumps
from portspeed.trace.torch_recorder import TORCH_GLOO_DUMP_PREFIX, records_itself

SCRIPT = REPO / "tests" / "data" / "trace_faults.py"
HANG_S = 10
BOUND = 240  # kill bound of one run: start-up of 2 ranks on a loaded 2-core machine + HANG_S + dumps


def _site(tag: str) -> str:
    """``trace_faults.py:LINE`` of the line marked ``# site: tag``."""
    for n, line in enumerate(SCRIPT.read_text().splitlines(), 1):
        if line.rstrip().endswith(f"# site: {tag}"):
            return f"trace_faults.py:{n}"
    raise AssertionError(f"no '# site: {tag}' in {SCRIPT}")


def _launch(mode: str, folder: Path, env: dict | None = None) -> tuple[int, list[str], str]:
    res = run_python(["-m", "portspeed.cli", "run", "--hang-timeout", str(HANG_S), "--nproc-per-node", "2",
                      "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(SCRIPT), mode],
                     timeout=BOUND, env={"PORTSPEED_ACCELERATOR": "cpu", "PORTSPEED_TRACE_DIR": str(folder),
                                         "PORTSPEED_TRACE_ON_EXIT": "1", **(env or {})},
                     drop=["PORTSPEED_TRACE", "PORTSPEED_HANG_TIMEOUT", "PORTSPEED_FRAMEWORK_MODULES"])
    lines = [x for x in res.stderr.splitlines() if x.startswith("portspeed run:")]
    return res.returncode, lines, res.stdout + res.stderr


def _nothing_left(folder: Path) -> None:
    """Every rank's process is gone (pids from the dumps)."""
    for f in folder.glob("portspeed_trace_rank_*"):
        if f.suffix:
            continue
        pid = pickle.loads(f.read_bytes())["ps_pid"]
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower(), \
            f"rank process {pid} still running"


#: mode -> (exit status, words of the cause line)
FAULTS = {
    "skip": (1, ["desync: rank 1 issued all_reduce collective #4 of group 0 (default_pg) from {last}",
                 "the others from {loop}"]),
    "shape": (1, ["shape/dtype mismatch: rank 1 issued _all_gather_base in [[3]]", "collective #5 of group 0",
                  "at {gather}"]),
    # two ranks, no majority: either may be named first (on the stand-in, which rank Gloo aborts first varies)
    "op": (1, [("op mismatch: rank 1 issued _all_gather_base as collective #5 of group 0 (default_pg) at {op-gather}"
                "; the others rank 0 all_reduce",
                "op mismatch: rank 0 issued all_reduce as collective #5 of group 0 (default_pg) at {op-reduce}"
                "; the others rank 1 _all_gather_base"), "{op-reduce}", "{op-gather}"]),
    "p2p": (1, ["point-to-point: rank 0 issued a send to rank 1 with no matching recv on rank 1",
                "p2p #2 of group 0 (default_pg)) at {send}"]),
    "straggler": (0, ["straggler: rank 1 entered collective #3 of group 0 (default_pg) (all_reduce at {loop})"]),
}


#: backend label -> environment: every fault runs on each (testdev cases marked testdev)
BACKENDS = {"cpu": {}, "standin": {"PORTSPEED_BACKEND": "standin"}, "testdev": {"PORTSPEED_ACCELERATOR": "testdev"}}
CASES = [pytest.param(b, m, id=f"{b}-{m}", marks=([pytest.mark.testdev] if b == "testdev" else [])
                      + ([pytest.mark.torch_hooks] if b != "standin" else []))
         for b in BACKENDS for m in FAULTS]
#: torch >= 2.15: torch's own recorder holds Gloo's collectives and testccl's calls (portspeed.trace.torch_recorder)
TORCH_RECORDS = records_itself()


def _no_call_twice(folder: Path, backend: str) -> None:
    """torch >= 2.15: torch's dumps are there and, read back merged, no rank lists one call twice."""
    prefix = {"cpu": TORCH_GLOO_DUMP_PREFIX, "testdev": "torch_fr_trace_rank_"}[backend]
    assert list(folder.glob(f"{prefix}?")), sorted(p.name for p in folder.iterdir())
    for rank, d in trace_dumps.load(str(folder)).items():
        if "torch_records" not in d:
            continue  # a rank read from its write-through file (killed hard): one recorder's numbering anyway
        assert "(with " in d["reason"], d["reason"]  # torch's dump, or the write-through file if the rank ended first
        keys = [(tuple(e["process_group"][:2]), bool(e.get("is_p2p")),
                 e.get("p2p_seq_id") if e.get("is_p2p") else e.get("collective_seq_id"))
                for e in d["entries"] if e["process_group"][0]]  # the unnamed group: testccl's inner Gloo group
        assert len(keys) == len(set(keys)), (rank, sorted(keys))


@pytest.mark.parametrize("backend,mode", CASES)
def test_planted_fault_is_named_in_the_closing_lines(backend: str, mode: str, tmp_path: Path) -> None:
    folder = tmp_path / "dumps"
    code, lines, text = _launch(mode, folder, BACKENDS[backend])
    want_code, words = FAULTS[mode]
    assert code == want_code, text[-4000:]
    why = [x for x in lines if x.startswith("portspeed run: why-hung: ")]
    assert why, text[-4000:]
    sites = {t: _site(t) for t in ("loop", "last", "gather", "op-gather", "op-reduce", "send")}
    for w in words:  # a tuple: one of its wordings
        assert any(x.format(**sites) in why[0] for x in (w if isinstance(w, tuple) else (w,))), why[0]
    assert lines[-1].startswith(f"portspeed run: flight-recorder dumps in {folder}"), lines[-3:]
    assert lines.index(why[0]) < len(lines) - 1  # the answer first, then the folder
    if want_code == 1:  # ended by the watchdog (or a rank's error), each live rank dumped
        assert "portspeed run: no rank completed a collective" in text or "RuntimeError ended the rank" in text
    dumped = sorted(int(p.name[-1]) for p in folder.glob("portspeed_trace_rank_?"))
    for r in {0, 1} - set(dumped):  # only a rank its backend aborted in C++ (Gloo's size check under the stand-in's
        # op mismatch: std::terminate, no Python left to dump) is read from its write-through file
        assert re.search(rf"rank {r} \(local rank {r} on .*\) killed by SIGABRT", text), text[-4000:]
        assert (folder / f"portspeed_last_calls_{r}.txt").exists()
    assert dumped, text[-4000:]
    if TORCH_RECORDS and backend != "standin":
        _no_call_twice(folder, backend)
        # torch's own analyser reads torch's dump of the run (Gloo's needs portspeed's pg_config rows)
        if mode == "skip":
            prefix = {"cpu": TORCH_GLOO_DUMP_PREFIX, "testdev": "torch_fr_trace_rank_"}[backend]
            out = run_python(["-m", "torch.distributed.flight_recorder.fr_trace", "--prefix", prefix, str(folder)],
                             timeout=120)
            assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    if backend != "cpu":  # the CCL's inner group: listed (and, for the stand-in, its ring steps recorded) as staging
        owner = {"standin": "standin", "testdev": "testccl"}[backend]
        d = pickle.loads((folder / f"portspeed_trace_rank_{dumped[0]}").read_bytes())
        assert any(c.get("ps_staging") == owner and c["desc"].startswith(f"staging group of {owner}")
                   for c in d["pg_config"].values()), d["pg_config"]
        staged = d["ps_staged"]
        if owner == "standin":
            assert staged and all(e["process_group"][0].endswith("/staging") and e["is_p2p"] for e in staged)
        assert "staging" not in why[0]  # never the cause
    _nothing_left(folder)


@pytest.mark.testdev
@pytest.mark.torch_hooks
def test_testccl_failure_dumps_torch_buffer_through_its_abort_hook(tmp_path: Path) -> None:
    """torch >= 2.15: testccl's completion and abort hooks let torch's FlightRecorderHook show the first all_reduce
    completed and dump, when the second fails (its peer died), with it scheduled; older torch has no hook to dump."""
    folder = tmp_path / "fr"
    folder.mkdir()
    res = run_python(["-m", "portspeed.cli", "run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                      "--master-port", str(free_port()), str(REPO / "tests" / "data" / "testccl_abort.py")],
                     timeout=BOUND, env={"PORTSPEED_ACCELERATOR": "testdev", "PORTSPEED_FRAMEWORK_MODULES": "__main__",
                                         "TORCH_FR_DUMP_TEMP_FILE": str(folder / "torch_fr_trace_rank_")},
                     drop=["PORTSPEED_TRACE", "TORCH_FR_BUFFER_SIZE"])
    text = res.stdout + res.stderr
    assert "rank 0 error: " in text and "rank 0: no error" not in text, text[-3000:]
    dumps = sorted(p.name for p in folder.iterdir())
    if not TORCH_RECORDS:
        assert dumps == [], dumps
        return
    assert dumps == ["torch_fr_trace_rank_0"], (dumps, text[-3000:])
    d = pickle.loads((folder / dumps[0]).read_bytes())
    assert [(e["profiling_name"], e["collective_seq_id"], e["state"]) for e in d["entries"]] == [
        ("testccl:all_reduce", 1, "completed"), ("testccl:all_reduce", 2, "scheduled")], d["entries"]


def test_a_rank_ending_on_its_own_error_after_a_peer_died_is_not_stopped_first(tmp_path: Path) -> None:
    """Rank 0 dies of SIGABRT; rank 1, asleep then, raises in its next all_reduce a second later. The launcher lets
    it end on its own error before torchrun stops what is left, so its dump and the closing lines say so, whichever
    ending the agent saw first (torchrun's agent SIGTERMed rank 1 within 0.1 s of rank 0's death: a SIGTERM dump, and
    CI's standin-op case, where the survivor's error usually won that race, failed once)."""
    folder = tmp_path / "dumps"
    code, lines, text = _launch("abort", folder)
    assert code == 1, text[-4000:]
    assert re.search(r"portspeed run: failed, no restarts left \(attempt 1: rank 0 \(local rank 0 on .*\) killed by "
                     r"SIGABRT\)", text), text[-4000:]
    why = [x for x in lines if x.startswith("portspeed run: why-hung: ")]
    assert why and f"rank 0 never issued collective #5 of group 0 (default_pg): all_reduce at {_site('last')}" \
        in why[0], text[-4000:]
    assert "portspeed run:   dumps: rank 0: write-through (no dump), rank 1: RuntimeError ended the rank" in lines, \
        lines[-3:]
    assert lines[-1].startswith(f"portspeed run: flight-recorder dumps in {folder}"), lines[-3:]
    _nothing_left(folder)


def test_control_run_dumped_at_exit_shows_no_divergence(tmp_path: Path) -> None:
    folder = tmp_path / "dumps"
    code, lines, text = _launch("none", folder)
    assert code == 0, text[-4000:]
    assert not any("why-hung" in x for x in lines), text[-6000:]  # nothing to say about a healthy run
    # ones(4), 5 all_reduces over 2 ranks: 4 x 2**5 (recording changes nothing it computes)
    assert re.search(r"rank 0 sum 128\.0", text) and re.search(r"rank 1 sum 128\.0", text), text[-2000:]
    code, out = why_hung.answer(str(folder))
    assert code == 1 and out[0].startswith("no divergence"), out
    assert re.search(r"rank 0: exit( \(with torch_fr_gloo_rank_0\))?, rank 1: exit", out[-1]), out[-1]
    _nothing_left(folder)


def test_recorder_fields_ring_bound_and_sigusr1(tmp_path: Path) -> None:
    """One rank, Gloo: torch's fields; the ring keeps the last N; the result is the unrecorded one; SIGUSR1 dumps.
    torch's own recorder off (TORCH_FR_BUFFER_SIZE=0): on torch >= 2.15 portspeed then records Gloo's calls itself."""
    res = run_snippet(f'''
        import json, os, pickle, signal, time, torch, torch.distributed as dist
        import portspeed
        from portspeed.adapters.cpu import CpuAccelerator
        from patches.torch_distributed import PATCHES
        portspeed.set_accelerator(CpuAccelerator())
        def main():  # raw is a local: the patch manager's rebinding sweep reaches module globals
            raw = dist.all_reduce
            m = portspeed.PatchManager(); m.register(PATCHES); m.apply()
            names = [r.patch.name for r in m.records()]
            dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:{free_port()}")
            t = torch.arange(4.0)
            for _ in range(5):
                dist.all_reduce(t)
            dist.broadcast(t, 0)
            dist.all_gather_into_tensor(torch.empty(4), t)
            u = torch.arange(4.0)
            raw(u)
            os.kill(os.getpid(), signal.SIGUSR1)
            for _ in range(100):
                if os.path.exists("{tmp_path}/portspeed_trace_rank_0"):
                    break
                time.sleep(0.1)
            d = pickle.load(open("{tmp_path}/portspeed_trace_rank_0", "rb"))
            from portspeed.trace.dumps import through_entry as _through_entry
            through = [_through_entry(x) for x in open("{tmp_path}/portspeed_last_calls_0.txt")]
            objs, box = [None], [7]  # torch's *_object collectives: recorded by their inner calls, named as such
            dist.all_gather_object(objs, {{"a": 1}})
            dist.broadcast_object_list(box, 0)
            from portspeed.trace import flight_recorder as trace
            d2 = pickle.load(open(trace.dump("asked"), "rb"))
            last = [_through_entry(x) for x in open("{tmp_path}/portspeed_last_calls_0.txt")][-4:]
            print(json.dumps({{"names": names, "equal": bool(torch.equal(t, u * 1)), "reason": d["ps_reason"],
                              "objects": [(e["ps_op"], e.get("ps_via"), e["frames"][0]["name"]) for e in d2["entries"]],
                              "objects_through": [(e["profiling_name"], e["frames"][0]["name"]) for e in last],
                              "through": [(e["collective_seq_id"], e["profiling_name"]) for e in through],
                              "pg": d["pg_config"],
                              "entries": [{{k: e[k] for k in ("collective_seq_id", "profiling_name", "input_sizes",
                                                              "output_sizes", "input_dtypes", "state", "frames",
                                                              "ps_device")}}
                                          for e in d["entries"]]}}, default=str), flush=True)
            dist.destroy_process_group()  # one run under load aborted at exit with the group alive (cause not found)
        main()
    ''', timeout=180, env={"PORTSPEED_TRACE": "3", "PORTSPEED_TRACE_DIR": str(tmp_path),
                           "TORCH_FR_BUFFER_SIZE": "0"})  # torch >= 2.15 records Gloo itself unless told not to
    got = res.check().last_json()
    assert "torch.distributed.broadcast.trace" in got["names"] and "torch.distributed.send.trace" in got["names"]
    assert got["equal"] and got["reason"] == "SIGUSR1"
    assert [tuple(x) for x in got["through"]] == [(n, "gloo:all_reduce") for n in range(1, 6)] + [
        (6, "gloo:broadcast"), (7, "gloo:_all_gather_base")]  # write-through: every issued call, not only the ring
    assert got["pg"] == {"0": {"name": "0", "desc": "default_pg", "ranks": "[0]"}}
    entries = got["entries"]
    assert [e["collective_seq_id"] for e in entries] == [5, 6, 7], entries  # the ring kept the last 3 of 7
    assert [e["profiling_name"] for e in entries] == ["gloo:all_reduce", "gloo:broadcast", "gloo:_all_gather_base"]
    assert entries[2]["input_sizes"] == [[4]] and entries[2]["output_sizes"] == [[4]]
    assert all(e["state"] == "completed" and e["input_dtypes"] == ["Float"] and e["ps_device"] == "cpu"
               for e in entries)
    assert entries[0]["frames"][0]["name"] == "main"  # the caller, not portspeed's wrapper
    # all_gather_object gathers with all_gather up to torch 2.14, with all_gather_single (_all_gather_base) from 2.15
    inner = "all_gather_single" if "all_gather_single(" in inspect.getsource(dist.all_gather_object) else "all_gather"
    assert [tuple(x) for x in got["objects"]] == [(inner, "all_gather_object", "main"),
                                                  ("broadcast", "broadcast_object_list", "main"),
                                                  ("broadcast", "broadcast_object_list", "main")], got["objects"]
    gathered = "gloo:_all_gather_base" if inner == "all_gather_single" else "gloo:all_gather"
    assert [tuple(x) for x in got["objects_through"]] == [(gathered, "main"), (gathered, "main"),
                                                          ("gloo:broadcast", "main"), ("gloo:broadcast", "main")]
    assert not any("portspeed" in f["filename"] for e in entries for f in e["frames"][:1])


def test_torch_reader_reads_portspeed_dumps(tmp_path: Path) -> None:
    """torch's own flight-recorder analyser (torch.distributed.flight_recorder.fr_trace) loads portspeed's dumps."""
    folder = tmp_path / "d"
    folder.mkdir()
    entry = {"record_id": 1, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": 1,
             "p2p_seq_id": 0, "op_id": 1, "profiling_name": "gloo:all_reduce", "time_created_ns": 1,
             "input_sizes": [[4]], "input_dtypes": ["Float"], "output_sizes": [[4]], "output_dtypes": ["Float"],
             "state": "completed", "time_discovered_started_ns": None, "time_discovered_completed_ns": 2,
             "retired": True, "timeout_ms": 1000, "is_p2p": False, "frames": [{"name": "f", "filename": "a.py",
                                                                               "line": 1}]}
    # the dump is written by portspeed's own writer, not by hand: one recorder per rank, with a staging group
    # (the stand-in's inner group) and one ring step of it under the all_reduce
    res = run_snippet(f'''
        import torch
        from portspeed.trace import staging as trace_staging
        from portspeed.trace import flight_recorder as trace
        for rank in (0, 1):
            import os; os.environ["RANK"] = str(rank)
            rec = trace.Recorder(10, "{folder}")
            rec.entries.append(dict({entry!r}, ps_ranks=[0, 1]))
            rec.groups["pg"] = ["0", "default_pg", [0, 1], 1, 0, "gloo"]
            trace_staging.label("standin", rank, 2, "inner Gloo group", rec)
            rec.in_flight = rec.entries[-1]
            trace_staging.staged_done(trace_staging.stage(rec, "standin", torch.ones(4), 1 - rank, torch.ones(4),
                                                          1 - rank))
            rec.in_flight = None
            rec.dump("test")
    ''', timeout=120)
    res.check()
    d = pickle.loads((folder / "portspeed_trace_rank_0").read_bytes())
    assert [e["profiling_name"] for e in d["entries"]] == ["gloo:all_reduce"]
    assert [e["profiling_name"] for e in d["ps_staged"]] == ["gloo:send 0->1", "gloo:recv 0<-1"]
    assert d["pg_config"]["staging:standin:0"]["desc"] == "staging group of standin (inner Gloo group)"
    out = run_python(["-m", "torch.distributed.flight_recorder.fr_trace", str(folder)], timeout=120)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
