"""Two groups moving the same bytes, one of them slow (TEST-ONLY script for ``compare --perf RUN``'s slow link).

Three ranks on Gloo: group A = ranks [0, 1], group B = ranks [1, 2]. Each iteration (an own loop marked with
``portspeed.perf.iteration``) every member all_reduces 64 KiB five times on each of its groups, each call
after a barrier of that group (so that its ranks arrive together). With ``--slow-ms MS`` (TEST-ONLY plant,
standing for a slow link): B's all_reduce is issued asynchronously and its ranks wait MS milliseconds before
``wait()``, so each B call ends about MS after both its ranks arrived, neither arriving late: a link, not a
rank, is slow.
"""

import argparse
import time

import torch
import torch.distributed as dist

import portspeed.perf

p = argparse.ArgumentParser()
p.add_argument("--slow-ms", type=float, default=0.0)
p.add_argument("--iters", type=int, default=4)
args = p.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
groups = {"A": dist.new_group([0, 1]), "B": dist.new_group([1, 2])}
mine = [name for name, ranks in (("A", (0, 1)), ("B", (1, 2))) if rank in ranks]
model = torch.nn.Linear(8, 8)
payload = torch.ones(16384)  # 64 KiB of float32
for n in range(1, args.iters + 1):
    with portspeed.perf.iteration(n, model):
        model(torch.randn(4, 8)).sum().backward()
        for _ in range(5):
            for name in mine:
                dist.barrier(group=groups[name])
                if name == "B" and args.slow_ms:
                    work = dist.all_reduce(payload, group=groups[name], async_op=True)
                    time.sleep(args.slow_ms / 1e3)  # TEST-ONLY plant: the slow link
                    work.wait()
                else:
                    dist.all_reduce(payload, group=groups[name])
                payload.fill_(1.0)
dist.barrier()
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()
