"""Conformance: every collective Megatron and DeepSpeed use, value for value, on Gloo and the stand-in.

The rank program is the conformance kit's (``portspeed.conformance.collectives``), so the
suite and ``portspeed conformance`` check the same things. Each test starts one process
group (2 or 3 real processes on 127.0.0.1) that runs every check and reports failures as
JSON. Inputs are small integers, so every reference (a float64 computation in one process
over all ranks' inputs, cast to the dtype) is exact and results are compared with
torch.equal. The group is created with ``backend="nccl"`` through the router, as Megatron does.

``--declared-gaps`` (patches off) first checks the capability table against the real
backend: every gap the adapter declares really raises or gives a wrong value (on Gloo:
PREMUL_SUM, and a flat all_gather_into_tensor output for a 2-d input). Then every
collective runs through the router, and the router's counters must name exactly the
collectives the table flags.
"""

from __future__ import annotations

import json

import pytest

#: test kind -> the adapter the ranks select (PORTSPEED_ACCELERATOR)
_ADAPTERS = {"gloo": "cpu", "standin": "standin"}


def _run(kind: str, world: int) -> list[dict]:
    from portspeed.testing import run_ranks

    adapter, _, replay = kind.partition("+")  # "gloo+gloo@2.7": run on Gloo, follow torch 2.7's Gloo table
    argv = ["-m", "portspeed.conformance.collectives", "--declared-gaps"] + (["--replay", replay] if replay else [])
    res = run_ranks(argv, world, timeout=400, env={"PORTSPEED_ACCELERATOR": _ADAPTERS[adapter]})
    reports = []
    for r in res:
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULTS ")]
        assert r.returncode == 0 and line, f"rank {r.rank} exit {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
        reports.append(json.loads(line[-1][len("RESULTS "):]))
    return reports


@pytest.mark.multiproc
@pytest.mark.parametrize("kind,world", [
    ("gloo", 2), ("gloo", 3), ("standin", 2), ("standin", 3),
    # Gloo following other tables: torch 2.7's Gloo gaps and Habana HCCL's (PRODUCT, AVG, bitwise)
    ("gloo+gloo@2.7", 3), ("gloo+hccl-hpu", 2),
])
def test_every_collective_matches_single_process_reference(kind: str, world: int) -> None:
    """Every collective, dtype and op Megatron/DeepSpeed use gives the reference value on every rank.

    ``gloo+<table>`` runs on the installed Gloo while the router follows another table, so
    the rewrites that torch 2.6-2.8 or a vendor need run for real here.
    """
    reports = _run(kind, world)
    failures = [f"rank {rep['rank']}: {c['check']}: {c['detail']}"
                for rep in reports for c in rep["results"] if not c["ok"]]
    assert not failures, "\n".join(failures)
    assert sum(len(rep["results"]) for rep in reports) > 100 * world  # the checks really ran
    checks = {c["check"] for rep in reports for c in rep["results"]}
    if kind == "standin":  # the stand-in declares gaps: they were checked on the raw backend first
        assert any(c.startswith("raw ") for c in checks)
    if kind == "gloo":  # the control: raw Gloo (patches off) refused the flat all_gather_into_tensor output
        assert "raw all_gather_into_tensor flat output float32 -> raises" in checks
    # outputs NCCL takes by element count (Megatron's gather_split_1d_tensor passes a flat one), sync and async
    gathers = {f"all_gather_into_tensor {form} output {dt} async={a}" for form in ("flat", "stacked", "0-d")
               for dt in ("float32", "bfloat16") for a in (False, True)}
    assert gathers <= checks, sorted(gathers - checks)
    assert "coalesced all_gather_into_tensor flat output #0" in checks
    assert "stats: exactly the collectives the table flags were rewritten" in checks
