"""For tests/test_trace.py: rank 1 leaves between two testccl all_reduces; rank 0's second one fails ("Connection
closed by peer"). On torch >= 2.15 testccl's abort hooks make torch's FlightRecorderHook dump its buffer then
(TORCH_FR_DUMP_TEMP_FILE); rank 0 prints what it got and exits 0."""
import os
import time

import torch
import torch.distributed as dist

import portspeed

acc = portspeed.get_accelerator()
acc.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
rank = dist.get_rank()
t = torch.ones(4, device=acc.device())
dist.all_reduce(t)
if rank == 1:
    time.sleep(1)
    os._exit(0)  # a clean exit: the launcher waits for rank 0 (a failing one made it SIGTERM rank 0, sometimes before
    # rank 0 had printed what its second all_reduce got)
try:
    dist.all_reduce(t)
    print("rank 0: no error", flush=True)
except RuntimeError as e:
    print(f"rank 0 error: {str(e).splitlines()[0][:200]}", flush=True)
os._exit(0)
