"""The scoped torch / torch.cuda translation (portspeed.translation.importer) and the torch_cuda patches.

The views themselves (CudaView, TorchView): test_translation_views.py.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers.requires import require
from helpers.adapter_checks import cpu_adapter  # noqa: F401 - the fixture both files use

import portspeed
from portspeed.translation import scope as framework_modules
from portspeed.translation import importer as translation
from portspeed.accelerator import reset_accelerator, set_accelerator
from portspeed.errors import ConfigError
from portspeed.patches import torch_cuda

FW = "ps_fw_testpkg"  # a framework package made up for these tests
PLAIN = "ps_plain_testmod"  # an ordinary module next to it

MODULE_SRC = textwrap.dedent('''
    import torch
    import torch.nn as nn
    from torch.cuda import _lazy_call, current_device
    from torch import Generator as TorchGenerator

    def seen():
        return torch

    def inner_import():
        import torch as t2
        return t2

    def cuda_available():
        return torch.cuda.is_available()

    def move(x):
        return x.cuda()

    def to_cuda(x, *a, **k):
        return x.to(*a, **k)

    def type_str(x):
        return x.type()

    def make():
        return torch.zeros(2, device="cuda")

    def module_cuda(m):
        return m.cuda()

    def sampling_generator():
        # as Megatron's text-generation controller makes its sampling generator
        return torch.Generator(device=torch.cuda.current_device())

    def alloc_like(x, n):
        # as Megatron's all-to-all-v (MoE token dispatch) allocates its output
        return x.new_empty(size=[n], dtype=x.dtype, device=torch.cuda.current_device())
''')


@pytest.fixture
def scoped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpu_adapter):
    """Translation enabled with FW as a framework prefix and two importable modules on sys.path."""
    pkg = tmp_path / FW
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(MODULE_SRC)
    (tmp_path / f"{PLAIN}.py").write_text(MODULE_SRC)
    monkeypatch.syspath_prepend(str(tmp_path))
    was = translation.enabled()
    monkeypatch.setattr(framework_modules, "extra_prefixes", [*framework_modules.extra_prefixes, FW])
    translation.enable()
    yield
    translation.disable()
    for name in [n for n in sys.modules if n == PLAIN or n == FW or n.startswith(FW + ".")]:
        del sys.modules[name]
    if was:
        translation.enable()


# ---------------------------------------------------------------------- scoping
def test_framework_module_imported_later_binds_the_view(scoped) -> None:
    """`import torch` / `from torch.cuda import x` inside a framework module bind the views; others stay real."""
    fw = importlib.import_module(f"{FW}.mod")
    plain = importlib.import_module(PLAIN)
    assert fw.torch is translation.torch_view()
    assert fw.inner_import() is translation.torch_view()
    assert fw._lazy_call == translation.cuda_view()._lazy_call
    assert fw.nn is torch.nn
    assert fw.cuda_available() is True
    assert plain.torch is torch and plain.inner_import() is torch
    assert plain.cuda_available() is torch.cuda.is_available()
    assert fw.sampling_generator().device.type == "cpu"
    with pytest.raises((AssertionError, RuntimeError)):
        plain.sampling_generator()  # ordinary code gets torch's own answer: no CUDA here
    assert torch.cuda.is_available() is False and torch.cuda.device_count() == 0  # the real answers


def test_already_imported_framework_module_is_rebound_and_restored(tmp_path, monkeypatch, cpu_adapter) -> None:
    """A framework module imported before enable() gets the views; disable() gives it the real torch back."""
    pkg = tmp_path / FW
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "early.py").write_text(MODULE_SRC)
    monkeypatch.syspath_prepend(str(tmp_path))
    was = translation.enabled()
    translation.disable()
    try:
        early = importlib.import_module(f"{FW}.early")
        assert early.torch is torch
        monkeypatch.setattr(framework_modules, "extra_prefixes", [*framework_modules.extra_prefixes, FW])
        translation.enable()
        assert early.torch is translation.torch_view()
        assert early.current_device == translation.cuda_view().current_device
        assert early.TorchGenerator is translation.Generator
        translation.disable()
        assert early.torch is torch
        assert early.current_device is torch.cuda.current_device
        assert early.TorchGenerator is torch.Generator
    finally:
        for name in [n for n in sys.modules if n == FW or n.startswith(FW + ".")]:
            del sys.modules[name]
        if was:
            translation.enable()


def test_disable_restores_modules_imported_while_enabled(scoped) -> None:
    fw = importlib.import_module(f"{FW}.mod")
    assert fw.torch is translation.torch_view()
    translation.disable()
    assert fw.torch is torch and fw._lazy_call is torch.cuda._lazy_call
    assert fw.inner_import() is torch  # functions keep the scoped __import__, which now answers the real torch
    translation.enable()


def test_torch_itself_is_never_a_framework_module() -> None:
    assert not translation.is_framework_module("torch")
    assert not translation.is_framework_module("torch.cuda")
    assert translation.is_framework_module("megatron.core.utils")
    assert not translation.is_framework_module("megatronic")
    with pytest.raises(ConfigError, match="other than torch"):
        translation.add_framework_prefixes("torch.nn")


def test_framework_env_var_is_validated(monkeypatch) -> None:
    monkeypatch.setenv(translation.FRAMEWORK_ENV, "my_project.models, other")
    assert translation.is_framework_module("my_project.models.gpt")
    assert translation.is_framework_module("other")
    monkeypatch.setenv(translation.FRAMEWORK_ENV, "bad name!")
    with pytest.raises(ConfigError, match=translation.FRAMEWORK_ENV):
        translation.framework_prefixes()


def test_cuda_adapter_translates_nothing(monkeypatch) -> None:
    """On a CUDA adapter enable() installs no view and the torch_cuda patches are inactive."""
    from portspeed.adapters.cuda import CudaAccelerator

    was = translation.enabled()
    translation.disable()
    reset_accelerator()
    set_accelerator(CudaAccelerator())
    try:
        assert translation.enable() is False
        assert not translation.enabled()
        assert not any(isinstance(f, translation._ScopeFinder) for f in sys.meta_path)
        mgr = portspeed.PatchManager()
        mgr.register(torch_cuda.PATCHES)
        mgr.apply()
        assert {r.status for r in mgr.records()} == {"inactive"}
    finally:
        reset_accelerator()
        if was:
            translation.enable()


# ---------------------------------------------------------------------- torch_cuda patches
def test_tensor_and_module_methods_translate_for_framework_callers_only(scoped) -> None:
    fw = importlib.import_module(f"{FW}.mod")
    plain = importlib.import_module(PLAIN)
    mgr = portspeed.PatchManager()
    mgr.register(torch_cuda.PATCHES)
    mgr.apply()
    try:
        x = torch.ones(2)
        assert fw.move(x).device.type == "cpu"
        assert fw.to_cuda(x, "cuda:0").device.type == "cpu"
        assert fw.to_cuda(x, device=torch.device("cuda")).device.type == "cpu"
        assert fw.to_cuda(x, 0, torch.float64).dtype == torch.float64
        assert fw.type_str(x) == "torch.cuda.FloatTensor"
        assert fw.make().device.type == "cpu"
        m = torch.nn.Linear(2, 2)
        assert fw.module_cuda(m) is m
        assert fw.alloc_like(x, 3).device.type == "cpu" and fw.alloc_like(x, 3).shape == (3,)
        assert x.new_empty(4).device.type == "cpu"  # no device named: torch's own behaviour
        # the same calls from ordinary code keep torch's behaviour, errors included
        assert plain.type_str(x) == "torch.FloatTensor"
        with pytest.raises((AssertionError, RuntimeError), match="CUDA|NVIDIA driver"):
            plain.move(x)
        with pytest.raises((AssertionError, RuntimeError)):
            plain.to_cuda(x, "cuda")
        with pytest.raises((AssertionError, RuntimeError)):
            plain.alloc_like(x, 3)
        assert x.to(torch.float16).dtype == torch.float16  # fast path: nothing names CUDA
    finally:
        mgr.revert()
    if not any(r["name"] == "torch.tensor_cuda" and r["status"] == "applied" for r in portspeed.report()):
        with pytest.raises((AssertionError, RuntimeError)):
            fw.move(torch.ones(2))  # reverted: torch's own error again


def test_type_string_helpers(cpu_adapter) -> None:
    assert torch_cuda.cuda_type_string("torch.FloatTensor") == "torch.cuda.FloatTensor"
    assert torch_cuda.cuda_type_string("torch.npu.HalfTensor", "npu") == "torch.cuda.HalfTensor"
    assert torch_cuda.cuda_type_string("torch.FloatTensor", "npu") == "torch.FloatTensor"  # host stays host
    assert torch_cuda.local_type_string("torch.cuda.BFloat16Tensor") == "torch.BFloat16Tensor"


# ---------------------------------------------------------------------- torch.compile
@pytest.mark.megatron
def test_torch_compile_still_works_with_the_adaptor_active(tmp_path) -> None:
    """Inductor on CPU compiles and runs with portspeed.megatron_adaptor imported; torch.cuda stays real outside."""
    require("megatron.core", "pip install 'portspeed[megatron]'")  # the framework half
    code = textwrap.dedent('''
        import portspeed.megatron_adaptor
        import torch
        import megatron.core.jit  # a framework module (its import sets the adaptor up): its globals see the view
        from portspeed.translation import importer as translation
        assert translation.enabled()
        assert torch.cuda.is_available() is False and torch.cuda.device_count() == 0
        @torch.compile
        def f(x):
            return torch.sin(x) * 2 + 1
        x = torch.arange(8, dtype=torch.float32)
        assert torch.allclose(f(x), torch.sin(x) * 2 + 1)
        assert megatron.core.jit.torch is translation.torch_view()
        # a framework function compiled by Megatron's jit_fuser (torch.compile): dynamo traces through the view
        from megatron.core.fusions.fused_bias_gelu import bias_gelu
        b, y = torch.randn(8), torch.randn(4, 8)
        z = b + y
        ref = z * 0.5 * (1.0 + torch.tanh(0.79788456 * z * (1 + 0.044715 * z * z)))
        assert torch.allclose(bias_gelu(b, y), ref, atol=1e-5)
        print("compiled-ok")
    ''')
    env = {"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "PYTHONWARNINGS": "ignore", "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "compiled-ok" in res.stdout, res.stderr[-3000:]
