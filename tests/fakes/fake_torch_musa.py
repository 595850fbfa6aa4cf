"""FAKE ``torch_musa`` (Moore Threads) for tests: no MUSA GPU behind it.

Provides what portspeed's musa adapter touches: an importable ``torch_musa`` package and
the ``torch.musa`` device module. ``bf16=None`` builds a module without
``is_bf16_supported`` (older torch_musa builds), so the adapter's fallback can be tested.
No c10d ``mccl`` backend is registered.

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
    state = FakeDevice("musa", count=count, available=available, bf16=bf16)
    pkg = new_module("torch_musa", "FAKE torch_musa package (tests only).")
    devmod = state.build_module("torch_musa.musa")
    pkg.musa = devmod
    with registered("musa", devmod, {"torch_musa": pkg}, register_device):
        yield state
