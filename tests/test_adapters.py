"""One conformance suite over every built-in adapter: cpu for real, cuda when a GPU exists,
each vendor adapter against its FAKE vendor module (tests/fakes), and the generic
PrivateUse1Accelerator on the test device (a real PrivateUse1 device, portspeed.testing.testdev)
and on a fake device module.

The fakes answer exactly what an adapter asks, so they only check vendor-specific API
names and the generic adapter's device-module path; device semantics are checked on the
test device.

npu, mlu and musa are out-of-tree devices: their vendor packages rename torch's
PrivateUse1 device so that ``torch.device('npu', 0)`` parses, which torch allows once
per process. Their checks therefore run in one child process per vendor (the fake does
the rename there, as the real package would), and each check's outcome is reported here
as its own test. xpu and hpu are native torch device types and run in this process. The checks themselves:
tests/helpers/adapter_checks.py.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

from fakes import fake_habana, fake_torch_mlu, fake_torch_musa, fake_torch_npu, fake_torch_xpu  # noqa: E402
from helpers.adapter_checks import (CHECKS, check_backend, check_device_never_none, check_dtypes,  # noqa: E402
                                    check_rng_roundtrip, expected, run_checks)
from helpers.launch import child_json  # noqa: E402

from portspeed.accelerator import BUILTIN_ADAPTERS, Accelerator, adapter_class  # noqa: E402
from portspeed.vendor import ModuleGenerator, PrivateUse1Accelerator  # noqa: E402
from portspeed.errors import MissingVendorPackageError, UnknownBackendError, UnsupportedCudaCallError  # noqa: E402

ADAPTERS = tuple(BUILTIN_ADAPTERS)
#: built-ins checked on their real device (cuda only where a GPU exists); every other one has a fake
REAL_DEVICES = ("cpu", "cuda")
#: adapters whose fake needs a PrivateUse1 rename, so a process of their own
IN_CHILD = ("npu", "mlu", "musa")
FAKES: dict[str, Callable[..., Any]] = {
    "npu": fake_torch_npu.installed,
    "mlu": fake_torch_mlu.installed,
    "musa": fake_torch_musa.installed,
    "xpu": fake_torch_xpu.installed,
    "hpu": fake_habana.installed,
}


# ----------------------------------------------------------------------------- running
@contextlib.contextmanager
def adapter_under_test(name: str, register_device: bool = False) -> Iterator[tuple[Accelerator, Any]]:
    """The adapter ``name`` on its real device or inside its fake; yields (adapter, fake state or None)."""
    cls = adapter_class(name)
    if name not in FAKES:
        if name == "cuda" and not torch.cuda.is_available():
            pytest.skip("cuda adapter: no CUDA device on this machine (torch.cuda.is_available() is False)")
        cls.load_vendor()
        yield cls(), None
        return
    kwargs = {"register_device": True} if register_device else {}
    with FAKES[name](**kwargs) as state:
        cls.load_vendor()
        yield cls(), state


def _run_checks_here(name: str, register_device: bool) -> dict[str, str]:
    """Run every check on adapter ``name``; {check name: 'ok' or the failure text}."""
    with adapter_under_test(name, register_device=register_device) as (acc, state):
        return run_checks(acc, state, expected(name))


def _child_main(name: str) -> None:
    """Entry of the child process for adapters whose fake renames PrivateUse1."""
    print(json.dumps(_run_checks_here(name, register_device=True)))


@functools.lru_cache(maxsize=None)
def _child_results(name: str) -> dict[str, str]:
    code = f"import sys; sys.path.insert(0, {str(_HERE)!r}); import test_adapters; test_adapters._child_main({name!r})"
    return child_json(code, timeout=180, env={"PORTSPEED_ACCELERATOR": ""}, cwd=_HERE)


pytestmark = pytest.mark.usefixtures("portspeed_env")  # tests/conftest.py: clean settings, selection forgotten


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
@pytest.mark.parametrize("name", ADAPTERS)
def test_conformance(name: str, check: Callable[[Accelerator, Any, dict], None]) -> None:
    """Every adapter passes every conformance check (vendors against their fakes)."""
    if name in IN_CHILD:
        result = _child_results(name)[check.__name__]
        if result != "ok":
            pytest.fail(f"{name} (in its child process): {result}")
        return
    with adapter_under_test(name) as (acc, state), torch.random.fork_rng(devices=[]):
        check(acc, state, expected(name))


@pytest.mark.parametrize("name", ["npu", "mlu", "musa", "hpu"])
def test_vendor_package_is_imported_only_by_load_vendor(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Importing an adapter and detecting its package import nothing of the vendor; load_vendor does.

    The vendor package here is a tripwire on disk whose import raises.
    """
    import importlib

    cls = adapter_class(name)
    pkg_dir = tmp_path
    for part in cls.vendor_modules[0].split("."):
        pkg_dir = pkg_dir / part
        pkg_dir.mkdir()
        (pkg_dir / "__init__.py").write_text("")
    (pkg_dir / "__init__.py").write_text(f"raise ImportError('tripwire: {cls.vendor_modules[0]} was imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    top = cls.vendor_modules[0].split(".")[0]
    try:
        module = importlib.reload(sys.modules[cls.__module__])
        cls = getattr(module, cls.__name__)
        assert cls.vendor_installed() is True
        assert top not in sys.modules, "vendor_installed() must not import the vendor package"
        with pytest.raises(MissingVendorPackageError, match="tripwire") as info:
            cls.load_vendor()
        assert cls.vendor_package in str(info.value)
    finally:
        for m in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
            del sys.modules[m]


def test_every_builtin_adapter_is_covered() -> None:
    """A new built-in adapter joins the conformance suite by itself, and must bring a fake of its vendor."""
    assert set(ADAPTERS) == set(BUILTIN_ADAPTERS)
    assert set(ADAPTERS) - set(REAL_DEVICES) == set(FAKES), "a vendor adapter is checked against a fake of its vendor"


# ----------------------------------------------------------------------------- the checks can fail
class _BrokenCpu(adapter_class("cpu")):  # type: ignore[misc]
    """A CPU adapter with the mistakes the suite exists to catch."""

    backend = "nccl"  # a CUDA backend named for the host device

    def device(self, index: int | None = None) -> torch.device:
        return None  # type: ignore[return-value]  # DeepSpeed's CPU accelerator does this

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        pass  # forgets to restore

    def is_bf16_supported(self) -> bool:
        return False  # while supported_dtypes() below still lists bf16

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("check", [check_device_never_none, check_rng_roundtrip, check_dtypes, check_backend],
                         ids=lambda c: c.__name__)
def test_checks_catch_a_broken_adapter(check: Callable[[Accelerator, Any, dict], None]) -> None:
    """The conformance checks fail on an adapter that breaks their rule."""
    with torch.random.fork_rng(devices=[]), pytest.raises(AssertionError):
        check(_BrokenCpu(), None, expected("cpu"))


# ----------------------------------------------------------------------------- vendor specifics
def test_xpu_backend_prefers_native_xccl(monkeypatch: pytest.MonkeyPatch) -> None:
    """xpu uses 'xccl' when torch.distributed has it, even with oneCCL bindings present."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_xccl_available", lambda: True)
    with fake_torch_xpu.installed(oneccl=True):
        assert adapter_class("xpu")().communication_backend == "xccl"


def test_xpu_backend_falls_back_to_oneccl(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without native xccl, xpu uses oneCCL's 'ccl' when oneccl_bindings_for_pytorch imports."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_xccl_available", lambda: False)
    with fake_torch_xpu.installed(oneccl=True):
        assert adapter_class("xpu")().communication_backend == "ccl"


def test_xpu_backend_without_either_warns(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """With neither, xpu names 'xccl' and warns what to install."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_xccl_available", lambda: False)
    with fake_torch_xpu.installed(oneccl=False), caplog.at_level(logging.WARNING, "portspeed"):
        acc = adapter_class("xpu")()
        assert acc.communication_backend == "xccl"
        assert acc.describe()["backend"] == "xccl"  # asked again: decided once, warned once
    assert "oneccl_bind_pt" in caplog.text
    assert sum("oneccl_bind_pt" in r.getMessage() for r in caplog.records) == 1


