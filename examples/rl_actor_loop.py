"""A PPO/GRPO-shaped actor on megatron-core, driven from its own loop as verl or ms-swift drive it.

No ``megatron.training``: the loop builds a GPTModel on the Transformer Engine layer spec
(portspeed's portable TE serves it off CUDA), wraps it in Megatron's DDP (optionally with the
distributed optimizer), and calls ``get_megatron_optimizer``, ``get_forward_backward_func`` and
``finalize_model_grads`` itself. Like an RL trainer's code, it also calls ``torch.cuda``
itself (``set_device``, ``current_device``, ``synchronize``, ``memory_allocated``, ``.cuda()``,
``device="cuda"``). Those calls are the user's, not Megatron's, so portspeed translates them
only because the user opts in::

    PORTSPEED_FRAMEWORK_MODULES=__main__ OMP_NUM_THREADS=1 \\
        torchrun --nproc-per-node 2 examples/rl_actor_loop.py --tp 2 --loss-log /tmp/tp2.json

(``__main__`` is this script; name your own packages the same way, comma-separated.) Without
the opt-in the first of them fails with torch's own error plus a note naming the module and
the setting (docs/megatron-core-loop.md).

Each rollout step ``t`` (of ``--steps``) takes a fixed batch (tokens and one advantage per
sequence, generated from ``--seed`` and ``t``: the same global batch in every layout), computes
the per-token log-probs of it forward-only through ``get_forward_backward_func`` (collected on
the last pipeline stage, as an actor computes ``old_log_prob``), then makes ``--ppo-epochs``
clipped-ratio policy updates on it. ``--loss-log`` records every update's loss and grad norm;
``--logprob-log`` records every token's negative log-prob (one entry per token, in global batch
order): both are portspeed loss records, so ``portspeed compare A B`` compares two layouts.

``--dp-wrapper`` picks the data-parallel wrapper as Megatron-LM's flags do: ``ddp`` (Megatron's
DDP, the default), ``megatron-fsdp`` (megatron-core's ``FullyShardedDataParallel`` with the
distributed optimizer, sharding per ``--data-parallel-sharding-strategy``: ``no_shard``, ``optim``,
``optim_grads``, ``optim_grads_params``) or ``fsdp2`` (``TorchFullyShardedDataParallel``: torch's
``fully_shard``; needs ``--untie-embeddings-and-output-weights``). A set-up the installed
megatron-core cannot train is refused at start-up naming the flag and the upstream defect
(docs/megatron-core-loop.md, "Megatron-FSDP and torch FSDP2").

Checkpoints (``dist_checkpointing``, any layout loads any other's): ``--save-init DIR`` writes
the weights before training (the shared start of a parity run), ``--init DIR`` starts from
such weights, ``--save DIR`` writes model, optimizer and step after the last step, and
``--resume DIR`` continues from that.
"""

import portspeed.megatron_adaptor  # noqa: F401  (first line: translation and patches before Megatron loads)

import argparse
import datetime
import os
import sys
from functools import partial
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.enums import ModelType
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

import portspeed.comm as ps_comm
from portspeed import get_accelerator
from portspeed.parity.losslog import IterationLoss, open_loss_log

CLIP = 0.2  # PPO's ratio clip
WRAPPERS = ("ddp", "megatron-fsdp", "fsdp2")
SHARDING = ("no_shard", "optim", "optim_grads", "optim_grads_params")  # Megatron-FSDP's, as Megatron-LM names them


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--dp-wrapper", choices=WRAPPERS, default="ddp",
                   help="data-parallel wrapper: Megatron's DDP (default), Megatron-FSDP, or torch FSDP2 "
                        "(megatron-core's TorchFullyShardedDataParallel over torch's fully_shard)")
    p.add_argument("--data-parallel-sharding-strategy", choices=SHARDING, default="no_shard",
                   help="with --dp-wrapper megatron-fsdp: what Megatron-FSDP shards across the DP ranks")
    p.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="a separate output layer (torch FSDP2 requires it, as Megatron-LM's --use-torch-fsdp2 does)")
    p.add_argument("--steps", type=int, default=3, help="rollout steps (each: log-probs, then --ppo-epochs updates)")
    p.add_argument("--ppo-epochs", type=int, default=2, help="policy updates per rollout batch")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=128)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--save-init", default=None, metavar="DIR", help="write the initial weights, then train")
    p.add_argument("--init", default=None, metavar="DIR", help="start from weights written by --save-init")
    p.add_argument("--save", default=None, metavar="DIR", help="model + optimizer + step after the last step")
    p.add_argument("--save-step", type=int, default=None, metavar="N", help="with --save: save after step N instead")
    p.add_argument("--resume", default=None, metavar="DIR", help="continue from a --save checkpoint")
    p.add_argument("--loss-log", default=None, help="loss record of every policy update (JSON)")
    p.add_argument("--logprob-log", default=None, help="per-token negative log-prob record (JSON)")
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    problems = []
    if world % (args.tp * args.pp):
        problems.append(f"world size {world} is not divisible by --tp {args.tp} x --pp {args.pp}")
    args.dp = max(1, world // (args.tp * args.pp))
    if args.global_batch_size % (args.micro_batch_size * args.dp):
        problems.append(f"--global-batch-size must be a multiple of --micro-batch-size x dp ({args.dp})")
    if args.num_layers % args.pp or args.vocab_size % args.tp:
        problems.append("--num-layers must be divisible by --pp and --vocab-size by --tp")
    if args.init and args.resume:
        problems.append("--init (weights only) and --resume (a full checkpoint) exclude each other")
    problems += fsdp_refusals(args)
    if problems:
        p.error("; ".join(problems))
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * args.dp)
    return args


