"""FAKE ``torch_mlu`` (Cambricon) for tests: no MLU behind it.

Provides what portspeed's mlu adapter touches: an importable ``torch_mlu`` package and the
``torch.mlu`` device module, including ``torch.mlu.cnpx`` (Cambricon's profiling ranges),
whose calls the fake records in ``state.ranges``. No c10d ``cncl`` backend is registered.

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
    state = FakeDevice("mlu", count=count, available=available, bf16=bf16)
    pkg = new_module("torch_mlu", "FAKE torch_mlu package (tests only).")
    devmod = state.build_module("torch_mlu.mlu")
    ranges: list[str] = []
    cnpx = new_module("torch_mlu.mlu.cnpx", "FAKE cnpx profiling ranges (tests only).")
    cnpx.range_push = lambda msg: ranges.append(f"push:{msg}")
    cnpx.range_pop = lambda: ranges.append("pop")
    devmod.cnpx = cnpx
    state.ranges = ranges  # type: ignore[attr-defined]
    pkg.mlu = devmod
    mods = {"torch_mlu": pkg, "torch_mlu.mlu": devmod, "torch_mlu.mlu.cnpx": cnpx}
    with registered("mlu", devmod, mods, register_device):
        yield state
