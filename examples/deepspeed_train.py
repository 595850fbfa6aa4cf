"""Train a tiny MLP with ``deepspeed.initialize`` under ZeRO stages 0-3, on whatever portspeed runs on.

The script is unmodified DeepSpeed usage; the only portspeed line is the adaptor import
(``--no-portspeed`` leaves it out, for the stock baseline, e.g. with ``DS_ACCELERATOR=cpu``).
Every rank sees the same global batch of ``--global-batch`` samples per step and trains on
its slice, so per-step losses are comparable across world sizes.

Several runs (``--runs 0:fp32,3:bf16,2:fp32:offload``: ZeRO stage, dtype, and optionally
ZeRO-Offload of the optimizer to the host) go through one process group, one fresh model and
engine each. Rank 0 writes a JSON record::

    {"world_size": 2, "backend": "gloo", "ds_accelerator": "PortspeedCpuAccelerator",
     "routes": [...], "runs": {"2:fp32": {"start_step": 0, "losses": [...]}, ...}}

Launch on 2 CPU ranks::

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/deepspeed_train.py --runs 2:fp32 --out losses.json

Without a launcher's environment (RANK, WORLD_SIZE, ...) it runs as one process.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
from typing import Any

STAGES = (0, 1, 2, 3)
DTYPES = ("fp32", "bf16")


def parse_runs(text: str) -> list[tuple[int, str, bool]]:
    """Parse ``"0:fp32,3:bf16:offload"`` into [(0, "fp32", False), (3, "bf16", True)], or raise naming the bad item."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        stage, sep, rest = item.partition(":")
        dtype, _, flag = rest.partition(":")
        if (not sep or not stage.isdigit() or int(stage) not in STAGES or dtype not in DTYPES
                or flag not in ("", "offload") or (flag and int(stage) == 0)):
            raise argparse.ArgumentTypeError(
                f"--runs item {item!r} must be STAGE:DTYPE[:offload] with STAGE in {STAGES} and DTYPE in {DTYPES} "
                "(offload: ZeRO stage 1-3), e.g. '0:fp32,3:bf16,2:fp32:offload'")
        out.append((int(stage), dtype, flag == "offload"))
    if not out:
        raise argparse.ArgumentTypeError("--runs needs at least one STAGE:DTYPE item")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=parse_runs, default=parse_runs("2:fp32"),
                   help="comma-separated ZeRO_STAGE:DTYPE[:offload] runs (default 2:fp32); offload keeps the "
                        "optimizer state and step on the host")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run")
    p.add_argument("--global-batch", type=int, default=8, help="samples per step over all ranks")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--no-portspeed", action="store_true", help="do not import portspeed (stock baseline)")
    p.add_argument("--dist-backend", default=None,
                   help="backend asked of deepspeed.init_distributed (e.g. nccl); default: the accelerator's")
    p.add_argument("--torch-dist-first", action="store_true",
                   help="call torch.distributed.init_process_group before DeepSpeed does")
    p.add_argument("--save-dir", default=None, help="save a ZeRO checkpoint per run here")
    p.add_argument("--save-at", type=int, default=3, help="step after which to save (with --save-dir)")
    p.add_argument("--resume-from", default=None,
                   help="load each run's checkpoint from this directory and train the remaining steps")
    p.add_argument("--megatron", action="store_true",
                   help="Megatron-DeepSpeed style: also import portspeed.megatron_adaptor and hand DeepSpeed "
                        "Megatron-Core's parallel state (tensor/pipeline parallel 1) as its mpu")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                   help="sgd: a client torch SGD (momentum 0.9); adam: DeepSpeed's own Adam from the config "
                        "(DeepSpeedCPUAdam, a host kernel JIT-built on first use, in offload runs; torch's Adam "
                        "otherwise)")
    p.add_argument("--out", default=None, help="JSON file rank 0 writes the losses to")
    return p


def _single_process_env() -> None:
    """Give a launcher-less run the environment a launcher would set, for one rank on 127.0.0.1."""
    if "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def make_data(args: argparse.Namespace) -> tuple[Any, Any]:
    """Inputs and targets for every step: the same on every rank and every world size."""
    import torch

    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.steps, args.global_batch, 16, generator=g)
    teacher = torch.randn(16, 8, generator=g)
    y = torch.tanh(x @ teacher) + 0.1 * torch.randn(args.steps, args.global_batch, 8, generator=g)
    return x, y


def make_model(seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, 8),
    )


#: ZeRO bucket size in elements: above the model's 5,832 parameters (one bucket, as with
#: DeepSpeed's default), far below that default (5e8), whose per-step buffers a device
#: really allocates (2 GB in fp32; on the CPU the untouched pages cost nothing).
BUCKET = 1 << 16


