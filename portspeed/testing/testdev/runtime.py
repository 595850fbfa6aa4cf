"""Registering the portspeed test device with torch: ``import portspeed.testing.testdev.runtime``.

It is a TEST DEVICE, NOT HARDWARE. It exists so that portspeed (and any porting layer) can
be proven on a device that is not the host, on machines without an accelerator: device
tensors carry the device type ``testdev``, ops that mix host and device tensors fail,
every host/device move is a real copy, each device has its own generator, and collectives
go through its own c10d backend ``testccl``, which declares gaps like a vendor CCL.

Importing this module does what importing a vendor's torch extension does: it builds (if
needed) and loads the C++ extension, renames PrivateUse1 to ``testdev``, registers the
device module as ``torch.testdev`` (so ``torch.accelerator`` and
``torch.get_device_module()`` answer for it), adds ``Tensor.testdev()`` and friends, and
registers the ``testccl`` backend. That cannot be undone in a process, so it is never
imported implicitly: portspeed selects the device only by name
(``PORTSPEED_ACCELERATOR=testdev``, through the ``portspeed.adapters`` entry point).

Build it ahead of time with ``python -m portspeed.testing.testdev build``.
"""

from __future__ import annotations

import time

_start = time.perf_counter()

import torch  # noqa: E402

from portspeed.testing.testdev import DEVICE_TYPE, bare, device_module  # noqa: E402
from portspeed.testing.testdev.build import load_extension  # noqa: E402
from portspeed.testing.testdev.ccl import BACKEND_NAME, register_backend

__all__ = ["BACKEND_NAME", "DEVICE_TYPE", "bare_faults", "counters", "extension", "load_seconds", "reset_counters"]


def _register() -> object:
    current = torch._C._get_privateuse1_backend_name()
    if current not in ("privateuseone", DEVICE_TYPE):
        raise RuntimeError(
            f"PrivateUse1 is already taken by {current!r} in this process; the portspeed test device "
            "cannot share a process with another PrivateUse1 device"
        )
    bare.faults()  # a PORTSPEED_TESTDEV_BARE that names no fault is refused before the library reads it
    ext = load_extension()
    if current != DEVICE_TYPE:
        torch.utils.rename_privateuse1_backend(DEVICE_TYPE)
    ext.register_hooks()
    device_module._ext = ext
    if not hasattr(torch, DEVICE_TYPE):
        torch._register_device_module(DEVICE_TYPE, device_module)
        torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)
    register_backend(ext, DEVICE_TYPE)
    return ext


extension = _register()
#: seconds this import took: building (when the cache was stale) or loading, and registering
load_seconds = time.perf_counter() - _start


def counters() -> dict[str, int]:
    """How many times each of the device's own kernels ran in this process (csrc/fused.cpp), for tests.

    ``sdpa_overrideable_fwd`` / ``_bwd``: its fused attention (torch's PrivateUse1 SDPA hook);
    ``sdpa_choice_overrideable`` / ``sdpa_choice_math`` (``..._math_dropout``): what its
    ``_fused_sdp_choice`` answered; ``rms_norm_fwd`` / ``_bwd``, ``attention_lse_fwd`` / ``_bwd``: its
    vendor-slot kernels.
    """
    return dict(extension.kernel_counters())


def bare_faults() -> tuple[str, ...]:
    """The faults of the bare variant the loaded library runs with (PORTSPEED_TESTDEV_BARE, read at its load)."""
    return tuple(extension.bare_faults())


def reset_counters() -> None:
    """Set every kernel counter back to zero."""
    extension.reset_kernel_counters()
