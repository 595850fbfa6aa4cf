"""Pretrain a tiny GPT on megatron-core alone (no megatron.training), on whatever accelerator portspeed picks.

Launch with torchrun; the layout is TP x PP x DP = world size::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc-per-node 4 --master-port 29511 \\
        examples/pretrain_gpt.py --tp 2 --pp 2 --iters 10 --loss-log /tmp/tp2pp2.json

Each iteration prints ``iteration N | lm loss: X | grad norm: Y`` (full float precision)
from the rank that holds the loss. Data is mock data generated from ``--seed`` and the
iteration number, the same global batch for every layout, so layouts that start from the
same weights (``--load DIR --finetune`` of a checkpoint written with ``--iters 0 --save DIR``)
must print the same losses. ``--fail-at RANK:ITER`` makes one rank die there (fault tests).

Parity tooling: ``--layer-stats ITER --layer-stats-out FILE`` records per-module activation
and gradient statistics of iteration ITER (``portspeed compare --layers A B``); the loss
record's ``meta["router_rewrites"]`` holds ``portspeed.comm.stats()`` (collectives the
router rewrote because the backend lacks them), also printed at the end as a sentence (``portspeed.comm.explain``).
``--plant-divergence ITER`` is TEST-ONLY (portspeed.testing.plant): it makes training
wrong on purpose from ITER on, so tests can prove the tools catch it.
"""

import portspeed.megatron_adaptor  # noqa: F401  (first: translation + patches before Megatron loads)

import argparse
import datetime
import functools
import math
import os
import sys
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.enums import ModelType
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

from portspeed import config as ps_config
from portspeed import get_accelerator
import portspeed.comm as ps_comm
from portspeed.megatron_adaptor import open_loss_log

from gpt_checkpoint import load_checkpoint, resume_point, save_checkpoint, sharded_state  # noqa: F401 (generate_gpt)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line; layout checks that argparse cannot express are in ``check_args``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank (needs --pp > 1)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (implied: world / (tp*pp)); checked if given")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=128, help="must be divisible by --tp (no padding here)")
    p.add_argument("--iters", type=int, default=10, help="iterations to run (after the loaded one)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--bf16", action="store_true", help="bf16 params and compute (fp32 main weights)")
    p.add_argument("--recompute", action="store_true", help="full activation recompute, uniform, 1 layer per chunk")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--overlap-grad-reduce", action="store_true")
    p.add_argument("--overlap-param-gather", action="store_true")
    p.add_argument("--save", default=None, help="torch_dist checkpoint directory written after the last iteration")
    p.add_argument("--save-interval", type=int, default=None, metavar="N",
                   help="with --save: also save every N iterations, as SAVE/iter_N + tracker (Megatron-LM's layout)")
    p.add_argument("--resume", action="store_true",
                   help="with --save: continue from the checkpoint SAVE's tracker names, if any (restarts)")
    p.add_argument("--load", default=None,
                   help="torch_dist checkpoint directory to start from (or a --save directory with a tracker)")
    p.add_argument("--train-iters", type=int, default=None, metavar="N",
                   help="train up to iteration N (instead of --iters more), so a resumed run ends where planned")
    p.add_argument("--finetune", action="store_true", help="with --load: weights only, start at iteration 0")
    p.add_argument("--loss-log", default=None, help="JSON loss record (default: PORTSPEED_LOSS_LOG)")
    p.add_argument("--print-step-time", action="store_true",
                   help="also print 'step time ms: X' per iteration (benchmarks/bench_testdev_step.py)")
    p.add_argument("--backend", default=None, help="c10d backend (default: the adapter's)")
    p.add_argument("--deallocate-pipeline-outputs", action="store_true",
                   help="free each stage's output after sending it, as Megatron-LM's training loop does")
    p.add_argument("--batch-p2p-comm", action="store_true",
                   help="force batched p2p even with --vpp (with --pp 2 Megatron mismatches messages; for tests)")
    p.add_argument("--fail-at", default=None, metavar="RANK:ITER[:save]",
                   help="fault injection: RANK exits at ITER (':save': while writing checkpoint ITER); "
                        "only in the first attempt of a restarted group (TORCHELASTIC_RESTART_COUNT=0)")
    p.add_argument("--average-in-collective", action="store_true",
                   help="DDP averages gradients in the collective (ReduceOp.AVG) instead of pre-scaling + SUM")
    p.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="with --bf16: reduce gradients in bf16 (grad_reduce_in_fp32=False)")
    p.add_argument("--layer-stats", type=int, default=None, metavar="ITER",
                   help="record per-module activation/gradient statistics of iteration ITER")
    p.add_argument("--layer-stats-out", default=None, metavar="FILE",
                   help="where --layer-stats writes (JSON; {rank} is replaced by the rank)")
    p.add_argument("--plant-divergence", type=int, default=None, metavar="ITER",
                   help="TEST-ONLY: scale the gradient into decoder layer --plant-layer by --plant-factor from ITER on")
    p.add_argument("--plant-layer", type=int, default=1, help="TEST-ONLY: 0-based decoder layer for --plant-divergence")
    p.add_argument("--plant-factor", type=float, default=3.0, help="TEST-ONLY: gradient factor for --plant-divergence")
    args = p.parse_args(argv)
    check_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    return args


