"""Framework code that names CUDA runs on the test device, and host tensors stay host tensors there.

On the CPU adapter a host tensor *is* a device tensor, so translations that confuse the two
pass unnoticed; on the test device (a C++ PrivateUse1 device, not hardware) they cannot.
Each test runs in a fresh process with ``PORTSPEED_ACCELERATOR=testdev`` and a made-up
framework package ``tdfw`` (named in ``PORTSPEED_FRAMEWORK_MODULES``) whose functions call
the CUDA APIs the way Megatron does.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from helpers.launch import run_python

pytestmark = [pytest.mark.testdev]

FRAMEWORK = '''
import torch

def type_str(t):
    return t.type()

def to_cuda(t):
    return t.cuda()

def make():
    return torch.zeros(2, device="cuda")

def make_on_current():
    return torch.empty(2, device=torch.cuda.current_device())

def current():
    return torch.cuda.current_device()

def rng_state():
    return torch.cuda.get_rng_state()

def seed(s):
    torch.cuda.manual_seed(s)
'''


def _run(tmp_path: Path, code: str) -> None:
    pkg = tmp_path / "tdfw"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text(FRAMEWORK)
    prelude = textwrap.dedent("""
        import torch
        import portspeed, portspeed.megatron_adaptor as adaptor
        adaptor.activate()
        import tdfw
    """)
    res = run_python(["-c", prelude + textwrap.dedent(code) + "\nprint('OK')\n"], timeout=180,
                     env={"PORTSPEED_ACCELERATOR": "testdev", "PORTSPEED_FRAMEWORK_MODULES": "tdfw",
                          "PYTHONPATH": str(tmp_path)})
    assert res.returncode == 0 and res.stdout.rstrip().endswith("OK"), (
        f"exit {res.returncode}\n--- stdout ---\n{res.stdout[-2000:]}\n--- stderr ---\n{res.stderr[-5000:]}")


def test_cuda_calls_from_framework_code_land_on_the_test_device(tmp_path: Path) -> None:
    """t.cuda(), device='cuda' and torch.cuda.current_device() mean the test device for framework code."""
    _run(tmp_path, """
        assert portspeed.get_accelerator().name == "testdev"
        torch.testdev.set_device(2)
        assert tdfw.current() == 2
        assert tdfw.to_cuda(torch.ones(2)).device == torch.device("testdev", 2)
        assert tdfw.make().device == torch.device("testdev", 2)
        assert tdfw.make_on_current().device == torch.device("testdev", 2)
    """)


def test_type_string_tells_host_from_device(tmp_path: Path) -> None:
    """Megatron asserts grad.type() == 'torch.cuda.FloatTensor': only a device tensor may answer that."""
    _run(tmp_path, """
        assert tdfw.type_str(torch.ones(2, device="testdev")) == "torch.cuda.FloatTensor"
        assert tdfw.type_str(torch.ones(2, device="testdev", dtype=torch.bfloat16)) == "torch.cuda.BFloat16Tensor"
        assert tdfw.type_str(torch.ones(2)) == "torch.FloatTensor", "a host tensor claimed to be on the device"
        # non-framework code: torch's answer
        assert torch.ones(2, device="testdev").type() == "torch.testdev.FloatTensor"
    """)


def test_cuda_rng_calls_reach_the_device_generator(tmp_path: Path) -> None:
    """torch.cuda.manual_seed / get_rng_state from framework code are the device generator's, not the host's."""
    _run(tmp_path, """
        host = torch.get_rng_state()
        tdfw.seed(1234)
        assert torch.equal(host, torch.get_rng_state()), "seeding 'cuda' moved the host generator"
        assert torch.equal(tdfw.rng_state(), torch.testdev.get_rng_state())
        assert torch.testdev.initial_seed() == 1234
    """)


def test_host_generator_patch_is_inactive_on_a_device_with_its_own_generator(tmp_path: Path) -> None:
    """The data-iterator RNG patch exists for devices whose generator is the host's; the test device's is not."""
    _run(tmp_path, """
        from portspeed.patches.megatron.training_data_rng import shares_host_generator
        from portspeed.adapters.cpu import CpuAccelerator
        assert not shares_host_generator(portspeed.get_accelerator())
        assert shares_host_generator(CpuAccelerator())
    """)


def test_p2p_send_copy_follows_the_backend_not_the_device(tmp_path: Path) -> None:
    """Megatron's p2p sends a private copy only where the backend reads the send buffer in flight (Gloo)."""
    _run(tmp_path, """
        from portspeed.accelerator.conditions import sends_from_buffer
        from portspeed.adapters.cpu import CpuAccelerator
        from portspeed.testing.standin_ccl import StandinAccelerator
        assert not sends_from_buffer(portspeed.get_accelerator()), "testccl takes the data when the send is issued"
        assert sends_from_buffer(CpuAccelerator()) and sends_from_buffer(StandinAccelerator())
    """)