def init_distributed(args: argparse.Namespace) -> None:
    """What an RL worker does on its own: pick its GPU, join the group, build Megatron's groups."""
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # the user's own CUDA call
    # "nccl" as a GPU trainer writes it: portspeed's collective router gives it the adapter's backend
    dist.init_process_group(backend="nccl", timeout=datetime.timedelta(seconds=float(os.environ.get(
        "PORTSPEED_TIMEOUT", "300"))))
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)


def build(args: argparse.Namespace) -> tuple[list[torch.nn.Module], Any]:
    """GPTModel (TE spec) -> .cuda() -> the DP wrapper -> Megatron's optimizer, with the schedule's hooks."""
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=4 * args.hidden_size, tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
                     vocab_size=args.vocab_size, max_sequence_length=args.seq_length,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)
    model.model_type = ModelType.encoder_or_decoder
    model.cuda(torch.cuda.current_device())  # the user's own CUDA call, as Megatron-LM's get_model does
    distopt = args.use_distributed_optimizer or args.dp_wrapper == "megatron-fsdp"  # Megatron-FSDP needs it
    wrapped = wrap(args, config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, params_dtype=torch.float32, clip_grad=1.0,
                        use_distributed_optimizer=distopt), [wrapped])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    return [wrapped], optimizer


def wrap(args: argparse.Namespace, config: TransformerConfig, model: GPTModel) -> torch.nn.Module:
    """Megatron's DDP, Megatron-FSDP (``--data-parallel-sharding-strategy``) or torch FSDP2, as Megatron-LM's
    get_model builds them for --use-megatron-fsdp / --use-torch-fsdp2."""
    if args.dp_wrapper == "fsdp2":
        from megatron.core.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig

        return TorchFullyShardedDataParallel(config=config, module=model,
                                             ddp_config=TorchFullyShardedDataParallelConfig())
    if args.dp_wrapper == "megatron-fsdp":
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        return FullyShardedDataParallel(config=config, module=model, ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True, use_megatron_fsdp=True,
            data_parallel_sharding_strategy=args.data_parallel_sharding_strategy))
    return DistributedDataParallel(config=config, module=model, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=args.use_distributed_optimizer))