def test_xpu_without_fp64_hardware() -> None:
    """An Intel GPU whose properties say has_fp64=False does not list float64."""
    with fake_torch_xpu.installed(has_fp64=False):
        assert torch.float64 not in adapter_class("xpu")().supported_dtypes()


def test_musa_build_without_bf16_query() -> None:
    """A torch_musa build without is_bf16_supported() is taken as no bf16."""
    with fake_torch_musa.installed(bf16=None):
        acc = adapter_class("musa")()
        assert acc.is_bf16_supported() is False and torch.bfloat16 not in acc.supported_dtypes()


def test_hpu_first_generation_gaudi_has_no_fp16() -> None:
    """hpu asks the bridge whether fp16 exists (first-generation Gaudi has none)."""
    with fake_habana.installed(fp16=False):
        assert torch.float16 not in adapter_class("hpu")().supported_dtypes()


def test_npu_bf16_follows_the_device() -> None:
    """npu reports bf16 from torch.npu.is_bf16_supported() (Ascend 910A has none)."""
    with fake_torch_npu.installed(bf16=False):
        assert adapter_class("npu")().is_bf16_supported() is False


def test_fakes_leave_nothing_behind() -> None:
    """After a fake's block, its modules and torch attributes are gone again."""
    had_xpu = torch.xpu
    for name, fake in FAKES.items():
        with fake():
            assert getattr(torch, name) is not None
        if name == "xpu":
            assert torch.xpu is had_xpu
        else:
            assert not hasattr(torch, name), name
    vendors = ("torch_npu", "torch_mlu", "torch_musa", "habana_frameworks")
    assert not any(m.split(".")[0] in vendors for m in sys.modules)


