"""The collective router in one process: name mapping, get_backend, hot path, rewrites, bad input.

Multi-rank values are checked in test_collective_conformance.py; here a world of one
(a real Gloo or stand-in group on a HashStore) is enough for the bookkeeping. All-gather output
shapes, gaps that raise and declared tables: test_router_rewrites.py.
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

from helpers.routed import GATHER_FNS, init_one_rank, router_on_cpu

import portspeed
from portspeed import comm
from portspeed.comm import backends, rewrites, router
from portspeed.accelerator import Accelerator, set_accelerator
from portspeed.adapters.cpu import CpuAccelerator
from portspeed.adapters.cuda import CudaAccelerator
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
    with router_on_cpu() as manager:
        yield manager


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
        init_one_rank("nccll")
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
    init_one_rank("nccl")
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
    init_one_rank("cpu:gloo,cuda:nccl")
    assert dist.get_backend() == "cpu:gloo,cuda:nccl"
    assert comm.real_backend() == "gloo"


def test_no_backend_on_cpu_uses_the_adapter_backend(routed) -> None:
    """init_process_group() without a backend creates the adapter's backend and reports the real name."""
    init_one_rank(None)
    assert comm.real_backend() == "gloo" and dist.get_backend() == "gloo"


def test_standin_adapter_gets_the_standin_backend(routed) -> None:
    """With the stand-in adapter a group asked for as nccl runs on the stand-in backend."""
    set_accelerator(StandinAccelerator())
    init_one_rank("nccl")
    assert comm.real_backend() == "standin" and dist.get_backend() == "nccl"
    x = torch.arange(4.0)
    dist.all_reduce(x, op=R.AVG)  # the stand-in raises on AVG: this only works rewritten
    assert torch.equal(x, torch.arange(4.0))
    assert comm.stats() == {"all_reduce": {"rewrites": 1, "by": {"avg_as_sum": 1}}}


# ---------------------------------------------------------------------- hot path and rewrites
def test_supported_call_goes_straight_through_with_the_callers_arguments(routed) -> None:
    """On a backend that does it right the original gets the caller's own arguments; nothing is counted."""
    init_one_rank("nccl")
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
    init_one_rank("nccl")
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
    init_one_rank("nccl")
    out = torch.zeros(4, dtype=torch.bfloat16)
    inp = torch.arange(1.0, 5.0, dtype=torch.bfloat16)
    work = dist.reduce_scatter_tensor(out, inp, async_op=True)  # bf16: the stand-in lacks it
    assert isinstance(work, comm.RewriteWork) and not work.is_completed()
    assert torch.equal(out, torch.zeros(4, dtype=torch.bfloat16))
    work.wait()
    assert work.is_completed() and torch.equal(out, inp)
    assert work.get_future().done()
    assert comm.stats()["reduce_scatter_tensor"]["by"] == {"upcast": 1}


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
                                *GATHER_FNS])
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
    init_one_rank("nccl")
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
    init_one_rank("nccl")
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