def ds_config(stage: int, dtype: str, global_batch: int, world: int, offload: bool = False,
              adam_lr: float | None = None) -> dict[str, Any]:
    zero: dict[str, Any] = {
        "stage": stage,
        "reduce_bucket_size": BUCKET,
        "allgather_bucket_size": BUCKET,
        "stage3_prefetch_bucket_size": BUCKET,
        # 0: ZeRO-3 partitions every parameter (the default, 1e5, keeps this small model whole)
        "stage3_param_persistence_threshold": 0,
    }
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config: dict[str, Any] = {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": global_batch // world,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        # with offload: the client SGD steps the host partitions (no JIT-built DeepSpeedCPUAdam)
        "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": dtype == "bf16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if adam_lr is not None:
        config["optimizer"] = {"type": "Adam", "params": {"lr": adam_lr, "torch_adam": not offload}}
    return config


def megatron_mpu() -> Any:
    """Megatron-Core's parallel state under the names DeepSpeed asks an ``mpu`` for."""
    import types

    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    return types.SimpleNamespace(
        get_model_parallel_rank=ps.get_tensor_model_parallel_rank,
        get_model_parallel_world_size=ps.get_tensor_model_parallel_world_size,
        get_model_parallel_group=ps.get_tensor_model_parallel_group,
        get_data_parallel_rank=ps.get_data_parallel_rank,
        get_data_parallel_world_size=ps.get_data_parallel_world_size,
        get_data_parallel_group=ps.get_data_parallel_group,
    )


def train_run(args: argparse.Namespace, stage: int, dtype: str, offload: bool, data: tuple[Any, Any],
              mpu: Any = None) -> dict[str, Any]:
    """One engine: train (or resume), return the global per-step losses."""
    import deepspeed
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} must be divisible by the world size {world}")
    micro = args.global_batch // world
    model = make_model(args.seed)
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, mpu=mpu,
                                               config=ds_config(stage, dtype, args.global_batch, world, offload))
    else:
        config = ds_config(stage, dtype, args.global_batch, world, offload, adam_lr=args.lr / 5)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), mpu=mpu,
                                               config=config)
    tag = f"zero{stage}_{dtype}" + ("_offload" if offload else "")
    start = 0
    if args.resume_from:
        path, _ = engine.load_checkpoint(args.resume_from, tag=tag)
        if path is None:
            raise SystemExit(f"no checkpoint {tag!r} under {args.resume_from}; save one with --save-dir first")
        start = args.save_at
    x, y = data
    in_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    losses = []
    for step in range(start, args.steps):
        xb = x[step, rank * micro:(rank + 1) * micro].to(engine.device, in_dtype)
        yb = y[step, rank * micro:(rank + 1) * micro].to(engine.device)
        loss = torch.nn.functional.mse_loss(engine(xb).float(), yb)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if args.save_dir and step + 1 == args.save_at:
            engine.save_checkpoint(args.save_dir, tag=tag)
    params = list(engine.module.parameters())
    placement = {
        "param_device": str(params[0].device),
        "optimizer": type(engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer")
                          else engine.optimizer).__name__,
        # ZeRO-3: how many parameters this rank holds only a slice of (the rest gathered on use)
        "partitioned_params": sum(1 for p in params if hasattr(p, "ds_tensor") and p.ds_tensor.numel() < p.ds_numel),
    }
    engine.destroy()
    return {"start_step": start, "losses": losses, **placement}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.resume_from and not 0 < args.save_at < args.steps:
        raise SystemExit(f"--save-at {args.save_at} must be between 1 and --steps - 1 ({args.steps - 1})")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _single_process_env()
    if not args.no_portspeed:
        import portspeed.deepspeed_adaptor  # noqa: F401  (the one portspeed line)
        if args.megatron:
            import portspeed.megatron_adaptor  # noqa: F401
    import torch

    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    if args.torch_dist_first:
        dist.init_process_group(args.dist_backend or "gloo")
    deepspeed.init_distributed(dist_backend=args.dist_backend)
    data = make_data(args)
    record: dict[str, Any] = {
        "world_size": dist.get_world_size(),
        "backend": str(dist.get_backend()),
        "ds_accelerator": type(deepspeed.accelerator.get_accelerator()).__name__,
        "runs": {},
    }
    mpu = megatron_mpu() if args.megatron else None
    for stage, dtype, offload in args.runs:
        key = f"{stage}:{dtype}" + (":offload" if offload else "")
        record["runs"][key] = train_run(args, stage, dtype, offload, data, mpu)
    if not args.no_portspeed:
        import portspeed
        import portspeed.comm
        from portspeed.patches.deepspeed import routes

        record["routes"] = routes()
        record["real_backend"] = portspeed.comm.real_backend()
        record["router_rewrites"] = portspeed.comm.stats()
        record["report"] = [{k: r[k] for k in ("name", "status", "detail")} for r in portspeed.report()]
    if dist.get_rank() == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    # Free the engines' reference cycles (they hold groups and tensors) while the interpreter
    # is whole: a Gloo worker thread that drops the last reference to a tensor during
    # interpreter shutdown cannot take the GIL and aborts the process.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
