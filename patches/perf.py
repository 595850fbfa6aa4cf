"""The perf recording's patches, declared only when ``PORTSPEED_PERF`` is set (unset: none, nothing installed).

- ``torch.distributed``'s collectives and point-to-point calls, wrapped by the probe's recording
  wrapper (``portspeed.probe.collectives.recorded``) plugged into the perf recording's own slot
  (``portspeed.perf.collectives.SLOT``): outside the router and the flight recorder (``ORDER``), so
  each call is seen as the caller made it; straight through unless an iteration is being timed.
- Megatron's schedule and optimizers (``patches/megatron/perf.py``), DeepSpeed's engine and the Hugging
  Face Trainer (``patches/perf_loops.py``): where an iteration begins and ends.

The integrations take the parts for their framework: ``for_megatron()``, ``for_deepspeed()``;
``all_patches()`` is the whole set (`portspeed patches` lists it as ``perf``).
"""

from __future__ import annotations

from portspeed import config
from portspeed.patching.record import WRAP, Patch
from portspeed.perf import collectives
from portspeed.probe.collectives import recorded

__all__ = ["all_patches", "collective_patches", "configured", "for_deepspeed", "for_megatron"]

_MOD = "torch.distributed.distributed_c10d"
#: outside the router's (0) and the flight recorder's wrappers; beside the probe's (100)
ORDER = 110


def configured() -> bool:
    """Whether the perf recording is configured in this process (PORTSPEED_PERF)."""
    return bool(config.settings().perf_dir)


def collective_patches() -> list[Patch]:
    """The timing wrappers of every collective and point-to-point call this torch has (equal records on every
    call: ``recorded`` gives one factory per name and slot, so both integrations of one process register one set)."""
    from torch.distributed import distributed_c10d as c10d

    return [Patch(
        name=f"torch.distributed.{fn}.perf",
        target=f"{_MOD}:{fn}",
        kind=WRAP,
        impl=recorded(fn, collectives.SLOT, "perf"),
        style="function",
        order=ORDER,
        distribution="torch",
        versions=">=2.6",
        reason="--perf: note when this rank entered and left the collective, its bytes and what the router did.",
    ) for fn in collectives.RECORDED if hasattr(c10d, fn)]


def for_megatron() -> list[Patch]:
    """Megatron's schedule and optimizers, the HF Trainer and the collectives (PORTSPEED_PERF set), else []."""
    if not configured():
        return []
    from portspeed.patches import perf_loops
    from portspeed.patches.megatron.perf import perf_patches

    return [*collective_patches(), *perf_patches(), *perf_loops.trainer_patches()]


def for_deepspeed() -> list[Patch]:
    """DeepSpeed's engine, the HF Trainer and the collectives (PORTSPEED_PERF set), else []."""
    if not configured():
        return []
    from portspeed.patches import perf_loops

    return [*collective_patches(), *perf_loops.deepspeed_patches(), *perf_loops.trainer_patches()]


def all_patches() -> list[Patch]:
    """Every perf patch (PORTSPEED_PERF set), else []."""
    if not configured():
        return []
    from portspeed.patches import perf_loops
    from portspeed.patches.megatron.perf import perf_patches

    return [*collective_patches(), *perf_patches(), *perf_loops.deepspeed_patches(), *perf_loops.trainer_patches()]
