"""Planted faults for tests/test_trace.py, run under `portspeed run` with 2 ranks on CPU/Gloo: MODE = argv[1].

none: no fault. skip: rank 1 skips its 3rd all_reduce. shape: an all_gather whose input has another shape on
rank 1. op: rank 0 all_reduce, rank 1 all_gather at the same point. p2p: rank 0 sends twice, rank 1 receives
once (a pipeline stage that never posts its second recv). straggler: rank 1 sleeps 3 s before its 3rd
all_reduce. abort: rank 0 dies of SIGABRT after the loop; rank 1's last all_reduce then raises. A rank done with
its collectives sleeps so its peer waits: `--hang-timeout` ends the job. `site:` lines: what `why-hung` must name.
"""
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import portspeed

mode = sys.argv[1]
acc = portspeed.get_accelerator()  # the CPU adapter, or the test device (one device per rank)
acc.set_device(int(os.environ["LOCAL_RANK"]))
dev = acc.device()
dist.init_process_group(os.environ.get("PLANT_BACKEND", "nccl"), timeout=datetime.timedelta(seconds=600))  # > any test
rank = dist.get_rank()
t = torch.ones(4, device=dev)
for i in range(4):
    if mode == "skip" and rank == 1 and i == 2:
        continue
    if mode == "straggler" and rank == 1 and i == 2:
        time.sleep(3)
    dist.all_reduce(t)  # site: loop
if mode == "shape":
    mine = torch.ones(3 if rank == 1 else 4, device=dev)
    dist.all_gather_into_tensor(torch.empty(8, device=dev), mine)  # site: gather
if mode == "op":
    if rank == 0:
        dist.all_reduce(t)  # site: op-reduce
    else:
        dist.all_gather_into_tensor(torch.empty(8, device=dev), t)  # site: op-gather
if mode in ("p2p", "abort") and rank == 0:  # abort: a rank killed in C++ (no Python left to dump) after the loop
    os.abort() if mode == "abort" else dist.send(t, 1)
    dist.send(torch.ones(8, device=dev), 1)  # site: send
elif mode in ("p2p", "abort"):
    dist.recv(t, 0) if mode == "p2p" else time.sleep(1)  # abort: rank 1's last all_reduce then raises, its peer gone
# the two sites above and below stay on lines 31 and 45: tests/data/nccl_dump_h200 (a real NCCL dump) holds them
dist.all_reduce(t)  # site: last
if mode != "none" and mode != "straggler":
    time.sleep(300)
print(f"rank {rank} sum {t.sum().item()}", flush=True)
dist.destroy_process_group()
