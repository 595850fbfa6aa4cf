"""Pretrain a tiny GPT on megatron-core alone (no megatron.training), on whatever accelerator portspeed picks.

Launch with torchrun; the layout is TP x PP x CP x DP = world size (expert parallelism, ``--ep``,
is carved out of CP x DP, as Megatron does with the experts tensor-parallel over --tp)::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc-per-node 4 --master-port 29511 \\
        examples/pretrain_gpt.py --tp 2 --pp 2 --iters 10 --loss-log /tmp/tp2pp2.json

Each iteration prints ``iteration N | lm loss: X | grad norm: Y`` (full float precision)
from the rank that holds the loss. Data is mock data generated from ``--seed`` and the
iteration number, the same global batch for every layout, so layouts that start from the
same weights (``--load DIR --finetune`` of a checkpoint written with ``--iters 0 --save DIR``)
must print the same losses. ``--fail-at RANK:ITER`` makes one rank die there (fault tests).

The model: Megatron's local layer spec, or with ``--transformer-impl transformer_engine`` its
Transformer Engine spec (served off CUDA by portspeed's portable TE, whose kernel table reaches an
adapter's vendor kernels, e.g. ``rms_norm`` with ``--normalization RMSNorm``). ``--cp N`` (TE spec
only) gives each context-parallel rank its two sequence chunks in Megatron's load-balanced order;
``--num-experts N --ep M`` makes every MLP a mixture of experts (SequentialMLP, alltoall dispatcher,
no load-balancing loss unless ``--moe-aux-loss-coeff``). ``--hidden-dropout`` /
``--attention-dropout`` default to 0 (layouts compare exactly only without dropout).

Parity tooling: per-module statistics come from ``portspeed run --probe DIR`` (no flag here); the loss
record's ``meta["router_rewrites"]`` holds ``portspeed.comm.stats()`` (collectives the router rewrote
because the backend lacks them), also printed at the end as a sentence (``portspeed.comm.explain``), and
``meta["model"]`` the options that are not in the layout (impl, normalization, cp, ep, experts, dropout).
TEST-ONLY planted faults (portspeed.testing.plant) make training wrong on purpose, so tests can prove
the tools catch it: ``--plant-divergence ITER`` (a gradient scaled from ITER on), ``--plant-reduce-avg
LAYER[:ITER]`` (one row-parallel all_reduce averaged instead of summed, TP >= 2) and ``--plant-nan
ITER:LAYER`` (one NaN in a decoder layer's output); for ``portspeed run --perf``, ``--plant-slow LAYER:MS[:RANK]``
(a decoder layer's MLP sleeps, on one rank or all) and ``--plant-item LAYER:COUNT`` (``.item()`` host round trips).
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
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                      get_gpt_layer_with_transformer_engine_spec)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

from portspeed import config as ps_config
from portspeed import get_accelerator
import portspeed.comm as ps_comm
from portspeed.parity.losslog import open_loss_log

from gpt_args import parse_args
from gpt_checkpoint import load_checkpoint, save_checkpoint, sharded_state  # noqa: F401 (generate_gpt)

#: read by `portspeed run --probe` (docs/probe-format.md, ``dp_order``): data-parallel rank r's micro-batch j is
#: the global batch's micro-batch r x m + j (m per rank; ``microbatches``), so `portspeed compare --probe` can
#: match a DP run's micro-batches with a one-rank run's
PORTSPEED_PROBE_DP_ORDER = "contiguous"


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
        virtual_pipeline_model_parallel_size=args.vpp, context_parallel_size=args.cp,
        expert_model_parallel_size=args.ep,
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
    # MoE without linear biases, as Megatron's MoE recipes (--disable-bias-linear): megatron-core 0.16's expert
    # MLP adds its bias in place into the output of an autograd Function, which torch refuses at TP1
    moe = dict(num_moe_experts=args.num_experts, expert_model_parallel_size=args.ep, add_bias_linear=False,
               moe_router_topk=args.moe_router_topk, moe_token_dispatcher_type="alltoall",
               moe_router_load_balancing_type="aux_loss" if args.moe_aux_loss_coeff else "none",
               moe_aux_loss_coeff=args.moe_aux_loss_coeff) if args.num_experts else {}
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=4 * args.hidden_size, tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp, virtual_pipeline_model_parallel_size=args.vpp,
        context_parallel_size=args.cp, sequence_parallel=args.sequence_parallel,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        normalization=args.normalization,
        # interleaving with 2 stages puts two sends between the same ranks in one batch: Megatron
        # needs the overlapped (unbatched, even/odd ordered) p2p path there
        overlap_p2p_comm=args.vpp is not None and not args.batch_p2p_comm,
        batch_p2p_comm=args.vpp is None or args.batch_p2p_comm,
        deallocate_pipeline_outputs=args.deallocate_pipeline_outputs,
        use_cpu_initialization=True, params_dtype=dtype, pipeline_dtype=dtype, bf16=args.bf16,
        **recompute, **moe)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=not args.grad_reduce_in_bf16, average_in_collective=args.average_in_collective,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        bucket_size=None if not args.overlap_grad_reduce else 40000)
    if args.transformer_impl == "transformer_engine":
        layer_spec = get_gpt_layer_with_transformer_engine_spec(num_experts=args.num_experts)
    else:
        layer_spec = get_gpt_layer_local_spec(num_experts=args.num_experts, normalization=args.normalization)
    chunks = []
    for vp in range(args.vpp or 1):
        vp_stage = vp if args.vpp else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        model = GPTModel(config=config, transformer_layer_spec=layer_spec,
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


def cp_chunks(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This context-parallel rank's part of a micro-batch, as Megatron's ``get_batch_on_this_cp_rank``: the
    sequence cut into 2 x cp chunks, rank r keeping chunks r and 2 x cp - 1 - r (each rank gets as much causal
    attention work), along dim 1 (dim 2 of the attention mask)."""
    cp, r = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    if cp == 1:
        return batch
    out = {}
    for key, val in batch.items():
        dim = 2 if key == "attention_mask" else 1
        chunks = val.view(*val.shape[:dim], 2 * cp, val.shape[dim] // (2 * cp), *val.shape[dim + 1:])
        index = torch.tensor([r, 2 * cp - 1 - r], device=val.device)
        out[key] = chunks.index_select(dim, index).reshape(*val.shape[:dim], -1, *val.shape[dim + 1:])
    return out


def microbatches(args: argparse.Namespace, iteration: int) -> Iterator[dict[str, torch.Tensor]]:
    """This data-parallel rank's micro-batches of ``iteration`` (this CP rank's sequence chunks of them)."""
    device = get_accelerator().device()
    local = args.global_batch_size // args.dp
    rows = global_batch(args, iteration)[ps.get_data_parallel_rank() * local:][:local]
    s = args.seq_length
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1).to(device)  # True = masked (future tokens)
    pos = torch.arange(s).unsqueeze(0).expand(args.micro_batch_size, s).to(device)
    for j in range(args.num_microbatches):
        mb = rows[j * args.micro_batch_size:(j + 1) * args.micro_batch_size].to(device)
        yield cp_chunks({"tokens": mb[:, :-1].contiguous(), "labels": mb[:, 1:].contiguous(), "position_ids": pos,
                         "attention_mask": mask, "loss_mask": torch.ones(args.micro_batch_size, s, device=device)})


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean token loss of one micro-batch (every micro-batch has the same token count).

    Under context parallelism, as Megatron-LM's pretrain_gpt.py computed it before per-token losses: this rank's
    loss sum over the whole sequence's token count (the schedule multiplies by cp and DDP averages over DP x CP,
    which gives the full sequence's gradient); the value reported is the whole sequence's mean.
    """
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    total, tokens = torch.sum(losses * mask), mask.sum()
    if ps.get_context_parallel_world_size() > 1:
        whole = torch.stack([total.detach(), tokens])
        dist.all_reduce(whole, group=ps.get_context_parallel_group())
        return total / whole[1], {"lm loss": whole[0] / whole[1]}
    loss = total / tokens
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


def train_step(args: argparse.Namespace, model: list, optimizer: Any,
               it: int) -> tuple[float | None, float | None, bool]:
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


def plant_faults(args: argparse.Namespace) -> Any:
    """TEST-ONLY: register the planted fault asked for (wrong on purpose); the plant module, or None."""
    if all(x is None for x in (args.plant_divergence, args.plant_reduce_avg_at, args.plant_nan_at,
                                args.plant_slow_at, args.plant_item_at)):
        return None
    from portspeed.testing import plant

    if args.plant_divergence is not None:
        plant.plant(args.plant_divergence, layer=args.plant_layer, factor=args.plant_factor)
    elif args.plant_reduce_avg_at is not None:
        layer, it = args.plant_reduce_avg_at
        plant.plant_reduce_avg(layer, iteration=it)
    elif args.plant_nan_at is not None:
        it, layer = args.plant_nan_at
        plant.plant_nan(it, layer=layer)
    elif args.plant_slow_at is not None:
        layer, ms, rank = args.plant_slow_at
        plant.plant_slow(layer, ms, rank=rank)
    else:
        layer, count = args.plant_item_at
        plant.plant_item(layer, count)
    return plant


def model_meta(args: argparse.Namespace) -> dict[str, Any]:
    """What the loss record's layout (tp, pp, dp, vpp) does not say: the model and the other parallel sizes."""
    return {"transformer_impl": args.transformer_impl, "normalization": args.normalization, "cp": args.cp,
            "ep": args.ep, "sequence_parallel": args.sequence_parallel, "num_experts": args.num_experts,
            "moe_router_topk": args.moe_router_topk if args.num_experts else None,
            "moe_aux_loss_coeff": args.moe_aux_loss_coeff if args.num_experts else None,
            "hidden_dropout": args.hidden_dropout, "attention_dropout": args.attention_dropout}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plant = plant_faults(args)
    model, optimizer, config, start = setup(args)
    report = (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
              and ps.get_context_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0)
    writer = None
    if report:
        layout = {"tp": args.tp, "pp": args.pp, "dp": args.dp, "vpp": args.vpp}
        writer = open_loss_log(args.loss_log, layout, "bf16" if args.bf16 else "fp32",
                               backend=dist.get_backend(), accelerator=get_accelerator().name)
        if writer is not None:
            writer.record.meta["model"] = model_meta(args)
    rank = dist.get_rank()
    end = args.train_iters if args.train_iters is not None else start + args.iters
    for it in range(start + 1, end + 1):
        if args.fail_rank == rank and args.fail_iter == it and not args.fail_save:
            print(f"rank {rank}: --fail-at {args.fail_at}: exiting on purpose", file=sys.stderr, flush=True)
            os._exit(17)
        if plant is not None:
            plant.set_iteration(it)
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
    if plant is not None and plant.planted():
        print(f"rank {rank}: {plant.planted()}", file=sys.stderr, flush=True)  # what the plant changed, per rank
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
