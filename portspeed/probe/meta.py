"""The run meta of a dump (``"portspeed"`` in dump.json) and the parallel sizes layouts depend on.

Why read from Megatron's ``parallel_state`` and the model's config rather than asked for: the
probe sits under an unedited script, so what the layout is must be found where Megatron keeps
it; without Megatron (DeepSpeed, the HF Trainer, an own loop) the data-parallel size is the world
and everything else is 1. Nothing here issues a collective: every value is this rank's own.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

import torch

from portspeed.probe import sharding as lay
from portspeed.probe.modules import ModuleTable

__all__ = ["FORMAT", "VERSION", "parallel_of", "run_meta", "megatron_ranks"]

FORMAT = "portspeed-probe"
VERSION = 1


def _ps() -> Any:
    """megatron.core.parallel_state when Megatron set it up in this process, else None."""
    ps = sys.modules.get("megatron.core.parallel_state")
    try:
        return ps if ps is not None and ps.model_parallel_is_initialized() else None
    except Exception:  # a release without the call, or a half-torn-down state
        return None


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    import os

    return int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)


def _config(table: ModuleTable) -> Any:
    return getattr(table.roots[0], "config", None) if table.roots else None


def parallel_of(table: ModuleTable, chunks: Sequence[torch.nn.Module]) -> lay.Parallel:
    """The sizes of this run's parallel groups (Megatron's, or dp = world without it)."""
    ps = _ps()
    if ps is None:
        return lay.Parallel(dp=_world()[1])
    config = _config(table)
    ddp = getattr(chunks[0], "ddp_config", None) if chunks else None
    etp = getattr(ps, "get_expert_tensor_parallel_world_size", lambda: ps.get_tensor_model_parallel_world_size())()
    return lay.Parallel(tp=ps.get_tensor_model_parallel_world_size(), cp=ps.get_context_parallel_world_size(),
                        ep=ps.get_expert_model_parallel_world_size(), etp=etp or 1,
                        dp=ps.get_data_parallel_world_size(), sp=bool(getattr(config, "sequence_parallel", False)),
                        distributed_optimizer=bool(getattr(ddp, "use_distributed_optimizer", False)))


def megatron_ranks() -> dict[str, int]:
    """This rank's place in Megatron's groups (all 0 without Megatron but dp = the global rank)."""
    ps = _ps()
    if ps is None:
        return {"tp": 0, "pp": 0, "cp": 0, "ep": 0, "dp": _world()[0]}
    return {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
            "cp": ps.get_context_parallel_rank(), "ep": ps.get_expert_model_parallel_rank(),
            "dp": ps.get_data_parallel_rank()}


#: distribution -> the module whose import means the run uses it
_FRAMEWORKS = {"megatron-core": "megatron.core", "deepspeed": "deepspeed", "transformers": "transformers"}


def _versions() -> dict[str, str | None]:
    """portspeed's and torch's releases, and those of the frameworks this process imported."""
    from portspeed.versions import distribution_version

    out = {}
    for d in ("portspeed", "torch", *(d for d, m in _FRAMEWORKS.items() if m in sys.modules)):
        v = distribution_version(d)
        out[d] = None if v is None else str(v)
    return out


def _dtype(table: ModuleTable) -> str:
    for root in table.roots:
        for p in root.parameters():
            if p.is_floating_point():
                return str(p.dtype).replace("torch.", "")
    return "float32"


def _dropout(table: ModuleTable) -> bool:
    config = _config(table)
    if config is not None and hasattr(config, "hidden_dropout"):
        return bool(getattr(config, "hidden_dropout", 0) or getattr(config, "attention_dropout", 0))
    return any(type(i.module).__name__.startswith("Dropout") and getattr(i.module, "p", 0) > 0 and i.module.training
               for i in table.infos)


def _model(table: ModuleTable, parallel: lay.Parallel, pp: int) -> dict[str, Any]:
    config = _config(table)
    vocab = None
    for info in table.infos:  # Megatron's vocab-parallel table (its global size), else a word-embedding table
        if info.cls == "VocabParallelEmbedding" or (info.cls == "Embedding" and any(
                w in info.path for w in ("word", "embed_tokens", "wte"))):
            vocab = getattr(info.module, "num_embeddings", None)
            break
    params = None
    if pp == 1 and parallel.ep == 1:  # otherwise other ranks hold parts this one cannot count without a collective
        total = 0
        for info in table.infos:
            for name, p in info.module.named_parameters(recurse=False):
                split = lay.param_layout(info.module, name, parallel)
                total += p.numel() * (parallel.tp if "tp" in split.get("dims", {}) else 1)
        params = total
    return {"num_layers": table.num_layers, "hidden_size": getattr(config, "hidden_size", None),
            "num_attention_heads": getattr(config, "num_attention_heads", None),
            "ffn_hidden_size": getattr(config, "ffn_hidden_size", None), "vocab_size": vocab,
            "num_moe_experts": getattr(config, "num_moe_experts", None), "parameters": params}


def _backends() -> tuple[str | None, str | None]:
    """(the backend the default group runs on, the one the script asked for when it differs, else None).

    Why both: the script's name is not what ran. Megatron asks for ``nccl``; on the CPU adapter the router makes
    the group on Gloo, and ``dist.get_backend()`` answers ``nccl`` back to framework code (``portspeed.comm``).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None, None
    from portspeed.comm import real_backend, requested_backend

    asked = requested_backend() or dist.get_backend()
    try:
        ran = real_backend()
    except ValueError:  # a default group torch does not list (torn down): what it answers is all there is
        ran = asked
    return ran, (asked if asked != ran else None)


def run_meta(*, iteration: int, level: str, framework: str, table: ModuleTable, chunks: Sequence[torch.nn.Module],
             parallel: lay.Parallel, context: dict[str, Any], micro_batches: int, nan_check: bool,
             loss_scale: float | None) -> dict[str, Any]:
    """The ``"portspeed"`` block of dump.json (docs/probe-format.md, "The run meta")."""
    rank, world = _world()
    ps = _ps()
    pp = ps.get_pipeline_model_parallel_world_size() if ps is not None else 1
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() if ps is not None else None
    try:
        from portspeed.accelerator import get_accelerator

        acc = get_accelerator()
        device, adapter = acc.device_type, acc.name
    except Exception:  # no adapter can be chosen here: the model's device says enough
        device, adapter = None, None
    backend, asked = _backends()
    mbs = context.get("micro_batch_size")
    gbs = mbs * micro_batches * parallel.dp if isinstance(mbs, int) else context.get("global_batch_size")
    scale = context.get("grad_scale")
    if scale is not None and loss_scale is not None:
        scale = scale * loss_scale
    return {"format": FORMAT, "version": VERSION, "iteration": iteration, "rank": rank, "world": world,
            "level": level, "framework": framework, "releases": _versions(), "device": device,
            "backend": backend, **({"backend_requested": asked} if asked else {}), "adapter": adapter,
            "dtype": _dtype(table),
            "layout": {"tp": parallel.tp, "pp": pp, "vpp": vpp, "cp": parallel.cp, "ep": parallel.ep,
                       "etp": parallel.etp, "dp": parallel.dp, "sp": parallel.sp,
                       "distributed_optimizer": parallel.distributed_optimizer},
            "ranks": megatron_ranks(), "dp_order": context.get("dp_order", "unknown"),
            "micro_batches": micro_batches, "micro_batch_size": mbs, "global_batch_size": gbs,
            "grad_scale": scale, "dropout": _dropout(table), "model": _model(table, parallel, pp),
            "nan_check": nan_check, "chunks": len(chunks)}
