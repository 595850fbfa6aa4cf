"""The scoped torch / torch.cuda translation (portspeed.accelerator.translation) and the torch_cuda patches."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers.requires import require

import portspeed
from portspeed.accelerator import scope as framework_modules
from portspeed.accelerator import translation
from portspeed.accelerator import reset_accelerator, set_accelerator
from portspeed.adapters.cpu import CpuAccelerator, NullEvent, NullStream
from portspeed.errors import ConfigError, UnsupportedCudaCallError
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
def cpu_adapter():
    """A fresh CPU adapter for the test; the previous selection is restored after."""
    reset_accelerator()
    acc = CpuAccelerator()
    set_accelerator(acc)
    yield acc
    reset_accelerator()


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


# ---------------------------------------------------------------------- CudaView
def test_cuda_view_answers_from_the_adapter(cpu_adapter) -> None:
    """is_available/device_count/current_device/set_device come from the adapter with CUDA's types."""
    cv = translation.cuda_view()
    assert cv.is_available() is True
    assert cv.device_count() == 1
    cv.set_device(3)
    assert cv.current_device() == 3 and isinstance(cv.current_device(), int)
    with cv.device(1):
        assert cv.current_device() == 1
    assert cv.current_device() == 3
    cv.synchronize()
    assert cv.get_device_capability() == (0, 0)
    props = cv.get_device_properties(0)
    assert props.total_memory > 0 and props.major == 0
    assert cv.is_bf16_supported() is True
    assert cv.is_current_stream_capturing() is False


def test_cuda_view_rng_maps_to_the_adapter_generator(cpu_adapter) -> None:
    """get/set_rng_state, manual_seed, default_generators all act on the adapter's generator."""
    cv = translation.cuda_view()
    cv.manual_seed(7)
    state = cv.get_rng_state()
    a = torch.rand(3)
    cv.set_rng_state(state)
    assert torch.equal(torch.rand(3), a)
    assert cv.default_generators[0] is torch.default_generator
    assert len(cv.default_generators) == 1
    assert cv.initial_seed() == 7
    assert torch.equal(cv.random.get_rng_state(device="cuda"), cv.get_rng_state())


def test_lazy_call_runs_now(cpu_adapter) -> None:
    """A CPU build's torch.cuda._lazy_call queues forever; the view runs the callback at once."""
    ran = []
    translation.cuda_view()._lazy_call(lambda: ran.append(1))
    assert ran == [1]


def test_streams_events_memory_nvtx_amp(cpu_adapter) -> None:
    cv = translation.cuda_view()
    s = cv.Stream()
    assert isinstance(s, NullStream) and cv.current_stream() == s
    with cv.stream(s):
        pass
    e1, e2 = cv.Event(enable_timing=True), cv.Event(enable_timing=True)
    assert isinstance(e1, NullEvent)
    e1.record(), e2.record()
    assert e1.elapsed_time(e2) >= 0
    assert cv.memory_allocated() == 0 and cv.memory_stats() == {}
    cv.empty_cache()
    cv.nvtx.range_push("x"), cv.nvtx.range_pop()
    with cv.nvtx.range("y"):
        pass
    with cv.amp.autocast(dtype=torch.bfloat16):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_unmapped_call_names_call_caller_and_adapter(cpu_adapter) -> None:
    """An attribute the view does not translate raises UnsupportedCudaCallError with what to do."""
    cv = translation.cuda_view()
    with pytest.raises(UnsupportedCudaCallError) as err:
        cv.CUDAGraph()
    msg = str(err.value)
    assert "torch.cuda.CUDAGraph" in msg and "test_translation.py:" in msg and "'cpu'" in msg
    assert "PORTSPEED_DISABLE" in msg and "CUDA graphs" in msg
    with pytest.raises(UnsupportedCudaCallError, match="torch.cuda.some_new_api"):
        cv.some_new_api
    assert not hasattr(cv, "use_mem_pool")  # an AttributeError: hasattr probes answer False


# ---------------------------------------------------------------------- TorchView
@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 0), 0])
def test_factories_translate_cuda_devices(cpu_adapter, device) -> None:
    tv = translation.torch_view()
    assert tv.zeros(2, device=device).device.type == "cpu"
    assert tv.full((1,), 3.0, device=device).device.type == "cpu"
    assert tv.tensor([1], device=device).device.type == "cpu"
    assert tv.empty_like(torch.ones(1), device=device).device.type == "cpu"


def test_pin_memory_is_dropped_where_the_device_is_the_host(cpu_adapter) -> None:
    """``torch.tensor(..., device="cpu", pin_memory=True).cuda(non_blocking=True)`` (Megatron 0.19's
    ``get_pos_emb_on_this_cp_rank``) raises on torch without an accelerator; on the CPU adapter it is a plain
    host tensor. The real torch still raises in a fresh interpreter (this process may have registered a device
    with a pinned-memory allocator), so the test shows the view is what makes the difference."""
    import subprocess
    import sys

    tv = translation.torch_view()
    t = tv.tensor([0, 3], device="cpu", pin_memory=True)
    assert t.tolist() == [0, 3] and not t.is_pinned()
    assert tv.empty(2, pin_memory=True).device.type == "cpu"
    if not torch.cuda.is_available():
        control = subprocess.run([sys.executable, "-c", "import torch; torch.tensor([0, 3], pin_memory=True)"],
                                 capture_output=True, text=True, timeout=120)
        assert control.returncode != 0, "control: plain torch pinned memory without an accelerator"


