"""Where DeepSpeed's and the Hugging Face Trainer's iterations begin and end, for the probe (probing on only)."""

from __future__ import annotations

from portspeed.patching.record import Patch

__all__ = ["deepspeed_patches", "trainer_patches"]


def deepspeed_patches() -> list[Patch]:
    return []


def trainer_patches() -> list[Patch]:
    return []
