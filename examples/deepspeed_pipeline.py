"""Train a tiny MLP with DeepSpeed's pipeline engine (``PipelineModule``, ``train_batch``) on what portspeed runs on.

Unmodified DeepSpeed usage; the only portspeed line is the adaptor import (``--no-portspeed``
leaves it out, for the stock baseline with ``DS_ACCELERATOR=cpu``). The same model and data
run as 1 stage on 1 process, 2 stages on 2 ranks, 2 stages x 2 data-parallel replicas on 4
ranks: each ``train_batch`` is one optimizer step over ``--micro-batches`` micro-batches of
a fixed global batch, so the per-step losses are comparable across layouts.

``--activation-checkpointing`` checkpoints every layer with ``deepspeed.checkpointing``
(DeepSpeed's own checkpoint function, its RNG tracker, ``partition_activations``) on a
topology with ``--model-parallel`` replicas that hold the same layers: a checkpointed input
is split between them and gathered again for the recomputation. A dropout draws from the
tracker's own state (``get_cuda_rng_tracker().fork``), so a recomputation that restored the
wrong RNG state changes the gradients. Without the flag the dropout is the same, so the
losses must be equal.

Launch::

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/deepspeed_pipeline.py --stages 2 --out pipe.json

Rank 0 writes ``{"world_size", "stages", "ds_accelerator", "losses": [...], ...}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import types
from typing import Any, Iterator

#: the tracker state the example's dropout draws from (same seed on every rank)
RNG_NAME = "portspeed-example-dropout"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=2, help="pipeline stages")
    p.add_argument("--model-parallel", type=int, default=1,
                   help="replicas of each stage that split checkpointed activations (partition_activations)")
    p.add_argument("--steps", type=int, default=5, help="train_batch calls (optimizer steps)")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (gradient accumulation)")
    p.add_argument("--global-batch", type=int, default=16, help="samples per step over all replicas")
    p.add_argument("--dropout", type=float, default=0.1, help="dropout drawn from the RNG tracker")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="checkpoint every layer with deepspeed.checkpointing, partition_activations on")
    p.add_argument("--no-portspeed", action="store_true", help="do not import portspeed (stock baseline)")
    p.add_argument("--dist-backend", default=None, help="backend asked of deepspeed.init_distributed (e.g. nccl)")
    p.add_argument("--save-dir", default=None, help="save a checkpoint after --save-at steps")
    p.add_argument("--save-at", type=int, default=2)
    p.add_argument("--resume-from", default=None, help="load the checkpoint and train the remaining steps")
    p.add_argument("--out", default=None, help="JSON file rank 0 writes")
    return p


def _single_process_env() -> None:
    if "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def tracked_dropout_class() -> type:
    """A dropout module that draws its mask from DeepSpeed's RNG tracker (what model-parallel code does)."""
    import torch
    from deepspeed import checkpointing

    class TrackedDropout(torch.nn.Module):
        def __init__(self, p: float) -> None:
            super().__init__()
            self.p = p

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with checkpointing.get_cuda_rng_tracker().fork(RNG_NAME):
                return torch.nn.functional.dropout(x, self.p, self.training)

    return TrackedDropout


def layer_specs(dropout: float) -> list[Any]:
    """16-64-64-8 tanh MLP with a tracked dropout; LayerSpec so that each stage builds only its layers."""
    import torch
    from deepspeed.pipe import LayerSpec

    return [LayerSpec(torch.nn.Linear, 16, 64), LayerSpec(torch.nn.Tanh), LayerSpec(tracked_dropout_class(), dropout),
            LayerSpec(torch.nn.Linear, 64, 64), LayerSpec(torch.nn.Tanh), LayerSpec(torch.nn.Linear, 64, 8)]


def tensor_parallel_view(grid: Any) -> Any:
    """The pipeline grid under the tensor-model-parallel names deepspeed.checkpointing asks its mpu for."""
    return types.SimpleNamespace(
        get_tensor_model_parallel_rank=grid.get_slice_parallel_rank,
        get_tensor_model_parallel_world_size=grid.get_slice_parallel_world_size,
        get_tensor_model_parallel_group=grid.get_slice_parallel_group,
        get_data_parallel_rank=grid.get_data_parallel_rank,
        get_data_parallel_world_size=grid.get_data_parallel_world_size,
        get_data_parallel_group=grid.get_data_parallel_group,
    )


