"""A/B: what flight recording costs a small all_reduce on torch >= 2.15, torch's recorder and portspeed's together.

Why: torch 2.15 records by itself, by default: Gloo its collectives, and every C++ backend that does
not record itself (testccl, a vendor's C++ CCL) through the FlightRecorderHook it attaches to each
new group (buffer 2000). So a run without PORTSPEED_TRACE now pays torch's recording on a custom
backend, and a run with it pays portspeed's recording frame, which on these groups keeps only its
write-through line, sequence number and in-flight mark (the entry is torch's: no call is recorded
twice, ``portspeed.trace.torch_recorder``).

``--backend testdev`` (the test device's testccl, 2 ranks): two groups of the same ranks, interleaved
call by call with a rotating order: the default group with torch's hook attached, and a second one
whose hook is removed (``FlightRecorderHook.remove``, what ``TORCH_FR_BUFFER_SIZE=0`` gives). On each:
the raw call, the routed call (portspeed's router), and the routed call recorded by portspeed
(``PORTSPEED_TRACE``, ring ``--trace``). Ratios: torch's hook = raw hooked / raw unhooked; portspeed's
recording = recorded / routed on each group (on the unhooked group portspeed keeps the whole entry, as
on torch <= 2.14).

``--backend gloo``: Gloo's own recording cannot be switched per group (its buffer is sized once per
process), so the arms are raw, routed and recorded on one group; run it with and without
``TORCH_FR_BUFFER_SIZE=0`` (``--torch-fr 0``) for Gloo's own recording, paired runs, same machine.

    OMP_NUM_THREADS=1 python benchmarks/bench_trace_torch.py --backend testdev --calls 3000
    OMP_NUM_THREADS=1 python benchmarks/bench_trace_torch.py --backend gloo --calls 3000 [--torch-fr 0]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    import portspeed
    from portspeed import config
    from portspeed.comm import router
    from portspeed.trace import wrappers as trace_wrappers
    from portspeed.trace import torch_recorder as trace_torch
    from portspeed.trace import flight_recorder as trace
    from portspeed.patches.torch_distributed import PATCHES

    if not trace_torch.records_itself():
        raise SystemExit(f"bench_trace_torch: torch {torch.__version__} has no FlightRecorderHook (needs >= 2.15)")
    config.reload()
    acc = portspeed.get_accelerator()
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    acc.set_device(rank)
    raw = dist.all_reduce  # the original, taken before patching
    manager = portspeed.PatchManager()
    manager.register(PATCHES)
    manager.apply()
    routed = router.COLLECTIVE_ROUTES["all_reduce"](raw)
    recorded = trace_wrappers.traced("all_reduce", router.COLLECTIVE_ROUTES["all_reduce"])(raw)
    dist.init_process_group("nccl", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=120),
                            init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
    groups = {"": None}
    if args.backend == "testdev":
        other = dist.new_group(list(range(n)))
        hooks = c10d._world.pg_flight_recorder_hooks
        assert c10d.GroupMember.WORLD in hooks and other in hooks, "torch attached no FlightRecorderHook"
        hooks.pop(other).remove()  # the second group: the same backend and ranks, torch's hook off
        groups = {"hooked_": None, "unhooked_": other}
    t = torch.ones(args.bytes // 4, dtype=torch.float32, device=acc.device())
    arms = {}
    for tag, g in groups.items():
        arms[f"{tag}raw"] = lambda fn=raw, g=g: fn(t, group=g)
        arms[f"{tag}routed"] = lambda fn=routed, g=g: fn(t, group=g)
        arms[f"{tag}recorded"] = lambda fn=recorded, g=g: fn(t, group=g)
    for _ in range(args.warmup):
        for fn in arms.values():
            fn()
    names = list(arms)
    times: dict[str, list[float]] = {k: [] for k in names}
    clock = time.perf_counter
    for i in range(args.calls):  # interleave call by call, rotating which arm goes first
        k0 = i % len(names)
        for name in names[k0:] + names[:k0]:
            s0 = clock()
            arms[name]()
            times[name].append(clock() - s0)
    med = {k: statistics.median(v) for k, v in times.items()}
    rec = trace.recorder()
    entries = len(rec.entries) if rec is not None else 0
    ratios = {}
    for tag in groups:
        ratios[f"{tag}recorded/{tag}routed"] = round(med[f"{tag}recorded"] / med[f"{tag}routed"], 4)
        ratios[f"{tag}routed/{tag}raw"] = round(med[f"{tag}routed"] / med[f"{tag}raw"], 4)
    if args.backend == "testdev":
        ratios["hooked_raw/unhooked_raw"] = round(med["hooked_raw"] / med["unhooked_raw"], 4)
        ratios["hooked_recorded/unhooked_raw"] = round(med["hooked_recorded"] / med["unhooked_raw"], 4)
    dist.barrier()
    if rank == 0:
        print(json.dumps({
            "backend": args.backend, "world": n, "bytes": args.bytes, "calls_per_arm": args.calls,
            "TORCH_FR_BUFFER_SIZE": os.environ.get("TORCH_FR_BUFFER_SIZE"), "PORTSPEED_TRACE": args.trace,
            "median_us": {k: round(v * 1e6, 2) for k, v in med.items()}, "ratios": ratios,
            "portspeed_entries_kept": entries, "torch": torch.__version__,
        }))
    dist.destroy_process_group()
    manager.revert()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("gloo", "testdev"), default="testdev",
                   help="gloo (the CPU adapter) or testdev (the test device's testccl); default testdev")
    p.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--bytes", type=int, default=4096, help="message size in bytes, float32 (default 4096)")
    p.add_argument("--calls", type=int, default=3000, help="timed calls per arm, interleaved (default 3000)")
    p.add_argument("--trace", type=int, default=2000, metavar="N",
                   help="portspeed's ring (PORTSPEED_TRACE, default 2000)")
    p.add_argument("--torch-fr", type=int, default=None, metavar="N",
                   help="set TORCH_FR_BUFFER_SIZE=N for the run (0: torch's own recording off)")
    p.add_argument("--warmup", type=int, default=200, help="warm-up calls per arm (default 200)")
    p.add_argument("--timeout", type=float, default=900, help="seconds before the ranks are killed")
    args = p.parse_args(argv)
    if args.calls < 10 or args.trace < 1:
        p.error(f"--calls must be at least 10 and --trace at least 1, got {args.calls} and {args.trace}")
    if args.bytes < 4 or args.bytes % 4:
        p.error(f"--bytes must be a positive multiple of 4 (float32 elements), got {args.bytes}")
    if "RANK" in os.environ:
        _worker(args)
        return 0
    os.environ["PORTSPEED_ACCELERATOR"] = "testdev" if args.backend == "testdev" else "cpu"
    os.environ["PORTSPEED_TRACE"] = str(args.trace)
    if args.torch_fr is not None:
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(args.torch_fr)
    from portspeed.testing import print_rank0, run_ranks

    return print_rank0(run_ranks([__file__, *(argv if argv is not None else sys.argv[1:])], args.world,
                                 timeout=args.timeout))


if __name__ == "__main__":
    sys.exit(main())