def test_megatron_groups_dropped_on_the_test_device_are_destroyed(tmp_path: Path) -> None:
    """Each testccl group owns a staging Gloo group: ``destroy_model_parallel`` must not leave them behind.

    Megatron drops its 'nccl' groups without destroying them; before the teardown patch
    covered testccl, Megatron's ``test_parallel_state.py`` piled up ~1,300 threads per rank.
    """
    _run(tmp_path, f"""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
        from portspeed.accelerator.conditions import groups_hold_host_threads
        from portspeed.adapters.cpu import CpuAccelerator
        from portspeed.adapters.cuda import CudaAccelerator
        from portspeed.testing.standin_ccl import StandinAccelerator
        from portspeed.patches.megatron.core_group_teardown import groups_in
        assert groups_hold_host_threads(portspeed.get_accelerator())
        assert groups_hold_host_threads(CpuAccelerator())
        # the stand-in's Python backend groups cannot be destroyed one by one on torch 2.13: not declared
        assert not groups_hold_host_threads(StandinAccelerator())
        assert not groups_hold_host_threads(CudaAccelerator()), "NCCL communicators are made lazily"
        from megatron.core import parallel_state as ps
        dist.init_process_group("nccl", rank=0, world_size=1, init_method="file://{tmp_path / 'store'}")
        for _ in range(3):
            ps.initialize_model_parallel()
            held = [g for g in groups_in(vars(ps)) if g is not c10d._get_default_group()]
            assert sum(c10d._world.pg_map[g][0] == "testccl" for g in held) > 5  # and Megatron's own Gloo twins
            ps.destroy_model_parallel()
            left = [g for g in held if g in c10d._world.pg_map and "testccl" in str(c10d._world.pg_map[g][0])]
            assert not left, "%d testccl groups outlived destroy_model_parallel" % len(left)
        dist.destroy_process_group()
    """)


OFFLOAD = """
import os, torch, torch.distributed as dist
import portspeed, portspeed.megatron_adaptor as adaptor
adaptor.activate()
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
acc = portspeed.get_accelerator()
acc.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1, init_method="tcp://127.0.0.1:%d" % int(os.environ["PORT"]))
ps.initialize_model_parallel()
cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)

class Tiny(MegatronModule):
    def __init__(self):
        super().__init__(cfg)
        self.lin = torch.nn.Linear(8, 8)

model = Tiny().to(acc.device())
# the parameters in a buffer
ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
buf = ddp.buffers[0]
before = model.lin.weight.detach().cpu().clone()
assert buf.param_data.device.type == acc.device_type
buf.offload_to_cpu(move_params=True, move_grads=True)
assert buf.param_data.untyped_storage().nbytes() == 0, "the device copy was not freed"
assert buf.param_data_cpu.device.type == "cpu" and buf.param_data_cpu.untyped_storage().nbytes() > 0
if acc.device_type != "cpu":
    assert buf.param_data_cpu.is_pinned(), "offloaded parameters should be in pinned host memory"
buf.reload_from_cpu(move_params=True, move_grads=True)
assert torch.equal(model.lin.weight.detach().cpu(), before), "parameters changed across offload and reload"
assert model.lin.weight.device.type == acc.device_type
dist.destroy_process_group()
print("OK")
"""


@pytest.mark.megatron
@pytest.mark.parametrize("adapter", ["testdev", "cpu"])
def test_ddp_buffer_offload_round_trip(adapter: str) -> None:
    """Megatron's param/grad buffer offload to host and reload keeps the weights, on a device and on the host."""
    from helpers.launch import free_port

    res = run_python(["-c", OFFLOAD], timeout=240, env={"PORTSPEED_ACCELERATOR": adapter, "PORT": str(free_port())})
    assert res.returncode == 0 and res.stdout.rstrip().endswith("OK"), (
        f"exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-5000:]}")


@pytest.mark.megatron
def test_megatron_fusions_run_eagerly_where_inductor_lacks_the_device(tmp_path: Path) -> None:
    """torch.compile has no code generator for the test device: Megatron's jit_fuser functions run eagerly there."""
    _run(tmp_path, """
        import megatron.core.jit as jit
        from megatron.core.fusions.fused_bias_gelu import bias_gelu
        assert jit.jit_fuser.__name__ == "eager_jit_fuser", jit.jit_fuser
        x = torch.randn(4, 8)
        b = torch.randn(8)
        got = bias_gelu(b.to("testdev"), x.to("testdev"))
        assert got.device.type == "testdev"
        assert torch.allclose(got.cpu(), bias_gelu(b, x))
        assert any(r["name"] == "megatron.core.jit_fuser.eager" and r["status"] == "applied"
                   for r in portspeed.report())
    """)
