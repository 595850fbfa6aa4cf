"""The collective router in one process: name mapping, get_backend, hot path, rewrites, bad input.

Multi-rank values are checked in test_collective_conformance.py; here a world of one
(a real Gloo or stand-in group on a HashStore) is enough for the bookkeeping.
"""

from __future__ import annotations

import datetime
import logging
import re
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional_collectives
from packaging.version import Version
from torch.distributed import distributed_c10d as c10d

import portspeed
from portspeed import comm
from portspeed.comm import backends, groups, rewrites, router
from portspeed.accelerator import Accelerator, adapter_class, reset_accelerator, set_accelerator
from portspeed.adapters.cpu import CpuAccelerator
from portspeed.adapters.cuda import CudaAccelerator
from portspeed.accelerator.capabilities import Gap, capabilities_for
from portspeed.vendor import BackendGaps
from portspeed.errors import CollectiveUnsupportedError, ConfigError, UnknownBackendError
from portspeed.patches.torch_distributed import PATCHES
from portspeed.testing.standin_ccl import StandinAccelerator

R = dist.ReduceOp


class FakeNpuAccelerator(Accelerator):
    """A fake Ascend adapter (no hardware): only its names matter to the mapping."""

    name = "fake-npu"
    device_type = "npu"
    backend = "hccl"


@pytest.fixture
def routed() -> Iterator[portspeed.PatchManager]:
    """The router patches applied by a private manager, on the CPU adapter; all undone after."""
    set_accelerator(CpuAccelerator())
    manager = portspeed.PatchManager()
    manager.register(PATCHES)
    manager.apply()
    comm.reset()
    yield manager
    if dist.is_initialized():
        dist.destroy_process_group()
    manager.revert()
    comm.reset()
    reset_accelerator()


def _init(backend: str | None = "nccl") -> None:
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))


# ---------------------------------------------------------------------- mapping
@pytest.mark.parametrize("asked,want", [
    ("nccl", "gloo"), ("NCCL", "gloo"), (None, "gloo"), ("gloo", "gloo"), ("hccl", "gloo"), ("mpi", "mpi"),
    ("cpu:gloo,cuda:nccl", "gloo"), ("standin", "standin"),
])
def test_map_backend_on_cpu(asked: str | None, want: str) -> None:
    """On the CPU adapter accelerator backends become gloo; CPU and registered backends stay."""
    assert comm.map_backend(asked, CpuAccelerator()) == want


@pytest.mark.parametrize("asked,want", [
    ("nccl", "standin"), (None, "standin"), ("gloo", "gloo"), ("cpu:gloo,cuda:nccl", "standin"),
])
def test_map_backend_on_standin(asked: str | None, want: str) -> None:
    """On the stand-in adapter nccl becomes standin, and its backend wins on its own device."""
    assert comm.map_backend(asked, StandinAccelerator()) == want


@pytest.mark.parametrize("asked", ["nccl", "gloo", "ucc", "cpu:gloo,cuda:nccl", None])
def test_map_backend_on_cuda_changes_nothing(asked: str | None) -> None:
    """On a CUDA adapter with nccl every name maps to itself (None stays torch's default)."""
    assert comm.map_backend(asked, CudaAccelerator()) == (asked.lower() if asked else None)


def test_map_backend_on_a_fake_npu_keeps_device_pairs() -> None:
    """On a fake NPU adapter nccl becomes hccl, and 'cpu:gloo,cuda:nccl' becomes 'cpu:gloo,npu:hccl'."""
    acc = FakeNpuAccelerator()
    assert comm.map_backend("nccl", acc) == "hccl"
    assert comm.map_backend("cpu:gloo,cuda:nccl", acc) == "cpu:gloo,npu:hccl"


class NativeCudaAccelerator(Accelerator):
    """An adapter under another name that declares the framework's CUDA code runs natively on it."""

    name = "native-cuda"
    device_type = "cuda"
    backend = "nccl"
    runs_cuda_natively = True


class UndeclaredCudaAccelerator(NativeCudaAccelerator):
    """The same names without the declaration: a device called cuda is not enough."""

    runs_cuda_natively = False


def test_no_backend_is_left_to_torch_only_where_cuda_runs_natively() -> None:
    """map_backend(None) reads the declared runs_cuda_natively, never the device name."""
    assert comm.map_backend(None, NativeCudaAccelerator()) is None
    assert comm.map_backend(None, UndeclaredCudaAccelerator()) == "nccl"