# ----------------------------------------------------------------------------- the generic adapter
class GenericXpu(PrivateUse1Accelerator):
    """What a vendor writes for a device torch knows: names only (the backend is torch's registration)."""

    name = "generic-xpu"
    device_type = "xpu"


class GenericTestdev(PrivateUse1Accelerator):
    """The generic adapter on portspeed's test device, with names only, as a third party would write it."""

    name = "generic-testdev"
    device_type = "testdev"
    vendor_modules = ("portspeed.testing.testdev.runtime",)
    auto_detect = False


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_generic_adapter_through_a_device_module(check: Callable[[Accelerator, Any, dict], None]) -> None:
    """Where torch.accelerator does not serve the device, the generic adapter works through its device module."""
    with fake_torch_xpu.installed() as state, torch.random.fork_rng(devices=[]):
        acc = GenericXpu()
        assert acc._runtime() is False, "this CPU torch's torch.accelerator cannot serve xpu"
        check(acc, state, expected("generic-xpu"))


def _child_main_testdev() -> None:
    """Child process: the test device registered, the generic adapter run through every check."""
    import portspeed.testing.testdev.runtime  # noqa: F401 - registers the device, as a vendor package does

    GenericTestdev.load_vendor()
    acc = GenericTestdev()
    out = run_checks(acc, None, expected("generic-testdev"))
    try:  # what only a device served by torch.accelerator shows
        assert acc._runtime() and acc._accelerator_memory(), "torch.accelerator does not serve the test device"
        assert type(acc.Stream()) is torch.Stream and type(acc.Event()) is torch.Event
        acc.set_device(0)
        other = acc.Stream(device=1)
        with acc.stream(other):
            assert acc.current_stream(1) == other and acc.current_device() == 1
        assert acc.current_device() == 0, "the stream block must give back the current device"
        assert acc.current_stream(1) != other
        x = torch.ones(1024, device=acc.device())
        assert acc.memory_allocated() >= x.numel() * 4, "memory must come from the device's allocator"
        assert GenericTestdev.detect() is False, "auto_detect = False: chosen by name only"
        out["torch_accelerator_path"] = "ok"
    except Exception:
        out["torch_accelerator_path"] = traceback.format_exc()
    print(json.dumps(out))


