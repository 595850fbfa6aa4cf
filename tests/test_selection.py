"""Adapter selection: PORTSPEED_* bad input, missing vendor packages, entry-point adapters,
and the documented detection order (vendor devices through their FAKE modules)."""

from __future__ import annotations

import contextlib
import logging
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

from fakes import fake_habana, fake_torch_mlu, fake_torch_musa, fake_torch_npu, fake_torch_xpu  # noqa: E402

from portspeed import config  # noqa: E402
from portspeed.accelerator import (  # noqa: E402
    BUILTIN_ADAPTERS,
    DETECTION_ORDER,
    ENTRY_POINT_GROUP,
    adapter_class,
    available_adapters,
    get_accelerator,
    reset_accelerator,
    selection_reason,
    set_accelerator,
)
from portspeed.errors import ConfigError, MissingVendorPackageError, UnknownAcceleratorError  # noqa: E402

FAKES: dict[str, Callable[..., Any]] = {
    "npu": fake_torch_npu.installed,
    "mlu": fake_torch_mlu.installed,
    "musa": fake_torch_musa.installed,
    "xpu": fake_torch_xpu.installed,
    "hpu": fake_habana.installed,
}
VARS = ("PORTSPEED_ACCELERATOR", "PORTSPEED_BACKEND", "PORTSPEED_STRICT", "PORTSPEED_DISABLE",
        "PORTSPEED_LOG_LEVEL", "PORTSPEED_TIMEOUT")


pytestmark = pytest.mark.usefixtures("portspeed_env")  # tests/conftest.py


def _select(monkeypatch: pytest.MonkeyPatch, **env: str) -> Any:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    config.reload()
    reset_accelerator()
    return get_accelerator()


# ----------------------------------------------------------------------------- explicit selection
def test_unknown_accelerator_lists_the_known_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unknown PORTSPEED_ACCELERATOR names itself and every known adapter."""
    with pytest.raises(UnknownAcceleratorError) as info:
        _select(monkeypatch, PORTSPEED_ACCELERATOR="tpu")
    msg = str(info.value)
    assert "'tpu'" in msg
    for name in BUILTIN_ADAPTERS:
        assert name in msg
    assert ENTRY_POINT_GROUP in msg


@pytest.mark.parametrize(
    "name, package",
    [("npu", "torch-npu"), ("mlu", "torch_mlu"), ("musa", "torch_musa"), ("hpu", "habana-torch-plugin")],
)
def test_selected_vendor_without_its_package_names_the_package(
    monkeypatch: pytest.MonkeyPatch, name: str, package: str
) -> None:
    """PORTSPEED_ACCELERATOR=<vendor> without the vendor package says what to pip install."""
    with pytest.raises(MissingVendorPackageError) as info:
        _select(monkeypatch, PORTSPEED_ACCELERATOR=name)
    assert package in str(info.value) and repr(name) in str(info.value)


def test_selected_xpu_on_a_torch_without_xpu_names_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """xpu has no vendor package: on a torch built without XPU it says which torch to install."""
    import torch

    if torch.xpu._is_compiled():
        pytest.skip("this torch is built with XPU support, so there is nothing missing to report")
    with pytest.raises(MissingVendorPackageError, match="download.pytorch.org/whl/xpu"):
        _select(monkeypatch, PORTSPEED_ACCELERATOR="xpu")


@pytest.mark.cpu_wheel  # on PyPI's CUDA build selecting cuda is legitimate (CI leg 2 leaves this out)
def test_selected_cuda_on_a_cpu_torch_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda on a CPU-only torch build raises instead of failing at the first tensor."""
    import torch

    assert not torch.backends.cuda.is_built(), "marker cpu_wheel: run this on the CPU-only torch wheel (CI leg 1)"
    with pytest.raises(MissingVendorPackageError, match="CPU-only"):
        _select(monkeypatch, PORTSPEED_ACCELERATOR="cuda")


def test_explicit_selection_reports_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """PORTSPEED_ACCELERATOR=cpu selects cpu and selection_reason() says it was asked for."""
    acc = _select(monkeypatch, PORTSPEED_ACCELERATOR="CPU")
    assert acc.name == "cpu" and selection_reason() == "PORTSPEED_ACCELERATOR"


