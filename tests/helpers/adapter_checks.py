"""The adapter conformance checks (tests/test_adapters.py runs them over every built-in adapter).

Each check takes the adapter, the fake's state (None on a real device) and the row ``expected`` gives, and
raises AssertionError on a violation; ``run_checks`` runs them all and says, per check, ``ok`` or the failure.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable

import pytest
import torch

from portspeed.accelerator import BUILTIN_ADAPTERS, Accelerator, adapter_class, reset_accelerator, set_accelerator
from portspeed.adapters.cpu import CpuAccelerator
from portspeed.accelerator.capabilities import KNOWN_BACKENDS, check_backend_name
from portspeed.vendor import registered_backend

__all__ = ["CHECKS", "check_backend", "check_device_never_none", "check_dtypes", "check_rng_roundtrip", "expected",
           "run_checks"]

#: Adapters whose hardware this project has run: the only ones that may claim ``verified_on_hardware``.
VERIFIED_ON_HARDWARE = frozenset({"cpu"})
#: Devices whose float64 is not dependable (computed as float32, or not at all), per vendor documentation:
#: their adapters must answer ``is_fp64_supported() is False``, whatever the device properties say.
NO_DEPENDABLE_FP64 = frozenset({"npu", "mlu", "hpu"})
#: Backend names that two vendors share: portspeed's table (KNOWN_BACKENDS) keys by name and lists
#: Ascend's HCCL; Habana's collective library is also called HCCL.
SHARED_BACKEND_NAMES = {"hpu": "hccl"}


def expected(name: str) -> dict[str, Any]:
    """Behaviour each adapter must show that its class attributes do not state (fakes at their defaults).

    Names, device types and backends are not restated here: ``check_identity`` and
    ``check_backend`` derive them from the device runtime (the fake's) and from
    ``KNOWN_BACKENDS`` / torch's registered backends.
    """
    cuda_bf16 = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    device = name.removeprefix("generic-")
    return dict(bf16=cuda_bf16 if device == "cuda" else True, fp16=True, fp64=device not in NO_DEPENDABLE_FP64,
                verified=name in VERIFIED_ON_HARDWARE)


# ----------------------------------------------------------------------------- checks
# Each check takes the adapter, the fake's state (None on real devices) and the expected
# table row, and raises AssertionError on a violation.


def _count(acc: Accelerator) -> int:
    return acc.device_count()


def check_identity(acc: Accelerator, state: Any, exp: dict) -> None:
    assert acc.name and (acc.name not in BUILTIN_ADAPTERS or adapter_class(acc.name) is type(acc))
    if acc.name in BUILTIN_ADAPTERS:
        assert acc.device_type == acc.name, "a built-in adapter is named after its torch device type"
    if state is not None:
        assert acc.device_type == state.device_type, "the adapter must name the device its runtime registers"
    assert torch.device(acc.device_type).type == acc.device_type, "the device type must be one torch parses"
    d = acc.describe()
    assert d["name"] == acc.name and d["device_type"] == acc.device_type
    assert d["backend"] == acc.communication_backend
    assert acc.verified_on_hardware is exp["verified"], "only adapters run on their hardware may claim it"


def check_availability(acc: Accelerator, state: Any, exp: dict) -> None:
    assert acc.is_available() is True


def check_device_count(acc: Accelerator, state: Any, exp: dict) -> None:
    n = acc.device_count()
    assert isinstance(n, int) and n >= 1
    if state is not None:
        assert n == state.count


def check_device_never_none(acc: Accelerator, state: Any, exp: dict) -> None:
    for index in (None, 0, _count(acc) - 1):
        d = acc.device(index)
        assert d is not None, f"device({index}) returned None"
        assert isinstance(d, torch.device) and d.type == acc.device_type
        if acc.device_type != "cpu":
            assert d.index == (acc.current_device() if index is None else index)


def check_current_set_device(acc: Accelerator, state: Any, exp: dict) -> None:
    last = _count(acc) - 1
    try:
        acc.set_device(last)
        assert acc.current_device() == last
        acc.set_device(torch.device(acc.device_type, 0))
        assert acc.current_device() == 0
        acc.set_device(f"{acc.device_type}:{last}")
        assert acc.current_device() == last
        if state is not None:
            assert state.current == last, "set_device must reach the vendor module"
    finally:
        acc.set_device(0)


def check_synchronize(acc: Accelerator, state: Any, exp: dict) -> None:
    before = state.synchronized if state is not None else 0
    assert acc.synchronize() is None
    assert acc.synchronize(0) is None
    if state is not None:
        assert state.synchronized == before + 2, "synchronize must reach the vendor module"


def _draw(g: torch.Generator) -> torch.Tensor:
    return torch.rand(16, generator=g, device=g.device)


def check_rng_roundtrip(acc: Accelerator, state: Any, exp: dict) -> None:
    g = acc.default_generator()
    assert isinstance(g, torch.Generator)
    saved = acc.get_rng_state()
    assert isinstance(saved, torch.Tensor) and saved.dtype == torch.uint8
    a = _draw(g)
    assert not torch.equal(acc.get_rng_state(), saved), "drawing must advance the generator state"
    acc.set_rng_state(saved)
    assert torch.equal(_draw(g), a), "restoring the RNG state must replay the same numbers"


def check_seed_determinism(acc: Accelerator, state: Any, exp: dict) -> None:
    acc.manual_seed(1234)
    a = _draw(acc.default_generator())
    acc.manual_seed(1234)
    assert torch.equal(_draw(acc.default_generator()), a)
    assert acc.initial_seed() == 1234
    acc.manual_seed(4321)
    assert not torch.equal(_draw(acc.default_generator()), a)
    acc.manual_seed_all(77)
    for i in range(_count(acc)):
        assert acc.default_generator(i).initial_seed() == 77


def check_streams_events(acc: Accelerator, state: Any, exp: dict) -> None:
    before = acc.current_stream()
    assert acc.default_stream() is not None
    s = acc.Stream()
    with acc.stream(s):
        assert acc.current_stream() == s
    assert acc.current_stream() == before
    with acc.stream(None):  # torch.cuda.stream(None) is a no-op context; every adapter must accept it
        assert acc.current_stream() == before
    s.wait_stream(acc.current_stream())
    start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
    start.record()
    end.record()
    end.synchronize()
    assert isinstance(end.query(), bool)
    ms = start.elapsed_time(end)
    assert isinstance(ms, float) and ms >= 0.0


def check_memory_stats(acc: Accelerator, state: Any, exp: dict) -> None:
    values = {
        f: getattr(acc, f)()
        for f in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved")
    }
    for f, v in values.items():
        assert isinstance(v, int) and v >= 0, f"{f}() returned {v!r}"
    assert values["max_memory_allocated"] >= values["memory_allocated"]
    assert isinstance(acc.memory_stats(), dict)
    total = acc.total_memory()
    assert isinstance(total, int) and total > 0
    assert acc.empty_cache() is None
    assert acc.reset_peak_memory_stats() is None
    if state is not None:  # the adapter must report what the device runtime says, not a constant
        base = acc.memory_allocated()
        state.fake_allocate(4096)
        assert acc.memory_allocated() == base + 4096
        state.fake_free(4096)
        assert acc.memory_allocated() == base
        assert acc.max_memory_allocated() >= base + 4096
        acc.reset_peak_memory_stats()
        assert acc.max_memory_allocated() == base
        assert total == state.total_memory


def check_dtypes(acc: Accelerator, state: Any, exp: dict) -> None:
    dtypes = acc.supported_dtypes()
    assert all(isinstance(d, torch.dtype) for d in dtypes) and torch.float32 in dtypes
    assert acc.is_bf16_supported() is exp["bf16"] and (torch.bfloat16 in dtypes) is exp["bf16"]
    assert acc.is_fp16_supported() is exp["fp16"] and (torch.float16 in dtypes) is exp["fp16"]
    assert acc.is_fp64_supported() is exp["fp64"] and (torch.float64 in dtypes) is exp["fp64"]


def check_backend(acc: Accelerator, state: Any, exp: dict) -> None:
    backend = acc.communication_backend
    check_backend_name(backend)
    serves = KNOWN_BACKENDS.get(backend) == acc.device_type or registered_backend(acc.device_type) == backend
    assert serves or SHARED_BACKEND_NAMES.get(acc.device_type) == backend, (
        f"{backend!r} is not a backend of device type {acc.device_type!r} (KNOWN_BACKENDS, or registered by torch)")
    assert type(acc)(backend="gloo").communication_backend == "gloo", "PORTSPEED_BACKEND must override"


def check_capabilities(acc: Accelerator, state: Any, exp: dict) -> None:
    caps = acc.capabilities()
    assert caps is not None
    assert getattr(caps, "backend", acc.communication_backend) == acc.communication_backend


def check_profiling_ranges(acc: Accelerator, state: Any, exp: dict) -> None:
    acc.range_push("conformance")
    acc.range_pop()
    if hasattr(state, "ranges"):  # the mlu fake records cnpx calls
        assert state.ranges == ["push:conformance", "pop"]


CHECKS: tuple[Callable[[Accelerator, Any, dict], None], ...] = (
    check_identity,
    check_availability,
    check_device_count,
    check_device_never_none,
    check_current_set_device,
    check_synchronize,
    check_rng_roundtrip,
    check_seed_determinism,
    check_streams_events,
    check_memory_stats,
    check_dtypes,
    check_backend,
    check_capabilities,
    check_profiling_ranges,
)


def run_checks(acc: Accelerator, state: Any, exp: dict) -> dict[str, str]:
    """Every check on ``acc``; {check name: 'ok' or the failure text}."""
    out: dict[str, str] = {}
    for check in CHECKS:
        try:
            with torch.random.fork_rng(devices=[]):
                check(acc, state, exp)
            out[check.__name__] = "ok"
        except Exception:
            out[check.__name__] = traceback.format_exc()
    return out


@pytest.fixture
def cpu_adapter():
    """A fresh CPU adapter for the test; the previous selection is restored after."""
    reset_accelerator()
    acc = CpuAccelerator()
    set_accelerator(acc)
    yield acc
    reset_accelerator()