def test_pytorch_backend_override_is_honoured() -> None:
    """An adapter built with a backend override (PORTSPEED_BACKEND) maps nccl to that backend."""
    assert comm.map_backend("nccl", CpuAccelerator(backend="standin")) == "standin"


@pytest.mark.parametrize("asked", ["nccll", "tcp", "cpu:", "cuda:nccl,", ""])
def test_unknown_backend_names_raise_listing_known_ones(asked: str) -> None:
    """Unknown or malformed names raise UnknownBackendError that says what was wrong."""
    with pytest.raises(UnknownBackendError) as info:
        comm.map_backend(asked, CpuAccelerator())
    msg = str(info.value)
    assert repr(asked) in msg or "malformed" in msg or "non-empty" in msg
    if asked in ("nccll", "tcp"):
        assert "gloo" in msg and "nccl" in msg


def test_init_process_group_with_unknown_backend_fails_before_any_group(routed) -> None:
    """The patched init_process_group rejects an unknown name and creates nothing."""
    with pytest.raises(UnknownBackendError, match="nccll"):
        _init("nccll")
    assert not dist.is_initialized()


# ---------------------------------------------------------------------- patches and rebinding
def test_patches_reach_the_torch_distributed_re_exports(routed) -> None:
    """torch.distributed.<fn> (a `from distributed_c10d import *` alias) is the patched chain too."""
    for name in ("init_process_group", "new_group", "get_backend", "all_reduce", "reduce_scatter_tensor",
                 "all_to_all"):
        assert getattr(dist, name) is getattr(c10d, name), name
        assert hasattr(getattr(dist, name), "__wrapped__"), name
    rebound = {r["name"]: r.get("rebound", []) for r in routed.report()}
    assert "torch.distributed.init_process_group" in rebound["torch.distributed.init_process_group.backend"]
    originals = {name: getattr(dist, name).__wrapped__ for name in ("init_process_group", "all_reduce")}
    routed.revert()
    for name, original in originals.items():
        assert getattr(dist, name) is original and getattr(c10d, name) is original


def test_every_patch_is_a_versioned_wrap_with_a_reason() -> None:
    """Each router patch wraps torch.distributed.distributed_c10d, declares torch>=2.6 and says why."""
    for p in PATCHES:
        assert p.kind == "wrap" and p.distribution == "torch" and p.versions.startswith(">=2.")
        assert p.target.startswith("torch.distributed.distributed_c10d:") and p.reason.endswith(".")


# ---------------------------------------------------------------------- get_backend: requested vs real
def test_get_backend_reports_requested_name_and_real_backend_is_available(routed) -> None:
    """A group asked for as nccl reports 'nccl'; real_backend says gloo; torch itself sees gloo."""
    _init("nccl")
    assert dist.get_backend() == "nccl"
    assert comm.real_backend() == "gloo" and comm.requested_backend() == "nccl"
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=10))  # torch checks == 'gloo' inside
    inherited = dist.new_group(ranks=[0])
    assert dist.get_backend(inherited) == "nccl" and comm.real_backend(inherited) == "gloo"
    explicit = dist.new_group(ranks=[0], backend="gloo")
    assert dist.get_backend(explicit) == "gloo"
    dist.destroy_process_group()
    assert comm.requested_backend is backends.requested_backend
    assert not backends._REQUESTED


def test_device_pair_string_is_reported_back(routed) -> None:
    """'cpu:gloo,cuda:nccl' runs on gloo and get_backend() returns the string asked for."""
    _init("cpu:gloo,cuda:nccl")
    assert dist.get_backend() == "cpu:gloo,cuda:nccl"
    assert comm.real_backend() == "gloo"


def test_no_backend_on_cpu_uses_the_adapter_backend(routed) -> None:
    """init_process_group() without a backend creates the adapter's backend and reports the real name."""
    _init(None)
    assert comm.real_backend() == "gloo" and dist.get_backend() == "gloo"


def test_standin_adapter_gets_the_standin_backend(routed) -> None:
    """With the stand-in adapter a group asked for as nccl runs on the stand-in backend."""
    set_accelerator(StandinAccelerator())
    _init("nccl")
    assert comm.real_backend() == "standin" and dist.get_backend() == "nccl"
    x = torch.arange(4.0)
    dist.all_reduce(x, op=R.AVG)  # the stand-in raises on AVG: this only works rewritten
    assert torch.equal(x, torch.arange(4.0))
    assert comm.stats() == {"all_reduce": {"rewrites": 1, "by": {"avg_as_sum": 1}}}


