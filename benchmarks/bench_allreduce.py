"""A/B: a small all_reduce through portspeed's router vs raw torch.distributed, same Gloo group.

Why: the router sits in front of every all_reduce Megatron issues; on a backend that does
the call right it must cost next to nothing (goal: ratio <= 1.02 for 4 KB on 2 ranks).

Both arms run in one process group, interleaved call by call with a rotating order, so
machine noise hits every arm alike; the ratio is median(routed call) / median(raw call).
A second raw arm gives the control ratio (raw vs raw: the method's own noise floor), and
the ratio over five consecutive segments shows its spread. A blocked A/B (20 alternating
blocks per arm, ratio of the medians of block means) is printed too. Also printed: the
router's own decision cost per call, measured without any collective.

``--pin`` gives each rank one core of its own (rank modulo the cores it may use).
``--diagnose`` adds arms that put a do-nothing layer in front of the raw call (a plain
function, a wrapt FunctionWrapper, 3 µs of busy work): what any layer costs on this
ping-pong, as a yardstick for the routed arm; and torch's function without its
exception-logging layer, which the routed hot path calls in that layer's place.

    /work/venv/bin/python benchmarks/bench_allreduce.py --world 2 --bytes 4096
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import portspeed
    from portspeed.comm import router
    from portspeed.adapters.cpu import CpuAccelerator
    from portspeed.patches.torch_distributed import PATCHES

    portspeed.set_accelerator(CpuAccelerator())
    raw = dist.all_reduce  # the original, taken before patching
    manager = portspeed.PatchManager()
    manager.register(PATCHES)
    manager.apply()
    routed = dist.all_reduce
    assert routed is not raw, "the router patch did not install"
    recorded = None
    if args.trace:  # the same routed function with portspeed.trace.flight_recorder's recording frame in front (A/B arm)
        os.environ["PORTSPEED_TRACE"] = str(args.trace)
        from portspeed import config
        from portspeed.trace import wrappers as trace_wrappers

        config.reload()
        recorded = trace_wrappers.traced("all_reduce", router.COLLECTIVE_ROUTES["all_reduce"])(raw)
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.pin:  # before the group exists, so Gloo's threads inherit the core
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    dist.init_process_group("nccl", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=120),
                            init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
    t = torch.ones(args.bytes // 4, dtype=torch.float32)
    for _ in range(args.warmup):
        raw(t)
        routed(t)
    arms = _arms(raw, routed, recorded, args.diagnose)
    times = _interleaved(arms, t, args.calls)
    blocks, block = _blocked(arms, t, args.calls)
    overheads = _overheads(t, recorded is not None)
    dist.barrier()
    if rank == 0:
        segments = 5
        seg = args.calls // segments

        def ratio(name: str, part: slice = slice(None)) -> float:
            return statistics.median(times[name][part]) / statistics.median(times["raw"][part])

        print(json.dumps({
            "world": n, "bytes": args.bytes, "calls_per_arm": args.calls,
            "median_us": {k: round(statistics.median(v) * 1e6, 2) for k, v in times.items()},
            "ratio": round(ratio("routed"), 4),
            "control_ratio_raw_vs_raw": round(ratio("raw_again"), 4),
            "blocked_ratio": round(statistics.median(blocks["routed"]) / statistics.median(blocks["raw"]), 4),
            "blocked_calls_per_block": block,
            "segment_ratios": [round(ratio("routed", slice(k * seg, (k + 1) * seg)), 4) for k in range(segments)],
            "other_ratios": {k: round(ratio(k), 4) for k in arms if k not in ("raw", "raw_again", "routed")},
            **overheads, "rewrites": router.stats(), "torch": torch.__version__,
        }))
    dist.destroy_process_group()
    manager.revert()


def _arms(raw: Any, routed: Any, recorded: Any, diagnose: bool) -> dict[str, Any]:
    """The functions timed: raw (twice: the control), routed, recorded; with ``diagnose`` the do-nothing layers."""
    arms: dict[str, Any] = {"raw": raw, "raw_again": raw, "routed": routed}
    if recorded is not None:
        arms["routed_recorded"] = recorded
    if diagnose:  # what any layer in front of the call costs here (see the module docstring)
        import wrapt

        clock_ = time.perf_counter

        def spin3(x):  # 3 µs of work before the call
            end = clock_() + 3e-6
            while clock_() < end:
                pass
            return raw(x)

        arms["plain_passthrough"] = lambda *a, **k: raw(*a, **k)
        arms["wrapt_passthrough"] = wrapt.FunctionWrapper(raw, lambda w, i, a, k: w(*a, **k))
        arms["spin_3us_then_raw"] = spin3
        arms["torch_without_logging_layer"] = getattr(raw, "__wrapped__", raw)  # what the routed hot path calls
    return arms


def _interleaved(arms: dict[str, Any], t: Any, calls: int) -> dict[str, list[float]]:
    """Each arm's call times, interleaved call by call, rotating which arm goes first."""
    names = list(arms)
    times: dict[str, list[float]] = {k: [] for k in names}
    clock = time.perf_counter
    for i in range(calls):
        k0 = i % len(names)
        for name in names[k0:] + names[:k0]:
            fn = arms[name]
            s0 = clock()
            fn(t)
            times[name].append(clock() - s0)
    return times