def check_args(args: argparse.Namespace, world: int) -> None:
    """Reject layouts that cannot work, naming the flag and the fix."""
    def fail(msg: str) -> None:
        print(f"pretrain_gpt.py: {msg}", file=sys.stderr)
        raise SystemExit(2)  # a usage error, as argparse's

    if world % (args.tp * args.pp):
        fail(f"world size {world} is not divisible by --tp {args.tp} x --pp {args.pp}")
    dp = world // (args.tp * args.pp)
    if args.dp is not None and args.dp != dp:
        fail(f"--dp {args.dp} does not match world {world} / (tp {args.tp} x pp {args.pp}) = {dp}")
    args.dp = dp
    if args.vocab_size % args.tp:
        fail(f"--vocab-size {args.vocab_size} must be divisible by --tp {args.tp} so every layout sees the same vocabulary")
    if args.global_batch_size % (args.micro_batch_size * dp):
        fail(f"--global-batch-size {args.global_batch_size} must be a multiple of micro-batch "
             f"{args.micro_batch_size} x dp {dp}")
    if args.vpp is not None:
        if args.pp < 2 or args.vpp < 2:
            fail("--vpp needs --pp >= 2 and --vpp >= 2")
        if args.num_layers % (args.pp * args.vpp):
            fail(f"--num-layers {args.num_layers} must be divisible by pp x vpp = {args.pp * args.vpp}")
    elif args.num_layers % args.pp:
        fail(f"--num-layers {args.num_layers} must be divisible by --pp {args.pp}")
    if args.sequence_parallel and args.tp < 2:
        fail("--sequence-parallel needs --tp >= 2")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        fail("--overlap-param-gather needs --use-distributed-optimizer")
    if args.finetune and not args.load:
        fail("--finetune needs --load DIR")
    if args.grad_reduce_in_bf16 and not args.bf16:
        fail("--grad-reduce-in-bf16 needs --bf16 (fp32 gradients are reduced in fp32)")
    if (args.layer_stats is None) != (args.layer_stats_out is None):
        fail("--layer-stats ITER and --layer-stats-out FILE go together; give both or neither")
    if args.layer_stats is not None and args.layer_stats < 1:
        fail(f"--layer-stats {args.layer_stats}: iterations start at 1")
    if args.plant_divergence is not None and not 0 <= args.plant_layer < args.num_layers:
        fail(f"--plant-layer {args.plant_layer} must be a decoder layer index in 0..{args.num_layers - 1}")
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)
    if (args.save_interval is not None or args.resume) and not args.save:
        fail("--save-interval and --resume need --save DIR")
    if args.save_interval is not None and args.save_interval < 1:
        fail(f"--save-interval {args.save_interval} must be at least 1")
    args.fail_rank = args.fail_iter = None
    args.fail_save = False
    if args.fail_at:
        parts = args.fail_at.split(":")
        try:
            if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "save"):
                raise ValueError
            args.fail_rank, args.fail_iter, args.fail_save = int(parts[0]), int(parts[1]), len(parts) == 3
        except ValueError:
            fail(f"--fail-at {args.fail_at!r} must be RANK:ITER or RANK:ITER:save, e.g. 1:3")
        if not 0 <= args.fail_rank < world:
            fail(f"--fail-at {args.fail_at!r}: rank {args.fail_rank} is not in 0..{world - 1}")
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
            args.fail_rank = None  # it died once already: a restarted group runs clean
    resume_point(args)