def fsdp_refusals(args: argparse.Namespace) -> list[str]:
    """What this loop does not do with an FSDP wrapper, each naming the flag and why (empty: nothing)."""
    if args.dp_wrapper == "ddp":
        return [] if args.data_parallel_sharding_strategy == "no_shard" else [
            "--data-parallel-sharding-strategy is Megatron-FSDP's: give --dp-wrapper megatron-fsdp with it"]
    flag, out = f"--dp-wrapper {args.dp_wrapper}", []
    for opt in ("save_init", "init", "save", "resume"):
        if getattr(args, opt):
            out.append(f"{flag} with --{opt.replace('_', '-')}: this example checkpoints Megatron DDP's "
                       f"sharded_state_dict (torch_dist); FSDP checkpoints (fsdp_dtensor, torch_dcp) are not wired "
                       f"into it: use --dp-wrapper ddp for checkpoints")
    if args.pp > 1:
        out.append(f"{flag} with --pp {args.pp}: not wired into this example (Megatron-LM refuses "
                   f"--use-torch-fsdp2 with pipeline parallelism); use --pp 1")
    if args.dp_wrapper == "fsdp2":
        if args.use_distributed_optimizer:
            out.append(f"{flag} with --use-distributed-optimizer: FSDP2 shards the optimizer state itself "
                       f"(Megatron-LM refuses the pair too); drop --use-distributed-optimizer")
        if not args.untie_embeddings_and_output_weights:
            out.append(f"{flag} needs --untie-embeddings-and-output-weights (as Megatron-LM's --use-torch-fsdp2 "
                       f"does): the embedding and the output layer are separate fully_shard units, which cannot "
                       f"share one weight")
    # upstream defects of the installed megatron-core: named now, before any process group (portspeed refuses the
    # same at start-up for any script: patches/megatron/core_fsdp_refusals.py)
    from portspeed.patches.megatron.core_fsdp_refusals import megatron_fsdp_defect, torch_fsdp2_defect

    defect = torch_fsdp2_defect() if args.dp_wrapper == "fsdp2" else \
        megatron_fsdp_defect(True, args.data_parallel_sharding_strategy)
    if defect:
        out.append(f"{flag}: {defect}")
    return out


# ---------------------------------------------------------------------- checkpoints
def _state(model: list, optimizer: Any, step: int, with_optimizer: bool, loading: bool) -> dict:
    sd: dict[str, Any] = {"step": step, "model": model[0].module.sharded_state_dict()}
    if with_optimizer:
        sd["optimizer"] = optimizer.sharded_state_dict(sd["model"], is_loading=loading)
    return sd


def save(path: str, model: list, optimizer: Any, step: int, with_optimizer: bool) -> None:
    """A torch_dist checkpoint (collective); any layout loads it (dist_checkpointing reshards)."""
    os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_state(model, optimizer, step, with_optimizer, loading=False), path)
    dist.barrier()


def load(path: str, model: list, optimizer: Any, full: bool) -> int:
    """Weights only (``full=False``: an initial policy) or model + optimizer + step; returns the step."""
    state = dist_checkpointing.load(_state(model, optimizer, 0, full, loading=True), path)
    model[0].module.load_state_dict(state["model"])
    if not full:
        optimizer.reload_model_params()
        return 0
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


