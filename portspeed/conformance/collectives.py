"""Collective checks of the conformance kit: every collective Megatron and DeepSpeed use, on device tensors.

This is the one rank program for collectives: ``portspeed conformance`` runs it against an
adapter, and the test suite (tests/test_collective_conformance.py) runs it on Gloo, the
stand-in and replayed tables. Each rank (a real process; ``run_collective_checks`` starts
them on 127.0.0.1) selects the adapter named by ``PORTSPEED_ACCELERATOR``, creates the
default group with ``"nccl"`` requested, as Megatron does, through portspeed's router, and
runs each collective on tensors on the adapter's device. Inputs are small integers, so the
reference (a float64 computation over all ranks' inputs in one process, cast to the dtype,
``portspeed.conformance.reference``) is exact and results are compared with ``torch.equal``
after ``.cpu()``. Collectives the adapter declares its backend lacks are rewritten by the
router and must still be exact, and the router's counters must name exactly those.
all_gather_into_tensor (and torch 2.13's all_gather_single) also gets the outputs NCCL
accepts by element count (flat, stacked, a 0-d input; sync, async and coalesced), which a
backend that wants chunk-shaped outputs (Gloo, testccl) only takes through the router.

A call that raises fails its check and the rank goes on (``rank.Rank.case``); each check is
keyed ``(collective, op, dtype)``, so a gap the adapter did not declare is reported as the
``BackendGaps`` field to write (``gaps.suggest``).

Options of the rank program (``python -m portspeed.conformance.collectives``; ``portspeed
conformance --declared-gaps`` passes the first): ``--declared-gaps`` first runs each gap of
the table, with portspeed's patches off, on the raw backend: a built-in row must still raise or
give a wrong value, and a declared item that does neither can go (off by default: on real
hardware a failing raw call may poison the communicator);
``--replay TABLE`` makes the router follow another table on the same backend (``gloo@2.7``:
torch 2.7's Gloo table; ``hccl-hpu``: the gaps the hpu adapter declares, plus the running
backend's output-shape gap), so rewrites that other torch releases or vendors need run for real.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import Any

from portspeed.accelerator.declarations import groups_backend
from portspeed.conformance import gaps
from portspeed.conformance.collective_cases import as_megatron_does, every_collective
from portspeed.conformance.rank import Rank
from portspeed.conformance.report import Report
from portspeed.conformance.staging import propose

__all__ = ["rank_main", "run_collective_checks"]

SUITE = "collectives"


def _replayed(table: str, running: Any) -> Any:
    """The table ``--replay`` names: ``gloo@2.7`` (a torch release's Gloo) or ``hccl-hpu`` (an adapter's).

    The running backend's gaps (``running``: its own record) that the replayed table does not
    flag are kept: they are properties of the library that runs the calls (Gloo's
    all_gather_into_tensor still wants chunk-shaped outputs while the router follows HCCL's
    table; torch 2.6's Gloo still has no list reduce_scatter), not of the table replayed.
    """
    import dataclasses

    from portspeed.accelerator.capabilities import CHUNK_SHAPED, capabilities_for

    name, _, version = table.partition("@")
    if name == "gloo":
        caps = capabilities_for("gloo", version or None)
    else:
        from portspeed.accelerator import adapter_class

        caps = adapter_class(name.split("-")[1])().capabilities()
    kept = tuple(g for g in running.gaps if (not caps.affects(CHUNK_SHAPED) if g.collective == CHUNK_SHAPED
                                             else caps.gap(g.collective, g.op, g.dtype) is None))
    if kept:
        caps = dataclasses.replace(caps, gaps=caps.gaps + kept,
                                   notes=caps.notes + ("the running backend's gaps the table does not flag kept",))
    return caps


def rank_main(argv: list[str] | None = None) -> int:
    """One rank's checks; prints ``RESULTS <json>`` (run by ``run_collective_checks`` and the test suite)."""
    p = argparse.ArgumentParser(prog="python -m portspeed.conformance.collectives")
    p.add_argument("--declared-gaps", action="store_true", help="first run the table's gaps on the raw backend")
    p.add_argument("--replay", default="", help="follow another capability table (gloo@2.7, hccl-hpu)")
    args = p.parse_args(argv)

    import torch.distributed as dist

    import portspeed
    from portspeed import comm
    from portspeed.integrations.patch_sets import load

    PATCHES = load("torch_distributed")

    acc = portspeed.get_accelerator()
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    acc.set_device(rank)
    r = Rank(rank, n, acc.device())
    real = groups_backend(acc)  # staged when it declares staged_collectives
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), n, rank == 0, timeout=timeout)

    if real == "staged":  # portspeed's own backend: registered for the device (the router does it when routed)
        from portspeed.comm import staged

        staged.register(acc.device_type)
    if args.declared_gaps and not args.replay:
        dist.init_process_group(backend=real, rank=rank, world_size=n, timeout=timeout,
                                store=dist.PrefixStore("raw", store))
        gaps.raw_declared(r, acc.capabilities(), _own_declaration(acc))
        # Not dist.barrier(): Gloo's barrier waits on the work each worker thread last ran, and
        # a work that failed stays there until that thread runs another, so the barrier raises
        # the gap's error a second time (458 of 500 tries right after a failed PREMUL_SUM; seen
        # once in CI). A barrier on the store does not look at earlier work.
        if store.add("raw done", 1) == n:
            store.set("raw all done", "1")
        store.wait(["raw all done"])
        dist.destroy_process_group()

    manager = portspeed.PatchManager()
    manager.register(PATCHES)
    manager.apply()
    comm.reset()
    dist.init_process_group(backend="nccl", rank=rank, world_size=n, timeout=timeout,
                            store=dist.PrefixStore("routed", store))
    if args.replay:
        comm.use_capabilities(_replayed(args.replay, acc.capabilities()))
    r.check("get_backend reports the requested name", dist.get_backend(), "nccl")
    r.check("real_backend reports the real name", comm.real_backend(), real)
    caps, expected = comm.capabilities_of(), set()
    r.caps = caps
    every_collective(r, caps, expected)
    as_megatron_does(r, caps, expected, real)
    dist.barrier()
    st = comm.stats()
    r.check("stats: exactly the collectives the table flags were rewritten", sorted(st), sorted(expected))
    dist.destroy_process_group()
    manager.revert()
    print("RESULTS " + json.dumps({"rank": rank, "results": r.results, "stats": st}), flush=True)
    return 0


