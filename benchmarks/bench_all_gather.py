"""A/B: all_gather_single / all_gather_into_tensor through portspeed's router vs raw torch.distributed, Gloo.

Why: Gloo's table lists the output-shape gap (each output chunk must be shaped as the
input), so on Gloo the router's hot path also compares the output's and the input's
trailing sizes on every all_gather, including the chunk-shaped calls it sends straight
through (Megatron's sequence-parallel and parameter all-gathers). This measures that
screen, and the rewrite a flat output gets (Megatron's ``gather_split_1d_tensor``).

Arms, interleaved call by call with a rotating order in one process group (the method of
``bench_allreduce.py``; ratios are median(arm) / median(raw)):

- ``raw``, ``raw_again``: torch's all_gather_single, unpatched, chunk-shaped output; the
  second is the control (the method's own noise floor);
- ``routed_chunk``: the routed call, chunk-shaped output: the screen's cost on Gloo;
- ``routed_flat``: the routed call with a flat output of a 2-d input: the rewrite
  (``view_output_as_chunks``);
- ``raw_view``: the raw call on a view made by hand: what the rewrite does, without the router;
- ``routed_old_name_chunk``: ``all_gather_into_tensor`` (torch 2.13 delegates it to
  all_gather_single), routed, chunk-shaped: what Megatron's calls pay (both names screen);
- ``raw_old_name``: the same, unpatched.

Also printed: the router's decision per call without any collective (a no-op stands in), on
Gloo's record and on a record without the shape gap (NCCL's), beside a bare no-op call.

    OMP_NUM_THREADS=1 python benchmarks/bench_all_gather.py --calls 5000
    OMP_NUM_THREADS=1 python benchmarks/bench_all_gather.py --calls 5000 --arms raw_again,routed_chunk
    OMP_NUM_THREADS=1 python benchmarks/bench_all_gather.py --decision-only
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import warnings
from typing import Any


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    import portspeed
    from portspeed.adapters.cpu import CpuAccelerator
    from portspeed.comm import router
    from portspeed.patches.torch_distributed import PATCHES

    warnings.simplefilter("ignore", FutureWarning)  # torch 2.13's all_gather_into_tensor is deprecated
    new_name = "all_gather_single" if hasattr(c10d, "all_gather_single") else "all_gather_into_tensor"
    portspeed.set_accelerator(CpuAccelerator())
    raw, raw_old = getattr(dist, new_name), dist.all_gather_into_tensor  # the originals, before patching
    manager = portspeed.PatchManager()
    manager.register(PATCHES)
    manager.apply()
    routed, routed_old = getattr(dist, new_name), dist.all_gather_into_tensor
    assert routed is not raw, "the router patch did not install"
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("nccl", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=120),
                            init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
    rows = args.bytes // 4 // 512
    x = torch.ones(rows, 512)
    chunk, flat = torch.empty(n * rows, 512), torch.empty(n * rows * 512)
    view = flat.view(n * rows, 512)
    arms = {
        "raw": lambda: raw(chunk, x),
        "raw_again": lambda: raw(chunk, x),
        "routed_chunk": lambda: routed(chunk, x),
        "routed_flat": lambda: routed(flat, x),
        "raw_view": lambda: raw(view, x),
        "routed_old_name_chunk": lambda: routed_old(chunk, x),
        "raw_old_name": lambda: raw_old(chunk, x),
    }
    if args.arms:
        arms = {k: arms[k] for k in ["raw", *(a for a in args.arms.split(",") if a != "raw")]}
    for _ in range(args.warmup):
        for fn in arms.values():
            fn()
    names = list(arms)
    times = _interleaved(arms, args.calls)
    seg, segments = args.calls // 5, 5

    def ratio(name: str, part: slice = slice(None)) -> float:
        return statistics.median(times[name][part]) / statistics.median(times["raw"][part])

    decision = _decision(new_name, n, chunk, x)
    dist.barrier()
    if rank == 0:
        print(json.dumps({
            "world": n, "bytes_per_rank": rows * 512 * 4, "calls_per_arm": args.calls,
            "median_us": {k: round(statistics.median(v) * 1e6, 2) for k, v in times.items()},
            "ratios_vs_raw": {k: round(ratio(k), 4) for k in names if k != "raw"},
            **({"routed_old_name_vs_raw_old_name": round(
                statistics.median(times["routed_old_name_chunk"]) / statistics.median(times["raw_old_name"]), 4)}
               if {"routed_old_name_chunk", "raw_old_name"} <= set(names) else {}),
            **({"routed_flat_vs_raw_view": round(
                statistics.median(times["routed_flat"]) / statistics.median(times["raw_view"]), 4)}
               if {"routed_flat", "raw_view"} <= set(names) else {}),
            "segment_ratios": {k: [round(ratio(k, slice(i * seg, (i + 1) * seg)), 4) for i in range(segments)]
                               for k in names if k.startswith("routed")},
            "router_decision": decision, "rewrites": router.stats(), "torch": torch.__version__,
            "load_average": os.getloadavg(),
        }))
    dist.destroy_process_group()
    manager.revert()



def _interleaved(arms: dict[str, Any], calls: int) -> dict[str, list[float]]:
    """Each arm's call times, interleaved call by call, rotating which arm goes first."""
    names = list(arms)
    times: dict[str, list[float]] = {k: [] for k in names}
    clock = time.perf_counter
    for i in range(calls):
        k0 = i % len(names)
        for name in names[k0:] + names[:k0]:
            fn = arms[name]
            s0 = clock()
            fn()
            times[name].append(clock() - s0)
    return times


