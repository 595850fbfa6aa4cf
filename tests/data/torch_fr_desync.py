"""TEST-ONLY: a desync recorded by torch's own flight recorder (no portspeed), dumped by torch's own writer.

Run with torchrun, 2 ranks, Gloo, ``TORCH_FR_BUFFER_SIZE`` set: 4 all_reduces in a loop, rank 1
skips its 3rd, then one more all_reduce (Gloo pairs rank 1's with rank 0's 4th: a wrong sum, no
hang; rank 0's 5th is paired with a last call rank 1 makes from another line so both end). Each
rank then writes ``torch._C._distributed_c10d._dump_fr_trace()`` (torch's pickle) to
``$DUMP_DIR/torch_fr_trace_rank_<R>``, the name torch's NCCL dumps get under portspeed.
"""

import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(4)
for i in range(4):
    if rank == 1 and i == 2:
        continue
    dist.all_reduce(t)  # site: loop
dist.all_reduce(t)  # site: after
if rank == 1:
    dist.all_reduce(t)  # site: tail
data = torch._C._distributed_c10d._dump_fr_trace()
with open(os.path.join(os.environ["DUMP_DIR"], f"torch_fr_trace_rank_{rank}"), "wb") as f:
    f.write(data)
dist.destroy_process_group()
