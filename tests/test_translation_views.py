"""The views framework modules get: ``CudaView`` (torch.cuda answered by the adapter), ``TorchView`` (torch, CUDA
devices translated).

On the CPU adapter, and the generator on the test device. Scoping the views onto framework modules, and the
torch_cuda patches: test_translation.py.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from helpers.adapter_checks import cpu_adapter  # noqa: F401 - the fixture both files use

from portspeed.translation import importer as translation
from portspeed.adapters.cpu import NullEvent, NullStream
from portspeed.errors import UnsupportedCudaCallError


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
    assert "torch.cuda.CUDAGraph" in msg and "test_translation_views.py:" in msg and "'cpu'" in msg
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
        from portspeed.translation import importer as translation
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
