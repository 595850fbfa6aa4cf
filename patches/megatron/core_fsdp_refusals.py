"""Megatron-FSDP and torch FSDP2 set-ups that upstream cannot train are refused at start-up, naming the flag.

Why: each of these fails on every device, CUDA included (upstream defects, not a port's), and
fails late or silently; refusing when the wrapper (torch FSDP2) or the optimizer (Megatron-FSDP)
is built, before iteration 1, names the option and what to use instead. The Megatron-FSDP checks
sit on ``get_megatron_optimizer`` because the optimizer is what goes wrong (a plain one) and
because it exists in every release (after core_v0.19 ``FullyShardedDataParallel`` is a factory
function); they apply only when the chunks' ``ddp_config.use_megatron_fsdp`` is set (so the
standalone ``megatron_fsdp.fully_shard`` API, which builds no such optimizer, is untouched).
Portspeed does not rewrite the code: the fixes are upstream's. Found with
examples/rl_actor_loop.py (``--dp-wrapper``) and the stock ``pretrain_gpt.py`` (docs/megatron.md,
"Megatron-FSDP and torch FSDP2").

- **Torch FSDP2** (``--use-torch-fsdp2``, ``TorchFullyShardedDataParallel``), megatron-core 0.16
  to 0.18: ``finalize_model_grads`` calls ``model_chunk.finish_grad_sync(force_all_reduce=...)``
  (``megatron/core/distributed/finalize_model_grads.py:443`` at core_v0.16.1) but the class
  inherits ``_BaseDataParallel.finish_grad_sync(self)`` (``data_parallel_base.py:49`` at
  core_v0.16.1): the first step dies with a TypeError. core_v0.19.0 gives the class its own
  ``finish_grad_sync(self, force_all_reduce=False)`` (``torch_fully_sharded_data_parallel.py:152``).
  Detected from the signatures of the imported release.
- **Megatron-FSDP without the distributed optimizer** (``--use-megatron-fsdp`` without
  ``--use-distributed-optimizer``; ``OptimizerConfig(use_distributed_optimizer=False)``), every
  release: the plain optimizer's updates do not reach the parameters Megatron-FSDP computes
  with, and training goes wrong without an error (examples/rl_actor_loop.py on 0.16.1 and 0.19.2:
  the same loss and grad norm on every update of a batch; the stock ``pretrain_gpt.py`` DP2 on
  core_v0.16.1: DDP's losses for two iterations, then 7.5e-3 apart at the third). Megatron-LM
  from core_v0.18.0 turns the distributed optimizer on itself (``megatron/training/arguments.py:1106``
  at core_v0.19.0); before that, and from one's own loop, nothing does.
- **Megatron-FSDP ``no_shard`` with the distributed optimizer**, megatron-core 0.15 to 0.17:
  ``MegatronFSDP.start_param_sync`` all-gathers weight buckets that ``no_shard`` never builds
  (``megatron_fsdp/megatron_fsdp.py:1126`` at core_v0.16.1: ``AttributeError: 'NoneType' object
  has no attribute 'fetch_bucket'`` at the first optimizer step); core_v0.18.0 returns early for
  ``no_shard`` (``megatron_fsdp.py:1246``). Detected from that method's source (run on 0.16.1
  and 0.19.2; 0.15 and 0.17 read from the source only).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from portspeed.errors import UnsupportedOptionError
from portspeed.patching.record import WRAP, Patch

from .ranges import CORE, DISTRIBUTION

__all__ = ["PATCHES", "megatron_fsdp_defect", "refuse_broken_megatron_fsdp", "refuse_broken_torch_fsdp2",
           "torch_fsdp2_defect"]

_FSDP2 = "megatron.core.distributed.torch_fully_sharded_data_parallel"
_MFSDP_CORE = "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp"


def _release() -> str:
    import megatron.core

    return str(getattr(megatron.core, "__version__", "?"))


def _takes(func: Any, name: str) -> bool:
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return True  # cannot tell: do not refuse
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def torch_fsdp2_defect() -> str | None:
    """Why the imported megatron-core cannot train with TorchFullyShardedDataParallel (None: it can)."""
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads").finalize_model_grads
    fsdp2 = importlib.import_module(_FSDP2).TorchFullyShardedDataParallel
    # finalize_model_grads takes force_all_reduce from 0.16 on and hands it to every chunk's finish_grad_sync
    if not _takes(finalize, "force_all_reduce") or _takes(fsdp2.finish_grad_sync, "force_all_reduce"):
        return None
    return (f"megatron-core {_release()}'s finalize_model_grads calls model_chunk.finish_grad_sync(force_all_reduce="
            f"...) (megatron/core/distributed/finalize_model_grads.py), but TorchFullyShardedDataParallel inherits "
            f"_BaseDataParallel.finish_grad_sync(self) (megatron/core/distributed/data_parallel_base.py), which takes "
            f"no such argument: the first training step would die with a TypeError on every device, CUDA included "
            f"(an upstream defect of megatron-core 0.16 to 0.18, fixed in 0.19.0). Use megatron-core >= 0.19, or "
            f"Megatron-FSDP (--use-megatron-fsdp --use-distributed-optimizer), or Megatron's DDP")


def megatron_fsdp_defect(use_distributed_optimizer: bool, strategy: str) -> str | None:
    """Why Megatron-FSDP with these settings cannot train on the imported megatron-core (None: it can)."""
    if not use_distributed_optimizer:
        return ("Megatron-FSDP needs Megatron's distributed optimizer (--use-distributed-optimizer; from your own "
                "code OptimizerConfig(use_distributed_optimizer=True), and the same in DistributedDataParallelConfig): "
                "without it the optimizer's updates do not reach the parameters Megatron-FSDP computes with and "
                "training goes wrong without an error, on every device (Megatron-LM turns it on itself from "
                "core_v0.18.0). Add --use-distributed-optimizer")
    if strategy == "no_shard":
        try:
            start = importlib.import_module(_MFSDP_CORE).MegatronFSDP.start_param_sync
            fixed = "no_shard" in inspect.getsource(start)
        except (ImportError, AttributeError, OSError, TypeError):
            fixed = True  # cannot tell: do not refuse
        if not fixed:
            return (f"--data-parallel-sharding-strategy no_shard: megatron-core {_release()}'s MegatronFSDP."
                    f"start_param_sync (called by the distributed optimizer's step) all-gathers weight buckets that "
                    f"no_shard never builds (megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py): "
                    f"AttributeError 'NoneType' object has no attribute 'fetch_bucket' at the first step on every "
                    f"device (an upstream defect of megatron-core 0.15 to 0.17, fixed in 0.18.0). Use "
                    f"--data-parallel-sharding-strategy optim, optim_grads or optim_grads_params, or Megatron's DDP")
    return None


def refuse_broken_torch_fsdp2(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of TorchFullyShardedDataParallel.__init__: refuse before sharding when the release is broken."""
    defect = torch_fsdp2_defect()
    if defect:
        raise UnsupportedOptionError(f"portspeed: torch FSDP2 (--use-torch-fsdp2, TorchFullyShardedDataParallel): "
                                     f"{defect}")
    return wrapped(*args, **kwargs)