def test_explicit_vendor_with_its_fake(monkeypatch: pytest.MonkeyPatch) -> None:
    """PORTSPEED_ACCELERATOR=npu with (fake) torch_npu present selects npu, backend hccl."""
    with fake_torch_npu.installed():
        acc = _select(monkeypatch, PORTSPEED_ACCELERATOR="npu")
        assert acc.name == "npu" and acc.communication_backend == "hccl"


def test_backend_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """PORTSPEED_BACKEND replaces the adapter's default collective backend."""
    acc = _select(monkeypatch, PORTSPEED_ACCELERATOR="cpu", PORTSPEED_BACKEND="mpi")
    assert acc.communication_backend == "mpi"


def test_set_accelerator_wins_and_rejects_non_adapters(monkeypatch: pytest.MonkeyPatch) -> None:
    """set_accelerator() beats the environment; anything but an Accelerator is refused."""
    monkeypatch.setenv("PORTSPEED_ACCELERATOR", "tpu")
    config.reload()
    injected = adapter_class("cpu")()
    set_accelerator(injected)
    assert get_accelerator() is injected and selection_reason() == "set_accelerator()"
    with pytest.raises(TypeError, match="Accelerator instance"):
        set_accelerator("cpu")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- garbage in settings
@pytest.mark.parametrize(
    "var, value",
    [
        ("PORTSPEED_ACCELERATOR", "np u!"),
        ("PORTSPEED_ACCELERATOR", "cuda:0"),
        ("PORTSPEED_BACKEND", "nccl,gloo"),
        ("PORTSPEED_BACKEND", "cpu:gloo"),
        ("PORTSPEED_STRICT", "maybe"),
        ("PORTSPEED_STRICT", "2"),
        ("PORTSPEED_DISABLE", "megatron.rng; rm -rf"),
        ("PORTSPEED_LOG_LEVEL", "LOUD"),
        ("PORTSPEED_LOG_LEVEL", "10"),
        ("PORTSPEED_TIMEOUT", "soon"),
        ("PORTSPEED_TIMEOUT", "-5"),
        ("PORTSPEED_TIMEOUT", "0"),
        ("PORTSPEED_TIMEOUT", "nan"),
        ("PORTSPEED_TIMEOUT", "inf"),
    ],
)
def test_garbage_settings_raise_config_error(monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    """Each malformed PORTSPEED_* value raises ConfigError naming the variable and the value."""
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as info:
        config.reload()
    assert var in str(info.value) and repr(value) in str(info.value)
    with pytest.raises(ConfigError):  # and selection, which reads the settings, fails the same way
        reset_accelerator()
        get_accelerator()


def test_well_formed_but_unknown_backend_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """PORTSPEED_BACKEND=foo parses but no torch.distributed backend has that name: say so, listing known ones."""
    with pytest.raises(ConfigError) as info:
        _select(monkeypatch, PORTSPEED_BACKEND="foo")
    assert "PORTSPEED_BACKEND='foo'" in str(info.value) and "gloo" in str(info.value)


@pytest.mark.parametrize(
    "var, value, field, parsed",
    [
        ("PORTSPEED_STRICT", "Yes", "strict", True),
        ("PORTSPEED_DISABLE", "megatron.rng, torch_cuda.*", "disable", ("megatron.rng", "torch_cuda.*")),
        ("PORTSPEED_LOG_LEVEL", "debug", "log_level", "DEBUG"),
        ("PORTSPEED_TIMEOUT", "2.5", "timeout", 2.5),
    ],
)
def test_good_settings_parse(monkeypatch: pytest.MonkeyPatch, var: str, value: str, field: str, parsed: Any) -> None:
    """The accepted spellings parse to the documented values (so the rejections above are not blanket)."""
    monkeypatch.setenv(var, value)
    assert getattr(config.reload(), field) == parsed


# ----------------------------------------------------------------------------- entry points
_TOY = textwrap.dedent(
    """
    from portspeed.adapters.cpu import CpuAccelerator

    class ToyAccelerator(CpuAccelerator):
        '''A third-party adapter for tests: the CPU under another name.'''
        name = "toy"
        present = True

        @classmethod
        def detect(cls):
            return cls.present

    class NotAnAdapter:
        pass
    """
)


@pytest.fixture
def toy_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A real (temporary) installed distribution registering adapters in the portspeed.adapters group."""
    (tmp_path / "portspeed_toy_adapter.py").write_text(_TOY)
    info = tmp_path / "portspeed_toy_adapter-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: portspeed-toy-adapter\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\n"
        "toy = portspeed_toy_adapter:ToyAccelerator\n"
        "bogus = portspeed_toy_adapter:NotAnAdapter\n"
        "broken = portspeed_toy_adapter_missing:Nothing\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import portspeed_toy_adapter  # type: ignore[import-not-found]

    yield portspeed_toy_adapter
    sys.modules.pop("portspeed_toy_adapter", None)


def test_entry_point_adapter_is_listed_and_selectable(monkeypatch: pytest.MonkeyPatch, toy_distribution: Any) -> None:
    """An adapter registered by another distribution is listed and can be asked for by name."""
    assert "toy" in available_adapters()
    assert available_adapters()[: len(BUILTIN_ADAPTERS)] == list(BUILTIN_ADAPTERS)
    acc = _select(monkeypatch, PORTSPEED_ACCELERATOR="toy")
    assert type(acc) is toy_distribution.ToyAccelerator and selection_reason() == "PORTSPEED_ACCELERATOR"


def test_entry_point_adapter_is_detected_before_builtins(
    monkeypatch: pytest.MonkeyPatch, toy_distribution: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Auto-detection tries entry-point adapters first; a broken one is logged and skipped."""
    with caplog.at_level(logging.WARNING, "portspeed"):
        acc = _select(monkeypatch)
    assert acc.name == "toy" and selection_reason() == "auto-detected (entry point 'toy')"
    assert "broken" in caplog.text and "bogus" in caplog.text


def test_entry_point_adapter_not_detected_falls_through(monkeypatch: pytest.MonkeyPatch, toy_distribution: Any) -> None:
    """When the third-party adapter's device is absent, the built-in order goes on (to cpu here)."""
    monkeypatch.setattr(toy_distribution.ToyAccelerator, "present", False)
    assert _select(monkeypatch).name == "cpu"


def test_entry_point_that_is_not_an_adapter_is_refused(monkeypatch: pytest.MonkeyPatch, toy_distribution: Any) -> None:
    """An entry point resolving to something other than an Accelerator subclass raises naming it."""
    with pytest.raises(UnknownAcceleratorError, match="'bogus'.*not a portspeed.vendor.Accelerator"):
        adapter_class("bogus")


# ----------------------------------------------------------------------------- detection order
@contextlib.contextmanager
def _fakes(*names: str, available: bool = True) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for n in names:
            stack.enter_context(FAKES[n](available=available))
        yield


def test_nothing_present_selects_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no vendor package and no GPU, auto-detection ends at cpu and says it detected it."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present, so cuda is detected before cpu")
    acc = _select(monkeypatch)
    assert acc.name == "cpu" and selection_reason() == "auto-detected"


