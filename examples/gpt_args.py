"""The command line of examples/pretrain_gpt.py: its flags, and the checks argparse cannot express.

Kept apart from the trainer so each file stays one concept. Every bad combination is refused here,
on every rank before any process group exists, in one line naming the flag and the fix, exit 2
(``pretrain_gpt.py: ...``), as argparse refuses a bad value. ``check_args`` also fills what the
layout implies (``args.dp``, ``args.num_microbatches``, the parsed ``--fail-at`` and ``--plant-*``
values) and decides what to load (``gpt_checkpoint.resume_point``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from gpt_checkpoint import resume_point

__all__ = ["DESCRIPTION", "check_args", "check_model_args", "check_plants", "parse_args"]

DESCRIPTION = ("Pretrain a tiny GPT on megatron-core alone (no megatron.training), on whatever accelerator "
               "portspeed picks.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line; layout checks that argparse cannot express are in ``check_args``."""
    p = argparse.ArgumentParser(description=DESCRIPTION)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank (needs --pp > 1)")
    p.add_argument("--cp", type=int, default=1,
                   help="context-parallel size (needs --transformer-impl transformer_engine)")
    p.add_argument("--dp", type=int, default=None,
                   help="data-parallel size (implied: world / (tp*pp*cp)); checked if given")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (needs --num-experts)")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=128, help="must be divisible by --tp (no padding here)")
    p.add_argument("--transformer-impl", choices=("local", "transformer_engine"), default="local",
                   help="Megatron's layer spec: local, or the Transformer Engine spec (portspeed's portable TE "
                        "off CUDA: its kernel table reaches the adapter's vendor kernels)")
    p.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    p.add_argument("--num-experts", type=int, default=None,
                   help="mixture of experts in every layer (SequentialMLP local experts, alltoall dispatcher)")
    p.add_argument("--moe-router-topk", type=int, default=2, help="experts per token (with --num-experts)")
    p.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                   help="Megatron's load-balancing loss (aux_loss) coefficient; 0 (default): no such loss")
    p.add_argument("--hidden-dropout", type=float, default=0.0)
    p.add_argument("--attention-dropout", type=float, default=0.0)
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
    p.add_argument("--plant-divergence", type=int, default=None, metavar="ITER",
                   help="TEST-ONLY: scale the gradient into decoder layer --plant-layer by --plant-factor from ITER on")
    p.add_argument("--plant-layer", type=int, default=1, help="TEST-ONLY: 0-based decoder layer for --plant-divergence")
    p.add_argument("--plant-factor", type=float, default=3.0, help="TEST-ONLY: gradient factor for --plant-divergence")
    p.add_argument("--plant-reduce-avg", default=None, metavar="LAYER[:ITER]",
                   help="TEST-ONLY: the row-parallel all_reduce of decoder layer LAYER's self_attention.linear_proj "
                        "is an average instead of a sum in iteration ITER (default 1); needs --tp >= 2")
    p.add_argument("--plant-nan", default=None, metavar="ITER:LAYER",
                   help="TEST-ONLY: one element of decoder layer LAYER's output becomes NaN in iteration ITER")
    p.add_argument("--plant-slow", default=None, metavar="LAYER:MS[:RANK]",
                   help="TEST-ONLY: decoder layer LAYER's MLP forward ('*': every layer's) sleeps MS milliseconds (on "
                        "global rank RANK only)")
    p.add_argument("--plant-item", default=None, metavar="LAYER:COUNT",
                   help="TEST-ONLY: decoder layer LAYER's MLP forward makes COUNT .item() host round trips")
    args = p.parse_args(argv)
    check_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    return args


def check_args(args: argparse.Namespace, world: int) -> None:
    """Reject layouts that cannot work, naming the flag and the fix."""
    def fail(msg: str) -> None:
        print(f"pretrain_gpt.py: {msg}", file=sys.stderr)
        raise SystemExit(2)  # a usage error, as argparse's

    if args.cp < 1 or args.ep < 1:
        fail(f"--cp {args.cp} and --ep {args.ep} must be at least 1")
    model_parallel = args.tp * args.pp * args.cp
    if world % model_parallel:
        fail(f"world size {world} is not divisible by --tp {args.tp} x --pp {args.pp} x --cp {args.cp}")
    dp = world // model_parallel
    if args.dp is not None and args.dp != dp:
        fail(f"--dp {args.dp} does not match world {world} / (tp {args.tp} x pp {args.pp} x cp {args.cp}) = {dp}")
    args.dp = dp
    check_model_args(args, fail)
    if args.vocab_size % args.tp:
        fail(f"--vocab-size {args.vocab_size} must be divisible by --tp {args.tp} "
             "so every layout sees the same vocabulary")
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
    if args.plant_divergence is not None and not 0 <= args.plant_layer < args.num_layers:
        fail(f"--plant-layer {args.plant_layer} must be a decoder layer index in 0..{args.num_layers - 1}")
    check_plants(args, fail)
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


