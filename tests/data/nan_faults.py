"""A NaN carried by collectives, for tests/test_nan_check.py: 2 ranks under `portspeed run` with PORTSPEED_NAN_CHECK=1.

1. An all_reduce of +inf (rank 0) and -inf (rank 1): no input holds NaN, every output does; each rank
   prints the error it got (synchronous, then asynchronous at wait()).
2. A broadcast from rank 0 into a NaN-filled buffer on rank 1: the buffer is an output there, not an input;
   nothing is raised.
3. Rank 1 puts a NaN into its all_reduce input (the line marked `site: input`); it must raise there, naming
   itself; rank 0 waits in that all_reduce until the launcher ends it.
"""
import datetime
import os

import torch
import torch.distributed as dist

import portspeed
from portspeed.comm.nan_check import CollectiveNaNError


def say(line: str) -> None:
    """One write per line: two ranks share the launcher's pipe, and print's separate newline lets lines interleave."""
    os.write(1, (line + "\n").encode())


acc = portspeed.get_accelerator()  # the CPU adapter, the stand-in, or the test device (one device per rank)
acc.set_device(int(os.environ["LOCAL_RANK"]))
dev = acc.device()
dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
t = torch.full((4,), float("inf") if rank == 0 else float("-inf"), device=dev)
try:
    dist.all_reduce(t)  # site: output
    say(f"rank {rank} output: no error")
except CollectiveNaNError as e:
    say(f"rank {rank} output: {e}")
t = torch.full((4,), float("inf") if rank == 0 else float("-inf"), device=dev)
work = dist.all_reduce(t, async_op=True)  # site: async
try:
    work.wait()
    say(f"rank {rank} async: no error")
except CollectiveNaNError as e:
    say(f"rank {rank} async: {e}")
b = torch.ones(4, device=dev) if rank == 0 else torch.full((4,), float("nan"), device=dev)
dist.broadcast(b, 0)
say(f"rank {rank} broadcast: {b.sum().item()}")
x = torch.ones(4, device=dev)
if rank == 1:
    x[2] = float("nan")
dist.all_reduce(x)  # site: input
say(f"rank {rank} input: no error")
dist.destroy_process_group()
