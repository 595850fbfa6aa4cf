"""A rank that skips one all_reduce inside Megatron's tensor-parallel forward is named, with Megatron's line.

The planted fault (tests/data/trace_megatron_skip.py): the example trainer on real megatron-core,
TP2 on 2 ranks (CPU adapter on Gloo, the stand-in CCL, the test device), with
``megatron.core.tensor_parallel.mappings._reduce`` wrapped so that rank 1 returns its 3rd call's input unreduced. Gloo
then pairs rank 1's later calls with rank 0's earlier ones until two of them differ in shape (the vocab-parallel loss's
all_reduce against the next layer's); the job must end (the run's kill bound is the hang timeout
plus start-up, not a timed assertion) and `portspeed run`'s closing lines must name rank 1, the
op, the TP group, the sequence number, the skipped call's site in Megatron's mappings.py, and the
dump folder, with no rank left running.

The same trainer at PP2 (tests/data/trace_megatron_pp.py): stage 1 (rank 1) posts its first receive of the
activations with half the sequence length. On all three backends the point-to-point message travels over
Gloo, whose I/O thread refuses a message larger than the receive buffer with std::terminate: rank 1 dies
by SIGABRT with no Python left to dump, rank 0 fails on the closed connection. The closing lines must
still name the mismatch (both ranks, both shapes, the pipeline group, each side's p2p sequence number,
Megatron's call site in p2p_communication.py) from rank 0's dump and rank 1's write-through file.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
from pathlib import Path

import pytest
from helpers.launch import REPO, free_port, run_python

pytestmark = [pytest.mark.megatron]

SCRIPT = REPO / "tests" / "data" / "trace_megatron_skip.py"
HANG_S = 10
BOUND = 240  # kill bound: start-up of 2 Megatron ranks on a loaded 2-core machine + HANG_S + dumps


def _megatron_site(module: str, function: str, call: str) -> str:
    """``file.py:LINE`` of the one ``call`` in Megatron's ``function`` of ``module`` (a path under megatron/core),
    read from the installed source (parsed, not imported: megatron.core's import takes seconds)."""
    spec = importlib.util.find_spec("megatron")
    assert spec is not None and spec.submodule_search_locations, "megatron-core is not installed"
    path = Path(list(spec.submodule_search_locations)[0]) / "core" / module
    fn = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == function)
    hits = [n.lineno for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == call]
    assert len(hits) == 1, hits
    return f"{path.name}:{hits[0]}"


def _reduce_site() -> str:
    """The all_reduce in Megatron's ``_reduce`` (tensor_parallel/mappings.py)."""
    return _megatron_site("tensor_parallel/mappings.py", "_reduce", "all_reduce")


