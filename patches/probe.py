"""The probe's patches, declared only when probing is configured (``PORTSPEED_PROBE_DIR``; probing off: none).

- ``torch.distributed``'s collectives and point-to-point calls, wrapped by
  ``portspeed.probe.collectives.recorded`` at ``--probe-level op`` (a collective is not a torch
  function, so the op-level mode does not see it). Each wrapper sits outside the router's and the
  flight recorder's (``order``), so it sees the caller's call; it calls straight through unless an
  iteration is being recorded. ``patches/torch_distributed.py`` is not touched: the manager
  composes the chain.
- Megatron's schedule and optimizers (``patches/megatron/probe.py``), DeepSpeed's engine and the
  Hugging Face Trainer (``patches/probe_loops.py``): where an iteration begins and ends.

The integrations take the parts for their framework: ``for_megatron()``, ``for_deepspeed()``;
``all_patches()`` is the whole set (`portspeed patches` lists it as ``probe``).
"""

from __future__ import annotations

from portspeed import config
from portspeed.patching.record import WRAP, Patch
from portspeed.probe import collectives

__all__ = ["all_patches", "collective_patches", "configured", "for_deepspeed", "for_megatron"]

_MOD = "torch.distributed.distributed_c10d"
#: wrappers of order 0 (the router's) and the flight recorder's are closer to torch's function than this one
ORDER = 100


def configured() -> bool:
    """Whether probing is configured in this process (PORTSPEED_PROBE_DIR)."""
    return bool(config.settings().probe_dir)


def collective_patches() -> list[Patch]:
    """The recording wrappers of every collective and point-to-point call this torch has."""
    from torch.distributed import distributed_c10d as c10d

    return [Patch(
        name=f"torch.distributed.{fn}.probe",
        target=f"{_MOD}:{fn}",
        kind=WRAP,
        impl=collectives.recorded(fn),
        style="function",
        order=ORDER,
        distribution="torch",
        versions=">=2.6",
        reason="--probe-level op: record the collective's inputs and outputs (it is not a torch function, so the "
               "op-level mode does not see it).",
    ) for fn in collectives.RECORDED if hasattr(c10d, fn)]


def _common() -> list[Patch]:
    if not configured():
        return []
    return collective_patches() if config.settings().probe_level == "op" else []


def for_megatron() -> list[Patch]:
    """Megatron's schedule and optimizers, the HF Trainer, and the collectives at op level (probing on), else []."""
    if not configured():
        return []
    from portspeed.patches import probe_loops
    from portspeed.patches.megatron.probe import probe_patches

    return [*_common(), *probe_patches(), *probe_loops.trainer_patches()]


def for_deepspeed() -> list[Patch]:
    """DeepSpeed's engine, the HF Trainer, and the collectives at op level (probing on), else []."""
    if not configured():
        return []
    from portspeed.patches import probe_loops

    return [*_common(), *probe_loops.deepspeed_patches(), *probe_loops.trainer_patches()]


def all_patches() -> list[Patch]:
    """Every probe patch (probing on), else []."""
    if not configured():
        return []
    from portspeed.patches import probe_loops
    from portspeed.patches.megatron.probe import probe_patches

    return [*_common(), *probe_patches(), *probe_loops.deepspeed_patches(), *probe_loops.trainer_patches()]
