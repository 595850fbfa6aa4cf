"""DeepSpeed under the adaptor, one process at a time: the accelerator DeepSpeed gets, its op builders, the routing.

Each check runs in a fresh interpreter (child_json: without this run's PORTSPEED_* and DS_ACCELERATOR*), so the
patches never leak into this one: the accelerator object backed by the adapter (before or after DeepSpeed's
import), the op builders offered on the test device and the install hints, MPI discovery and the nccl mapping,
both adaptors applied once and reverted, a CUDA adapter or a program's own accelerator left alone. The
multi-rank ZeRO parity: test_deepspeed.py.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from helpers.ds_runs import CLEAN, DS_OPS_DIR, TESTDEV, TIMEOUT
from helpers.launch import child_json, run_snippet
from helpers.requires import require

deepspeed = require("deepspeed", "pip install 'portspeed[deepspeed]'")

import torch  # noqa: E402

pytestmark = [pytest.mark.deepspeed]

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:  # tests/fakes
    sys.path.insert(0, str(_HERE))


@pytest.mark.testdev
def test_testdev_offers_deepspeeds_host_op_builders_only() -> None:
    """On the test device DeepSpeed gets its host builders (CPU Adam, async I/O...), a clear error for device ops."""
    got = child_json("""
        import json, torch
        import portspeed.deepspeed_adaptor, deepspeed
        import deepspeed.ops.op_builder as ob
        import deepspeed.ops.op_builder.cpu as host
        from deepspeed.accelerator import get_accelerator
        from portspeed.errors import PortspeedError
        acc = get_accelerator()
        try:
            ob.FusedAdamBuilder().load()
            fused = "loaded"
        except PortspeedError as e:
            fused = str(e)
        free, total = torch.testdev.mem_get_info(0)
        print(json.dumps({
            "cls": type(acc).__name__, "device": acc.current_device_name(),
            "host_same": {n: issubclass(getattr(ob, n), getattr(host, n)) for n in
                          ("CPUAdamBuilder", "CPUAdagradBuilder", "CPULionBuilder", "AsyncIOBuilder",
                           "PinMemoryBuilder")},
            "cpu_adam_compatible": ob.CPUAdamBuilder().is_compatible(),
            "create_host": type(acc.create_op_builder("CPUAdamBuilder")).__module__,
            "create_device": [acc.create_op_builder(n) is None for n in ("FusedAdamBuilder", "ShareMemCommBuilder")],
            "fused_compatible": ob.FusedAdamBuilder().is_compatible(), "fused": fused,
            "memory": [acc.total_memory(0), acc.available_memory(0), total, free],
        }))
    """, timeout=TIMEOUT, env=TESTDEV, drop=CLEAN)
    assert got["cls"] == "PortspeedAccelerator" and got["device"] == "testdev:0"
    assert all(got["host_same"].values()), got["host_same"]  # stock: None, so CPUAdamBuilder() raised TypeError
    assert got["cpu_adam_compatible"] is True
    assert got["create_host"] == "deepspeed.ops.op_builder.cpu.cpu_adam"
    assert got["create_device"] == [True, True]
    assert got["fused_compatible"] is False
    assert "FusedAdamBuilder" in got["fused"] and "'testdev'" in got["fused"] and "torch_adam" in got["fused"]
    total, avail, dev_total, dev_free = got["memory"]
    assert (total, avail) == (dev_total, dev_free) and 0 < avail <= total


def test_async_io_without_libaio_says_what_to_install() -> None:
    """Where libaio is missing (a FAKE absence: DeepSpeed's probe answers no), loading the op names libaio-dev."""
    got = child_json("""
        import json
        import portspeed.deepspeed_adaptor, deepspeed
        from deepspeed.ops.op_builder import AsyncIOBuilder
        from deepspeed.ops.op_builder.cpu import async_io
        async_io.AsyncIOBuilder.has_function = lambda self, *a, **k: False  # FAKE: no libaio here
        try:
            AsyncIOBuilder().load()
            load = "loaded"
        except Exception as e:
            load = f"{type(e).__name__}: {e}"
        from portspeed.integrations.ds_build import missing_prerequisite
        print(json.dumps({"load": load, "build": missing_prerequisite("async_io")}))
    """, timeout=TIMEOUT, env={"TORCH_EXTENSIONS_DIR": str(DS_OPS_DIR)}, drop=CLEAN)
    assert got["load"].startswith("PortspeedError") and "apt-get install -y libaio-dev" in got["load"], got
    assert "libaio-dev" in got["build"], got


# ---------------------------------------------------------------------- single-process checks in a child
# (child_json: a fresh interpreter without CLEAN's variables; it prints one JSON line last, which is returned)
_PROBE = """
    import json, torch, portspeed
    from deepspeed.accelerator import get_accelerator
    import deepspeed.runtime.engine as engine
    acc = get_accelerator()
    print(json.dumps({
        "deepspeed_before_adaptor": DS_BEFORE,
        "cls": type(acc).__name__,
        "engine_sees_same": engine.get_accelerator() is acc,
        "device": str(acc.device()), "device_is_torch_device": isinstance(acc.device(), torch.device),
        "current_device": acc.current_device(), "current_device_type": type(acc.current_device()).__name__,
        "fp16": acc.is_fp16_supported(), "backend": acc.communication_backend_name(),
        "adapter_backend": portspeed.get_accelerator().communication_backend,
        "backed_by_adapter": acc.adapter is portspeed.get_accelerator(),
        "shm_builder": acc.create_op_builder("ShareMemCommBuilder") is None,
    }))
"""


@pytest.mark.parametrize("order", ["adaptor_first", "deepspeed_first"])
def test_deepspeed_gets_adapter_backed_accelerator(order: str) -> None:
    """Either import order: DeepSpeed's get_accelerator() is the adapter-backed object, CPU quirks fixed."""
    imports = ("import sys, portspeed.deepspeed_adaptor\nDS_BEFORE = 'deepspeed' in sys.modules\nimport deepspeed\n"
               if order == "adaptor_first" else
               "import sys, deepspeed\nDS_BEFORE = True\nimport portspeed.deepspeed_adaptor\n")
    got = child_json(imports + textwrap.dedent(_PROBE), timeout=TIMEOUT, env={"LOCAL_RANK": "1"}, drop=CLEAN)
    assert got["deepspeed_before_adaptor"] is (order == "deepspeed_first")
    assert got["cls"] == "PortspeedCpuAccelerator" and got["backed_by_adapter"] and got["engine_sees_same"]
    assert got["device_is_torch_device"] and got["device"] == "cpu"  # stock: None
    assert got["current_device_type"] == "int"  # stock: the LOCAL_RANK string
    assert isinstance(got["fp16"], bool)  # stock: None when mkldnn lacks fp16
    assert got["backend"] == got["adapter_backend"] == "gloo"
    assert got["shm_builder"], "DeepSpeed's shared-memory comm kernel would bypass the routed backend"


def test_importing_the_adaptor_does_not_import_deepspeed() -> None:
    """`import portspeed.deepspeed_adaptor` leaves DeepSpeed unimported (its hook waits for DeepSpeed's import)."""
    got = child_json("""
        import sys, json, portspeed.deepspeed_adaptor, portspeed
        print(json.dumps({"ds": "deepspeed" in sys.modules,
                          "status": {r["name"]: r["status"] for r in portspeed.report()}}))
    """, timeout=TIMEOUT, drop=CLEAN)
    assert got["ds"] is False
    assert got["status"]["deepspeed.comm.init_distributed.backend"] == "pending"


def test_ds_accelerator_env_contradiction_raises() -> None:
    """DS_ACCELERATOR naming another device than the adapter's fails `import deepspeed` with a ConfigError."""
    proc = run_snippet("import portspeed.deepspeed_adaptor, deepspeed", timeout=TIMEOUT,
                       env={"DS_ACCELERATOR": "cuda"}, drop=CLEAN)
    assert proc.returncode != 0
    assert "DS_ACCELERATOR='cuda'" in proc.stderr and "PORTSPEED_ACCELERATOR" in proc.stderr


def test_mpi_discovery_still_runs_and_nccl_is_routed() -> None:
    """Without launcher variables DeepSpeed still runs its MPI discovery (here a FAKE one), then 'nccl' becomes Gloo."""
    got = child_json("""
        import json, os, socket
        import portspeed.deepspeed_adaptor, portspeed, deepspeed
        import deepspeed.comm.comm as ds_comm
        import torch.distributed as dist
        from portspeed.comm import router
        calls = []
        def fake_mpi_discovery(distributed_port=29500, verbose=True):  # FAKE: no mpi4py here
            s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(port))
            calls.append(distributed_port)
        ds_comm.mpi_discovery = fake_mpi_discovery
        deepspeed.init_distributed(dist_backend="nccl", distributed_port=12345)
        rec = {r["name"]: r for r in portspeed.report()}
        print(json.dumps({"calls": calls, "real": router.real_backend(), "asked": dist.get_backend(),
                          "detail": rec["deepspeed.comm.init_distributed.backend"]["detail"]}))
        dist.destroy_process_group()
    """, timeout=TIMEOUT, drop=CLEAN)
    assert got["calls"] == [12345]
    assert got["real"] == "gloo" and got["asked"] == "nccl"
    assert "'nccl' -> 'gloo'" in got["detail"]


def test_nccl_is_mapped_by_the_deepspeed_patch_when_router_patches_are_disabled() -> None:
    """With the router's torch.distributed patches disabled, the DeepSpeed patch maps 'nccl' itself."""
    got = child_json("""
        import json, os, socket
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import portspeed.deepspeed_adaptor, portspeed, deepspeed
        import torch.distributed as dist
        deepspeed.init_distributed(dist_backend="nccl")
        rec = {r["name"]: r for r in portspeed.report()}
        print(json.dumps({"backend": dist.get_backend(),
                          "router": rec["torch.distributed.init_process_group.backend"]["status"],
                          "detail": rec["deepspeed.comm.init_distributed.backend"]["detail"]}))
        dist.destroy_process_group()
    """, timeout=TIMEOUT, env={"PORTSPEED_DISABLE": "torch.distributed.*"}, drop=CLEAN)
    assert got["router"] == "disabled"
    assert got["backend"] == "gloo"
    assert "'nccl' -> 'gloo' (mapped here" in got["detail"]


def test_both_adaptors_apply_once_and_revert_restores_everything() -> None:
    """Both adaptors in one process: every patch once, both sets reported, revert restores everything."""
    got = child_json("""
        import json, importlib, sys
        import torch.distributed, megatron.core, deepspeed
        from deepspeed.accelerator import real_accelerator
        from portspeed.patches import torch_cuda, torch_distributed, deepspeed as ds_patches
        from portspeed.patches.megatron import all_patches
        from portspeed.patching.targets import resolve_target as _resolve

        declared = torch_cuda.PATCHES + torch_distributed.PATCHES + ds_patches.PATCHES + all_patches()
        def current(target):
            mod, _, path = target.partition(":")
            if mod not in sys.modules:
                return None
            try:
                owner, attr = _resolve(sys.modules[mod], tuple(path.split(".")))
            except AttributeError:
                return None
            if hasattr(owner, "__dict__"):
                return owner.__dict__.get(attr, getattr(owner, attr))
            return getattr(owner, attr)
        before = {p.target: current(p.target) for p in declared}
        slot_before = real_accelerator.ds_accelerator

        import portspeed, portspeed.megatron_adaptor, portspeed.deepspeed_adaptor
        portspeed.deepspeed_adaptor.activate(); portspeed.megatron_adaptor.activate()  # again: no-ops
        mgr = portspeed.manager()
        report = portspeed.report()
        names = [r["name"] for r in report]
        applied = [r for r in report if r["status"] == "applied"]
        chains = {t: mgr.chain(t) for t in {r["target"] for r in applied}}
        dup_chains = {t: c for t, c in chains.items() if len(c) != len(set(c))}
        wrappers_per_target = {}
        for r in applied:
            wrappers_per_target.setdefault(r["target"], []).append(r["name"])
        chain_mismatch = {t: (chains[t], ns) for t, ns in wrappers_per_target.items()
                          if sorted(c.split(" ")[1] for c in chains[t][1:] if c.startswith("wrapper"))
                          != sorted(n for n in ns if next(x for x in report if x["name"] == n)["kind"] == "wrap")}
        slot_target = "deepspeed.accelerator.real_accelerator:ds_accelerator"
        unsnapshotted = sorted({r["target"] for r in applied} - set(before) - {slot_target})
        slot_patched = type(real_accelerator.ds_accelerator).__name__
        changed = sorted(t for t in before if before[t] is not None and current(t) is not before[t])

        mgr.revert()
        after = {t: current(t) for t in before}
        not_restored = sorted(t for t in before if before[t] is not None and after[t] is not before[t])
        print(json.dumps({
            "n": len(names), "unique": len(set(names)),
            "megatron": sum(n.startswith("megatron") for n in names),
            "deepspeed": sorted(n for n in names if n.startswith("deepspeed")),
            "router": sum(n.startswith("torch.distributed") for n in names),
            "dup_chains": dup_chains, "chain_mismatch": {k: str(v) for k, v in chain_mismatch.items()},
            "slot_patched": slot_patched, "changed": len(changed),
            "slot_after": type(real_accelerator.ds_accelerator).__name__,
            "slot_before": type(slot_before).__name__,
            "not_restored": not_restored, "unsnapshotted": unsnapshotted,
            "statuses_after": sorted({r["status"] for r in portspeed.report()}),
            "reapplied": (portspeed.deepspeed_adaptor.activate(),
                          type(real_accelerator.ds_accelerator).__name__)[1],
        }))
    """, timeout=TIMEOUT, drop=CLEAN)
    assert got["n"] == got["unique"]
    assert got["megatron"] > 0 and got["router"] > 0
    assert got["deepspeed"] == ["deepspeed.accelerator", "deepspeed.comm.init_distributed.backend"]
    assert got["dup_chains"] == {} and got["chain_mismatch"] == {}
    assert got["slot_patched"] == "PortspeedCpuAccelerator" and got["changed"] > 0
    assert got["slot_after"] == got["slot_before"] == "CPU_Accelerator"
    assert got["not_restored"] == []
    assert got["unsnapshotted"] == [], "patches applied that this test does not know to check"
    assert "applied" not in got["statuses_after"]
    assert got["reapplied"] == "PortspeedCpuAccelerator"


def test_cuda_adapter_leaves_deepspeed_its_own_accelerator() -> None:
    """On the CUDA adapter DeepSpeed keeps its own accelerator (its CUDA kernels): the patch is inactive, not failed."""
    got = child_json("""
        import json, portspeed
        from portspeed.adapters.cuda import CudaAccelerator
        portspeed.set_accelerator(CudaAccelerator())
        import portspeed.deepspeed_adaptor, deepspeed
        acc = deepspeed.accelerator.get_accelerator()
        rec = {r["name"]: r for r in portspeed.report()}
        print(json.dumps({"module": type(acc).__module__, "status": rec["deepspeed.accelerator"]["status"]}))
    """, timeout=TIMEOUT, drop=CLEAN)
    assert got["status"] == "inactive"
    assert got["module"].startswith("deepspeed.accelerator.")


def test_program_injected_accelerator_is_left_in_place() -> None:
    """An accelerator the program gave DeepSpeed's set_accelerator itself is an explicit choice: portspeed keeps it."""
    got = child_json("""
        import json
        from deepspeed.accelerator import set_accelerator, get_accelerator
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
        class MyAccelerator(CPU_Accelerator):
            pass
        mine = MyAccelerator()
        set_accelerator(mine)
        import portspeed, portspeed.deepspeed_adaptor
        print(json.dumps({"kept": get_accelerator() is mine,
                          "names": [r["name"] for r in portspeed.report()]}))
    """, timeout=TIMEOUT, drop=CLEAN)
    assert got["kept"] is True
    assert "deepspeed.accelerator" not in got["names"]


# ---------------------------------------------------------------------- the accelerator object, in this process
def test_generic_accelerator_on_fake_xpu_delegates_to_adapter() -> None:
    """On a non-CPU adapter (FAKE xpu runtime) the DeepSpeed accelerator passes DeepSpeed's check and delegates."""
    from fakes import fake_torch_xpu

    from deepspeed.accelerator.real_accelerator import _validate_accelerator
    from portspeed.adapters.xpu import XpuAccelerator
    from portspeed.integrations.ds_accelerator import PortspeedAccelerator, build_ds_accelerator

    with fake_torch_xpu.installed(count=2) as state:
        adapter = XpuAccelerator()
        acc = build_ds_accelerator(adapter)
        _validate_accelerator(acc)
        assert isinstance(acc, PortspeedAccelerator)
        acc.set_device(1)
        assert acc.current_device() == 1 and acc.current_device_name() == "xpu:1"
        assert acc.device() == torch.device("xpu", 1) and acc.device_name(0) == "xpu:0"
        assert acc.device_count() == 2
        assert acc.communication_backend_name() == adapter.communication_backend
        assert not acc.is_synchronized_device()
        assert acc.create_op_builder("FusedAdamBuilder") is None
        from deepspeed.ops.op_builder.cpu import CPUAdamBuilder
        assert acc.get_op_builder("CPUAdamBuilder") is CPUAdamBuilder  # host work on every device
        before = acc.memory_allocated(1)
        state.fake_allocate(4096, 1)
        assert acc.memory_allocated(1) == before + 4096
        acc.manual_seed(7)
        assert acc.initial_seed() == 7


def test_build_rejects_non_adapter() -> None:
    """build_ds_accelerator names what it needs when given something else."""
    from portspeed.integrations.ds_accelerator import build_ds_accelerator

    with pytest.raises(TypeError, match="portspeed.get_accelerator"):
        build_ds_accelerator("cpu")  # type: ignore[arg-type]
