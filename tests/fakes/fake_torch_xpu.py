"""FAKE ``torch.xpu`` (Intel GPU) for tests: no XPU behind it.

torch.xpu is part of torch, so the fake replaces the ``torch.xpu`` attribute (and
``sys.modules['torch.xpu']``) for the ``with`` block only. ``has_fp64`` sets what
``get_device_properties`` reports; ``oneccl=True`` also installs a FAKE, empty
``oneccl_bindings_for_pytorch`` so the adapter's ``ccl`` fallback can be tested (the real
one registers the ``ccl`` c10d backend; the fake registers nothing).

It exists only to check vendor-specific API names (see tests/fakes/__init__.py);
device semantics are checked on the test device, not here.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Iterator

from ._fake_device import FakeDevice, install_modules, new_module

__all__ = ["installed"]


@contextlib.contextmanager
def installed(
    count: int = 2, available: bool = True, bf16: bool | None = True, has_fp64: bool = True, oneccl: bool = False
) -> Iterator[FakeDevice]:
    """Install the fake for the ``with`` block (``torch.device('xpu', i)`` parses natively)."""
    state = FakeDevice("xpu", count=count, available=available, bf16=bf16)
    devmod = state.build_module("torch.xpu")
    base_props = devmod.get_device_properties

    def get_device_properties(device: Any = None) -> types.SimpleNamespace:
        props = base_props(device)
        props.has_fp64 = has_fp64
        return props

    devmod.get_device_properties = get_device_properties
    devmod._is_compiled = lambda: True  # torch.xpu._is_compiled(): this torch was built with XPU
    mods = {"torch.xpu": devmod}
    if oneccl:
        mods["oneccl_bindings_for_pytorch"] = new_module(
            "oneccl_bindings_for_pytorch", "FAKE oneCCL bindings (tests only; registers no backend)."
        )
    undo = install_modules(mods, {"xpu": devmod})
    try:
        yield state
    finally:
        undo()
