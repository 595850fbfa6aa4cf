"""Train a tiny MLP with ``deepspeed.initialize`` under ZeRO stages 0-3, on whatever portspeed runs on.

The script is unmodified DeepSpeed usage; the only portspeed line is the adaptor import
(``--no-portspeed`` leaves it out, for the stock baseline, e.g. with ``DS_ACCELERATOR=cpu``).
Every rank sees the same global batch of ``--global-batch`` samples per step and trains on
its slice, so per-step losses are comparable across world sizes.

Several runs (``--runs 0:fp32,3:bf16,2:fp32:offload+adam``: ZeRO stage, dtype, and options:
where ZeRO keeps its state: ``offload`` the optimizer on the host (ZeRO-Offload),
``offload_param`` the ZeRO-3 parameters and optimizer on the host, ``nvme`` both on disk
under ``--nvme-dir`` through DeepSpeed's async I/O op (ZeRO-Infinity); ``sgd`` or ``adam``
(DeepSpeed's Adam: ``DeepSpeedCPUAdam`` when offloaded); ``overflow`` (fp16, which uses
dynamic loss scaling: step ``--overflow-at`` overflows and must be skipped); ZeRO++ (ZeRO-3:
``qwz`` quantized weights, ``qgz`` quantized gradients, ``hpz`` a secondary partition over all
ranks)) go through one process group, one fresh model and engine each. Rank 0 writes a JSON record::

    {"world_size": 2, "backend": "gloo", "ds_accelerator": "PortspeedCpuAccelerator",
     "routes": [...], "runs": {"2:fp32": {"start_step": 0, "losses": [...]}, ...}}

Launch on 2 CPU ranks::

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/deepspeed_train.py --runs 2:fp32 --out losses.json

Without a launcher's environment (RANK, WORLD_SIZE, ...) it runs as one process, unless
it was started by ``mpirun``: DeepSpeed's own MPI discovery then fills the environment.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # deepspeed_args.py, beside this file
from deepspeed_args import TORCH_DTYPES, ZEROPP, Run, build_parser  # noqa: E402

#: variables mpirun (Open MPI, MPICH / Hydra) sets: DeepSpeed's MPI discovery then fills the rest
MPI_ENV = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}


def _single_process_env() -> None:
    """Give a launcher-less run the environment a launcher would set, for one rank on 127.0.0.1."""
    if "WORLD_SIZE" in os.environ or MPI_ENV & set(os.environ):
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


def make_model(seed: int, last_bias: bool = True) -> Any:
    """The MLP; ZeRO++ runs leave out the last bias: DeepSpeed's weight quantizer needs every gathered
    slice to hold a multiple of 8 elements, and the 8-element bias gives 4 per rank on 2 ranks."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, 8, bias=last_bias),
    )


#: ZeRO bucket size in elements: above the model's 5,832 parameters (one bucket, as with
#: DeepSpeed's default), far below that default (5e8), whose per-step buffers a device
#: really allocates (2 GB in fp32; on the CPU the untouched pages cost nothing).
BUCKET = 1 << 16


def ds_config(stage: int, dtype: str, global_batch: int, world: int, offload: str = "",
              adam_lr: float | None = None, nvme_dir: str | None = None,
              zeropp: tuple[str, ...] = ()) -> dict[str, Any]:
    """The DeepSpeed config of one run; ``offload``: "", "offload", "offload_param" or "nvme"; ``zeropp``: of
    ZEROPP (see --runs)."""
    zero: dict[str, Any] = {
        "stage": stage,
        "reduce_bucket_size": BUCKET,
        "allgather_bucket_size": BUCKET,
        "stage3_prefetch_bucket_size": BUCKET,
        # 0: ZeRO-3 partitions every parameter (the default, 1e5, keeps this small model whole)
        "stage3_param_persistence_threshold": 0,
    }
    for option in zeropp:
        zero[ZEROPP[option]] = world if option == "hpz" else True
    if offload == "nvme":
        if not nvme_dir:
            raise SystemExit("an nvme run needs --nvme-dir (a directory on a local disk)")
        # buffers of BUCKET elements: above the largest parameter (4,096), far below the default 1e8
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir, "buffer_count": 5, "buffer_size": BUCKET}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir}
    elif offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if offload == "offload_param":
            zero["offload_param"] = {"device": "cpu"}
    config: dict[str, Any] = {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": global_batch // world,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        # with offload and the client SGD: it steps the host partitions (Adam runs get DeepSpeedCPUAdam)
        "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": dtype == "bf16"},
        # fp16: dynamic loss scaling (loss_scale 0) from 2**16; hysteresis 1: the first overflow halves the scale in
        # ZeRO-1/2 too, as ZeRO-0 always does (DeepSpeed's default 2 holds it once)
        "fp16": {"enabled": dtype == "fp16", "loss_scale": 0, "hysteresis": 1},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if offload == "nvme":
        config["aio"] = {"block_size": 1 << 20, "queue_depth": 8, "single_submit": False, "overlap_events": True,
                         "thread_count": 1}
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