def _alive_with(port: int) -> list[int]:
    """Processes still running whose command line carries this job's master port."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if f"--master-port {port}" in cmd and state != "Z" and int(pid) != os.getpid():
            out.append(int(pid))
    return out


#: where the fault is planted: the CPU adapter on Gloo, the stand-in vendor CCL, the C++ test device and its CCL
#: (the settings, the backend rank 0's dump must name in its calls)
BACKENDS = [pytest.param({"PORTSPEED_ACCELERATOR": "cpu"}, "gloo", id="cpu"),
            pytest.param({"PORTSPEED_ACCELERATOR": "cpu", "PORTSPEED_BACKEND": "standin"}, "standin", id="standin"),
            pytest.param({"PORTSPEED_ACCELERATOR": "testdev"}, "testccl", id="testdev", marks=pytest.mark.testdev)]


@pytest.mark.parametrize("backend,ccl", BACKENDS)
def test_skipped_all_reduce_in_megatron_tp2_forward_is_named(backend: dict, ccl: str, tmp_path: Path) -> None:
    folder, port = tmp_path / "dumps", free_port()
    res = run_python(["-m", "portspeed.cli", "run", "--hang-timeout", str(HANG_S), "--nproc-per-node", "2",
                      "--master-addr", "127.0.0.1", "--master-port", str(port), str(SCRIPT),
                      "--tp", "2", "--iters", "2", "--num-layers", "2"],
                     timeout=BOUND, env={**backend, "PORTSPEED_TRACE_DIR": str(folder)},
                     drop=["PORTSPEED_TRACE", "PORTSPEED_TRACE_ON_EXIT", "PORTSPEED_BACKEND"])
    text = res.stdout + res.stderr
    assert res.returncode == 1, text[-4000:]
    assert "trace_megatron_skip: rank 1 skips _reduce call 3" in text, text[-4000:]
    lines = [x for x in res.stderr.splitlines() if x.startswith("portspeed run:")]
    why = [x for x in lines if x.startswith("portspeed run: why-hung: ")]
    assert why, text[-4000:]
    cause = why[0]
    m = re.search(r"rank 1 issued all_reduce .* as collective #(\d+) of group \d+ \(TENSOR_MODEL_PARALLEL_GROUP\)",
                  cause)
    assert m, cause
    seq = m.group(1)
    site = _reduce_site()
    assert "the others rank 0 all_reduce" in cause and f"at {site}" in cause, cause
    assert re.search(rf"rank 1 issued 1 all_reduce fewer from {re.escape(site)} \(\d+ against rank 0's \d+ in "
                     rf"#\d+-#{seq}\): the call it skipped or replaced", cause), cause
    assert lines[-1].startswith(f"portspeed run: flight-recorder dumps in {folder}"), lines[-3:]
    assert lines.index(cause) < len(lines) - 1
    assert (folder / "portspeed_trace_rank_0").exists() or (folder / "portspeed_last_calls_0.txt").exists()
    assert (folder / "portspeed_trace_rank_1").exists() or (folder / "portspeed_last_calls_1.txt").exists()
    assert not _alive_with(port), _alive_with(port)
    # the fault ran on the backend it names: rank 0's write-through file holds every call it issued
    from portspeed.trace.dumps import through_entry as _through_entry

    with open(folder / "portspeed_last_calls_0.txt") as f:
        ops = {_through_entry(x)["profiling_name"].split(":")[0] for x in f if x.strip()}
    assert ops == {ccl}, ops


PP_SCRIPT = REPO / "tests" / "data" / "trace_megatron_pp.py"


@pytest.mark.parametrize("backend,ccl", BACKENDS)
def test_pp2_stage_receiving_another_shape_is_named(backend: dict, ccl: str, tmp_path: Path) -> None:
    folder, port = tmp_path / "dumps", free_port()
    res = run_python(["-m", "portspeed.cli", "run", "--hang-timeout", str(HANG_S), "--nproc-per-node", "2",
                      "--master-addr", "127.0.0.1", "--master-port", str(port), str(PP_SCRIPT),
                      "--pp", "2", "--iters", "2", "--num-layers", "2"],
                     timeout=BOUND, env={**backend, "PORTSPEED_TRACE_DIR": str(folder)},
                     drop=["PORTSPEED_TRACE", "PORTSPEED_TRACE_ON_EXIT", "PORTSPEED_BACKEND", "PLANT_*"])
    text = res.stdout + res.stderr
    assert res.returncode == 1, text[-4000:]
    # the example's defaults (--seq-length 32, --micro-batch-size 2, --hidden-size 64): the planted receive is half
    assert "trace_megatron_pp: rank 1 posts receive 1 from the previous stage as [16, 2, 64] instead of [32, 2, 64]" \
        in text, text[-4000:]
    # how the backend ended it (docs/reliability.md): Gloo's size check aborts the receiving rank
    assert "Received data size doesn't match expected size" in text, text[-4000:]
    assert re.search(r"rank 1 \(local rank 1 on .*\) killed by SIGABRT", text), text[-4000:]
    lines = [x for x in res.stderr.splitlines() if x.startswith("portspeed run:")]
    why = [x for x in lines if x.startswith("portspeed run: why-hung: ")]
    assert why, text[-4000:]
    cause, site = why[0], _megatron_site("pipeline_parallel/p2p_communication.py", "_batched_p2p_ops",
                                         "batch_isend_irecv")  # the example's PP2 path: batched p2p
    want = (r"point-to-point shape mismatch in group \d+ \(PIPELINE_MODEL_PARALLEL_GROUP\): send #1 from rank 0 to "
            r"rank 1 carries \[\[32, 2, 64\]\] \['Float'\] \(rank 0's p2p #1, at {0}\), rank 1 receives "
            r"\[\[16, 2, 64\]\] \['Float'\] \(rank 1's p2p #1, at {0}\)$").format(re.escape(site))
    assert re.search(want, cause), cause
    assert lines[-1].startswith(f"portspeed run: flight-recorder dumps in {folder}"), lines[-3:]
    assert lines.index(cause) < len(lines) - 1
    assert (folder / "portspeed_trace_rank_0").exists()  # rank 0 dumped on its error; rank 1 left its write-through
    assert (folder / "portspeed_last_calls_1.txt").exists() and not (folder / "portspeed_trace_rank_1").exists()
    assert not _alive_with(port), _alive_with(port)
    from portspeed.trace.dumps import through_entry as _through_entry

    with open(folder / "portspeed_last_calls_0.txt") as f:
        ops = {_through_entry(x)["profiling_name"].split(":")[0] for x in f if x.strip()}
    assert ops == {ccl}, ops
