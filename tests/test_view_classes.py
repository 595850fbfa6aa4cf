"""Every class the translated torch view serves stays a class to the framework code that reads it.

Megatron-LM main annotates a class attribute ``torch.cuda.Stream | None``
(``megatron_fsdp/experimental/dbuffer.py``) and ``torch.cuda.MemPool | None``
(``.../parameter_group.py``); when the view served functions there, ``|`` raised TypeError
at import (issue 22). Here every name whose real torch object is a class is found from the
view's own table (``CUDA_API``, its namespaces, and the names ``TorchView`` replaces), and
each served one is read the ways framework code reads a class: ``X | None``, ``Optional[X]``,
a class-level annotation evaluated at import, subclassing, ``isinstance`` of what calling it
makes. Each adapter runs in a fresh process: the CPU adapter, and the test device (a C++
PrivateUse1 device, not hardware), where the objects are torch's own ``torch.Stream``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

from helpers.launch import run_python  # noqa: E402

#: classes in torch that the view does not serve: touching the name raises UnsupportedCudaCallError.
NOT_SERVED = {"CUDAGraph", "graph", "CUDAPluggableAllocator"}

# a framework module written the way Megatron-LM main writes it: annotations evaluated at import
FRAMEWORK = '''
import torch


class DBufferLike:
    allocation_stream: torch.cuda.Stream | None
    ready: torch.cuda.Event | None
    pool: torch.cuda.MemPool | None
    scaler: torch.cuda.amp.GradScaler | None
    cast: torch.autocast | None


def cuda():
    return torch.cuda


def torch_view():
    return torch
'''

CHECK = '''
import inspect, json, typing
import torch
import portspeed, portspeed.megatron_adaptor as adaptor
adaptor.activate()
from portspeed.translation import cuda_view as cv_mod
from portspeed.translation.served_class import ServedClass
from portspeed.errors import UnsupportedCudaCallError
import tdfw

cv, tv = tdfw.cuda(), tdfw.torch_view()
assert getattr(tv, "__portspeed_view__", False) and cv is not torch.cuda, "the framework module got no view"
assert "allocation_stream" in tdfw.DBufferLike.__annotations__

# every name whose real torch object is a class, as the view replaces it
found = {}
for name, rule in cv_mod.CUDA_API.items():
    if hasattr(rule, "members"):
        real_ns = getattr(torch.cuda, name)
        for sub in rule.members:
            if inspect.isclass(getattr(real_ns, sub, None)):
                found[f"torch.cuda.{name}.{sub}"] = lambda name=name, sub=sub: getattr(getattr(cv, name), sub)
    elif inspect.isclass(getattr(torch.cuda, name, None)):
        found[f"torch.cuda.{name}"] = lambda name=name: getattr(cv, name)
for name, value in vars(tv).items():
    real = getattr(torch, name, None)
    if value is not real and inspect.isclass(real) and not inspect.ismodule(value):
        found[f"torch.{name}"] = lambda value=value: value

forwarded = {f"torch.cuda.{n}" for n, r in cv_mod.CUDA_API.items() if type(r).__name__ == "Forward"}
not_served, served, made = [], [], {}
for full, get in sorted(found.items()):
    try:
        cls = get()
    except UnsupportedCudaCallError:
        not_served.append(full.rsplit(".", 1)[1])
        continue
    assert inspect.isclass(cls), f"{full} is served as {type(cls).__name__}, not a class"
    assert typing.get_args(cls | None) == (cls, type(None)) and typing.get_args(typing.Optional[cls])[0] is cls
    served.append(full)
    if full in forwarded:  # torch's own class, as it is (some of them torch itself does not let one subclass)
        assert cls is getattr(torch.cuda, full.rsplit(".", 1)[1]), full
        continue

    class Sub(cls):
        pass

    assert issubclass(Sub, cls) and typing.get_args(Sub | None) == (Sub, type(None)), full

samples = {
    "torch.cuda.Stream": lambda: cv.Stream(),
    "torch.cuda.Event": lambda: cv.Event(enable_timing=True),
    "torch.cuda.device": lambda: cv.device(0),
    "torch.cuda.amp.autocast": lambda: cv.amp.autocast(dtype=torch.bfloat16),
    "torch.cuda.amp.GradScaler": lambda: cv.amp.GradScaler(),
    "torch.autocast": lambda: tv.autocast("cuda", dtype=torch.bfloat16),
    "torch.Generator": lambda: tv.Generator(device="cuda"),
}
named_only = {"torch.cuda.ExternalStream", "torch.cuda.MemPool"}
for full in served:
    cls = found[full]()
    if full in named_only:
        try:
            cls()
        except UnsupportedCudaCallError:
            continue
        raise AssertionError(f"{full}() constructed something off CUDA")
    if full in forwarded:
        continue
    assert full in samples, f"{full}: a class the view serves with no construction check in this test"
    obj = samples[full]()
    assert isinstance(obj, cls) and isinstance(obj, cls | None), (full, type(obj))
    made[full] = type(obj).__module__ + "." + type(obj).__qualname__
    if isinstance(cls, ServedClass):
        class Sub(cls):
            pass
        try:
            Sub()
        except UnsupportedCudaCallError:
            pass
        else:
            raise AssertionError(f"a subclass of {full} constructed something")

assert isinstance(cv.current_stream(), cv.Stream), type(cv.current_stream())
assert not hasattr(cv.Stream, "priority_range")  # no translation: an AttributeError naming it
with cv.amp.autocast(dtype=torch.bfloat16):
    pass
print(json.dumps({"served": served, "not_served": sorted(not_served), "made": made}))
'''


def _check(tmp_path: Path, adapter: str) -> dict:
    pkg = tmp_path / "tdfw"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(FRAMEWORK)
    res = run_python(["-c", CHECK], timeout=240, drop=["PORTSPEED_*"],
                     env={"PORTSPEED_ACCELERATOR": adapter, "PORTSPEED_FRAMEWORK_MODULES": "tdfw",
                          "PYTHONPATH": str(tmp_path)})
    got = res.check().last_json()
    assert set(got["not_served"]) == NOT_SERVED, got
    served = set(got["served"])
    for name in ("torch.cuda.Stream", "torch.cuda.Event", "torch.cuda.MemPool", "torch.cuda.amp.autocast",
                 "torch.cuda.amp.GradScaler", "torch.cuda.device", "torch.autocast", "torch.Generator"):
        assert name in served, (name, got)
    return got


def test_view_classes_stay_classes_on_the_cpu_adapter(tmp_path: Path) -> None:
    """On the CPU adapter: classes everywhere, and calling Stream/Event makes the adapter's null objects."""
    got = _check(tmp_path, "cpu")
    assert got["made"]["torch.cuda.Stream"].endswith("NullStream"), got["made"]


@pytest.mark.testdev
def test_view_classes_stay_classes_on_the_test_device(tmp_path: Path) -> None:
    """On the test device: the same, with torch's own Stream and Event objects."""
    got = _check(tmp_path, "testdev")
    assert got["made"]["torch.cuda.Stream"] == "torch.Stream", got["made"]