def _loss_scale(engine: Any) -> float | None:
    """DeepSpeed's current fp16 loss scale (None without loss scaling)."""
    opt = engine.optimizer
    # ZeRO's optimizers keep it in a loss_scaler; the ZeRO-0 fp16 optimizers in a loss_scale_config
    holder = getattr(opt, "loss_scaler", None) or getattr(opt, "loss_scale_config", None)
    return float(holder.cur_scale) if holder is not None else None


def _param_sum(engine: Any) -> float:
    """A float64 checksum of the rank's full module parameters (ZeRO 0-2 keep them whole on every rank)."""
    import torch

    with torch.no_grad():
        return float(sum(p.detach().double().abs().sum().item() for p in engine.module.parameters()))


def rank_devices(tensor: Any) -> list[str]:
    """Every rank's device of ``tensor`` (its own device, e.g. a parameter's), gathered over the world.

    A collective over a one-hot vector of device indices (-1: the host), made on ``tensor``'s
    device, so it runs on the backend the parameters use. Shows, e.g., two ranks sharing a device.
    """
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    index = tensor.device.index
    ids = torch.zeros(world, dtype=torch.int64)
    ids[rank] = (-1 if index is None else index) + 1  # 0 for the host, so the sum over ranks is the list
    ids = ids.to(tensor.device)
    dist.all_reduce(ids)
    kind = tensor.device.type
    return [kind if i == 0 else f"{kind}:{i - 1}" for i in ids.cpu().tolist()]


#: all_to_all_single calls by input dtype (``--count-all-to-all``)
ALL_TO_ALL: dict[str, int] = {}


def count_all_to_all() -> None:
    """Count ``torch.distributed.all_to_all_single`` calls by dtype (DeepSpeed's comm calls it through the module)."""
    import torch.distributed as dist

    inner = dist.all_to_all_single

    def all_to_all_single(output: Any, input: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: A002
        key = str(input.dtype).replace("torch.", "")
        ALL_TO_ALL[key] = ALL_TO_ALL.get(key, 0) + 1
        return inner(output, input, *args, **kwargs)

    dist.all_to_all_single = all_to_all_single


def quantizer_calls() -> dict[str, int]:
    """portspeed's torch quantizer op counts in this process (empty without portspeed, or before ZeRO++ loads it)."""
    module = sys.modules.get("portspeed.integrations.ds_quantizer")
    return module.counters() if module is not None else {}


def train_run(args: argparse.Namespace, run: Run, data: tuple[Any, Any], mpu: Any = None) -> dict[str, Any]:
    """One engine: train (or resume), return the global per-step losses (fp16: loss scales and skips too)."""
    import torch
    import torch.distributed as dist

    stage, dtype = run.stage, run.dtype
    world, rank = dist.get_world_size(), dist.get_rank()
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} must be divisible by the world size {world}")
    micro = args.global_batch // world
    engine = make_engine(args, run, world, mpu)
    tag = "zero" + run.key.replace(":", "_").replace("+", "_")
    start = 0
    if args.resume_from:
        path, _ = engine.load_checkpoint(args.resume_from, tag=tag)
        if path is None:
            raise SystemExit(f"no checkpoint {tag!r} under {args.resume_from}; save one with --save-dir first")
        start = args.save_at
    x, y = data
    calls_before = quantizer_calls()
    a2a_before = dict(ALL_TO_ALL)
    in_dtype = getattr(torch, TORCH_DTYPES[dtype])
    losses: list[float] = []
    fp16: dict[str, list[Any]] = {"scale": [], "skipped": [], "param_sum": []}
    for step in range(start, args.steps):
        xb = x[step, rank * micro:(rank + 1) * micro].to(engine.device, in_dtype)
        yb = y[step, rank * micro:(rank + 1) * micro].to(engine.device)
        loss = torch.nn.functional.mse_loss(engine(xb).float(), yb)
        if dtype == "fp16" and stage == 0 and not args.fp16_stage0_as_is:
            # DeepSpeed 0.19.8's engine.backward scales the loss for ZeRO optimizers only, while its ZeRO-0
            # fp16 optimizer divides the gradients by the loss scale (upstream PR deepspeedai/DeepSpeed#8393,
            # open): without this the ZeRO-0 fp16 updates are 2**16 times too small. Same product as the PR.
            loss_for_backward = loss * _loss_scale(engine)
        else:
            loss_for_backward = loss
        # the planted overflow: the loss is scaled by 2**16 and more, its fp16 gradients become inf
        engine.backward(loss_for_backward * 1e30 if run.overflow and step == args.overflow_at else loss_for_backward)
        # hpZ: the secondary partitions the forward and backward built (the optimizer step drops them)
        secondary = sum(1 for p in engine.module.parameters() if getattr(p, "ds_secondary_tensor", None) is not None)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if dtype == "fp16":
            fp16["scale"].append(_loss_scale(engine))
            fp16["skipped"].append(int(engine.skipped_steps))
            fp16["param_sum"].append(_param_sum(engine) if stage < 3 else None)
        if args.save_dir and step + 1 == args.save_at:
            engine.save_checkpoint(args.save_dir, tag=tag)
    placement = where_things_are(engine, secondary, calls_before, a2a_before)
    engine.destroy()
    return {"start_step": start, "losses": losses, **placement, **({"fp16": fp16} if dtype == "fp16" else {})}


