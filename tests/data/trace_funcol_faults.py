"""Planted faults in torch's functional collectives for tests/test_trace_funcol.py: 2 ranks, CPU/Gloo, MODE = argv[1].

none: four functional all_reduces, one torch.distributed all_reduce on the same group, then one DTensor
redistribute (Shard(0) -> Replicate() on a 1-D mesh); prints each rank's sums. skip: rank 1 skips its 3rd
functional all_reduce, so its torch.distributed all_reduce pairs with rank 0's 4th functional one (Gloo
pairs them silently), and rank 0's last call waits forever: `--hang-timeout` ends the job. The lines marked
`site:` are what the test expects the dumps and `why-hung` to name.
"""
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import portspeed

mode = sys.argv[1]
portspeed.get_accelerator().set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=600))  # longer than any test: the watchdog ends it
rank = dist.get_rank()
group = dist.group.WORLD
t = torch.ones(4)
for i in range(4):
    if mode == "skip" and rank == 1 and i == 2:
        continue
    t = funcol.all_reduce(t, "sum", group).wait()  # site: funcol
dist.all_reduce(t)  # site: c10d
if mode == "skip":
    time.sleep(300)
print(f"rank {rank} sum {t.sum().item()}", flush=True)

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402

mesh = init_device_mesh("cpu", (2,))
shard = DTensor.from_local(torch.arange(4.0) + 4 * rank, mesh, [Shard(0)], run_check=False)
full = shard.redistribute(mesh, [Replicate()]).to_local()  # site: dtensor
print(f"rank {rank} dtensor {full.tolist()}", flush=True)
dist.destroy_process_group()
