"""portspeed.megatron_adaptor: import order, what it patches, Megatron-Core behaviour on CPU.

Each check runs in a fresh interpreter: importing the adaptor changes the process
(translation scoped onto megatron.*, torch.Tensor methods wrapped), which must not leak
into other tests.
"""

from __future__ import annotations

import textwrap

import pytest

from helpers.requires import require

require("megatron.core", "pip install 'portspeed[megatron]'")

from helpers.launch import run_snippet  # noqa: E402

pytestmark = pytest.mark.megatron

SINGLE_RANK_WORLD = '''
import os, torch.distributed as dist
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
from helpers_port import port
dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port()}")
from megatron.core import parallel_state as ps
ps.initialize_model_parallel(1, 1)
'''


def _py(code: "str | list[str]", tmp_path) -> str:
    """Run the snippet (or the snippets, each dedented, joined) in a fresh interpreter; return its output."""
    if isinstance(code, list):
        code = "\n".join(textwrap.dedent(c) for c in code)
    (tmp_path / "helpers_port.py").write_text(textwrap.dedent('''
        import socket
        def port():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                return s.getsockname()[1]
    '''))
    res = run_snippet(code, timeout=240, env={"PYTHONPATH": str(tmp_path)}).check()
    return res.stdout + res.stderr


def test_adaptor_does_not_import_megatron(tmp_path) -> None:
    out = _py('''
        import sys
        import portspeed.megatron_adaptor, portspeed
        assert not [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]
        pending = [r["name"] for r in portspeed.report() if r["status"] == "pending"]
        assert "megatron.core.rng.set_state" in pending, pending
        print("ok")
    ''', tmp_path)
    assert "ok" in out


@pytest.mark.parametrize("order", ["adaptor-first", "megatron-first"])
def test_import_order_does_not_matter(order: str, tmp_path) -> None:
    """Either order ends with the same patches applied and megatron's modules seeing the view."""
    megatron = ("import megatron.core.tensor_parallel.random, megatron.core.parallel_state, "
                "megatron.core.transformer.torch_norm")
    first, second = ("import portspeed.megatron_adaptor", megatron)
    if order != "adaptor-first":
        first, second = second, first
    out = _py(f'''
        {first}
        {second}
        import portspeed, torch
        from portspeed.translation import importer as translation
        import megatron.core.tensor_parallel.random as r
        import megatron.core.parallel_state as ps
        from megatron.core.models.gpt import gpt_layer_specs
        status = {{x["name"]: x["status"] for x in portspeed.report()}}
        for name in ("megatron.core.rng.set_state", "megatron.core.rng.get_state",
                     "megatron.core.parallel_state.nccl_options", "megatron.core.fallbacks.torch_norm_sp",
                     "torch.tensor_cuda", "torch.tensor_type"):
            assert status[name] == "applied", (name, status[name])
        assert r.torch is translation.torch_view() and ps.torch is translation.torch_view()
        assert r._lazy_call == translation.cuda_view()._lazy_call
        assert r._set_cuda_rng_state.__module__.startswith("portspeed")
        assert getattr(gpt_layer_specs.LNImpl, "__wrapped__", None) is not None
        assert torch.cuda.is_available() is False
        print("ok")
    ''', tmp_path)
    assert "ok" in out


def test_rng_tracker_keeps_its_own_state(tmp_path) -> None:
    """The tracker's TP-rank state lives apart from the default generator: fork swaps it in and out."""
    out = _py(['''
        import portspeed.megatron_adaptor
        import torch
    ''', SINGLE_RANK_WORLD, '''
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(123)
        tracker = get_cuda_rng_tracker()
        before = torch.get_rng_state()
        with tracker.fork():
            a = torch.rand(4)
        assert torch.equal(torch.get_rng_state(), before), "fork must restore the default generator"
        with tracker.fork():
            b = torch.rand(4)
        ref = torch.Generator().manual_seed(123 + 2718)   # Megatron's TP-rank-0 seed
        assert torch.equal(a, torch.rand(4, generator=ref)) and torch.equal(b, torch.rand(4, generator=ref))
        outside = torch.rand(4)
        assert not torch.equal(outside, a)
        print("ok")
    '''], tmp_path)
    assert "ok" in out