# ---------------------------------------------------------------------- data and losses
def rollout(args: argparse.Namespace, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed batch of rollout ``step``: token ids (global, seq+1) and one advantage per sequence."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    tokens = torch.randint(0, args.vocab_size, (args.global_batch_size, args.seq_length + 1), generator=g)
    adv = torch.randn(args.global_batch_size, generator=g)
    return tokens, (adv - adv.mean()) / (adv.std() + 1e-6)  # GRPO-style normalised advantages


def microbatches(args: argparse.Namespace, step: int, old: torch.Tensor | None) -> Iterator[dict]:
    """This DP rank's micro-batches, moved with the user's own ``.cuda()`` / ``device="cuda"``."""
    tokens, adv = rollout(args, step)
    local = args.global_batch_size // args.dp
    first = ps.get_data_parallel_rank() * local
    s, mb = args.seq_length, args.micro_batch_size
    mask = torch.ones(1, 1, s, s, dtype=torch.bool, device="cuda").triu(1)  # True: a future token
    pos = torch.arange(s, device="cuda").unsqueeze(0).expand(mb, s)
    for j in range(args.num_microbatches):
        rows = slice(first + j * mb, first + (j + 1) * mb)
        batch = tokens[rows].cuda()
        out = {"tokens": batch[:, :-1].contiguous(), "labels": batch[:, 1:].contiguous(), "position_ids": pos,
               "attention_mask": mask, "adv": adv[rows].cuda()}
        if old is not None:
            out["old_logp"] = old[j * mb:(j + 1) * mb]
        yield out


def logprob_loss(batch: dict, output: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Forward-only: the model's per-token cross entropy is minus the log-prob of each label."""
    return output.sum() * 0.0, {"logp": -output.detach()}


def ppo_loss(batch: dict, output: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Clipped-ratio policy loss, mean over tokens; the ratio is against the rollout's log-probs."""
    ratio = torch.exp(-output - batch["old_logp"])
    adv = batch["adv"].unsqueeze(1)
    loss = -torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv).mean()
    return loss, {"pg loss": loss.detach().clone()}


def forward_step(loss_func: Any, data: Iterator, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    batch = next(data)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, partial(loss_func, batch)


def run_schedule(args: argparse.Namespace, model: list, data: Iterator, loss_func: Any, forward_only: bool) -> list:
    return get_forward_backward_func()(
        forward_step_func=partial(forward_step, loss_func), data_iterator=data, model=model,
        num_microbatches=args.num_microbatches, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, forward_only=forward_only)


def compute_log_probs(args: argparse.Namespace, model: list, step: int) -> torch.Tensor | None:
    """Per-token log-probs (local rows, seq) of rollout ``step``, on the last pipeline stage (else None)."""
    with torch.no_grad():
        out = run_schedule(args, model, microbatches(args, step, None), logprob_loss, forward_only=True)
    return torch.cat([o["logp"] for o in out]) if ps.is_pipeline_last_stage() else None


def update(args: argparse.Namespace, model: list, optimizer: Any, step: int, old: torch.Tensor | None) -> tuple:
    """One policy update; returns (DP-mean loss on the last stage else None, grad norm)."""
    model[0].zero_grad_buffer()
    optimizer.zero_grad()
    out = run_schedule(args, model, microbatches(args, step, old), ppo_loss, forward_only=False)
    _, grad_norm, _ = optimizer.step()
    if not ps.is_pipeline_last_stage():
        return None, grad_norm
    loss = torch.stack([o["pg loss"] for o in out]).mean()
    dist.all_reduce(loss, group=ps.get_data_parallel_group())
    return loss.item() / args.dp, grad_norm


def gather_rows(local: torch.Tensor) -> torch.Tensor:
    """The global batch's rows from every DP rank (collective over the DP group)."""
    parts = [torch.empty_like(local) for _ in range(ps.get_data_parallel_world_size())]
    dist.all_gather(parts, local.contiguous(), group=ps.get_data_parallel_group())
    return torch.cat(parts)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    init_distributed(args)
    model, optimizer = build(args)
    start = 0
    if args.init:
        load(args.init, model, optimizer, full=False)
    elif args.resume:
        start = load(args.resume, model, optimizer, full=True)
    if args.save_init:
        save(args.save_init, model, optimizer, 0, with_optimizer=False)
    reporter = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and \
        ps.get_data_parallel_rank() == 0
    layout = {"tp": args.tp, "pp": args.pp, "dp": args.dp, "vpp": None}
    facts = {"backend": dist.get_backend(), "accelerator": get_accelerator().name}
    losses = open_loss_log(args.loss_log, layout, "fp32", **facts) if reporter else None
    logprobs = open_loss_log(args.logprob_log, layout, "fp32", **facts) if reporter else None
    for record in (r for r in (losses, logprobs) if r is not None):
        record.record.meta["real_backend"] = ps_comm.real_backend()  # get_backend() answers "nccl", as asked
        record.record.meta["dp_wrapper"] = args.dp_wrapper + (
            f" {args.data_parallel_sharding_strategy}" if args.dp_wrapper == "megatron-fsdp" else "")
    tokens_per_step = args.global_batch_size * args.seq_length
    for step in range(start + 1, start + args.steps + 1):
        old = compute_log_probs(args, model, step)
        if old is not None:
            full = gather_rows(old)
            if logprobs is not None:  # one entry per token: `portspeed compare` then checks every log-prob
                logprobs.record.meta["what"] = "negative log-prob of each label token; iteration = token index"
                first = (step - 1) * tokens_per_step + 1
                nll = [IterationLoss(first + i, -v) for i, v in enumerate(full.flatten().tolist())]
                logprobs.record.iterations += nll
                logprobs.flush()
            if reporter:
                print(f"step {step} | mean log-prob: {full.mean().item()!r}", flush=True)
        for epoch in range(1, args.ppo_epochs + 1):
            loss, grad_norm = update(args, model, optimizer, step, old)
            it = (step - 1) * args.ppo_epochs + epoch
            if reporter:
                print(f"iteration {it} | lm loss: {loss!r} | grad norm: {grad_norm!r}", flush=True)
                if losses is not None:
                    losses.add(it, loss, grad_norm)
        torch.cuda.synchronize()  # the user's own CUDA calls, as a trainer logs memory per step
        if reporter:
            print(f"step {step} | memory allocated: {torch.cuda.memory_allocated()} bytes on device "
                  f"{torch.cuda.current_device()}", flush=True)
        if args.save and step == (args.save_step or start + args.steps):
            save(args.save, model, optimizer, step, with_optimizer=True)
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
