"""Building the data iterators leaves the device generator alone, as it does on a GPU.

On a GPU, dropout draws from the CUDA generator and Megatron-LM's host work draws from the
CPU generator. Where the adapter's device generator *is* the host's ``torch.default_generator``
(the CPU adapter) the two are one, and ``build_train_valid_test_data_iterators`` draws from
it: the DataLoader takes its base seed from the default generator, on the ranks that build a
loader only (tensor-parallel rank 0). Without this patch, tensor-parallel ranks then apply
different dropout masks to replicated activations, and a resumed run (whose RNG states
``load_checkpoint`` restored just before) starts its first step from another state than the
uninterrupted run had at that iteration. The wrapper puts the generator state back after the
build, so the training steps draw from the state seeding or the checkpoint left, on every rank.
The DataLoader's own seed is still drawn, from the same state as before.
"""

from __future__ import annotations

from typing import Any

import torch

from portspeed.accelerator import Accelerator
from portspeed.patching.record import WRAP, Patch

from ._training_common import log
from .ranges import DISTRIBUTION, TRAINING

__all__ = ["PATCHES", "keep_device_stream", "shares_host_generator"]


def shares_host_generator(acc: Accelerator) -> bool:
    """Patch condition: the adapter's device generator is the host's default generator."""
    try:
        return acc.default_generator() is torch.default_generator
    except Exception:  # an adapter that cannot answer has its own generator: Megatron's path is right
        return False


def keep_device_stream(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``build_train_valid_test_data_iterators``: its host draws leave the generator as it was."""
    state = torch.default_generator.get_state()
    try:
        return wrapped(*args, **kwargs)
    finally:
        if not torch.equal(state, torch.default_generator.get_state()):
            log.debug("portspeed: building the data iterators drew from the shared CPU generator; state put back")
        torch.default_generator.set_state(state)


_REASON = ("On the CPU adapter the device generator is the host's default generator, and building "
           "the data iterators draws from it (the DataLoader's seed, on some ranks only): dropout "
           "masks would differ between tensor-parallel ranks and a resumed run would not continue "
           "the uninterrupted one; on a GPU the device generator is untouched by that work.")

PATCHES: list[Patch] = [
    Patch(
        name="megatron.training.data_iterators_rng",
        target="megatron.training.training:build_train_valid_test_data_iterators",
        kind=WRAP,
        impl=keep_device_stream,
        distribution=DISTRIBUTION,
        versions=TRAINING,
        when=shares_host_generator,
        reason=_REASON,
    ),
]
