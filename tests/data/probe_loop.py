"""An own training loop (plain torch, torch's DDP, Gloo) that marks its iterations with portspeed.probe's one call.

Run under torchrun. It trains twice from the same seeds: first without the call (``plain iteration N | lm
loss: X``), then with it (``iteration N | lm loss: X | grad norm: None``), so one launch holds the unprobed
losses and the probed ones. ``--nan-at ITER`` makes the output of module ``body.1`` (a GELU) NaN at one element
in iteration ITER of the second pass, on rank 0 (TEST-ONLY: the fault --probe-nan must name).
"""

import argparse
import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

import portspeed.probe


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 32))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x) + 1.0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--nan-at", type=int, default=None)
    args = p.parse_args()
    dist.init_process_group("gloo")
    train(args, probed=False)
    train(args, probed=True)
    dist.destroy_process_group()


def train(args: argparse.Namespace, probed: bool) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Net())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = {"it": 0}

    def poison(module: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor | None:
        if probed and state["it"] == args.nan_at and rank == 0:
            out = out.clone()
            out.view(-1)[0] = float("nan")
            return out
        return None

    model.module.body[1].register_forward_hook(poison)
    g = torch.Generator().manual_seed(100 + rank)
    for it in range(1, args.iters + 1):
        state["it"] = it
        with portspeed.probe.iteration(it, model) if probed else contextlib.nullcontext():
            total = 0.0
            for _ in range(2):  # two micro-batches, accumulated
                x = torch.randn(4, 8, generator=g)
                loss = model(x).pow(2).mean() / 2
                loss.backward()
                total += loss.detach()
            opt.step()
            opt.zero_grad()
        dist.all_reduce(total)
        if rank == 0:
            print(f"{'' if probed else 'plain '}iteration {it} | lm loss: {float(total) / dist.get_world_size()!r} | "
                  "grad norm: None", flush=True)


if __name__ == "__main__":
    main()