@pytest.mark.parametrize("name", list(FAKES))
def test_a_present_vendor_beats_cpu(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """A vendor whose (fake) device is available is selected instead of cpu."""
    with _fakes(name):
        assert _select(monkeypatch).name == name


@pytest.mark.parametrize("name", list(FAKES))
def test_installed_vendor_without_a_device_is_skipped(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """A vendor package that is installed but sees no device does not win detection."""
    with _fakes(name, available=False):
        assert _select(monkeypatch).name != name


_VENDOR_ORDER = [n for n in DETECTION_ORDER if n in FAKES]


@pytest.mark.parametrize(
    "first, later", [(a, b) for i, a in enumerate(_VENDOR_ORDER) for b in _VENDOR_ORDER[i + 1:]]
)
def test_detection_order_among_vendors(monkeypatch: pytest.MonkeyPatch, first: str, later: str) -> None:
    """With two vendors present, the one earlier in DETECTION_ORDER wins."""
    with _fakes(later, first):
        assert _select(monkeypatch).name == first


def test_detection_order_is_documented() -> None:
    """The order tested above is the one the accelerator module documents: vendors, cuda, cpu."""
    assert DETECTION_ORDER[-2:] == ("cuda", "cpu")
    assert sorted(DETECTION_ORDER) == sorted(BUILTIN_ADAPTERS), "every built-in has one place in the order"
    import portspeed.accelerator.selection as acc_mod

    assert "DETECTION_ORDER" in (acc_mod.__doc__ or "")