def _decision(new_name: str, n: int, chunk: Any, x: Any) -> dict[str, float]:
    """The router's decision alone, warm: a no-op stands in for the collective (chunk-shaped call)."""
    import torch

    from portspeed import comm
    from portspeed.accelerator.capabilities import capabilities_for
    from portspeed.comm import router

    noop = lambda *a, **k: None  # noqa: E731
    screen = router.COLLECTIVE_ROUTES[new_name](noop)
    shapes = {"1-d": (torch.empty(n * 1024), torch.ones(1024)), "2-d": (chunk, x),
              "3-d": (torch.empty(n * 8, 2, 64), torch.ones(8, 2, 64))}  # chunk-shaped: straight

    def per_call_us(fn, out, inp) -> float:  # best of 5 rounds of 20,000 calls
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(20000):
                fn(out, inp)
            best = min(best, time.perf_counter() - start)
        return round(best / 20000 * 1e6, 3)

    decision = {"no_router_noop_us": per_call_us(noop, chunk, x)}
    decision.update({f"gloo_record_{k}_us": per_call_us(screen, *v) for k, v in shapes.items()})
    comm.use_capabilities(capabilities_for("nccl"))  # a record without the shape gap, as NCCL's
    decision["nccl_record_2-d_us"] = per_call_us(screen, chunk, x)
    return decision

def _decision_only() -> None:
    """The screens alone in this process (a 1-rank Gloo group; a no-op stands in for the collective)."""
    import timeit

    import torch
    import torch.distributed as dist

    import portspeed
    from portspeed import comm
    from portspeed.adapters.cpu import CpuAccelerator
    from portspeed.comm import router
    from portspeed.accelerator.capabilities import capabilities_for
    from portspeed.patches.torch_distributed import PATCHES

    portspeed.set_accelerator(CpuAccelerator())
    manager = portspeed.PatchManager()
    manager.register(PATCHES)
    manager.apply()
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    noop = lambda *a, **k: None  # noqa: E731
    name = "all_gather_single" if "all_gather_single" in router.COLLECTIVE_ROUTES else "all_gather_into_tensor"
    gather, reduce_ = router.COLLECTIVE_ROUTES[name](noop), router.COLLECTIVE_ROUTES["all_reduce"](noop)
    dist.all_reduce(torch.ones(1))  # fills the group's cache
    cases = {"1-d": (torch.empty(1024), torch.ones(1024)), "2-d": (torch.empty(2, 512), torch.ones(2, 512)),
             "3-d": (torch.empty(8, 2, 64), torch.ones(8, 2, 64))}

    def best_us(fn, *a) -> float:  # best of 9 rounds of 20,000 calls
        return round(min(timeit.repeat(lambda: fn(*a), number=20000, repeat=9)) / 20000 * 1e6, 3)

    out = {}
    for record in ("gloo", "nccl"):
        comm.use_capabilities(capabilities_for(record))
        out[record] = {"no_router_noop": best_us(noop, *cases["1-d"]),
                       "all_reduce_screen": best_us(reduce_, cases["1-d"][1]),
                       **{f"all_gather_{k}": best_us(gather, *v) for k, v in cases.items()}}
    print(json.dumps({"decision_us": out, "torch": torch.__version__, "load_average": os.getloadavg()}))
    dist.destroy_process_group()
    manager.revert()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--bytes", type=int, default=4096, help="input bytes per rank, float32, a multiple of 2048 "
                   "(rows of 512; default 4096)")
    p.add_argument("--calls", type=int, default=5000, help="timed calls per arm, interleaved (default 5000)")
    p.add_argument("--warmup", type=int, default=100, help="warm-up calls per arm (default 100)")
    p.add_argument("--arms", default="", help="comma-separated arms to run besides raw (default: all seven); "
                   "fewer arms, warmer caches: e.g. raw_again,routed_chunk")
    p.add_argument("--timeout", type=float, default=900, help="seconds before the ranks are killed")
    p.add_argument("--decision-only", action="store_true",
                   help="only time the router's screens in this process (no ranks, no collective)")
    args = p.parse_args(argv)
    if args.decision_only:
        _decision_only()
        return 0
    if args.calls < 10:
        p.error(f"--calls must be at least 10, got {args.calls}")
    known = {"raw", "raw_again", "routed_chunk", "routed_flat", "raw_view", "routed_old_name_chunk", "raw_old_name"}
    if args.arms and not set(args.arms.split(",")) <= known:
        p.error(f"--arms: unknown {sorted(set(args.arms.split(',')) - known)}; known: {', '.join(sorted(known))}")
    if args.bytes < 2048 or args.bytes % 2048:
        p.error(f"--bytes must be a positive multiple of 2048 (rows of 512 float32), got {args.bytes}")
    if "RANK" in os.environ:
        _worker(args)
        return 0
    from portspeed.testing import print_rank0, run_ranks

    return print_rank0(run_ranks([__file__, *(argv if argv is not None else sys.argv[1:])], args.world,
                                 timeout=args.timeout))


if __name__ == "__main__":
    sys.exit(main())
