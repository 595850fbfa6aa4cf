"""The calls each rank of the collective checks makes, in one order on every rank, each checked exactly.

``every_collective``: every collective Megatron and DeepSpeed use, per dtype and reduce op, sync and
async, through the router, against ``portspeed.conformance.reference``; ``as_megatron_does``: Megatron's
coalesced calls and its sub-groups. Both add to ``expected`` the collectives the capability table says
must be rewritten, which the router's counters must then name exactly. The rank program that runs
them is ``portspeed.conformance.collectives``.
"""

from __future__ import annotations

from typing import Any, Callable

from portspeed.conformance import gaps
from portspeed.conformance.rank import Rank

__all__ = ["as_megatron_does", "every_collective"]


def every_collective(r: Rank, caps: Any, expected: set[str]) -> None:
    """Every collective x dtype x op through the router; ``expected`` gets the collectives the table flags."""
    import torch
    import torch.distributed as dist

    def note(coll: str, op: str, dtype: torch.dtype) -> None:
        """Remember which collectives the table says must be rewritten for the calls made."""
        R = dist.ReduceOp
        if caps.gap(coll, R.PREMUL_SUM if op == "PREMUL" else getattr(R, op), dtype) is not None:
            expected.add(coll)

    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):  # every rank calls in this order
        _reductions(r, note, dtype)
        _gathers(r, caps, expected, dtype)
        _reduce_scatters(r, note, dtype)
        _all_to_alls(r, note, dtype)
        _rooted_and_point_to_point(r, dtype)


def _reductions(r: Rank, note: Callable[[str, str, Any], None], dtype: Any) -> None:
    """all_reduce (every op, sync and async) and reduce to the last rank."""
    import torch.distributed as dist

    from portspeed.conformance.reference import reduce_op as rop, reference as ref

    shape, tag, is_int = (3, 5), str(dtype)[6:], not dtype.is_floating_point
    ops = ("SUM", "MAX", "MIN", "PRODUCT", "BAND", "BOR", "BXOR") if is_int else (
        "SUM", "AVG", "MAX", "MIN", "PRODUCT", "PREMUL")
    for op in ops:
        for async_op in (False, True) if op in ("SUM", "AVG") else (False,):
            with r.case(name := f"all_reduce {op} {tag} async={async_op}", "all_reduce", op, dtype):
                x = r.data(r.rank, shape, dtype)
                note("all_reduce", op, dtype)
                w = dist.all_reduce(x, op=rop(op), async_op=async_op)
                if async_op:
                    w.wait()
                r.check(name, x, ref(op, r.everyone(shape), dtype))
    for op in ("SUM", "MAX") + (() if is_int else ("AVG",)):
        with r.case(f"reduce {op} {tag}", "reduce", op, dtype):
            x = r.data(r.rank, shape, dtype)
            note("reduce", op, dtype)
            dist.reduce(x, dst=r.n - 1, op=rop(op))
            if r.rank == r.n - 1:  # non-dst contents are unspecified (Gloo uses them as scratch)
                r.check(f"reduce {op} {tag}", x, ref(op, r.everyone(shape), dtype))


def _gathers(r: Rank, caps: Any, expected: set[str], dtype: Any) -> None:
    """broadcast, all_gather, all_gather_into_tensor, and the output shapes NCCL takes for the last."""
    import torch
    import torch.distributed as dist

    n, rank, data, everyone, empty, check = r.n, r.rank, r.data, r.everyone, r.empty, r.check
    shape, full, tag = (3, 5), (n * 3, 5), str(dtype)[6:]
    with r.case(f"broadcast {tag}", "broadcast", None, dtype):
        x = data(rank, shape, dtype)
        dist.broadcast(x, src=1)
        check(f"broadcast {tag}", x, data(1, shape, dtype))
    with r.case(f"all_gather {tag}", "all_gather", None, dtype):
        outs = [empty(shape, dtype) for _ in range(n)]
        dist.all_gather(outs, data(rank, shape, dtype))
        check(f"all_gather {tag}", torch.stack([o.cpu() for o in outs]), everyone(shape).to(dtype))
    with r.case(f"all_gather_into_tensor {tag}", "all_gather_into_tensor", None, dtype):
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
        for form, ins, out_shape in (("flat", shape, (n * 15,)), ("stacked", shape, (n, *shape)), ("0-d", (), (n,))):
            for async_op in (False, True):
                with r.case(name := f"{fn_name} {form} output {tag} async={async_op}", "all_gather_into_tensor",
                            gaps.SHAPE, dtype):
                    out = empty(out_shape, dtype)
                    w = gather(out, data(rank, ins, dtype, salt=3), async_op=async_op)
                    if async_op:
                        w.wait()
                    check(name, out, everyone(ins, salt=3).to(dtype).reshape(out_shape))


