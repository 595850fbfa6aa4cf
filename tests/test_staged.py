"""The staged backend (portspeed.comm.staged) and the start check of a job's CCL (portspeed.comm.ccl_check), on CPU.

The staged backend in both modes is proven by the collectives suite on one adapter (two ranks, host tensors): a CPU
adapter on the stand-in CCL whose broadcast and all_gather are staged, so every collective the suite makes runs
either through the staged path or through the stand-in inside the staged group. The start check runs against a CCL
planted to get broadcast wrong (a stand-in whose broadcast moves nothing). On the device, with every collective
staged: tests/test_bare_device.py.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from helpers.launch import run_python

TIMEOUT = 240

#: CPU adapters for the checks: the stand-in CCL with broadcast and all_gather staged, and a CCL that lies
ADAPTERS = '''
import torch
import torch.distributed as dist
from portspeed.vendor import BackendGaps
from portspeed.testing.standin_ccl import StandinAccelerator, StandinProcessGroup, _done, register


class PartlyStaged(StandinAccelerator):
    name = "partly-staged"
    staged_collectives = ("broadcast", "all_gather")


class LyingProcessGroup(StandinProcessGroup):
    def broadcast(self, tensors, opts):  # returns at once having moved nothing, as a stub CCL does
        return _done(tensors)


def _create(store, rank, size, timeout):
    return LyingProcessGroup(store, rank, size, timeout)


class Liar(StandinAccelerator):
    name = "liar"
    backend = "liar"
    backend_gaps = None

    @classmethod
    def load_vendor(cls):
        register()
        if "liar" not in dist.Backend.backend_list:
            dist.Backend.register_backend("liar", _create, devices=["cpu"])

    def __init__(self, backend=None):
        self.load_vendor()
        super().__init__(backend)


class VerifiedLiar(Liar):
    name = "verified-liar"
    ccl_verified = True

class Bf16LyingProcessGroup(StandinProcessGroup):
    def allreduce(self, tensors, opts):  # right in float32, moves nothing in bfloat16
        return _done(tensors) if tensors[0].dtype == torch.bfloat16 else super().allreduce(tensors, opts)

class Bf16Liar(Liar):
    name = "bf16-liar"
    backend = "bf16liar"
    @classmethod
    def load_vendor(cls):
        register()
        if "bf16liar" not in dist.Backend.backend_list:
            dist.Backend.register_backend("bf16liar", lambda s, r, n, t: Bf16LyingProcessGroup(s, r, n, t),
                                          devices=["cpu"])

class Bf16Declared(Bf16Liar):
    name = "bf16-declared"
    backend_gaps = BackendGaps(unsupported_dtypes=[("all_reduce", torch.bfloat16)])
'''


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("staged") / "staged_adapters.py"
    path.write_text(ADAPTERS)
    return path


@pytest.mark.multiproc
def test_staged_collectives_and_the_rest_on_the_adapters_ccl_pass_the_collectives_suite(adapters: Path) -> None:
    """Broadcast and all_gather staged, everything else on the stand-in inside the staged group: every check of the
    collectives suite passes (two ranks), and the groups run on 'staged'."""
    from portspeed.conformance.collectives import run_collective_checks
    from portspeed.conformance.report import Report

    report = Report("partly-staged")
    run_collective_checks(f"{adapters}:PartlyStaged", report, timeout=TIMEOUT)
    assert not report.failed and not report.paste, report.render()[-3000:]
    names = {c.name for c in report.checks}
    assert "real_backend reports the real name" in names and "broadcast float32" in names, sorted(names)[:20]


_START = '''
    import datetime, json, os, sys
    import torch.distributed as dist
    sys.path.insert(0, os.path.dirname({path!r}))
    import staged_adapters as A
    import portspeed
    from portspeed.accelerator import reset_accelerator, set_accelerator
    from portspeed.comm import ccl_check
    from portspeed.errors import CclCheckError
    from portspeed.integrations.patch_sets import load
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    manager = portspeed.PatchManager()
    manager.register(load("torch_distributed"))
    manager.apply()
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), n, rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    got = {{}}
    for k, cls in enumerate((A.Liar, A.VerifiedLiar, A.StandinAccelerator, A.Bf16Liar, A.Bf16Declared)):
        set_accelerator(cls())
        ccl_check.last.clear()
        try:
            dist.init_process_group("nccl", rank=rank, world_size=n, store=dist.PrefixStore(str(k), store))
            got[cls.name] = "passed"
        except CclCheckError as exc:
            got[cls.name] = str(exc)
        got[cls.name + " seconds"] = ccl_check.last.get("seconds")
        dist.destroy_process_group()
        reset_accelerator()
    manager.revert()
    print("RESULT " + json.dumps(got), flush=True)
'''


@pytest.mark.multiproc
def test_a_wrong_ccl_stops_the_job_when_its_default_group_is_made(adapters: Path) -> None:
    """A CCL whose broadcast moves nothing: init_process_group raises CclCheckError on every rank, one line naming
    broadcast, what rank 1 got and wanted, and the line to paste; ccl_verified = True skips the check; the stand-in
    (right) passes it, in milliseconds. A CCL right in float32 whose bfloat16 all_reduce moves nothing is named
    too, unless its backend_gaps declares bfloat16 all_reduce missing (the router then casts it); the stand-in's
    bfloat16 reduce_scatter, which raises (a gap the Liar does not declare), is left to say so when used."""
    from portspeed.testing import run_ranks

    res = run_ranks(["-c", textwrap.dedent(_START.format(path=str(adapters)))], 2, timeout=TIMEOUT)
    import json

    outs = []
    for r in res:
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        assert r.returncode == 0 and line, (r.stdout + r.stderr)[-3000:]
        outs.append(json.loads(line[-1][len("RESULT "):]))
    for got in outs:
        msg = got["liar"]
        assert "\n" not in msg and msg.startswith("portspeed: the collective library 'liar' of adapter 'liar' is "
                                                  "wrong"), msg
        assert "broadcast: rank 1 got [2, 4, 6, 8], want [1, 2, 3, 4] (wrong: broadcast)" in msg, msg
        assert "paste into the adapter class Liar: staged_collectives = ('broadcast',)" in msg, msg
        assert got["verified-liar"] == "passed" and got["verified-liar seconds"] is None, got
        assert got["standin"] == "passed" and got["standin seconds"] < 5.0, got  # ~20 ms; loose for loaded CI
        assert "all_reduce bfloat16: rank " in got["bf16-liar"] and "(wrong: all_reduce)" in got["bf16-liar"] and \
            "staged_collectives = ('all_reduce',)" in got["bf16-liar"], got["bf16-liar"]
        assert got["bf16-declared"] == "passed", got  # the gap declared: the router casts, the check leaves it
    print("start check on the stand-in, 2 ranks:", [f"{o['standin seconds'] * 1e3:.1f} ms" for o in outs])


def test_conformance_proposes_staging_for_wrong_or_missing_collectives() -> None:
    """Silently wrong (any call) or missing (every call raised): staged; some ops raising: left to backend_gaps;
    every collective checked wrong: backend = "staged"."""
    from portspeed.adapters.cpu import CpuAccelerator
    from portspeed.conformance.staging import propose

    def res(coll: str, ok: bool, effect: str = "wrong", op: str | None = None) -> dict:
        return {"key": [coll, op, "float32"], "ok": ok, **({} if ok else {"effect": effect})}

    acc = CpuAccelerator()
    results = [res("broadcast", False), res("all_reduce", True, op="SUM"), res("all_reduce", False, "raises", "AVG"),
               res("all_to_all", False, "raises"), res("isend/recv", True), res("gather", True)]
    assert propose(results, acc) == ("staged_collectives", "('broadcast', 'all_to_all')")
    assert propose([res("broadcast", False), res("isend/recv", False)], acc) == ("backend", '"staged"')
    assert propose([res("all_reduce", True, op="SUM"), res("all_reduce", False, "raises", "AVG")], acc) is None


@pytest.mark.parametrize("line,words", [
    ("staged_collectives = ('bcast',)", "staged_collectives names 'bcast', not a collective the staged backend"),
    ("ccl_verified = 1", "ccl_verified = 1; give True"),
])
def test_a_staging_declaration_of_the_wrong_kind_is_refused_naming_it(line: str, words: str) -> None:
    from portspeed.vendor import AdapterContractError, PrivateUse1Accelerator

    with pytest.raises(AdapterContractError, match=words):
        exec(f"class Acme(PrivateUse1Accelerator):\n    name = 'acme'\n    device_type = 'acme'\n"
             f"    backend = 'accl'\n    {line}\n", {"PrivateUse1Accelerator": PrivateUse1Accelerator})


def test_staged_groups_run_gloos_table_plus_the_adapters_gaps() -> None:
    """An adapter with staged_collectives: its groups are made on 'staged' (the router maps 'nccl' there), whose
    table is Gloo's plus the adapter's own gaps, and asks for no sub-group teardown."""
    import torch.distributed as dist

    from portspeed.accelerator.capabilities import capabilities_for
    from portspeed.comm.backends import map_backend
    from portspeed.testing.standin_ccl import StandinAccelerator

    class Partly(StandinAccelerator):
        name = "partly"
        staged_collectives = ("broadcast",)

    acc = Partly()
    assert map_backend("nccl", acc) == "staged"
    caps = acc.capabilities()
    assert caps.backend == "staged" and not caps.groups_hold_host_threads
    assert set(capabilities_for("gloo").gaps) <= set(caps.gaps)
    assert caps.gap("all_to_all", dist.ReduceOp.SUM, None) is not None  # the stand-in's declared gap
    assert map_backend("nccl", StandinAccelerator()) == "standin"