@functools.lru_cache(maxsize=None)
def _testdev_results() -> dict[str, str]:
    code = f"import sys; sys.path.insert(0, {str(_HERE)!r}); import test_adapters; test_adapters._child_main_testdev()"
    return child_json(code, timeout=600, env={"PORTSPEED_ACCELERATOR": ""}, cwd=_HERE)


@pytest.mark.testdev
@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS] + ["torch_accelerator_path"],
                         ids=lambda c: c.removeprefix("check_"))
def test_generic_adapter_conformance_on_the_test_device(check: str) -> None:
    """The generic adapter, given only names, passes every check on a real PrivateUse1 device (the test device)."""
    result = _testdev_results()[check]
    if result != "ok":
        pytest.fail(f"generic adapter on the test device: {result}")


def test_generic_backend_is_what_torch_has_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no backend named, the adapter uses the vendor's registration; without one it says what to do."""
    import torch.distributed as dist

    monkeypatch.setitem(dist.Backend.default_device_backend_map, "xpu", "acmeccl")
    assert GenericXpu().communication_backend == "acmeccl"
    assert GenericXpu(backend="gloo").communication_backend == "gloo"
    monkeypatch.delitem(dist.Backend.default_device_backend_map, "xpu")
    with pytest.raises(UnknownBackendError, match="'xpu'.*PORTSPEED_BACKEND"):
        GenericXpu().communication_backend
    assert "backend=None" in repr(GenericXpu())


def test_generic_detection_follows_the_device_unless_auto_detect_is_off() -> None:
    """detect(): True with a device, False without one, and always False when auto_detect is False."""

    class NeverDetected(GenericXpu):
        auto_detect = False

    with fake_torch_xpu.installed():
        assert GenericXpu.detect() is True and NeverDetected.detect() is False
    with fake_torch_xpu.installed(available=False):
        assert GenericXpu.detect() is False


def test_generic_rng_without_generator_objects_goes_through_the_module() -> None:
    """A device module with RNG functions but no default_generators gets a ModuleGenerator view per device."""
    with fake_torch_xpu.installed() as state:
        del torch.xpu.default_generators
        acc = GenericXpu()
        g = acc.default_generator(1)
        assert isinstance(g, ModuleGenerator) and g.device == torch.device("xpu", 1)
        g.manual_seed(5)
        assert state.generators[1].initial_seed() == 5 and state.generators[0].initial_seed() != 5
        assert acc.current_device() == 0, "seeding device 1 must give back the current device"
        saved = g.get_state()
        assert torch.equal(saved, state.generators[1].get_state())
        first = torch.rand(4, generator=state.generators[1])
        g.set_state(saved)
        assert torch.equal(torch.rand(4, generator=state.generators[1]), first)
        acc.manual_seed_all(9)
        assert [x.initial_seed() for x in state.generators] == [9, 9]


def test_generic_call_the_device_lacks_names_it() -> None:
    """A call neither torch.accelerator nor the device module offers raises naming the call and the adapter."""
    with fake_torch_xpu.installed():
        del torch.xpu.default_stream
        with pytest.raises(UnsupportedCudaCallError, match="'generic-xpu'.*default_stream.*GenericXpu.default_stream"):
            GenericXpu().default_stream()