def check_model_args(args: argparse.Namespace, fail: Callable[[str], None]) -> None:
    """The model options (impl, CP, MoE, dropout): what Megatron would refuse later, refused now in one line."""
    te = args.transformer_impl == "transformer_engine"
    if args.cp > 1 and not te:
        fail(f"--cp {args.cp} needs --transformer-impl transformer_engine (Megatron's local attention has no "
             "context parallelism)")
    if args.seq_length % (2 * args.cp):
        fail(f"--seq-length {args.seq_length} must be divisible by 2 x --cp {args.cp} (two chunks per CP rank)")
    if args.num_experts is None:
        if args.ep > 1:
            fail(f"--ep {args.ep} needs --num-experts N (expert parallelism splits the experts)")
    else:
        if args.num_experts < 1 or args.num_experts % args.ep:
            fail(f"--num-experts {args.num_experts} must be a positive multiple of --ep {args.ep}")
        if (args.cp * args.dp) % args.ep:
            fail(f"--ep {args.ep} must divide cp x dp = {args.cp * args.dp} (the experts' tensor-parallel size is "
                 f"--tp, as Megatron's default)")
        if not 1 <= args.moe_router_topk <= args.num_experts:
            fail(f"--moe-router-topk {args.moe_router_topk} must be in 1..--num-experts {args.num_experts}")
        if args.tp > 1 and not args.sequence_parallel:
            fail(f"--num-experts with --tp {args.tp} needs --sequence-parallel (Megatron's MoE layer requires it)")
        if args.moe_aux_loss_coeff < 0:
            fail(f"--moe-aux-loss-coeff {args.moe_aux_loss_coeff} must be >= 0")
    for flag in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(args, flag) < 1.0:
            fail(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be in [0, 1)")


def check_plants(args: argparse.Namespace, fail: Callable[[str], None]) -> None:
    """The TEST-ONLY planted faults: their arguments parsed (``args.plant_*_at``), one plant at a time."""
    given = [f for f in ("plant_divergence", "plant_reduce_avg", "plant_nan", "plant_slow", "plant_item")
             if getattr(args, f) is not None]
    if len(given) > 1:
        fail(f"TEST-ONLY plants go one at a time; got {', '.join('--' + f.replace('_', '-') for f in given)}")
    last = args.num_layers - 1
    args.plant_reduce_avg_at = args.plant_nan_at = None
    if args.plant_reduce_avg is not None:
        parts = args.plant_reduce_avg.split(":")
        try:
            if len(parts) > 2:
                raise ValueError
            layer, it = int(parts[0]), int(parts[1]) if len(parts) == 2 else 1
        except ValueError:
            fail(f"--plant-reduce-avg {args.plant_reduce_avg!r} must be LAYER or LAYER:ITER, e.g. 1:1")
        if not 0 <= layer <= last or it < 1:
            fail(f"--plant-reduce-avg {args.plant_reduce_avg!r}: LAYER in 0..{last}, ITER >= 1")
        if args.tp < 2 or args.sequence_parallel or args.transformer_impl != "local":
            fail("--plant-reduce-avg plants into Megatron's RowParallelLinear all_reduce: it needs --tp >= 2, "
                 "no --sequence-parallel (that reduce-scatters) and --transformer-impl local")
        args.plant_reduce_avg_at = (layer, it)
    if args.plant_nan is not None:
        parts = args.plant_nan.split(":")
        try:
            if len(parts) != 2:
                raise ValueError
            it, layer = int(parts[0]), int(parts[1])
        except ValueError:
            fail(f"--plant-nan {args.plant_nan!r} must be ITER:LAYER, e.g. 3:1")
        if not 0 <= layer <= last or it < 1:
            fail(f"--plant-nan {args.plant_nan!r}: ITER >= 1, LAYER in 0..{last}")
        args.plant_nan_at = (it, layer)
    args.plant_slow_at = args.plant_item_at = None
    if args.plant_slow is not None:
        parts = args.plant_slow.split(":")
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            layer, ms = (None if parts[0] == "*" else int(parts[0])), float(parts[1])
            rank = int(parts[2]) if len(parts) == 3 else None
        except ValueError:
            fail(f"--plant-slow {args.plant_slow!r} must be LAYER:MS or LAYER:MS:RANK (LAYER '*': every layer), "
                 "e.g. 1:30 or '*:20:1'")
        if layer is not None and not 0 <= layer <= last or not ms > 0:
            fail(f"--plant-slow {args.plant_slow!r}: LAYER in 0..{last} or '*', MS > 0")
        args.plant_slow_at = (layer, ms, rank)
    if args.plant_item is not None:
        parts = args.plant_item.split(":")
        try:
            if len(parts) != 2:
                raise ValueError
            layer, count = int(parts[0]), int(parts[1])
        except ValueError:
            fail(f"--plant-item {args.plant_item!r} must be LAYER:COUNT, e.g. 1:4")
        if not 0 <= layer <= last or count < 1:
            fail(f"--plant-item {args.plant_item!r}: LAYER in 0..{last}, COUNT >= 1")
        args.plant_item_at = (layer, count)