def _attempt_store(timeout: float) -> dict[str, Any]:
    """After a torchrun restart: the agent's store under a prefix of this attempt (else the env:// default).

    torchrun's agent keeps one store for every attempt and workers use it unprefixed, so a
    restarted group can read the addresses the dead group published (Gloo: 'Connection
    refused'). A prefix per TORCHELASTIC_RESTART_COUNT keeps the attempts apart.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt == 0 or "MASTER_ADDR" not in os.environ:
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and
                          os.environ["RANK"] == "0", timeout=datetime.timedelta(seconds=timeout))
    return {"store": dist.PrefixStore(f"attempt_{attempt}", store), "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"])}


def init_distributed(args: argparse.Namespace) -> None:
    """torch.distributed on the adapter's backend, then Megatron's model-parallel groups."""
    acc = get_accelerator()
    acc.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = ps_config.settings().timeout
    dist.init_process_group(backend=args.backend or acc.communication_backend,
                            timeout=datetime.timedelta(seconds=timeout), **_attempt_store(timeout))
    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp,
        distributed_timeout_minutes=max(1, math.ceil(timeout / 60)))
    # as Megatron-LM's _set_random_seed: the host generator (CPU-initialised weights, data) and
    # the device generators; on the CPU adapter they are one generator, on a device they are not
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)


def build_model(args: argparse.Namespace) -> tuple[list[DistributedDataParallel], TransformerConfig]:
    """One GPTModel chunk per virtual stage, each wrapped in Megatron's DDP."""
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    recompute = dict(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1) if args.recompute else {}
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=4 * args.hidden_size, tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp, virtual_pipeline_model_parallel_size=args.vpp,
        sequence_parallel=args.sequence_parallel, hidden_dropout=0.0, attention_dropout=0.0,
        # interleaving with 2 stages puts two sends between the same ranks in one batch: Megatron
        # needs the overlapped (unbatched, even/odd ordered) p2p path there
        overlap_p2p_comm=args.vpp is not None and not args.batch_p2p_comm,
        batch_p2p_comm=args.vpp is None or args.batch_p2p_comm,
        deallocate_pipeline_outputs=args.deallocate_pipeline_outputs,
        use_cpu_initialization=True, params_dtype=dtype, pipeline_dtype=dtype, bf16=args.bf16,
        **recompute)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=not args.grad_reduce_in_bf16, average_in_collective=args.average_in_collective,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer, bucket_size=None if not args.overlap_grad_reduce else 40000)
    chunks = []
    for vp in range(args.vpp or 1):
        vp_stage = vp if args.vpp else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                         vocab_size=args.vocab_size, max_sequence_length=args.seq_length,
                         pre_process=pre, post_process=post, share_embeddings_and_output_weights=True,
                         vp_stage=vp_stage)
        model.model_type = ModelType.encoder_or_decoder
        if args.bf16:
            model = model.to(torch.bfloat16)
        # use_cpu_initialization builds the weights on the host; training runs on the device
        # (Megatron-LM's get_model does the same with model.cuda())
        model = model.to(get_accelerator().device())
        chunks.append(DistributedDataParallel(config=config, ddp_config=ddp_config, module=model,
                                              disable_bucketing=vp > 0))
    return chunks, config


def global_batch(args: argparse.Namespace, iteration: int) -> torch.Tensor:
    """The whole global batch of iteration ``iteration``: (global_batch, seq+1) token ids, layout-free."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + iteration)
    return torch.randint(0, args.vocab_size, (args.global_batch_size, args.seq_length + 1), generator=g)


def microbatches(args: argparse.Namespace, iteration: int) -> Iterator[dict[str, torch.Tensor]]:
    """This data-parallel rank's micro-batches of ``iteration``."""
    device = get_accelerator().device()
    local = args.global_batch_size // args.dp
    rows = global_batch(args, iteration)[ps.get_data_parallel_rank() * local:][:local]
    s = args.seq_length
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1).to(device)  # True = masked (future tokens)
    pos = torch.arange(s).unsqueeze(0).expand(args.micro_batch_size, s).to(device)
    for j in range(args.num_microbatches):
        mb = rows[j * args.micro_batch_size:(j + 1) * args.micro_batch_size].to(device)
        yield {"tokens": mb[:, :-1].contiguous(), "labels": mb[:, 1:].contiguous(), "position_ids": pos,
               "attention_mask": mask, "loss_mask": torch.ones(args.micro_batch_size, s, device=device)}


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean token loss of one micro-batch (every micro-batch has the same token count)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum()
    return loss, {"lm loss": loss.detach().clone()}  # clone: the schedule divides `loss` in place