def _reduce_scatters(r: Rank, note: Callable[[str, str, Any], None], dtype: Any) -> None:
    """reduce_scatter_tensor (and torch 2.13's reduce_scatter_single), reduce_scatter: every rank gives n chunks."""
    import torch.distributed as dist

    from portspeed.conformance.reference import reduce_op as rop, reference as ref

    n, rank, data, empty, check = r.n, r.rank, r.data, r.empty, r.check
    shape, full, tag = (3, 5), (n * 3, 5), str(dtype)[6:]
    for op in ("SUM", "MAX") + (() if not dtype.is_floating_point else ("AVG", "PREMUL")):
        want = ref(op, r.everyone(full), dtype)[rank * 3:(rank + 1) * 3]
        note("reduce_scatter_tensor", op, dtype)
        note("reduce_scatter", op, dtype)
        for async_op in (False, True) if op == "AVG" else (False,):
            with r.case(name := f"reduce_scatter_tensor {op} {tag} async={async_op}", "reduce_scatter_tensor", op,
                        dtype):
                out = empty(shape, dtype)
                w = dist.reduce_scatter_tensor(out, data(rank, full, dtype), op=rop(op), async_op=async_op)
                if async_op:
                    w.wait()
                check(name, out, want)
        if hasattr(dist, "reduce_scatter_single"):  # torch 2.13's name
            with r.case(f"reduce_scatter_single {op} {tag}", "reduce_scatter_tensor", op, dtype):
                out = empty(shape, dtype)
                dist.reduce_scatter_single(out, data(rank, full, dtype), op=rop(op))
                check(f"reduce_scatter_single {op} {tag}", out, want)
        with r.case(f"reduce_scatter {op} {tag}", "reduce_scatter", op, dtype):
            out = empty(shape, dtype)
            dist.reduce_scatter(out, list(data(rank, full, dtype).chunk(n)), op=rop(op))
            check(f"reduce_scatter {op} {tag}", out, want)


def _all_to_alls(r: Rank, note: Callable[[str, str, Any], None], dtype: Any) -> None:
    """all_to_all (a list) and all_to_all_single, even and uneven: rank r sends chunk j to rank j."""
    import torch
    import torch.distributed as dist

    n, rank, data, empty, check, tag = r.n, r.rank, r.data, r.empty, r.check, str(dtype)[6:]
    src = data(rank, (n * 2,), dtype, salt=rank)
    want = torch.cat([data(j, (n * 2,), dtype, salt=j).cpu()[rank * 2:rank * 2 + 2] for j in range(n)])
    note("all_to_all", "SUM", dtype)
    with r.case(f"all_to_all list {tag}", "all_to_all", None, dtype):
        outs = [empty(2, dtype) for _ in range(n)]
        dist.all_to_all(outs, list(src.chunk(n)), async_op=True).wait()
        check(f"all_to_all list {tag}", torch.cat([o.cpu() for o in outs]), want)
    with r.case(f"all_to_all_single even {tag}", "all_to_all_single", None, dtype):
        out = empty(n * 2, dtype)
        dist.all_to_all_single(out, src)
        check(f"all_to_all_single even {tag}", out, want)
    with r.case(f"all_to_all_single uneven {tag}", "all_to_all_single", None, dtype):  # rank r sends j+1 to rank j
        src = data(rank, (sum(j + 1 for j in range(n)),), dtype, salt=7)
        out = empty(n * (rank + 1), dtype)
        dist.all_to_all_single(out, src, [rank + 1] * n, [j + 1 for j in range(n)])
        start = sum(j + 1 for j in range(rank))
        want = torch.cat([data(j, (src.numel(),), dtype, salt=7).cpu()[start:start + rank + 1] for j in range(n)])
        check(f"all_to_all_single uneven {tag}", out, want)


def _rooted_and_point_to_point(r: Rank, dtype: Any) -> None:
    """gather and scatter at root 0; batch_isend_irecv and isend/recv around the ring (pipeline parallelism)."""
    import torch
    import torch.distributed as dist

    n, rank, data, empty, check = r.n, r.rank, r.data, r.empty, r.check
    shape, tag = (3, 5), str(dtype)[6:]
    with r.case(f"gather {tag}", "gather", None, dtype):
        gl = [empty(shape, dtype) for _ in range(n)] if rank == 0 else None
        dist.gather(data(rank, shape, dtype), gl, dst=0)
        if rank == 0:
            check(f"gather {tag}", torch.stack([g.cpu() for g in gl]), r.everyone(shape).to(dtype))
    with r.case(f"scatter {tag}", "scatter", None, dtype):
        out = empty(shape, dtype)
        dist.scatter(out, [data(j, shape, dtype, salt=1) for j in range(n)] if rank == 0 else None, src=0)
        check(f"scatter {tag}", out, data(rank, shape, dtype, salt=1))
    right, left = (rank + 1) % n, (rank - 1) % n
    with r.case(f"batch_isend_irecv {tag}", "batch_isend_irecv", None, dtype):
        got = empty(shape, dtype)
        for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, data(rank, shape, dtype), right),
                                           dist.P2POp(dist.irecv, got, left)]):
            req.wait()
        check(f"batch_isend_irecv {tag}", got, data(left, shape, dtype))
    with r.case(f"isend/recv {tag}", "isend/recv", None, dtype):
        got = empty(shape, dtype)
        s = dist.isend(data(rank, shape, dtype, salt=2), right)
        dist.recv(got, left)
        s.wait()
        check(f"isend/recv {tag}", got, data(left, shape, dtype, salt=2))


def as_megatron_does(r: Rank, caps: Any, expected: set[str], real: str) -> None:
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
