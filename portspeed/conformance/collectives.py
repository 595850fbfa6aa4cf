"""Collective checks of the conformance kit: every collective Megatron and DeepSpeed use, on device tensors.

Each rank (a real process; ``run_collective_checks`` starts them on 127.0.0.1) creates the
default group with ``"nccl"`` requested, as Megatron does, through portspeed's router, and
runs each collective on tensors on the adapter's device. Inputs are small integers, so the
reference (a float64 computation over all ranks' inputs in one process, cast to the dtype)
is exact and results are compared with ``torch.equal`` after ``.cpu()``. Collectives the
adapter declares its backend lacks are rewritten by the router and must still be exact.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from typing import Any

from portspeed.conformance.report import Report

__all__ = ["rank_main", "run_collective_checks"]

SUITE = "collectives"


def rank_main() -> int:  # noqa: C901 - one list of checks, read top to bottom
    """One rank's checks; prints ``RESULTS <json>`` (run by ``run_collective_checks``)."""
    import torch
    import torch.distributed as dist

    import portspeed
    from portspeed.comm import router
    from portspeed.patches.torch_distributed import PATCHES

    from portspeed.conformance.reference import all_values as everyone_n, reduce_op as rop, reference as ref, values as host

    acc = portspeed.get_accelerator()
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    acc.set_device(rank)
    dev = acc.device()
    manager = portspeed.PatchManager()
    manager.register(PATCHES)
    manager.apply()
    dist.init_process_group(backend="nccl", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=120))
    results: list[dict[str, Any]] = []
    R = dist.ReduceOp

    def everyone(shape: tuple, salt: int = 0) -> Any:
        return everyone_n(n, shape, salt)

    def check(name: str, got: Any, want: Any) -> None:
        got = got.cpu() if isinstance(got, torch.Tensor) else got
        if isinstance(got, torch.Tensor):
            ok = got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
            detail = "" if ok else f"got {got.flatten()[:6].tolist()} want {want.flatten()[:6].tolist()} ({got.dtype})"
        else:
            ok, detail = got == want, f"got {got!r} want {want!r}"
        results.append({"check": name, "ok": bool(ok), "detail": detail})

    def data(r: int, shape: tuple, dtype: Any, salt: int = 0) -> Any:
        return host(r, shape, dtype, salt).to(dev)

    shape, full = (3, 4), (n * 3, 4)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        tag = str(dtype)[6:]
        ops = ("SUM", "MAX") if not dtype.is_floating_point else ("SUM", "AVG", "MAX", "PREMUL")
        for op in ops:
            x = data(rank, shape, dtype)
            dist.all_reduce(x, op=rop(op))
            check(f"all_reduce {op} {tag}", x, ref(op, everyone(shape), dtype))
            out = torch.empty(shape, dtype=dtype, device=dev)
            dist.reduce_scatter_tensor(out, data(rank, full, dtype), op=rop(op))
            check(f"reduce_scatter_tensor {op} {tag}", out, ref(op, everyone(full), dtype)[rank * 3:rank * 3 + 3])
        x = data(rank, shape, dtype)
        dist.broadcast(x, src=n - 1)
        check(f"broadcast {tag}", x, host(n - 1, shape, dtype))
        out = torch.empty(full, dtype=dtype, device=dev)
        dist.all_gather_into_tensor(out, data(rank, shape, dtype))
        check(f"all_gather_into_tensor {tag}", out, everyone(shape).to(dtype).reshape(full))
        outs = [torch.empty(shape, dtype=dtype, device=dev) for _ in range(n)]
        dist.all_gather(outs, data(rank, shape, dtype))
        check(f"all_gather {tag}", torch.stack([o.cpu() for o in outs]), everyone(shape).to(dtype))
        src = data(rank, (n * 2,), dtype, salt=rank)
        out = torch.empty(n * 2, dtype=dtype, device=dev)
        dist.all_to_all_single(out, src)
        want = torch.cat([host(j, (n * 2,), dtype, salt=j)[rank * 2:rank * 2 + 2] for j in range(n)])
        check(f"all_to_all_single {tag}", out, want)
        right, left = (rank + 1) % n, (rank - 1) % n
        got = torch.empty(shape, dtype=dtype, device=dev)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, data(rank, shape, dtype), right),
                                         dist.P2POp(dist.irecv, got, left)]):
            w.wait()
        check(f"batch_isend_irecv {tag}", got, host(left, shape, dtype))

    from torch.distributed.distributed_c10d import _coalescing_manager

    bufs = [data(rank, (n * 2,), torch.float32, salt=k) for k in range(3)]
    outs = [torch.empty(2, device=dev) for _ in bufs]
    with _coalescing_manager(dist.group.WORLD, async_ops=True) as cm:  # Megatron's gradient reduce-scatter
        for o, b in zip(outs, bufs):
            dist.reduce_scatter_tensor(o, b, op=R.AVG)
    cm.wait()
    for k, o in enumerate(outs):
        check(f"coalesced reduce_scatter_tensor AVG #{k}", o,
              ref("AVG", everyone((n * 2,), salt=k), torch.float32)[rank * 2:rank * 2 + 2])
    x = data(rank, (4,), torch.float32)
    w = dist.all_reduce(x, async_op=True)
    w.wait()
    check("async all_reduce lands by wait()", x, ref("SUM", everyone((4,)), torch.float32))
    check("get_backend reports the requested name", dist.get_backend(), "nccl")
    dist.barrier()
    dist.destroy_process_group()
    manager.revert()
    print("RESULTS " + json.dumps({"rank": rank, "results": results, "rewrites": router.stats()}), flush=True)
    return 0


def run_collective_checks(adapter: str, report: Report, nproc: int = 2, timeout: float = 300) -> None:
    """Start ``nproc`` ranks on 127.0.0.1 with ``PORTSPEED_ACCELERATOR=adapter``; add their checks to ``report``."""
    from portspeed.testing import run_ranks

    res = run_ranks(["-m", "portspeed.conformance.collectives"], nproc, timeout=timeout,
                    env={"PORTSPEED_ACCELERATOR": adapter})
    seen: dict[str, list[str]] = {}
    for r in res:
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULTS ")]
        if r.returncode != 0 or not line:
            report.add(SUITE, f"rank {r.rank} ran to the end", False,
                       f"exit {r.returncode}: {(r.stderr or r.stdout)[-1500:]}")
            continue
        for c in json.loads(line[-1][len("RESULTS "):])["results"]:
            seen.setdefault(c["check"], [])
            if not c["ok"]:
                seen[c["check"]].append(f"rank {r.rank}: {c['detail']}")
    for name, problems in seen.items():
        report.add(SUITE, name, not problems, "; ".join(problems))


if __name__ == "__main__":
    sys.exit(rank_main())
