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
from portspeed.conformance.rank import Rank
from portspeed.conformance.report import Report
from portspeed.conformance.staging import propose

__all__ = ["rank_main", "run_collective_checks"]

SUITE = "collectives"


def _every_collective(r: Rank, caps: Any, expected: set[str]) -> None:  # noqa: C901 - one list, top to bottom
    """Every collective x dtype x op through the router; ``expected`` gets the collectives the table flags."""
    import torch
    import torch.distributed as dist

    from portspeed.conformance.reference import reduce_op as rop, reference as ref

    R, n, rank, data, everyone, empty, check, case = (dist.ReduceOp, r.n, r.rank, r.data, r.everyone, r.empty, r.check,
                                                      r.case)

    def note(coll: str, op: str, dtype: torch.dtype) -> None:
        """Remember which collectives the table says must be rewritten for the calls made."""
        if caps.gap(coll, R.PREMUL_SUM if op == "PREMUL" else getattr(R, op), dtype) is not None:
            expected.add(coll)

    shape, full = (3, 5), (n * 3, 5)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        tag, is_int = str(dtype)[6:], not dtype.is_floating_point
        ops = ("SUM", "MAX", "MIN", "PRODUCT", "BAND", "BOR", "BXOR") if is_int else (
            "SUM", "AVG", "MAX", "MIN", "PRODUCT", "PREMUL")
        for op in ops:
            for async_op in (False, True) if op in ("SUM", "AVG") else (False,):
                with case(name := f"all_reduce {op} {tag} async={async_op}", "all_reduce", op, dtype):
                    x = data(rank, shape, dtype)
                    note("all_reduce", op, dtype)
                    w = dist.all_reduce(x, op=rop(op), async_op=async_op)
                    if async_op:
                        w.wait()
                    check(name, x, ref(op, everyone(shape), dtype))
        for op in ("SUM", "MAX") + (() if is_int else ("AVG",)):
            with case(f"reduce {op} {tag}", "reduce", op, dtype):
                x = data(rank, shape, dtype)
                note("reduce", op, dtype)
                dist.reduce(x, dst=n - 1, op=rop(op))
                if rank == n - 1:  # non-dst contents are unspecified (Gloo uses them as scratch)
                    check(f"reduce {op} {tag}", x, ref(op, everyone(shape), dtype))
        with case(f"broadcast {tag}", "broadcast", None, dtype):
            x = data(rank, shape, dtype)
            dist.broadcast(x, src=1)
            check(f"broadcast {tag}", x, data(1, shape, dtype))
        with case(f"all_gather {tag}", "all_gather", None, dtype):
            outs = [empty(shape, dtype) for _ in range(n)]
            dist.all_gather(outs, data(rank, shape, dtype))
            check(f"all_gather {tag}", torch.stack([o.cpu() for o in outs]), everyone(shape).to(dtype))
        with case(f"all_gather_into_tensor {tag}", "all_gather_into_tensor", None, dtype):
            out = empty(full, dtype)
            dist.all_gather_into_tensor(out, data(rank, shape, dtype))
            check(f"all_gather_into_tensor {tag}", out, everyone(shape).to(dtype).reshape(full))
        # outputs NCCL takes by their element count, not chunk-shaped like the input (Gloo wants
        # them so; Megatron's gather_split_1d_tensor passes a flat one): the values NCCL gives
        if caps.gap("all_gather_into_tensor", None, dtype) is not None:
            expected.add("all_gather_into_tensor")
        gather_fns = [("all_gather_into_tensor", dist.all_gather_into_tensor)] + (
            [("all_gather_single", dist.all_gather_single)] if hasattr(dist, "all_gather_single") else [])
        for fn_name, gather in gather_fns:
            for form, ins, out_shape in (("flat", shape, (n * 15,)), ("stacked", shape, (n, *shape)),
                                         ("0-d", (), (n,))):
                for async_op in (False, True):
                    with case(name := f"{fn_name} {form} output {tag} async={async_op}", "all_gather_into_tensor",
                              gaps.SHAPE, dtype):
                        out = empty(out_shape, dtype)
                        w = gather(out, data(rank, ins, dtype, salt=3), async_op=async_op)
                        if async_op:
                            w.wait()
                        check(name, out, everyone(ins, salt=3).to(dtype).reshape(out_shape))
        # reduce_scatter: every rank contributes n chunks of `shape`
        for op in ("SUM", "MAX") + (() if is_int else ("AVG", "PREMUL")):
            want = ref(op, everyone(full), dtype)[rank * 3:(rank + 1) * 3]
            note("reduce_scatter_tensor", op, dtype)
            note("reduce_scatter", op, dtype)
            for async_op in (False, True) if op == "AVG" else (False,):
                with case(name := f"reduce_scatter_tensor {op} {tag} async={async_op}", "reduce_scatter_tensor", op,
                          dtype):
                    out = empty(shape, dtype)
                    w = dist.reduce_scatter_tensor(out, data(rank, full, dtype), op=rop(op), async_op=async_op)
                    if async_op:
                        w.wait()
                    check(name, out, want)
            if hasattr(dist, "reduce_scatter_single"):  # torch 2.13's name
                with case(f"reduce_scatter_single {op} {tag}", "reduce_scatter_tensor", op, dtype):
                    out = empty(shape, dtype)
                    dist.reduce_scatter_single(out, data(rank, full, dtype), op=rop(op))
                    check(f"reduce_scatter_single {op} {tag}", out, want)
            with case(f"reduce_scatter {op} {tag}", "reduce_scatter", op, dtype):
                out = empty(shape, dtype)
                dist.reduce_scatter(out, list(data(rank, full, dtype).chunk(n)), op=rop(op))
                check(f"reduce_scatter {op} {tag}", out, want)
        # all_to_all: rank r sends chunk j to rank j
        src = data(rank, (n * 2,), dtype, salt=rank)
        want = torch.cat([data(j, (n * 2,), dtype, salt=j).cpu()[rank * 2:rank * 2 + 2] for j in range(n)])
        note("all_to_all", "SUM", dtype)
        with case(f"all_to_all list {tag}", "all_to_all", None, dtype):
            outs = [empty(2, dtype) for _ in range(n)]
            dist.all_to_all(outs, list(src.chunk(n)), async_op=True).wait()
            check(f"all_to_all list {tag}", torch.cat([o.cpu() for o in outs]), want)
        with case(f"all_to_all_single even {tag}", "all_to_all_single", None, dtype):
            out = empty(n * 2, dtype)
            dist.all_to_all_single(out, src)
            check(f"all_to_all_single even {tag}", out, want)
        with case(f"all_to_all_single uneven {tag}", "all_to_all_single", None, dtype):  # rank r sends j+1 to rank j
            src = data(rank, (sum(j + 1 for j in range(n)),), dtype, salt=7)
            out = empty(n * (rank + 1), dtype)
            dist.all_to_all_single(out, src, [rank + 1] * n, [j + 1 for j in range(n)])
            start = sum(j + 1 for j in range(rank))
            want = torch.cat([data(j, (src.numel(),), dtype, salt=7).cpu()[start:start + rank + 1] for j in range(n)])
            check(f"all_to_all_single uneven {tag}", out, want)
        with case(f"gather {tag}", "gather", None, dtype):  # gather / scatter at root 0
            gl = [empty(shape, dtype) for _ in range(n)] if rank == 0 else None
            dist.gather(data(rank, shape, dtype), gl, dst=0)
            if rank == 0:
                check(f"gather {tag}", torch.stack([g.cpu() for g in gl]), everyone(shape).to(dtype))
        with case(f"scatter {tag}", "scatter", None, dtype):
            out = empty(shape, dtype)
            dist.scatter(out, [data(j, shape, dtype, salt=1) for j in range(n)] if rank == 0 else None, src=0)
            check(f"scatter {tag}", out, data(rank, shape, dtype, salt=1))
        right, left = (rank + 1) % n, (rank - 1) % n  # point to point around the ring (pipeline parallelism)
        with case(f"batch_isend_irecv {tag}", "batch_isend_irecv", None, dtype):
            got = empty(shape, dtype)
            for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, data(rank, shape, dtype), right),
                                               dist.P2POp(dist.irecv, got, left)]):
                req.wait()
            check(f"batch_isend_irecv {tag}", got, data(left, shape, dtype))
        with case(f"isend/recv {tag}", "isend/recv", None, dtype):
            got = empty(shape, dtype)
            s = dist.isend(data(rank, shape, dtype, salt=2), right)
            dist.recv(got, left)
            s.wait()
            check(f"isend/recv {tag}", got, data(left, shape, dtype, salt=2))