def forward_step(data_iterator: Iterator, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    batch = next(data_iterator)
    out = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return out, functools.partial(loss_func, batch["loss_mask"])


def setup(args: argparse.Namespace) -> tuple[list, Any, TransformerConfig, int]:
    """Process groups, model chunks, optimizer, schedule hooks, and the checkpoint if any."""
    init_distributed(args)
    model, config = build_model(args)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, bf16=args.bf16, params_dtype=torch.float32,
                        use_distributed_optimizer=args.use_distributed_optimizer, clip_grad=1.0,
                        weight_decay=0.01),
        model)
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    if args.overlap_grad_reduce:
        config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    if args.overlap_param_gather:
        config.param_sync_func = [m.start_param_sync for m in model] if len(model) > 1 else model[0].start_param_sync
    start = load_checkpoint(args, model, optimizer) if args.load_dir else 0
    return model, optimizer, config, start


def train_step(args: argparse.Namespace, model: list, optimizer: Any, it: int) -> tuple[float | None, float | None, bool]:
    """One iteration; returns (DP-averaged lm loss on the loss-holding ranks else None, grad norm, update ok)."""
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    data = [microbatches(args, it) for _ in model]
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data if len(model) > 1 else data[0],
        model=model, num_microbatches=args.num_microbatches, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, forward_only=False)
    ok, grad_norm, _ = optimizer.step()
    gn = None if grad_norm is None else float(grad_norm)
    if not (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0):
        return None, gn, bool(ok)
    loss = torch.stack([d["lm loss"] for d in losses]).mean()
    dist.all_reduce(loss, group=ps.get_data_parallel_group())
    return loss.item() / args.dp, gn, bool(ok)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plant_divergence is not None:
        from portspeed.testing import plant  # TEST-ONLY: wrong on purpose

        plant.plant(args.plant_divergence, layer=args.plant_layer, factor=args.plant_factor)
    model, optimizer, config, start = setup(args)
    recorder = None
    if args.layer_stats is not None:
        from portspeed.parity.layerstats import LayerStatsRecorder

        recorder = LayerStatsRecorder(model, iterations=[args.layer_stats], path=args.layer_stats_out,
                                      meta={"iteration": args.layer_stats, "backend": dist.get_backend()})
    report = (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
              and ps.get_data_parallel_rank() == 0)
    writer = None
    if report:
        layout = {"tp": args.tp, "pp": args.pp, "dp": args.dp, "vpp": args.vpp}
        writer = open_loss_log(args.loss_log, layout, "bf16" if args.bf16 else "fp32",
                               backend=dist.get_backend())
    rank = dist.get_rank()
    end = args.train_iters if args.train_iters is not None else start + args.iters
    for it in range(start + 1, end + 1):
        if args.fail_rank == rank and args.fail_iter == it and not args.fail_save:
            print(f"rank {rank}: --fail-at {args.fail_at}: exiting on purpose", file=sys.stderr, flush=True)
            os._exit(17)
        if args.plant_divergence is not None:
            plant.set_iteration(it)
        if recorder is not None:
            with recorder.iteration(it):
                loss, gn, ok = train_step(args, model, optimizer, it)
        else:
            t0 = time.perf_counter()
            loss, gn, ok = train_step(args, model, optimizer, it)
            if args.print_step_time and report:
                print(f"step time ms: {(time.perf_counter() - t0) * 1000:.3f}", flush=True)
        if report:
            print(f"iteration {it} | lm loss: {loss!r} | grad norm: {gn!r}", flush=True)
            if writer is not None:
                writer.record.meta["router_rewrites"] = ps_comm.stats()
                writer.record.meta["real_backend"] = ps_comm.real_backend()
                writer.add(it, loss, gn, skipped=not ok)
        if args.save_interval and it % args.save_interval == 0 and it != end:
            save_checkpoint(args, model, optimizer, it)
    if recorder is not None:
        recorder.close()
    if report:
        print(ps_comm.explain(), flush=True)  # which collectives the backend lacked and how each was rewritten
    if args.save:
        save_checkpoint(args, model, optimizer, end)
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
