"""FAKE Habana bridge (``habana_frameworks.torch``, Intel Gaudi) for tests: no HPU behind it.

Provides what portspeed's hpu adapter touches: the ``habana_frameworks`` package tree
(``habana_frameworks.torch``, ``.torch.hpu`` with its ``random`` submodule holding the
generators, ``.torch.distributed.hccl``, ``.torch.utils.experimental._is_fp16_supported``)
and ``torch.hpu``. Memory statistics use the bridge's key names (``InUse``, ``MaxInUse``,
``Limit``). The fake ``hccl`` module registers no c10d backend.

It exists only to check vendor-specific API names (see tests/fakes/__init__.py);
device semantics are checked on the test device, not here.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from ._fake_device import FakeDevice, new_module, registered

__all__ = ["installed"]


@contextlib.contextmanager
def installed(count: int = 2, available: bool = True, fp16: bool = True) -> Iterator[FakeDevice]:
    """Install the fake for the ``with`` block (``torch.device('hpu', i)`` parses natively)."""
    state = FakeDevice("hpu", count=count, available=available, bf16=True)
    hpu = state.build_module("habana_frameworks.torch.hpu")
    random = new_module("habana_frameworks.torch.hpu.random", "FAKE hpu random (tests only).")
    for name in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all", "initial_seed", "seed"):
        setattr(random, name, getattr(hpu, name))
    random.default_generators = hpu.default_generators
    hpu.random = random
    del hpu.default_generators  # the bridge keeps them in torch.hpu.random only

    def memory_stats(device: Any = None) -> dict[str, int]:
        i = state.resolve(device)
        return {"InUse": state.allocated[i], "MaxInUse": state.peak[i], "Limit": state.total_memory}

    hpu.memory_stats = memory_stats
    del hpu.get_device_properties, hpu.empty_cache  # absent from the bridge's torch.hpu

    experimental = new_module("habana_frameworks.torch.utils.experimental", "FAKE (tests only).")
    experimental._is_fp16_supported = lambda: fp16
    mods = {
        "habana_frameworks": new_module("habana_frameworks", "FAKE Habana package (tests only)."),
        "habana_frameworks.torch": new_module("habana_frameworks.torch", "FAKE bridge (tests only)."),
        "habana_frameworks.torch.hpu": hpu,
        "habana_frameworks.torch.hpu.random": random,
        "habana_frameworks.torch.distributed": new_module("habana_frameworks.torch.distributed", "FAKE."),
        "habana_frameworks.torch.distributed.hccl": new_module(
            "habana_frameworks.torch.distributed.hccl", "FAKE hccl (tests only; registers no c10d backend)."
        ),
        "habana_frameworks.torch.utils": new_module("habana_frameworks.torch.utils", "FAKE."),
        "habana_frameworks.torch.utils.experimental": experimental,
    }
    with registered("hpu", hpu, mods, register_device=False):
        yield state
