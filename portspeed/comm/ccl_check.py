"""The start check: a wrong collective library stops the job when its default group is made, not hours later.

Why: a CCL that returns at once having moved nothing (or the wrong data) raises nothing; the job trains, the
ranks drift apart, and the loss says so hours later, if at all. Each collective the frameworks use is checked
once, on tiny tensors of the adapter's device, right after ``init_process_group`` made the default group
(``groups.wrap_init_process_group``): milliseconds, next to seconds of group creation.

Contract
- ``check_default_group(acc)``: on the default group, if it has two or more ranks, runs on float32 tensors of
  ``acc.device()``: all_reduce SUM, broadcast (root 0), all_gather_into_tensor, reduce_scatter_tensor SUM,
  all_to_all_single, send/recv around the ring; then all_reduce MAX, and all_reduce, all_gather_into_tensor and
  reduce_scatter_tensor in bfloat16 (a bf16 model's gradients and parameters), unless the adapter's
  ``backend_gaps`` declares that dtype or op missing or wrong there (the router rewrites those); one of these that
  raises is left to say so when the job uses it (only a silent wrong value stops the job here). Inputs are small
  integers that differ by rank, outputs start at -1, so a CCL that moves nothing is seen on every rank. The
  calls go to the group object itself (not through ``torch.distributed``'s functions): the router's counters, the
  flight recorder and the NaN check see nothing of them.
- The verdict is exchanged on the group's store (not on the CCL under test): every rank waits for every other,
  then every rank raises the same ``CclCheckError``, one line naming the collective, the rank, what it got and
  wanted, and the line to paste into the adapter (``backend = "staged"`` when every collective was wrong,
  ``staged_collectives = (...)`` naming the wrong ones otherwise).
- Skipped: the adapter declares ``ccl_verified = True``; ``PORTSPEED_CCL_CHECK=0``; the group runs on Gloo or
  MPI (torch's own host libraries; Gloo's differences are in the router's tables) or ``fake``; one rank.

Limits: float32, and bfloat16 for the three collectives that carry a bf16 model's tensors; SUM, and MAX for
all_reduce (other dtypes and ops are the router's, declared in ``backend_gaps``, or conformance's); a CCL
that hangs hangs here (at the group's timeout), which is at least at the start; sub-groups are not checked.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions
from torch.distributed import distributed_c10d as c10d

from portspeed.errors import CclCheckError

__all__ = ["CHECKED", "check_default_group"]

log = logging.getLogger("portspeed.comm.ccl_check")

#: the collectives checked, as ``staged_collectives`` names them
CHECKED = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
           "send_recv")
#: backends not checked: torch's own host libraries (Gloo; MPI, which frameworks use for host-side discovery), and
#: the fake backend (which moves nothing by design)
UNCHECKED = frozenset({"gloo", "mpi", "fake"})

_count = itertools.count()  # the check's keys on the store, per default group made in this process
#: the last check's figures (seconds, backend, result), for tests and the benchmark
last: dict[str, Any] = {}


Case = tuple[str, str, Callable[[], torch.Tensor], torch.Tensor]
#: the cases beyond float32 SUM: (collective, reduce op or None, dtype), left out where the adapter's table (its
#: ``backend_gaps``, the built-in defaults) has a gap for them: the router rewrites those calls
_BEYOND = {"all_reduce MAX": ("all_reduce", dist.ReduceOp.MAX, torch.float32),
           "all_reduce bfloat16": ("all_reduce", dist.ReduceOp.SUM, torch.bfloat16),
           "all_gather_into_tensor bfloat16": ("all_gather_into_tensor", None, torch.bfloat16),
           "reduce_scatter_tensor bfloat16": ("reduce_scatter_tensor", dist.ReduceOp.SUM, torch.bfloat16)}


def _cases(pg: Any, dev: torch.device, r: int, n: int) -> list[Case]:
    """``(collective as staged_collectives names it, what is checked, run -> the output on the host, expected)``
    for rank ``r`` of ``n``: each collective in float32, and those the frameworks also run in bfloat16 (gradients
    and parameters of a bf16 model: all_reduce, all_gather, reduce_scatter) again in it; all_reduce also with MAX
    (Megatron's found-inf, DeepSpeed's overflow). The values are small integers: exact in bfloat16."""
    f32, bf16 = torch.float32, torch.bfloat16
    ramp = torch.arange(1, 5, dtype=f32)

    def on(t: torch.Tensor, dtype: torch.dtype = f32) -> torch.Tensor:
        return t.to(device=dev, dtype=dtype)

    def all_reduce(dtype: torch.dtype, op: Any = dist.ReduceOp.SUM) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            x = on(ramp * (r + 1), dtype)
            opts = dist.AllreduceOptions()
            opts.reduceOp = op
            pg.allreduce([x], opts).wait()
            return x.float().cpu()
        return run

    def broadcast() -> torch.Tensor:
        x = on(ramp * (r + 1))
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        pg.broadcast([x], opts).wait()
        return x.cpu()

    def all_gather(dtype: torch.dtype) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            out = on(torch.full((2 * n,), -1.0), dtype)
            pg._allgather_base(out, on(torch.full((2,), float(r + 1)), dtype), AllgatherOptions()).wait()
            return out.float().cpu()
        return run

    def reduce_scatter(dtype: torch.dtype) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            out = on(torch.full((2,), -1.0), dtype)
            pg._reduce_scatter_base(out, on(torch.arange(1, 2 * n + 1, dtype=f32) * (r + 1), dtype),
                                    dist.ReduceScatterOptions()).wait()
            return out.float().cpu()
        return run

    def all_to_all() -> torch.Tensor:
        out = on(torch.full((n,), -1.0))
        pg.alltoall_base(out, on(torch.arange(n, dtype=f32) + 100 * r), [], [], dist.AllToAllOptions()).wait()
        return out.cpu()

    def send_recv() -> torch.Tensor:
        got = on(torch.full((2,), -1.0))
        s = pg.send([on(torch.full((2,), float(r + 1)))], (r + 1) % n, 0)
        pg.recv([got], (r - 1) % n, 0).wait()
        s.wait()
        return got.cpu()

    total = n * (n + 1) / 2  # the sum of (rank + 1) over the ranks
    gathered = torch.arange(1, n + 1, dtype=f32).repeat_interleave(2)
    scattered = torch.arange(2 * r + 1, 2 * r + 3, dtype=f32) * total
    return [
        ("all_reduce", "all_reduce", all_reduce(f32), ramp * total),
        ("broadcast", "broadcast", broadcast, ramp),
        ("all_gather_into_tensor", "all_gather_into_tensor", all_gather(f32), gathered),
        ("reduce_scatter_tensor", "reduce_scatter_tensor", reduce_scatter(f32), scattered),
        ("all_to_all_single", "all_to_all_single", all_to_all, torch.arange(n, dtype=f32) * 100 + r),
        ("send_recv", "send_recv", send_recv, torch.full((2,), float((r - 1) % n + 1))),
        ("all_reduce", "all_reduce MAX", all_reduce(f32, dist.ReduceOp.MAX), ramp * n),
        ("all_reduce", "all_reduce bfloat16", all_reduce(bf16), ramp * total),
        ("all_gather_into_tensor", "all_gather_into_tensor bfloat16", all_gather(bf16), gathered),
        ("reduce_scatter_tensor", "reduce_scatter_tensor bfloat16", reduce_scatter(bf16), scattered),
    ]


def _values(t: torch.Tensor) -> str:
    v = t.tolist()
    return "[" + ", ".join(f"{x:g}" for x in v[:8]) + (", ...]" if len(v) > 8 else "]")


def _backend_on(real: str, device_type: str) -> str:
    """The backend of ``real`` ('testccl', or 'cpu:gloo,testdev:testccl') that serves ``device_type``."""
    if ":" not in real:
        return real
    pairs = dict(p.strip().split(":", 1) for p in real.split(","))
    return pairs.get(device_type, pairs.get("cpu", real))


def check_default_group(acc: Any) -> None:
    """Check the default group's collectives (see the module docstring); raise CclCheckError if one is wrong."""
    from portspeed import config
    from portspeed.accelerator.declarations import STAGED_BACKEND, groups_backend

    if getattr(acc, "ccl_verified", False) or not config.settings().ccl_check:
        return
    pg = c10d._get_default_group()
    n, r = pg.size(), pg.rank()
    entry = c10d._world.pg_map.get(pg)
    if n < 2 or entry is None:
        return
    backend = _backend_on(str(entry[0]), acc.device_type).lower()
    if backend in UNCHECKED:
        return
    started = time.perf_counter()
    dev = acc.device()
    wrong: list[tuple[str, str]] = []
    caps = acc.capabilities()
    for name, what, run, want in _cases(pg, dev, r, n):
        if what in _BEYOND and caps.gap(*_BEYOND[what]) is not None:
            continue
        try:
            got = run()
        except Exception as exc:  # noqa: BLE001 - a collective that raises is as wrong as one that lies
            if what in _BEYOND:  # a dtype or op the library refuses says so when used: only a silent lie counts
                log.debug("portspeed: start check: %s raised %s (an undeclared gap, not a silent one)", what, exc)
                continue
            first = str(exc).splitlines()[0][:200] if str(exc) else ""
            wrong.append((name, f"{what}: rank {r} raised {type(exc).__name__}: {first}"))
            continue
        if not torch.equal(got, want):
            wrong.append((name, f"{what}: rank {r} got {_values(got)}, want {_values(want)}"))
    store, key = entry[1], f"portspeed-ccl-check/{next(_count)}/"
    if wrong:
        store.set(key + "first", wrong[0][1])
        for name, _ in wrong:
            store.add(key + "wrong/" + name, 1)
    if store.add(key + "arrived", 1) == n:
        store.set(key + "all", "1")
    store.wait([key + "all"])
    bad = [name for name in CHECKED if store.check([key + "wrong/" + name])]
    last.update(seconds=time.perf_counter() - started, backend=backend, wrong=bad)
    if not bad:
        log.info("portspeed: the collectives of %r (%d ranks) checked at start in %.1f ms", backend, n,
                 last["seconds"] * 1e3)
        return
    first = store.get(key + "first").decode()
    if len(bad) == len(CHECKED):
        line = f'backend = "{STAGED_BACKEND}"'
    else:
        staged = tuple(dict.fromkeys(tuple(acc.staged_collectives) + tuple(bad)))
        line = f"staged_collectives = {staged!r}"
    on = groups_backend(acc)
    raise CclCheckError(
        f"portspeed: the collective library {on!r} of adapter {acc.name!r} is wrong, found when the default group "
        f"was made ({n} ranks): {first} (wrong: {', '.join(bad)}); paste into the adapter class "
        f"{type(acc).__name__}: {line} (those collectives then run through the host on Gloo: portspeed.comm.staged; "
        "`portspeed conformance --suites collectives` checks every one), or fix the library")
