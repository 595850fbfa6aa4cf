"""TEST-ONLY: the test device with a planted wrong vendor kernel, ``rms_norm`` off by 1e-3 relative.

A vendor kernel that is slightly wrong is the bug loss parity can miss and the probe must name
(the first layer's norm, forward, iteration 1). This adapter is the test device's own
(``TestdevAccelerator``: its memory, generator, CCL and kernels), except that the kernel slot's
``rms_norm`` calls the device's C++ ``rms_norm`` and multiplies its result by ``1 + OFF``. So the
device's kernel counters (``rms_norm_fwd`` / ``_bwd``) prove that the slot ran it, and the
planted factor is the only difference from the test device's own kernel.

Select it with ``PORTSPEED_ACCELERATOR=tests/data/testdev_rms_off.py:TestdevRmsOff``. Each
process that selected it prints, at exit, one line to stderr with the calls it served and the
device's counters (``testdev_rms_off: ...``), so a test can read them from a torchrun job.
"""

from __future__ import annotations

import atexit
import json
import sys
from typing import Any, ClassVar

import torch

from portspeed.testing.testdev.adapter import TestdevAccelerator

__all__ = ["OFF", "TestdevRmsOff", "rms_norm"]

#: the planted relative error of the vendor rms_norm
OFF = 1e-3
_calls = {"rms_norm": 0}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``kernel_ops.rms_norm`` through the test device's own kernel, then wrong by ``OFF`` relative (planted)."""
    from portspeed.testing.testdev.kernels import rms_norm as device_rms_norm

    _calls["rms_norm"] += 1
    return device_rms_norm(x, weight, eps) * (1.0 + OFF)


def _report() -> None:
    """One stderr line at exit: the planted kernel's calls and the device's kernel counters."""
    import portspeed.testing.testdev.runtime as rt

    print(f"testdev_rms_off: {json.dumps({'calls': _calls, 'counters': rt.counters()})}", file=sys.stderr,
          flush=True)


class TestdevRmsOff(TestdevAccelerator):
    """portspeed's test device whose vendor ``rms_norm`` is off by ``OFF`` relative (TEST-ONLY)."""

    name: ClassVar[str] = "testdev_rms_off"

    @classmethod
    def load_vendor(cls) -> None:
        """The test device's runtime, and the exit report of the planted kernel (once per process)."""
        super().load_vendor()
        if not getattr(cls, "_reporting", False):
            cls._reporting = True
            atexit.register(_report)

    @classmethod
    def kernels(cls) -> dict[str, Any]:
        """The test device's kernels, with ``rms_norm`` replaced by the planted one."""
        return {**super().kernels(), "rms_norm": rms_norm}
