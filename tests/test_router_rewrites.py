"""The collective router in one process, continued: all_gather output shapes, gaps that raise, declared tables.

A flat all_gather_into_tensor output viewed as chunks where the backend wants them (Gloo) and left alone where
it does not, in coalescing batches too; integer AVG and float64 on a table that would lose precision refused;
a third-party adapter's declared gaps are what the router rewrites; a group on another backend gets that
backend's defaults; the rewrite ladders. Mapping, get_backend and the hot path: test_router.py.
"""

from __future__ import annotations

import datetime
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from helpers.routed import GATHER_FNS, init_one_rank, router_on_cpu

import portspeed
from portspeed import comm
from portspeed.comm import groups, rewrites, router
from portspeed.accelerator import adapter_class, set_accelerator
from portspeed.adapters.cpu import CpuAccelerator
from portspeed.accelerator.capabilities import Gap, capabilities_for
from portspeed.vendor import BackendGaps
from portspeed.errors import CollectiveUnsupportedError
from portspeed.testing.standin_ccl import StandinAccelerator

R = dist.ReduceOp


@pytest.fixture
def routed() -> Iterator[portspeed.PatchManager]:
    """The router patches applied by a private manager, on the CPU adapter; all undone after."""
    with router_on_cpu() as manager:
        yield manager


# ---------------------------------------------------------------------- all_gather_into_tensor: the output's shape
@pytest.mark.parametrize("fn", GATHER_FNS)
def test_a_chunk_shaped_all_gather_on_gloo_goes_straight_with_the_callers_arguments(routed, fn: str) -> None:
    """Gloo's table lists the shape gap, yet a chunk-shaped call (Megatron's usual one) is not touched or counted."""
    init_one_rank("nccl")
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


@pytest.mark.parametrize("fn", GATHER_FNS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_flat_all_gather_output_is_viewed_as_chunks_on_gloo(routed, fn: str, dtype: torch.dtype) -> None:
    """Megatron's gather_split_1d_tensor form (a flat output for a 2-d input), a stacked output and a 0-d
    input: Gloo gets views of the caller's tensors; sync, and async with the backend's own work."""
    init_one_rank("nccl")
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
    init_one_rank("nccl")
    with pytest.raises(RuntimeError, match="invalid tensor size"):
        dist.all_gather_into_tensor(torch.zeros(7), torch.ones(2, 4))
    with pytest.raises(RuntimeError, match="invalid tensor size"):
        dist.all_gather_into_tensor(torch.zeros(16)[::2], torch.ones(2, 4))  # 8 elements, not contiguous: no view
    assert comm.stats() == {}


def test_a_flat_all_gather_goes_straight_where_the_table_lists_no_shape_gap(routed) -> None:
    """On an NCCL record the router never looks at the shapes: the flat call reaches the backend untouched."""
    init_one_rank("nccl")
    comm.use_capabilities(capabilities_for("nccl"))
    with pytest.raises(RuntimeError, match="invalid tensor size"):  # Gloo underneath refuses it: nothing rewrote it
        dist.all_gather_into_tensor(torch.zeros(8), torch.ones(2, 4))
    assert comm.stats() == {}


def test_the_standin_takes_flat_all_gather_outputs_itself(routed) -> None:
    """The stand-in CCL counts elements as NCCL does and declares no shape gap: the flat call goes straight."""
    set_accelerator(StandinAccelerator())
    init_one_rank("nccl")
    out, x = torch.zeros(8), torch.arange(8.0).view(2, 4)
    dist.all_gather_into_tensor(out, x)
    assert torch.equal(out, torch.arange(8.0)) and comm.stats() == {}


def test_a_flat_all_gather_in_a_coalescing_batch_stays_in_the_batch(routed) -> None:
    """The view is issued as the original would be: recorded, run at the batch's exit, written by wait()."""
    from torch.distributed.distributed_c10d import _coalescing_manager

    init_one_rank("nccl")
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
    init_one_rank("nccl")
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
    init_one_rank("nccl")
    with pytest.raises(CollectiveUnsupportedError, match="torch.int64.*cast to a float"):
        dist.all_reduce(torch.ones(2, dtype=torch.int64), op=R.AVG)


def test_float64_on_cncl_table_raises_instead_of_losing_precision(routed) -> None:
    """CNCL maps float64 to float32 silently (the mlu adapter declares it); the router refuses loudly."""
    init_one_rank("nccl")
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
    init_one_rank("nccl")
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
    init_one_rank("nccl")
    x = torch.arange(4.0)
    dist.all_reduce(x, op=R.MAX)
    dist.all_reduce(torch.ones(3, dtype=torch.float16))
    assert comm.stats() == {}


def test_a_group_on_another_backend_gets_that_backends_defaults(routed) -> None:
    """A Gloo group under an adapter whose own backend is the stand-in gets Gloo's table, not the stand-in's gaps."""
    set_accelerator(StandinAccelerator())
    init_one_rank("gloo")
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
    init_one_rank("nccl")
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