# ---------------------------------------------------------------------- hot path and rewrites
def test_supported_call_goes_straight_through_with_the_callers_arguments(routed) -> None:
    """On a backend that does it right the original gets the caller's own arguments; nothing is counted."""
    _init("nccl")
    seen = []

    def spy(*args, **kwargs):
        seen.append((args, kwargs))

    t = torch.ones(4)
    routed = router.COLLECTIVE_ROUTES["all_reduce"](spy)
    routed(t)  # first call fills the cache
    routed(t, op=R.SUM)
    assert seen[1][0][0] is t and seen[1][1] == {"op": R.SUM}
    assert routed.__wrapped__ is spy and routed.__name__ == "spy"
    assert comm.stats() == {}


def test_premul_sum_on_gloo_is_rewritten(routed) -> None:
    """Gloo has no PREMUL_SUM: the router scales then sums, and counts it."""
    _init("nccl")
    x = torch.full((3,), 4.0)
    dist.all_reduce(x, op=dist._make_nccl_premul_sum(0.25))
    assert torch.equal(x, torch.ones(3))
    assert comm.stats()["all_reduce"]["by"] == {"premul_as_scale_sum": 1}


def test_premul_sum_factor_is_read_where_reduce_op_has_no_factor_property() -> None:
    """torch 2.6-2.8's ReduceOp has no ``factor``: the rewrite reads the (op, factor) pickling state instead."""
    assert dist._make_nccl_premul_sum(0.25).__getstate__() == (R.RedOpType.PREMUL_SUM, 0.25)  # this torch's state
    scale = torch.tensor([0.5])
    assert dist._make_nccl_premul_sum(scale).__getstate__()[1] is scale

    class StateOnly:  # the shape of a torch 2.6 PREMUL_SUM op: state, no factor property
        def __getstate__(self) -> tuple:
            return (R.RedOpType.PREMUL_SUM, 0.125)

    class NoFactor:
        def __getstate__(self) -> tuple:
            return (R.RedOpType.PREMUL_SUM,)

    assert rewrites._factor(StateOnly()) == 0.125
    assert rewrites._factor(dist._make_nccl_premul_sum(0.25)) == 0.25
    with pytest.raises(CollectiveUnsupportedError,
                       match=f"torch {re.escape(torch.__version__)}.*_make_nccl_premul_sum"):
        rewrites._factor(NoFactor())


def test_async_rewrite_writes_the_callers_tensor_on_wait(routed) -> None:
    """async_op=True returns a RewriteWork; the caller's output is written when wait() runs."""
    set_accelerator(StandinAccelerator())
    _init("nccl")
    out = torch.zeros(4, dtype=torch.bfloat16)
    inp = torch.arange(1.0, 5.0, dtype=torch.bfloat16)
    work = dist.reduce_scatter_tensor(out, inp, async_op=True)  # bf16: the stand-in lacks it
    assert isinstance(work, comm.RewriteWork) and not work.is_completed()
    assert torch.equal(out, torch.zeros(4, dtype=torch.bfloat16))
    work.wait()
    assert work.is_completed() and torch.equal(out, inp)
    assert work.get_future().done()
    assert comm.stats()["reduce_scatter_tensor"]["by"] == {"upcast": 1}


# ---------------------------------------------------------------------- all_gather_into_tensor: the output's shape
_GATHER_FNS = ["all_gather_into_tensor"] + (["all_gather_single"] if hasattr(dist, "all_gather_single") else [])


@pytest.mark.parametrize("fn", _GATHER_FNS)
def test_a_chunk_shaped_all_gather_on_gloo_goes_straight_with_the_callers_arguments(routed, fn: str) -> None:
    """Gloo's table lists the shape gap, yet a chunk-shaped call (Megatron's usual one) is not touched or counted."""
    _init("nccl")
    seen = []

    def spy(*args, **kwargs):
        seen.append((args, kwargs))

    out, x = torch.zeros(2, 4), torch.ones(2, 4)
    flat_out, flat_x = torch.zeros(6), torch.ones(6)  # Megatron's parameter all-gather: 1-d buffers
    route = router.COLLECTIVE_ROUTES[fn](spy)
    dist.all_reduce(torch.ones(1))  # fills the group's cache: the calls below take the hot path
    route(out, x)
    route(out, input_tensor=x, async_op=True)
    route(output_tensor=flat_out, input_tensor=flat_x, group=None, async_op=False)  # DeepSpeed's keywords
    assert seen[0][0][0] is out and seen[0][0][1] is x and seen[0][1] == {}
    assert seen[1][0] == (out,) and seen[1][1] == {"input_tensor": x, "async_op": True}
    assert seen[2] == ((), {"output_tensor": flat_out, "input_tensor": flat_x, "group": None, "async_op": False})
    assert comm.capabilities_of().gap("all_gather_into_tensor", None, torch.float32) is not None
    assert comm.stats() == {}


