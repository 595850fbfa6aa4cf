"""FAKE ``torch_npu`` (Huawei Ascend) for tests: no NPU behind it.

Provides what portspeed's npu adapter touches: an importable ``torch_npu`` package with a
``torch_npu.npu`` device module, registered as ``torch.npu``. The real torch_npu also
registers the ``hccl`` c10d backend and patches torch; this fake does neither.

    with fake_torch_npu.installed(count=2) as state:
        ...   # torch.npu.device_count() == 2; state.fake_allocate(1024) moves memory_allocated

It exists only to check vendor-specific API names (see tests/fakes/__init__.py);
device semantics are checked on the test device, not here.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from ._fake_device import FakeDevice, new_module, registered

__all__ = ["installed"]


@contextlib.contextmanager
def installed(
    count: int = 2, available: bool = True, bf16: bool | None = True, register_device: bool = False
) -> Iterator[FakeDevice]:
    """Install the fake for the ``with`` block; see ``_fake_device.registered`` for ``register_device``."""
    state = FakeDevice("npu", count=count, available=available, bf16=bf16)
    pkg = new_module("torch_npu", "FAKE torch_npu package (tests only).")
    devmod = state.build_module("torch_npu.npu")
    pkg.npu = devmod
    with registered("npu", devmod, {"torch_npu": pkg, "torch_npu.npu": devmod}, register_device):
        yield state
