"""Checkpoints of examples/pretrain_gpt.py: torch_dist format, Megatron-LM's layout, and the save-time fault.

Kept apart from the trainer so each file stays one concept. What it guarantees:

- any layout loads any other's checkpoint (``dist_checkpointing`` reshards: TP2xPP2 -> TP1, DP2);
- with ``--save-interval`` / ``--resume`` a checkpoint goes to ``SAVE/iter_0000005`` and the
  tracker ``SAVE/latest_checkpointed_iteration.txt`` is replaced (atomically, by rank 0) only
  after every rank finished writing, so a crash during save N leaves the tracker on N-1;
- a plain final ``--save DIR`` (no interval) writes one checkpoint into DIR itself, as before;
- ``--fail-at RANK:ITER:save`` (fault tests) kills RANK in the middle of writing checkpoint
  ITER: its shard is half-written and the other ranks are inside the collective save.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Any

import torch.distributed as dist
from megatron.core import dist_checkpointing

from portspeed.parity import checkpoints

__all__ = ["sharded_state", "load_checkpoint", "save_checkpoint", "resume_point", "uses_tracker"]


def sharded_state(model: list, optimizer: Any, iteration: int, with_optimizer: bool, loading: bool) -> dict:
    """The sharded state dict of the model chunks (and optimizer): what dist_checkpointing saves and loads."""
    sd: dict[str, Any] = {"iteration": iteration}
    model_sd: dict[str, Any] = {}
    for i, chunk in enumerate(model):
        key = "model" if len(model) == 1 else f"model{i}"
        model_sd[key] = chunk.module.sharded_state_dict()
    sd.update(model_sd)
    if with_optimizer:
        sd["optimizer"] = optimizer.sharded_state_dict(model_sd if len(model) > 1 else model_sd["model"],
                                                       is_loading=loading)
    return sd


def uses_tracker(args: argparse.Namespace) -> bool:
    """Megatron-LM's iter_*/tracker layout (periodic saves, resumable) rather than one final checkpoint in --save."""
    return bool(args.save_interval or args.resume)


def resume_point(args: argparse.Namespace) -> None:
    """Decide what to load, on every rank before any process group (bad directories exit 2 here).

    Sets ``args.load_dir`` (a complete torch_dist directory or None) and ``args.load_full``
    (model + optimizer + iteration, else weights only for --finetune).
    """
    args.load_dir, args.load_full = None, not args.finetune
    try:
        if args.resume and args.save and checkpoints.read_tracker(args.save) is not None:
            args.load_dir, _ = checkpoints.resolve(args.save)  # a restart: continue where the last save ended
            args.load_full = True
        elif args.load:
            args.load_dir, _ = checkpoints.resolve(args.load)
    except checkpoints.CheckpointError as exc:
        prog = os.path.basename(sys.argv[0])  # pretrain_gpt.py, or generate_gpt.py, which parses the same flags
        print(f"{prog if prog.endswith('.py') else 'pretrain_gpt.py'}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def load_checkpoint(args: argparse.Namespace, model: list, optimizer: Any) -> int:
    """Load ``args.load_dir``; returns the iteration to continue from (0 for a weights-only --finetune load)."""
    sd = sharded_state(model, optimizer, 0, args.load_full, loading=True)
    state = dist_checkpointing.load(sd, str(args.load_dir))
    for i, chunk in enumerate(model):
        chunk.module.load_state_dict(state["model" if len(model) == 1 else f"model{i}"])
    if args.load_full:
        optimizer.load_state_dict(state["optimizer"])
        return int(state["iteration"])
    # weights only: the optimizer's fp32 main copies (bf16) still hold the initial weights
    # (as Megatron-LM does after a --finetune load)
    optimizer.reload_model_params()
    return 0


def _die_mid_save(args: argparse.Namespace, target: str) -> None:
    """Fault injection: write half a shard, then exit as a killed writer would (no clean-up)."""
    with open(os.path.join(target, f"__{dist.get_rank()}_0.distcp"), "wb") as f:
        f.write(b"PK\x03\x04" + b"\0" * 4096)  # the start of a shard, never finished
        f.flush()
        os.fsync(f.fileno())
    print(f"rank {dist.get_rank()}: --fail-at {args.fail_at}: dying while writing checkpoint {args.fail_iter}",
          file=sys.stderr, flush=True)
    os._exit(17)


def save_checkpoint(args: argparse.Namespace, model: list, optimizer: Any, iteration: int) -> None:
    """Save (collective); with the tracker layout, commit it by moving the tracker once every rank is done."""
    for chunk in model:
        if args.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)
    tracked = uses_tracker(args)
    target = str(checkpoints.iteration_dir(args.save, iteration)) if tracked else args.save
    if dist.get_rank() == 0 and tracked and os.path.isdir(target):
        shutil.rmtree(target)  # a half-written directory of an earlier, crashed attempt
    dist.barrier()
    os.makedirs(target, exist_ok=True)
    if args.fail_save and args.fail_rank == dist.get_rank() and args.fail_iter == iteration:
        _die_mid_save(args, target)
    dist_checkpointing.save(sharded_state(model, optimizer, iteration, True, loading=False), target)
    dist.barrier()  # every shard and the metadata are on disk
    if tracked and dist.get_rank() == 0:
        checkpoints.write_tracker(args.save, iteration)
    dist.barrier()