def batches(args: argparse.Namespace, dp_rank: int, dp: int, start: int) -> Iterator[tuple[Any, Any]]:
    """This replica's micro-batches, step after step: the same global batch whatever the layout."""
    import torch

    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.steps, args.global_batch, 16, generator=g)
    y = torch.tanh(x @ torch.randn(16, 8, generator=g)) + 0.1 * torch.randn(args.steps, args.global_batch, 8,
                                                                            generator=g)
    per_micro = args.global_batch // args.micro_batches  # samples of one micro-batch over all replicas
    mine = per_micro // dp
    for step in range(start, args.steps):
        for m in range(args.micro_batches):
            lo = m * per_micro + dp_rank * mine
            yield x[step, lo:lo + mine], y[step, lo:lo + mine]


def rank_devices(tensor: Any) -> list[str]:
    """Every rank's device of ``tensor``, gathered over the world (-1 in the sum: the host)."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    index = tensor.device.index
    ids = torch.zeros(world, dtype=torch.int64)
    ids[rank] = (-1 if index is None else index) + 1
    ids = ids.to(tensor.device)
    dist.all_reduce(ids)
    kind = tensor.device.type
    return [kind if i == 0 else f"{kind}:{i - 1}" for i in ids.cpu().tolist()]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _single_process_env()
    if not args.no_portspeed:
        import portspeed.deepspeed_adaptor  # noqa: F401  (the one portspeed line)
    import torch

    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist
    from deepspeed import checkpointing
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    deepspeed.init_distributed(dist_backend=args.dist_backend)
    world = dist.get_world_size()
    dp = world // (args.stages * args.model_parallel)
    if dp < 1 or world % (args.stages * args.model_parallel) or args.global_batch % (args.micro_batches * dp):
        raise SystemExit(f"world size {world} must be a multiple of --stages x --model-parallel "
                         f"({args.stages} x {args.model_parallel}), and --global-batch {args.global_batch} of "
                         f"--micro-batches x data-parallel replicas ({args.micro_batches} x {dp})")
    topo = PipeModelDataParallelTopology(num_pp=args.stages, num_mp=args.model_parallel, num_dp=dp)
    # seed_layers: layer i is built from base_seed + i, so its weights do not depend on the partition
    net = PipelineModule(layers=layer_specs(args.dropout), topology=topo, loss_fn=torch.nn.MSELoss(),
                         partition_method="uniform", seed_layers=True, base_seed=args.seed,
                         activation_checkpoint_interval=1 if args.activation_checkpointing else 0)
    checkpointing.configure(tensor_parallel_view(net.mpu()), partition_activations=args.activation_checkpointing)
    checkpointing.model_parallel_cuda_manual_seed(args.seed)
    checkpointing.get_cuda_rng_tracker().add(RNG_NAME, args.seed + 7)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    config = {"train_batch_size": args.global_batch, "gradient_accumulation_steps": args.micro_batches,
              "train_micro_batch_size_per_gpu": args.global_batch // (args.micro_batches * dp),
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=config)
    start = 0
    if args.resume_from:
        path, _ = engine.load_checkpoint(args.resume_from, tag="pipe")
        if path is None:
            raise SystemExit(f"no checkpoint 'pipe' under {args.resume_from}; save one with --save-dir first")
        start = args.save_at
    data = batches(args, engine.grid.get_data_parallel_rank(), dp, start)
    losses = []
    for step in range(start, args.steps):
        # every rank gets the iterator: the first stage reads inputs from it, the last stage labels
        losses.append(float(engine.train_batch(data_iter=data)))
        if args.save_dir and step + 1 == args.save_at:
            engine.save_checkpoint(args.save_dir, tag="pipe")
    record: dict[str, Any] = {
        "world_size": world, "stages": args.stages, "data_parallel": dp, "model_parallel": args.model_parallel,
        "start_step": start, "losses": losses,
        "ds_accelerator": type(deepspeed.accelerator.get_accelerator()).__name__,
        "stage_params": [n for n, _ in net.named_parameters()] if engine.is_first_stage() else None,
        # every rank's parameter device (a stage's layers live on its rank's device)
        "param_devices": rank_devices(next(net.parameters())),
        "partition_activations": bool(checkpointing.PARTITION_ACTIVATIONS),
    }
    if not args.no_portspeed:
        import portspeed.comm

        record["real_backend"] = portspeed.comm.real_backend()
    if dist.get_rank() == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
