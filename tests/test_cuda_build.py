"""PyPI's default torch (a CUDA build) on a machine without a GPU: the CPU adapter, and no GPU path taken.

On Python 3.12 ``pip install torch`` installs a CUDA build: ``torch.version.cuda`` is set,
``torch.cuda._is_compiled()`` and ``torch.backends.cuda.is_built()`` are True,
``dist.is_nccl_available()`` is True, and ``torch.cuda.device_count()`` probes the driver.
Nothing of that may make portspeed choose CUDA, keep an NCCL group, or touch the driver.
These tests only make sense on that build (CI leg 2, marker ``cuda_build``).
"""

from __future__ import annotations

import textwrap

import pytest

pytestmark = [pytest.mark.cuda_build]

PROBE = textwrap.dedent(
    """
    import json, warnings
    # a CUDA driver probe (device_count, _lazy_init) warns "Found no NVIDIA driver" / "CUDA initialization"
    warnings.filterwarnings("error", message="(?i).*(cuda|nvidia|driver).*")
    import torch, torch.distributed as dist
    facts = {"cuda": torch.version.cuda, "compiled": torch.cuda._is_compiled(),
             "built": torch.backends.cuda.is_built(), "nccl": dist.is_nccl_available()}
    import portspeed.megatron_adaptor
    from portspeed.accelerator import get_accelerator, selection_reason
    import megatron.core                  # fires the deferred set-up
    from megatron.core import parallel_state
    acc = get_accelerator()
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    from portspeed.comm import real_backend
    x = torch.ones(3, device=torch.device(acc.device_type))
    dist.all_reduce(x, group=parallel_state.get_data_parallel_group())
    out = dict(facts, adapter=acc.name, reason=selection_reason(), requested=dist.get_backend(),
               real=real_backend(), dp_real=real_backend(parallel_state.get_data_parallel_group()),
               value=x.tolist(), device=str(x.device), initialized=torch.cuda.is_initialized())
    parallel_state.destroy_model_parallel(); dist.destroy_process_group()
    print(json.dumps(out))
    """
)


def test_cuda_build_without_gpu_selects_cpu_and_routes_nccl_to_gloo() -> None:
    from helpers.launch import child_json, free_port

    # without this run's PORTSPEED_* settings: the adapter is what portspeed selects by itself
    out = child_json(PROBE.replace("{port}", str(free_port())), timeout=300, drop=("PORTSPEED_*",))
    # the build is what this leg claims it is
    assert out["cuda"] and out["compiled"] and out["built"] and out["nccl"], out
    assert out["adapter"] == "cpu", out
    assert out["requested"] == "nccl" and out["real"] == "gloo" and out["dp_real"] == "gloo", out
    assert out["value"] == [1.0, 1.0, 1.0] and out["device"] == "cpu"
    assert out["initialized"] is False, "something initialised CUDA on a machine without a GPU"