def refuse_broken_megatron_fsdp(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of get_megatron_optimizer: refuse an optimizer for Megatron-FSDP chunks that cannot train them."""
    try:
        bound = inspect.signature(wrapped).bind(*args, **kwargs).arguments
    except TypeError:
        bound = {}  # let Megatron report its own argument error
    chunks = bound.get("model_chunks") or []
    ddp_config = getattr(chunks[0], "ddp_config", None) if chunks else None
    if getattr(ddp_config, "use_megatron_fsdp", False) is True:
        distopt = bool(getattr(bound.get("config"), "use_distributed_optimizer", True))
        defect = megatron_fsdp_defect(distopt, str(getattr(ddp_config, "data_parallel_sharding_strategy", "")))
        if defect:
            raise UnsupportedOptionError(f"portspeed: Megatron-FSDP (--use-megatron-fsdp): {defect}")
    return wrapped(*args, **kwargs)


PATCHES: list[Patch] = [
    Patch(
        name="megatron.core.fsdp.refuse_torch_fsdp2_finish_grad_sync",
        target=f"{_FSDP2}:TorchFullyShardedDataParallel.__init__",
        kind=WRAP,
        impl=refuse_broken_torch_fsdp2,
        distribution=DISTRIBUTION,
        versions=CORE,
        reason="megatron-core 0.16-0.18's finalize_model_grads passes force_all_reduce to a finish_grad_sync that "
        "TorchFullyShardedDataParallel does not take (a TypeError at the first step on every device): refuse "
        "--use-torch-fsdp2 when the model is wrapped, naming the defect.",
    ),
    Patch(
        name="megatron.core.fsdp.refuse_megatron_fsdp_untrainable",
        target="megatron.core.optimizer:get_megatron_optimizer",
        kind=WRAP,
        impl=refuse_broken_megatron_fsdp,
        distribution=DISTRIBUTION,
        versions=CORE,
        reason="Megatron-FSDP without the distributed optimizer trains wrong without an error (every release), and "
        "no_shard with it dies at the first step before megatron-core 0.18: refuse both when the optimizer is built "
        "for Megatron-FSDP chunks, naming the flag.",
    ),
]
