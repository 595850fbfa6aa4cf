"""Hugging Face Accelerate patches: the ``Trainer(deepspeed=...)`` path on a device Accelerate does not know.

The Trainer starts DeepSpeed through Accelerate's ``PartialState``, which picks the process
group backend and the device from a fixed list of devices it knows (CUDA, XPU, NPU, MLU,
MUSA, HPU, ...). On any other device (an out-of-tree PrivateUse1 device, or DeepSpeed on
CPU without ``use_cpu``) it finds no backend, and then
- counts one process (``num_processes == 1``, every rank is "process zero"), so every rank
  is fed the same batches and the ranks do not split the data;
- takes the host as its device, so the Trainer's batches stay on the host while DeepSpeed
  moved the model to the accelerator: ``Expected all tensors to be on the same device``.

DeepSpeed itself asks its accelerator (portspeed's, ``portspeed.integrations.ds_accelerator``)
for both, so the two patches here give Accelerate the same answers, in the DeepSpeed
launch case only (``ACCELERATE_USE_DEEPSPEED=true``, which the Trainer sets while it builds
the state; a rank of a launcher, ``LOCAL_RANK`` set; not ``use_cpu``):

- ``accelerate.state.backend``: the adapter's backend when Accelerate found none;
- ``accelerate.state.device``: the adapter's device for the local rank (``LOCAL_RANK`` modulo
  the device count, as Accelerate does for CUDA), made current, when Accelerate would take
  the host for want of a known device.

A plain (non-DeepSpeed) Trainer, ``use_cpu=True`` and ``ACCELERATE_TORCH_DEVICE`` (the
user's own choice) are left alone. Inactive on CUDA, where Accelerate runs natively.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import torch

from portspeed.accelerator import get_accelerator
from portspeed.accelerator.conditions import translated
from portspeed.patching.record import WRAP, Patch

__all__ = ["PATCHES", "DISTRIBUTION", "VERSIONS", "BACKEND_PATCH", "DEVICE_PATCH"]

log = logging.getLogger("portspeed.hf_accelerate")

DISTRIBUTION = "accelerate"
#: The Accelerate releases these patches were written and run against.
VERSIONS = ">=1.10,<2"

BACKEND_PATCH = "accelerate.state.backend"
DEVICE_PATCH = "accelerate.state.device"


def _deepspeed_launch(cpu: bool) -> bool:
    """Whether Accelerate is building the state of a DeepSpeed rank (the only case patched)."""
    return (not cpu and int(os.environ.get("LOCAL_RANK", -1)) != -1
            and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true")


def _prepare_backend(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Accelerate's choice, or the adapter's backend where Accelerate found none for a DeepSpeed rank."""
    backend, distributed_type = wrapped(*args, **kwargs)
    cpu = bool(args[0]) if args else bool(kwargs.get("cpu", False))
    if backend is None and _deepspeed_launch(cpu):
        backend = get_accelerator().communication_backend
        log.info("portspeed: accelerate found no backend for this DeepSpeed rank; using the %r adapter's %r",
                 get_accelerator().name, backend)
    return backend, distributed_type


def _set_device(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """The adapter's device for the local rank where Accelerate would fall back to the host."""
    from accelerate.utils import DistributedType

    if (instance.device is not None or instance.distributed_type != DistributedType.NO
            or instance.backend is None or not _deepspeed_launch(bool(getattr(instance, "_cpu", False)))):
        return wrapped(*args, **kwargs)
    acc = get_accelerator()
    index = instance.local_process_index % max(1, acc.device_count())
    if acc.device_type == "cpu":
        instance.device = torch.device("cpu")
    else:
        acc.set_device(index)
        instance.device = acc.device(index)
    log.info("portspeed: accelerate's device for this DeepSpeed rank: %s", instance.device)
    return None


PATCHES: list[Patch] = [
    Patch(
        name=BACKEND_PATCH,
        target="accelerate.state:PartialState._prepare_backend",
        kind=WRAP,
        impl=_prepare_backend,
        distribution=DISTRIBUTION,
        versions=VERSIONS,
        when=translated,
        reason=("Accelerate finds no backend for a DeepSpeed rank on a device it does not know, counts one "
                "process and feeds every rank the same batches; the adapter's backend is the answer DeepSpeed uses"),
    ),
    Patch(
        name=DEVICE_PATCH,
        target="accelerate.state:PartialState.set_device",
        kind=WRAP,
        impl=_set_device,
        distribution=DISTRIBUTION,
        versions=VERSIONS,
        when=translated,
        reason=("Accelerate takes the host as the device it does not know, so the Trainer's batches stay on the "
                "host while DeepSpeed put the model on the accelerator"),
    ),
]