def test_cuda_kernel_defaults_fall_back_with_one_log_line(tmp_path) -> None:
    out = _py('''
        import portspeed.megatron_adaptor
        from megatron.core.transformer.transformer_config import TransformerConfig
        kw = dict(num_layers=2, hidden_size=8, num_attention_heads=2, masked_softmax_fusion=True,
                  persist_layer_norm=True, gradient_accumulation_fusion=True, bias_activation_fusion=True)
        for _ in range(2):
            c = TransformerConfig(**kw)
        assert not (c.masked_softmax_fusion or c.persist_layer_norm or c.gradient_accumulation_fusion
                    or c.bias_activation_fusion)
        print("ok")
    ''', tmp_path)
    assert "ok" in out
    for field in ("masked_softmax_fusion", "persist_layer_norm", "gradient_accumulation_fusion",
                  "bias_activation_fusion"):
        assert out.count(f"portspeed: {field} has no cpu kernel") == 1, out


def test_megatrons_cuda_allocator_build_is_refused_off_cuda(tmp_path) -> None:
    """megatron-core 0.15 builds a CUDA allocator at import and catches only RuntimeError, ImportError and OSError;
    a CUDA build of torch without a GPU raised an IndexError there (the stock run died at import). Off CUDA that one
    build raises a RuntimeError naming why; any other load_inline is torch's own, wrapped."""
    out = _py('''
        import portspeed.megatron_adaptor, portspeed
        import megatron.core
        import torch.utils.cpp_extension as ext
        try:
            ext.load_inline(name="managed_alloc_runtime", cpp_sources=["int f();"], functions=[], with_cuda=True)
        except RuntimeError as exc:
            print("refused:", exc)
        status = {r["name"]: r["status"] for r in portspeed.report()}
        print("status", status["megatron.core.unified_memory.not_built"])
        print("inner", ext.load_inline.__wrapped__.__module__)
    ''', tmp_path)
    assert "refused: portspeed: Megatron's unified-memory allocator (managed_alloc_runtime) is CUDA code and the " \
           "active device is 'cpu'" in out, out
    assert "status applied" in out and "inner torch.utils.cpp_extension" in out, out


def test_broadcast_from_last_pipeline_stage_on_cpu(tmp_path) -> None:
    """The inference broadcast accepts adapter-device tensors and names the device when it rejects one."""
    out = _py(['''
        import portspeed.megatron_adaptor
        import torch
    ''', SINGLE_RANK_WORLD, '''
        from megatron.core.inference.communication_utils import broadcast_from_last_pipeline_stage
        t = torch.arange(6, dtype=torch.float32).view(2, 3)
        got = broadcast_from_last_pipeline_stage([2, 3], torch.float32, t)
        assert torch.equal(got, t)
        try:
            broadcast_from_last_pipeline_stage([2, 3], torch.float32, torch.empty(2, 3, device="meta"))
        except AssertionError as exc:
            assert "'cpu' device" in str(exc) and "meta" in str(exc), exc
        else:
            raise SystemExit("a meta tensor was accepted")
        print("ok")
    '''], tmp_path)
    assert "ok" in out


def test_ddp_buffer_offload_keeps_host_resident_params(tmp_path) -> None:
    """offload_to_cpu + reload_from_cpu round-trips parameters that already live on the CPU."""
    out = _py(['''
        import portspeed.megatron_adaptor
        import torch
    ''', SINGLE_RANK_WORLD, '''
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig
        model_parallel_cuda_manual_seed(1)
        cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
        gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=32,
                       max_sequence_length=8)
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True), gpt)
        before = [p.detach().clone() for p in gpt.parameters()]
        buf = ddp.buffers[0]
        buf.offload_to_cpu(move_params=True, move_grads=True)
        assert buf.param_data.storage().size() == 0 and buf.param_data_cpu.storage().size() > 0
        buf.reload_from_cpu(move_params=True, move_grads=True)
        assert all(torch.equal(a, p) for a, p in zip(before, gpt.parameters()))
        print("ok")
    '''], tmp_path)
    assert "ok" in out


def test_nccl_only_options_are_dropped(tmp_path) -> None:
    out = _py(['''
        import portspeed.megatron_adaptor
        import torch
    ''', SINGLE_RANK_WORLD.replace("ps.initialize_model_parallel(1, 1)",
                                   "ps.initialize_model_parallel(1, 1, use_sharp=False, "
                                   "high_priority_stream_groups=['dp'])"), '''
        assert ps.model_parallel_is_initialized()
        print("ok")
    '''], tmp_path)
    assert "ok" in out and "high_priority_stream_groups" in out