def make_engine(args: argparse.Namespace, run: Run, world: int, mpu: Any) -> Any:
    """A fresh model and its DeepSpeed engine for ``run``: a client SGD, or DeepSpeed's Adam from the config."""
    import deepspeed
    import torch

    model = make_model(args.seed, last_bias=not run.zeropp)
    sgd = (run.optimizer or args.optimizer) == "sgd"
    config = ds_config(run.stage, run.dtype, args.global_batch, world, run.where,
                       adam_lr=None if sgd else args.lr / 5, nvme_dir=args.nvme_dir, zeropp=run.zeropp)
    if args.gradient_clipping is not None:
        config["gradient_clipping"] = args.gradient_clipping
    if sgd:
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, mpu=mpu, config=config)
    else:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), mpu=mpu,
                                               config=config)
    return engine


def where_things_are(engine: Any, secondary: int, calls_before: dict[str, int],
                     a2a_before: dict[str, int]) -> dict[str, Any]:
    """Where the run's parameters and optimizer lived, and what it called (for the record)."""
    import deepspeed

    params = list(engine.module.parameters())
    return {
        "param_device": str(params[0].device),
        # every rank's (rank 0 writes the record): one device per rank, each rank on its own
        "param_devices": rank_devices(params[0]),
        # ZeRO-3: where this rank's slice of a parameter lives (offload_param: the host)
        "partition_device": str(params[0].ds_tensor.device) if hasattr(params[0], "ds_tensor") else None,
        "optimizer": type(engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer")
                          else engine.optimizer).__name__,
        # ZeRO-3: how many parameters this rank holds only a slice of (the rest gathered on use)
        "partitioned_params": sum(1 for p in params if hasattr(p, "ds_tensor") and p.ds_tensor.numel() < p.ds_numel),
        # hpZ: parameters with a secondary partition before the last optimizer step
        "secondary_partitions": secondary,
        # what DeepSpeed counts: ranks per node (its accelerator's device_count) and nodes (qgZ engages at 2)
        "node_size": deepspeed.accelerator.get_accelerator().device_count(),
        # portspeed's torch quantizer ops this run called (ZeRO++), and the all-to-alls by dtype (--count-all-to-all)
        "quantizer_calls": {k: v - calls_before.get(k, 0) for k, v in quantizer_calls().items()
                            if v != calls_before.get(k, 0)},
        "all_to_all": {k: v - a2a_before.get(k, 0) for k, v in ALL_TO_ALL.items() if v != a2a_before.get(k, 0)},
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser(__doc__.split("\n\n")[0]).parse_args(argv)
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

    if args.count_all_to_all:
        count_all_to_all()
    if args.torch_dist_first:
        dist.init_process_group(args.dist_backend or "gloo")
    deepspeed.init_distributed(dist_backend=args.dist_backend, distributed_port=args.dist_port)
    data = make_data(args)
    record: dict[str, Any] = {
        "world_size": dist.get_world_size(),
        "backend": str(dist.get_backend()),
        "ds_accelerator": type(deepspeed.accelerator.get_accelerator()).__name__,
        "mpi_launched": bool(MPI_ENV & set(os.environ)),
        "runs": {},
    }
    mpu = megatron_mpu() if args.megatron else None
    for run in args.runs:
        record["runs"][run.key] = train_run(args, run, data, mpu)
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