def _blocked(arms: dict[str, Any], t: Any, calls: int) -> tuple[dict[str, list[float]], int]:
    """Blocked A/B: alternating blocks of calls (raw, routed, raw, ...), both ranks in step; the block means.

    Per-call interleaving alternates two code paths every call; blocks let each arm run as a
    training loop would.
    """
    import torch.distributed as dist

    clock = time.perf_counter
    blocks: dict[str, list[float]] = {"raw": [], "routed": []}
    block = max(10, calls // 20)
    for i in range(40):
        name = ("raw", "routed")[i % 2]
        fn = arms[name]
        dist.barrier()
        s0 = clock()
        for _ in range(block):
            fn(t)
        blocks[name].append((clock() - s0) / block)
    return blocks, block


def _overheads(t: Any, recording: bool) -> dict[str, Any]:
    """The router's decision alone (a no-op stands in for the collective) and, when recording, the recorder alone
    (its frame around a no-op, with and without write-through)."""
    from portspeed.comm import router

    noop = lambda *a, **k: None  # noqa: E731
    start = time.perf_counter()
    for _ in range(20000):
        router.all_reduce(noop, t)
    decision_us = (time.perf_counter() - start) / 20000 * 1e6
    recording_us: dict[str, float] = {}
    if recording:
        from portspeed.trace import wrappers as trace_wrappers
        from portspeed.trace import flight_recorder as trace

        rec_noop = trace_wrappers.traced("all_reduce")(noop)
        for label in ("write_through", "memory_only"):
            start = time.perf_counter()
            for _ in range(20000):
                rec_noop(t)
            recording_us[label] = round((time.perf_counter() - start) / 20000 * 1e6, 3)
            trace.recorder()._wt_fd = None
    return {"router_decision_us": round(decision_us, 3), "recording_us": recording_us}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--bytes", type=int, default=4096, help="message size in bytes, float32 (default 4096)")
    p.add_argument("--calls", type=int, default=10000, help="timed calls per arm, interleaved (default 10000)")
    p.add_argument("--diagnose", action="store_true",
                   help="add arms that put a do-nothing layer before the raw call (plain function, wrapt, 3 us spin)")
    p.add_argument("--trace", type=int, default=0, metavar="N",
                   help="add an arm: the routed all_reduce recorded by the flight recorder "
                        "(portspeed.trace.flight_recorder; ring of N entries)")
    p.add_argument("--pin", action="store_true", help="pin each rank (and its Gloo threads) to one core of its own")
    p.add_argument("--warmup", type=int, default=200, help="warm-up calls per arm (default 200)")
    p.add_argument("--timeout", type=float, default=600, help="seconds before the ranks are killed")
    args = p.parse_args(argv)
    if args.calls < 10:
        p.error(f"--calls must be at least 10, got {args.calls}")
    if args.bytes < 4 or args.bytes % 4:
        p.error(f"--bytes must be a positive multiple of 4 (float32 elements), got {args.bytes}")
    if "RANK" in os.environ:
        _worker(args)
        return 0
    from portspeed.testing import print_rank0, run_ranks

    return print_rank0(run_ranks([__file__, *(argv if argv is not None else sys.argv[1:])], args.world,
                                 timeout=args.timeout))


if __name__ == "__main__":
    sys.exit(main())
