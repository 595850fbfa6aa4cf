"""A/B: collectives on portspeed's staged backend vs the same collectives on Gloo, host tensors, 2 ranks.

Why: ``staged`` (portspeed/comm/staged.py) runs every collective on an inner Gloo group after copying the
device's tensors to the host. On host tensors there is no copy to make (a contiguous host tensor is used as it
is), so what this measures is the backend's own cost: a Python c10d group in front of Gloo (torch's dispatch
into Python, the options, a completed work). On a device the copies come on top (device to host and back,
which is the device's own copy speed). Also measured: the start check (portspeed/comm/ccl_check.py) on a
default group made on ``staged``: its first run (the inner Gloo group connects there) and a second.

Both arms run in one process, interleaved call by call, so machine noise hits them alike; figures are the
median per call over ``--iters`` calls after ``--warmup``.

    python benchmarks/bench_staged.py --world 2 --iters 200
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

SIZES = (1 << 10, 64 << 10, 1 << 20)  # float32 elements x 4 bytes: 4 KiB, 256 KiB, 4 MiB


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from portspeed.accelerator import set_accelerator
    from portspeed.adapters.cpu import CpuAccelerator
    from portspeed.comm import ccl_check, staged

    class StagedCpu(CpuAccelerator):
        name = "staged-cpu"
        backend = "staged"

    acc = StagedCpu()
    set_accelerator(acc)
    staged.register("cpu")
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), n, rank == 0,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("staged", store=store, rank=rank, world_size=n)
    check = []
    for _ in range(2):
        ccl_check.check_default_group(acc)
        check.append(ccl_check.last["seconds"])
    gloo = dist.new_group(backend="gloo")
    stg = dist.group.WORLD
    out: dict[str, object] = {"check_first_ms": check[0] * 1e3, "check_again_ms": check[1] * 1e3}
    for numel in SIZES:
        x = torch.ones(numel)
        gathered = torch.empty(n * numel)
        arms = {
            "all_reduce": lambda g: dist.all_reduce(x, group=g),
            "all_gather_into_tensor": lambda g: dist.all_gather_into_tensor(gathered, x, group=g),
            "broadcast": lambda g: dist.broadcast(x, src=0, group=g),
        }
        for name, call in arms.items():
            times: dict[str, list[float]] = {"gloo": [], "staged": []}
            for i in range(args.warmup + args.iters):
                order = (("gloo", gloo), ("staged", stg)) if i % 2 else (("staged", stg), ("gloo", gloo))
                for arm, g in order:
                    t0 = time.perf_counter()
                    call(g)
                    dt = time.perf_counter() - t0
                    if i >= args.warmup:
                        times[arm].append(dt)
            med = {a: statistics.median(v) * 1e6 for a, v in times.items()}
            out[f"{name} {numel * 4 // 1024} KiB"] = {"gloo_us": round(med["gloo"], 1),
                                                      "staged_us": round(med["staged"], 1),
                                                      "ratio": round(med["staged"] / med["gloo"], 3)}
    dist.barrier(group=gloo)
    dist.destroy_process_group()
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return 0
    from portspeed.testing import free_port

    port, procs = free_port(), []
    for rank in range(args.world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", "--iters", str(args.iters),
                                       "--warmup", str(args.warmup)], env=env, stdout=subprocess.PIPE, text=True))
    outs = [pr.communicate()[0] for pr in procs]
    if any(pr.returncode for pr in procs):
        print("a rank failed", file=sys.stderr)
        return 1
    res = json.loads(next(ln for ln in outs[0].splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    print(f"start check on staged (2 ranks): first {res.pop('check_first_ms'):.1f} ms (the inner Gloo group "
          f"connects), again {res.pop('check_again_ms'):.2f} ms")
    print(f"{'collective':<32}{'gloo us':>10}{'staged us':>11}{'ratio':>8}")
    for name, v in res.items():
        print(f"{name:<32}{v['gloo_us']:>10.1f}{v['staged_us']:>11.1f}{v['ratio']:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