@pytest.mark.parametrize("fn", _GATHER_FNS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_flat_all_gather_output_is_viewed_as_chunks_on_gloo(routed, fn: str, dtype: torch.dtype) -> None:
    """Megatron's gather_split_1d_tensor form (a flat output for a 2-d input), a stacked output and a 0-d
    input: Gloo gets views of the caller's tensors; sync, and async with the backend's own work."""
    _init("nccl")
    gather = getattr(dist, fn)
    x = torch.arange(8, dtype=dtype).view(2, 4)
    for out in (torch.zeros(8, dtype=dtype), torch.zeros(1, 2, 4, dtype=dtype)):
        gather(out, x)
        assert torch.equal(out.reshape(-1), x.reshape(-1)) and out.dtype == dtype
        out.zero_()
        work = gather(out, x, async_op=True)
        assert not isinstance(work, comm.RewriteWork), "a view needs no last step: the backend's work is returned"
        assert work.wait() and torch.equal(out.reshape(-1), x.reshape(-1))
    scalar, out = torch.tensor(3.0, dtype=dtype), torch.zeros(1, dtype=dtype)
    gather(output_tensor=out, input_tensor=scalar)
    assert torch.equal(out, torch.tensor([3.0], dtype=dtype))
    assert comm.stats() == {"all_gather_into_tensor": {"rewrites": 5, "by": {"view_output_as_chunks": 5}}}


def test_raw_gloo_refuses_the_flat_all_gather_output() -> None:
    """The control: without the router, Gloo itself raises for Megatron's flat output (so the tests above can fail)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        with pytest.raises(RuntimeError, match=r"invalid tensor size at index 0 \(expected \(2, 4\), got \(8\)\)"):
            dist.all_gather_into_tensor(torch.zeros(8), torch.ones(2, 4))
    finally:
        dist.destroy_process_group()


def test_an_all_gather_output_the_view_cannot_fix_reaches_the_backend_as_it_is(routed) -> None:
    """A wrong element count or a non-contiguous output is not rewritten: Gloo answers it, as without portspeed."""
    _init("nccl")
    with pytest.raises(RuntimeError, match="invalid tensor size"):
        dist.all_gather_into_tensor(torch.zeros(7), torch.ones(2, 4))
    with pytest.raises(RuntimeError, match="invalid tensor size"):
        dist.all_gather_into_tensor(torch.zeros(16)[::2], torch.ones(2, 4))  # 8 elements, not contiguous: no view
    assert comm.stats() == {}


def test_a_flat_all_gather_goes_straight_where_the_table_lists_no_shape_gap(routed) -> None:
    """On an NCCL record the router never looks at the shapes: the flat call reaches the backend untouched."""
    _init("nccl")
    comm.use_capabilities(capabilities_for("nccl"))
    with pytest.raises(RuntimeError, match="invalid tensor size"):  # Gloo underneath refuses it: nothing rewrote it
        dist.all_gather_into_tensor(torch.zeros(8), torch.ones(2, 4))
    assert comm.stats() == {}


def test_the_standin_takes_flat_all_gather_outputs_itself(routed) -> None:
    """The stand-in CCL counts elements as NCCL does and declares no shape gap: the flat call goes straight."""
    set_accelerator(StandinAccelerator())
    _init("nccl")
    out, x = torch.zeros(8), torch.arange(8.0).view(2, 4)
    dist.all_gather_into_tensor(out, x)
    assert torch.equal(out, torch.arange(8.0)) and comm.stats() == {}


def test_a_flat_all_gather_in_a_coalescing_batch_stays_in_the_batch(routed) -> None:
    """The view is issued as the original would be: recorded, run at the batch's exit, written by wait()."""
    from torch.distributed.distributed_c10d import _coalescing_manager

    _init("nccl")
    outs = [torch.zeros(8), torch.zeros(8)]
    with _coalescing_manager(dist.group.WORLD, async_ops=True) as cm:
        for k, o in enumerate(outs):
            dist.all_gather_into_tensor(o, torch.full((2, 4), float(k + 1)))
        assert not any(o.any() for o in outs), "issued before the batch's exit: the rewrite left the batch"
    cm.wait()
    assert torch.equal(outs[0], torch.ones(8)) and torch.equal(outs[1], torch.full((8,), 2.0))
    assert comm.stats()["all_gather_into_tensor"]["by"] == {"view_output_as_chunks": 2}


@pytest.mark.parametrize("async_ops", [True, False])
def test_a_batch_of_rewritten_calls_ends_with_nothing_recorded(routed, async_ops: bool) -> None:
    """Every call rewritten outside the batch: torch 2.6's manager would read an unset ``work`` at its exit.

    The wrapper (patched in below torch 2.8 only) ends such a batch itself; here it wraps this
    torch's own manager, and a batch with a recorded call still goes through torch's exit.
    """
    from portspeed.comm.work import wrap_coalescing_manager

    set_accelerator(StandinAccelerator())  # AVG is a gap: rewritten outside the batch
    _init("nccl")
    xs = [torch.full((4,), 2.0), torch.full((4,), 6.0)]
    with wrap_coalescing_manager(c10d._coalescing_manager, None, (dist.group.WORLD,),
                                 {"async_ops": async_ops}) as cm:
        for x in xs:
            dist.all_reduce(x, op=R.AVG)
    assert dist.group.WORLD not in c10d._world.pg_coalesce_state and cm.works == []
    assert torch.equal(xs[0], torch.full((4,), 2.0)) and torch.equal(xs[1], torch.full((4,), 6.0))
    assert comm.stats()["all_reduce"]["by"] == {"avg_as_sum": 2}
    y = torch.ones(4)
    with wrap_coalescing_manager(c10d._coalescing_manager, None, (), {"group": dist.group.WORLD,
                                                                       "async_ops": async_ops}) as cm:
        dist.all_reduce(y)  # SUM: recorded, issued at the exit by torch
    cm.wait()
    assert torch.equal(y, torch.ones(4)) and dist.group.WORLD not in c10d._world.pg_coalesce_state


def test_avg_on_integers_raises_naming_the_dtype(routed) -> None:
    """AVG on int64 where the backend lacks AVG cannot be rewritten: the error says so and what to do."""
    set_accelerator(StandinAccelerator())
    _init("nccl")
    with pytest.raises(CollectiveUnsupportedError, match="torch.int64.*cast to a float"):
        dist.all_reduce(torch.ones(2, dtype=torch.int64), op=R.AVG)


def test_float64_on_cncl_table_raises_instead_of_losing_precision(routed) -> None:
    """CNCL maps float64 to float32 silently (the mlu adapter declares it); the router refuses loudly."""
    _init("nccl")
    comm.use_capabilities(adapter_class("mlu")().capabilities())
    with pytest.raises(CollectiveUnsupportedError, match="float64"):
        dist.all_reduce(torch.ones(2, dtype=torch.float64))


class DeclaringAdapter(CpuAccelerator):
    """A third-party adapter on Gloo that declares gaps Gloo does not have, so only the
    declaration (never Gloo itself) can make the router rewrite these calls."""

    name = "declaring"
    backend_gaps = BackendGaps(unsupported_ops=[R.MAX], unsupported_dtypes=[("all_reduce", torch.float16)],
                               unsupported_collectives=["all_to_all"], note="test declaration")
    asked: list = []

    def capabilities(self, backend=None):
        type(self).asked.append(backend)
        return super().capabilities(backend)


def test_a_third_party_adapters_declared_gaps_are_what_the_router_rewrites(routed) -> None:
    """The router asks the active adapter, once per group, and rewrites exactly what it declares."""
    DeclaringAdapter.asked = []
    set_accelerator(DeclaringAdapter())
    _init("nccl")
    x = torch.arange(4.0)
    dist.all_reduce(x, op=R.MAX)
    dist.all_reduce(x, op=R.SUM)
    h = torch.ones(3, dtype=torch.float16)
    dist.all_reduce(h)
    outs = [torch.empty(2)]
    dist.all_to_all(outs, [torch.arange(2.0)])
    assert torch.equal(x, torch.arange(4.0)) and torch.equal(h, torch.ones(3, dtype=torch.float16))
    assert torch.equal(outs[0], torch.arange(2.0))
    assert comm.stats() == {
        "all_reduce": {"rewrites": 2, "by": {"via_all_gather": 1, "upcast": 1}},
        "all_to_all": {"rewrites": 1, "by": {"via_all_to_all_single": 1}},
    }
    assert DeclaringAdapter.asked == ["gloo"], "the table is resolved once per group, for its real backend"
    caps = comm.capabilities_of()
    assert caps.gap("all_reduce", R.PREMUL_SUM, torch.float32) is not None  # Gloo's own row is kept
    assert any("test declaration" in n for n in caps.notes)


def test_the_plain_cpu_adapter_declares_nothing_so_max_goes_straight(routed) -> None:
    """The same calls on the CPU adapter are not rewritten: the rewrites above came from the declaration."""
    _init("nccl")
    x = torch.arange(4.0)
    dist.all_reduce(x, op=R.MAX)
    dist.all_reduce(torch.ones(3, dtype=torch.float16))
    assert comm.stats() == {}


def test_a_group_on_another_backend_gets_that_backends_defaults(routed) -> None:
    """A Gloo group under an adapter whose own backend is the stand-in gets Gloo's table, not the stand-in's gaps."""
    set_accelerator(StandinAccelerator())
    _init("gloo")
    dist.all_reduce(torch.arange(4.0), op=R.AVG)  # the stand-in lacks AVG; Gloo has it from torch 2.8
    gloo = capabilities_for("gloo")
    rewritten = {"all_reduce": {"rewrites": 1, "by": {"avg_as_sum": 1}}}
    assert comm.stats() == ({} if gloo.gap("all_reduce", R.AVG, torch.float32) is None else rewritten)
    assert comm.real_backend() == "gloo" and comm.capabilities_of() == gloo


def test_use_capabilities_rejects_other_objects(routed) -> None:
    """use_capabilities takes a Capabilities record only."""
    with pytest.raises(TypeError, match="Capabilities"):
        comm.use_capabilities({"all_reduce": ()})


def test_destroy_forgets_cached_tables(routed) -> None:
    """destroy_process_group clears the capability cache, so a new group is looked up afresh."""
    _init("nccl")
    comm.capabilities_of()
    assert groups._CAPS
    dist.destroy_process_group()
    assert not groups._CAPS


def test_rewrite_work_runs_finish_once() -> None:
    """RewriteWork waits for its inner works, runs its last step once, then reports completion."""
    calls = []

    class Inner:
        def wait(self):
            calls.append("inner")

    work = comm.RewriteWork([Inner(), None], lambda: calls.append("finish"), result=[1])
    assert not work.is_completed()
    work.wait()
    work.wait()
    assert calls == ["inner", "finish"] and work.is_completed()
    assert work.get_future().value() == [1]


def test_every_routed_collective_has_a_ladder_of_known_rules() -> None:
    """The rewrite table covers each collective a gap may name; every step names a rule; every rule is used."""
    from portspeed.vendor import ROUTED_COLLECTIVES

    assert set(rewrites.LADDERS) == set(ROUTED_COLLECTIVES)
    used = {step for ladder in rewrites.LADDERS.values() for step, _ in ladder}
    assert used == set(rewrites.RULES)
    for collective, ladder in rewrites.LADDERS.items():
        gap = capabilities_for("gloo", "2.6").gap(collective, R.SUM, torch.float32) or Gap(collective, "raises", "x")
        assert ladder[-1][1](gap, R.SUM), f"the last step of {collective}'s ladder must always apply"


# ---------------------------------------------------------------------- PORTSPEED_BACKEND
@pytest.mark.parametrize("value", ["cuda:nccl", "nccl,gloo", "gl oo"])
def test_garbage_portspeed_backend_is_a_config_error(portspeed_env, value: str) -> None:
    """PORTSPEED_BACKEND with device prefixes, commas or spaces fails naming the variable."""
    with pytest.raises(ConfigError, match="PORTSPEED_BACKEND"):
        portspeed_env(PORTSPEED_BACKEND=value)


def test_unknown_portspeed_backend_fails_at_selection_listing_known_ones(portspeed_env) -> None:
    """A well-formed but unknown PORTSPEED_BACKEND fails when the adapter is selected, listing known names."""
    portspeed_env(PORTSPEED_BACKEND="fooccl", PORTSPEED_ACCELERATOR="cpu")
    with pytest.raises((ConfigError, UnknownBackendError), match="fooccl.*gloo"):
        portspeed.get_accelerator()


# ---------------------------------------------------------------------- torch's logging layer
def _c10d_debug_records(call) -> tuple[list, BaseException]:
    """The debug records torch's c10d logger emits while ``call()`` runs (it must raise)."""
    from torch.distributed.c10d_logger import _c10d_logger

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    level, _c10d_logger.level = _c10d_logger.level, logging.DEBUG
    _c10d_logger.addHandler(handler)
    try:
        with pytest.raises(Exception) as info:
            call()
    finally:
        _c10d_logger.removeHandler(handler)
        _c10d_logger.level = level
    return [r.msg for r in records], info.value


@pytest.mark.parametrize("fn", ["all_reduce", "reduce", "reduce_scatter_tensor", "reduce_scatter", "all_to_all",
                                *_GATHER_FNS])
def test_routed_collectives_take_the_place_of_torchs_logging_layer(fn: str) -> None:
    """On this torch the hot path calls the function under torch's exception logger, not a frame above it."""
    original = getattr(c10d, fn)
    call, layer = router._torch_logging_layer(original)
    assert layer is not None, f"torch's logging layer of {fn} was not recognised: the hot path stacks a frame"
    assert call is original.__wrapped__


def test_other_wrappers_are_called_as_they_are() -> None:
    """A wrapper that is not torch's exception logger is never bypassed."""
    import functools

    def mine(*args, **kwargs):
        return c10d.all_reduce(*args, **kwargs)

    assert router._torch_logging_layer(mine) == (mine, None)
    timed = functools.wraps(c10d.all_reduce.__wrapped__)(lambda *a, **k: None)
    assert router._torch_logging_layer(timed) == (timed, None)


def test_a_failing_straight_call_logs_and_raises_as_torch_does(routed) -> None:
    """Bypassing torch's logging layer loses nothing: the same error, the same c10d debug record."""
    _init("nccl")
    t = torch.ones(4)
    dist.all_reduce(t)  # fills the router's cache: the next call takes the hot path
    bad = [t]  # a list, not a tensor: torch's own argument check raises
    raw = dist.all_reduce.__wrapped__  # torch's function, its logging layer included
    want_records, want_error = _c10d_debug_records(lambda: raw(bad))
    got_records, got_error = _c10d_debug_records(lambda: dist.all_reduce(bad))
    assert want_records, "torch logged nothing for the raw call: this test no longer tests anything"
    assert got_records == want_records
    assert type(got_error) is type(want_error) and str(got_error) == str(want_error)
    assert comm.stats() == {}


def test_torch_compile_still_traces_a_routed_all_reduce(routed) -> None:
    """Dynamo turns a routed all_reduce into torch's functional collective, in one graph, as without portspeed.

    From torch 2.13 (run on 2.13.0). Below it (seen on 2.6.0, 2.8.0 and 2.11.0; 2.12 not run)
    Dynamo cannot trace the router's table read (a bound ``dict.get``), a declared gap:
    ``fullgraph=True`` refuses, and without it the call breaks the graph and runs eagerly,
    with the right value.
    """
    # Dynamo maps the collectives by identity, as they were when _functional_collectives was
    # imported; this module imports it before any patch, as a framework that uses DTensor does.
    assert dist.all_reduce.__wrapped__ in functional_collectives.traceable_collective_remaps
    _init("nccl")
    dist.all_reduce(torch.ones(4))  # fills the cache: the traced call takes the hot path
    targets: list[str] = []

    def backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    def step(x):
        dist.all_reduce(x)
        return x * 2

    torch._dynamo.reset()
    if Version(torch.__version__.split("+")[0]) < Version("2.13"):
        with pytest.raises(torch._dynamo.exc.Unsupported, match=r"dict\.get"):
            torch.compile(step, fullgraph=True, backend=backend)(torch.ones(4))
        torch._dynamo.reset()
        assert torch.equal(torch.compile(step, backend=backend)(torch.ones(4)), torch.full((4,), 2.0))
        return
    out = torch.compile(step, fullgraph=True, backend=backend)(torch.ones(4))
    assert torch.equal(out, torch.full((4,), 2.0))
    assert any("_c10d_functional.all_reduce" in t for t in targets), targets