def test_torch_view_forwards_everything_else(cpu_adapter) -> None:
    """Non-translated names are the real torch objects (no proxy on the hot path)."""
    tv = translation.torch_view()
    assert tv.nn is torch.nn and tv.float32 is torch.float32 and tv.Tensor is torch.Tensor
    assert tv.matmul is torch.matmul and tv.distributed is torch.distributed
    assert tv.cuda is translation.cuda_view()
    assert tv.zeros(2).device.type == "cpu"
    with tv.autocast("cuda", dtype=torch.bfloat16):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 0), 0, 2])
def test_generator_on_a_cuda_device_is_the_adapters_generator_type(cpu_adapter, device) -> None:
    """torch.Generator(device=<CUDA device or int index>) in the view is a new CPU generator on the CPU adapter."""
    tv = translation.torch_view()
    g = tv.Generator(device=device)
    assert type(g) is torch.Generator and g.device.type == "cpu"
    assert g is not torch.default_generator
    assert tv.Generator(device).device.type == "cpu"  # positional, as torch.Generator accepts it


def test_translated_generator_is_its_own_and_keeps_torchs_class(cpu_adapter) -> None:
    """Seeding it leaves the default generator alone; isinstance and class attributes answer as torch.Generator."""
    tv = translation.torch_view()
    host = torch.get_rng_state()
    g = tv.Generator(device="cuda")
    g.manual_seed(42)
    a = torch.rand(4, generator=g)
    assert torch.equal(torch.get_rng_state(), host), "drawing from the translated generator moved the default one"
    assert torch.equal(torch.rand(4, generator=tv.Generator(device=0).manual_seed(42)), a)
    assert isinstance(g, tv.Generator) and issubclass(torch.Generator, tv.Generator)
    assert not isinstance(torch.ones(1), tv.Generator)
    assert tv.Generator.manual_seed is torch.Generator.manual_seed
    assert hasattr(tv.Generator, "graphsafe_set_state") == hasattr(torch.Generator, "graphsafe_set_state")
    assert tv.Generator().device.type == "cpu" and tv.Generator("cpu").device.type == "cpu"  # host stays host


def test_cuda_generator_name_is_not_invented(cpu_adapter) -> None:
    """torch.cuda has no Generator on any build: the view says so instead of answering what CUDA never does."""
    assert not hasattr(torch.cuda, "Generator")
    cv = translation.cuda_view()
    assert not hasattr(cv, "Generator")
    with pytest.raises(UnsupportedCudaCallError, match=r"torch.Generator\(device='cuda'\)"):
        cv.Generator


@pytest.mark.testdev
def test_generator_on_the_test_device_is_a_device_generator() -> None:
    """On the test device (a test device, not hardware) Megatron's sampling generator is a testdev generator.

    Subprocess: registering the test device is permanent in a process. The generator must
    be on the current device, seeded independently of the device's default generator and
    the host's, and usable by device ops (multinomial draws from it).
    """
    from helpers.launch import run_python

    code = textwrap.dedent('''
        import torch
        import portspeed.megatron_adaptor as adaptor
        adaptor.activate()
        import portspeed
        assert portspeed.get_accelerator().device_type == "testdev"
        from portspeed.accelerator import translation
        tv = translation.torch_view()
        torch.testdev.set_device(1)
        g = tv.Generator(device=tv.cuda.current_device())
        assert g.device == torch.device("testdev", 1), g.device
        assert tv.Generator(device="cuda:3").device == torch.device("testdev", 3)
        assert tv.Generator(device="cuda").device == torch.device("testdev", 1)
        assert tv.Generator().device.type == "cpu"
        host, dev = torch.get_rng_state(), torch.testdev.get_rng_state(1)
        g.manual_seed(7)
        p = torch.tensor([0.1, 0.2, 0.3, 0.4], device="testdev:1")
        a = torch.multinomial(p, 8, replacement=True, generator=g)
        assert a.device == torch.device("testdev", 1)
        assert torch.equal(torch.get_rng_state(), host), "the host generator moved"
        assert torch.equal(torch.testdev.get_rng_state(1), dev), "the device's default generator moved"
        b = torch.multinomial(p, 8, replacement=True, generator=tv.Generator(device=1).manual_seed(7))
        assert torch.equal(a.cpu(), b.cpu())
        print("generator-ok")
    ''')
    res = run_python(["-c", code], timeout=180, env={"PORTSPEED_ACCELERATOR": "testdev"})
    assert res.returncode == 0 and "generator-ok" in res.stdout, res.stderr[-4000:]


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
        from portspeed.accelerator import translation
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