def _own_declaration(acc: Any) -> Any:
    """The adapter's BackendGaps where its groups run on its own backend (else None: the backend's defaults apply)."""
    return acc.backend_gaps if acc.backend_gaps is not None and acc.owns_backend(groups_backend(acc)) else None


def run_collective_checks(adapter: str, report: Report, nproc: int = 2, timeout: float = 300,
                          declared_gaps: bool = False) -> None:
    """Start ``nproc`` ranks on 127.0.0.1 with ``PORTSPEED_ACCELERATOR=adapter`` (``--declared-gaps`` first runs
    the table's gaps raw); add their checks to ``report``, an undeclared gap as the declaration to write."""
    from portspeed.accelerator import adapter_class
    from portspeed.testing import run_ranks

    argv = ["-m", "portspeed.conformance.collectives"] + (["--declared-gaps"] if declared_gaps else [])
    # PORTSPEED_CCL_CHECK=0: the start check would stop a wrong library before this suite names each call
    res = run_ranks(argv, nproc, timeout=timeout, env={"PORTSPEED_ACCELERATOR": adapter, "PORTSPEED_CCL_CHECK": "0"})
    seen: dict[str, list[str]] = {}
    keys: dict[str, tuple] = {}
    results: list[dict] = []
    for r in res:
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULTS ")]
        if r.returncode != 0 or not line:
            report.add(SUITE, f"rank {r.rank} ran to the end", False,
                       f"exit {r.returncode}: {(r.stderr or r.stdout)[-1500:]}")
            continue
        for c in json.loads(line[-1][len("RESULTS "):])["results"]:
            results.append(c)
            seen.setdefault(c["check"], [])
            if c.get("key"):
                keys[c["check"]] = tuple(c["key"])
            if not c["ok"]:
                seen[c["check"]].append(f"rank {r.rank}: {c['detail']}")
    acc = adapter_class(adapter)()
    declared = _own_declaration(acc)
    findings, explained, why = gaps.suggest(results, declared)
    staging = propose(results, acc)  # wrong values, or a missing collective: stage them (a line to paste)
    if staging is not None:
        report.declare(*staging)
        if staging[0] == "backend":
            findings, explained = [], set()  # every collective staged: no BackendGaps item of the library applies
    for name, problems in seen.items():
        if problems and keys.get(name) in explained:
            continue  # said below, as the declaration to write
        note = f" ({why[keys[name]]})" if problems and keys.get(name) in why else ""
        report.add(SUITE, name, not problems, "; ".join(problems) + note)
    items = declared.items() if declared is not None else []
    drop = sorted({c["item"] for c in results if "item" in c and not c["ok"]})
    if findings or drop:
        fits = gaps.declaration(declared, findings, [items[i][:2] for i in drop])
        for field in dict.fromkeys(f.field for f in findings):
            of = [f for f in findings if f.field == field]
            report.add(SUITE, f"undeclared gap: {'; '.join(f.what for f in of)}", False,
                       f"write in the adapter's BackendGaps(...): {fits.field_source(field) or field + '=...'} "
                       f"(first seen: {of[0].evidence})")
        report.add(SUITE, "the declaration that fits this library", False, f"backend_gaps = {fits.source()}")


if __name__ == "__main__":
    sys.exit(rank_main())
