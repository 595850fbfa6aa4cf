"""A tiny real data-parallel training (torch.distributed, Gloo) that writes a portspeed loss record.

Used by the compare and pytest-plugin tests as a run to launch: a linear regression on a
fixed synthetic batch, split across ranks, gradients all-reduced. Any world size computes
the same losses up to reduction order, so 1-rank and 2-rank runs must agree within fp32
tolerance. ``--perturb-at K`` plants a divergence: from iteration K the learning rate is
10% higher, so the losses differ from iteration K+1 (iteration K's loss precedes its update). Run it directly (one
process) or under torchrun.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from portspeed.parity.losslog import LossRecordWriter


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--perturb-at", type=int, default=0)
    p.add_argument("--loss-log", default=os.environ.get("PORTSPEED_LOSS_LOG"))
    p.add_argument("--crash-at", type=int, default=0, help="exit with status 3 at this iteration (failure tests)")
    a = p.parse_args()
    torch.set_num_threads(1)
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1

    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(16, 1, generator=g)
    w = torch.zeros(8, 1, requires_grad=True)
    shard = slice(rank * 16 // world, (rank + 1) * 16 // world)
    writer = LossRecordWriter(a.loss_log, meta={
        "backend": "gloo" if distributed else "none", "accelerator": "cpu", "dtype": "fp32",
        "layout": {"tp": 1, "pp": 1, "dp": world, "vpp": None}}) if (a.loss_log and rank == 0) else None
    for it in range(1, a.iters + 1):
        if a.crash_at and it == a.crash_at:
            print(f"rank {rank}: crashing on purpose at iteration {it}", flush=True)
            raise SystemExit(3)
        # sum of squared errors on the shard; the global loss is the sum over ranks / 16
        err = x[shard] @ w - y[shard]
        local = (err * err).sum() / 16
        local.backward()
        loss = local.detach().clone()
        if distributed:
            dist.all_reduce(w.grad)
            dist.all_reduce(loss)
        gn = w.grad.norm()
        lr = a.lr * (1.1 if a.perturb_at and it >= a.perturb_at else 1.0)
        with torch.no_grad():
            w -= lr * w.grad
            w.grad = None
        if rank == 0:
            print(f"iteration {it} | lm loss: {loss.item()!r} | grad norm: {gn.item()!r}", flush=True)
        if writer:
            writer.add(it, loss.item(), gn.item())
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