def _as_megatron_does(r: Rank, caps: Any, expected: set[str], real: str) -> None:
    """Megatron's coalesced gradient reduce-scatter and param all-gather, and its sub-groups."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _coalescing_manager

    from portspeed import comm
    from portspeed.conformance.reference import reference as ref

    R, n, rank, data, everyone, check, f32 = dist.ReduceOp, r.n, r.rank, r.data, r.everyone, r.check, torch.float32
    if caps.gap("reduce_scatter_tensor", R.AVG, f32) is not None:
        expected.add("reduce_scatter_tensor")
    with r.case("coalesced reduce_scatter_tensor AVG", "reduce_scatter_tensor", "AVG", f32):
        bufs = [data(rank, (n * 2,), f32, salt=k) for k in range(3)]
        outs = [r.empty(2) for _ in bufs]
        with _coalescing_manager(dist.group.WORLD, async_ops=True) as cm:
            for o, b in zip(outs, bufs):
                dist.reduce_scatter_tensor(o, b, op=R.AVG)
        cm.wait()
        for k, o in enumerate(outs):
            check(f"coalesced reduce_scatter_tensor AVG #{k}", o,
                  ref("AVG", everyone((n * 2,), salt=k), f32)[rank * 2:rank * 2 + 2])
    with r.case("coalesced all_gather_into_tensor", "all_gather_into_tensor", None, f32):
        outs = [r.empty(n * 2) for _ in range(2)]
        with _coalescing_manager(dist.group.WORLD, async_ops=True) as cm:
            for k, o in enumerate(outs):
                dist.all_gather_into_tensor(o, data(rank, (2,), f32, salt=k))
        cm.wait()
        for k, o in enumerate(outs):
            check(f"coalesced all_gather_into_tensor #{k}", o, everyone((2,), salt=k).float().reshape(-1))
    with r.case("coalesced all_gather_into_tensor flat output", "all_gather_into_tensor", gaps.SHAPE, f32):
        outs = [r.empty(n * 6) for _ in range(2)]  # flat outputs of 2-d inputs, recorded in the batch
        with _coalescing_manager(dist.group.WORLD, async_ops=True) as cm:
            for k, o in enumerate(outs):
                dist.all_gather_into_tensor(o, data(rank, (2, 3), f32, salt=k))
        cm.wait()
        for k, o in enumerate(outs):
            check(f"coalesced all_gather_into_tensor flat output #{k}", o, everyone((2, 3), salt=k).float().reshape(-1))
    with r.case("coalesced all_reduce SUM", "all_reduce", "SUM", f32):
        xs = [data(rank, (4,), f32, salt=k) for k in range(2)]
        with _coalescing_manager(dist.group.WORLD):
            for x in xs:
                dist.all_reduce(x)
        for k, x in enumerate(xs):
            check(f"coalesced all_reduce SUM #{k}", x, ref("SUM", everyone((4,), salt=k), f32))

    sub = dist.new_group(ranks=[0, 1], backend="nccl")
    if rank in (0, 1):
        check("new_group get_backend", dist.get_backend(sub), "nccl")
        check("new_group real backend", comm.real_backend(sub), real)
        if caps.gap("all_reduce", R.AVG, torch.bfloat16) is not None:
            expected.add("all_reduce")
        with r.case("sub-group all_reduce AVG bf16", "all_reduce", "AVG", torch.bfloat16):
            x = data(rank, (4,), torch.bfloat16)
            dist.all_reduce(x, op=R.AVG, group=sub)
            check("sub-group all_reduce AVG bf16", x, everyone((4,))[:2].mean(0).to(torch.bfloat16))
    gloo_sub = dist.new_group(ranks=list(range(n)), backend="gloo")
    check("explicit gloo group stays gloo", comm.real_backend(gloo_sub), "gloo")
    with r.case("async all_reduce lands by wait()", "all_reduce", "SUM", f32):
        x = data(rank, (4,), f32)
        dist.all_reduce(x, async_op=True).wait()
        check("async all_reduce lands by wait()", x, ref("SUM", everyone((4,)), f32))


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
    _every_collective(r, caps, expected)
    _as_megatron_does(r, caps, expected, real)
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
