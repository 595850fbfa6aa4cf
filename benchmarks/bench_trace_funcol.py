"""A/B: a small functional all_reduce (``funcol.all_reduce(...)`` then its wait) with and without recording.

Why: ``portspeed.trace.funcol`` puts one frame in front of each functional collective and
of funcol's ``wait_tensor`` when ``PORTSPEED_TRACE`` is on; this is what that costs per call.

Arms, in one Gloo group, interleaved call by call with a rotating order: ``raw`` (torch's
``all_reduce`` and ``wait_tensor``), ``raw_again`` (the same: the method's noise floor) and
``recorded`` (both through portspeed's recording frames). Each call is ``all_reduce`` then the
wait on the result's tensor, as ``AsyncCollectiveTensor.wait()`` does. Printed: the medians,
the ratios, and the recording frame alone around a no-op (with and without the write-through
file). ``--diagnose`` adds arms with only the call, or only the wait, recorded.

    .venv/bin/python benchmarks/bench_trace_funcol.py --world 2 --bytes 4096
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time


def _worker(args: argparse.Namespace) -> None:
    os.environ["PORTSPEED_TRACE"] = str(args.trace)
    os.environ.setdefault("PORTSPEED_TRACE_DIR", tempfile.mkdtemp(prefix="bench-trace-funcol-"))
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from portspeed import config
    from portspeed.trace import funcol as trace_funcol
    from portspeed.trace import flight_recorder as trace

    config.reload()
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=120),
                            init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
    pg = dist.group.WORLD
    raw_ar, raw_wait = funcol.all_reduce, funcol.wait_tensor
    rec_ar = trace_funcol.traced("all_reduce")(raw_ar)
    rec_wait = trace_funcol.traced("wait_tensor")(raw_wait)
    assert rec_ar is not raw_ar and rec_wait is not raw_wait, "recording is off"
    t = torch.ones(args.bytes // 4, dtype=torch.float32)
    pairs = {"raw": (raw_ar, raw_wait), "raw_again": (raw_ar, raw_wait), "recorded": (rec_ar, rec_wait)}
    if args.diagnose:  # which frame costs what: the call recorded, its wait not (its entry then stays scheduled)
        pairs["recorded_call_raw_wait"] = (rec_ar, raw_wait)
        pairs["raw_call_recorded_wait"] = (raw_ar, rec_wait)
    for _ in range(args.warmup):
        for ar, wait in pairs.values():
            wait(ar(t, "sum", pg).elem)
    names = list(pairs)
    times: dict[str, list[float]] = {k: [] for k in names}
    clock = time.perf_counter
    for i in range(args.calls):
        k0 = i % len(names)
        for name in names[k0:] + names[:k0]:
            ar, wait = pairs[name]
            s0 = clock()
            wait(ar(t, "sum", pg).elem)
            times[name].append(clock() - s0)
    rec = trace.recorder()
    states = {e["state"] for e in rec.entries if e.get("ps_via")}
    frame_us: dict[str, float] = {}
    noop = trace_funcol.traced("all_reduce")(lambda x, op, group, tag="": x)  # completed at once: not an ACS
    for label in ("write_through", "memory_only"):
        start = clock()
        for _ in range(20000):
            noop(t, "sum", pg)
        frame_us[label] = round((clock() - start) / 20000 * 1e6, 3)
        rec._wt_fd = None
    dist.barrier()
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        print(json.dumps({
            "world": n, "bytes": args.bytes, "calls_per_arm": args.calls, "torch": torch.__version__,
            "median_us": {k: round(v * 1e6, 2) for k, v in med.items()},
            "ratio_recorded": round(med["recorded"] / med["raw"], 4),
            "other_ratios": {k: round(v / med["raw"], 4) for k, v in med.items()
                             if k.startswith(("recorded_", "raw_c"))},
            "control_ratio_raw_vs_raw": round(med["raw_again"] / med["raw"], 4),
            "recorded_minus_raw_us": round((med["recorded"] - med["raw"]) * 1e6, 2),
            "frame_alone_us": frame_us, "entry_states": sorted(states),
        }))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--bytes", type=int, default=4096, help="message size in bytes, float32 (default 4096)")
    p.add_argument("--calls", type=int, default=5000, help="timed calls per arm, interleaved (default 5000)")
    p.add_argument("--trace", type=int, default=2000, metavar="N", help="ring entries (default 2000)")
    p.add_argument("--diagnose", action="store_true", help="add arms with only the call or only the wait recorded")
    p.add_argument("--warmup", type=int, default=200, help="warm-up calls per arm (default 200)")
    p.add_argument("--timeout", type=float, default=600, help="seconds before the ranks are killed")
    args = p.parse_args(argv)
    if args.calls < 10 or args.bytes < 4 or args.bytes % 4 or args.trace < 1:
        p.error("--calls >= 10, --bytes a positive multiple of 4, --trace >= 1")
    if "RANK" in os.environ:
        _worker(args)
        return 0
    from portspeed.testing import print_rank0, run_ranks

    return print_rank0(run_ranks([__file__, *(argv if argv is not None else sys.argv[1:])], args.world,
                                 timeout=args.timeout))


if __name__ == "__main__":
    sys.exit(main())
