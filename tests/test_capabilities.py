"""Capability records: the built-in Gloo rows per torch release, gaps declared by adapters (BackendGaps,
the vendor adapters, the stand-in), bad names."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from portspeed.accelerator import adapter_class
from portspeed.accelerator.capabilities import (
    CHUNK_SHAPED,
    KNOWN_BACKENDS,
    REDUCING_COLLECTIVES,
    ROUTED_COLLECTIVES,
    BackendGaps,
    Capabilities,
    Gap,
    capabilities_for,
    check_backend_name,
    op_type,
)
from portspeed.errors import UnknownBackendError
from portspeed.testing.standin_ccl import StandinAccelerator

R = dist.ReduceOp
F32, BF16 = torch.float32, torch.bfloat16


def effect(backend: str, version: str, coll: str, op=None, dtype=F32) -> str | None:
    gap = capabilities_for(backend, version).gap(coll, op, dtype)
    return gap.effect if gap else None


def declared(adapter: str, coll: str, op=None, dtype=F32) -> str | None:
    """The effect the built-in adapter ``adapter`` declares for its own backend."""
    gap = adapter_class(adapter)().capabilities().gap(coll, op, dtype)
    return gap.effect if gap else None


@pytest.mark.parametrize("version,want", [("2.6.0", "raises"), ("2.7.1", "raises"), ("2.8.0", None),
                                          ("2.11.0", None), ("2.13.0", None)])
def test_gloo_avg_all_reduce_raises_before_2_8(version: str, want: str | None) -> None:
    """AVG all_reduce/reduce raise on Gloo before torch 2.8 and work after."""
    assert effect("gloo", version, "all_reduce", R.AVG) == want
    assert effect("gloo", version, "reduce", R.AVG) == want


@pytest.mark.parametrize("version", ["2.6.0", "2.7.1", "2.8.0"])
@pytest.mark.parametrize("op", [R.AVG, R.MAX])
def test_gloo_reduce_scatter_tensor_silently_sums_until_2_8(version: str, op) -> None:
    """reduce_scatter_tensor AVG/MAX silently sum on Gloo 2.6-2.8: a 'wrong' gap, not a raise."""
    assert effect("gloo", version, "reduce_scatter_tensor", op) == "wrong"
    assert effect("gloo", version, "reduce_scatter_tensor", R.SUM) is None


@pytest.mark.parametrize("version", ["2.9.1", "2.12.0", "2.13.0"])
def test_gloo_reduce_scatter_tensor_right_from_2_9(version: str) -> None:
    """From torch 2.9 Gloo's reduce_scatter_tensor honours AVG and MAX."""
    assert effect("gloo", version, "reduce_scatter_tensor", R.AVG) is None
    assert effect("gloo", version, "reduce_scatter_tensor", R.MAX) is None


def test_gloo_list_reduce_scatter_rows() -> None:
    """List reduce_scatter: raises for any op on 2.6/2.7, ignores the op on 2.8, right from 2.9."""
    assert effect("gloo", "2.7", "reduce_scatter", R.SUM) == "raises"
    assert effect("gloo", "2.8", "reduce_scatter", R.SUM) is None
    assert effect("gloo", "2.8", "reduce_scatter", R.AVG) == "wrong"
    assert effect("gloo", "2.9", "reduce_scatter", R.AVG) is None


@pytest.mark.parametrize("version,want", [("2.6", "raises"), ("2.11.0", "raises"), ("2.12.0", None),
                                          ("2.13.0", None)])
def test_gloo_list_all_to_all_until_2_11(version: str, want: str | None) -> None:
    """The list all_to_all raises on Gloo up to torch 2.11."""
    assert effect("gloo", version, "all_to_all") == want


@pytest.mark.parametrize("version", ["2.6", "2.8", "2.9", "2.13"])
@pytest.mark.parametrize("coll", ["all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"])
def test_gloo_has_no_premul_sum_in_any_release(version: str, coll: str) -> None:
    """PREMUL_SUM is a gap on Gloo in every release; a ReduceOp object from _make_nccl_premul_sum matches.

    It raises, except where a reduce-scatter ignores the op and sums: reduce_scatter_tensor before
    torch 2.9, the list reduce_scatter on 2.8 (run on 2.6.0 and 2.8.0: a factor of 0.5 gave the sum).
    """
    ignores_op = {"2.6": ("reduce_scatter_tensor",), "2.8": ("reduce_scatter_tensor", "reduce_scatter")}
    want = "wrong" if coll in ignores_op.get(version, ()) else "raises"
    assert effect("gloo", version, coll, R.PREMUL_SUM) == want
    assert effect("gloo", version, coll, dist._make_nccl_premul_sum(0.5)) == want


@pytest.mark.parametrize("version", ["2.6", "2.7.1", "2.9", "2.12", "2.13.0"])
def test_gloo_wants_chunk_shaped_all_gather_outputs_in_every_release(version: str) -> None:
    """all_gather_into_tensor on Gloo: a gap for any op and dtype (the router then looks at the shapes).

    Run on torch 2.13.0 (flat, stacked and 0-d cases raise); read, not run, in the 2.7.1
    source: ProcessGroupGloo::_allgather_base chunks the output and compares each chunk's sizes.
    """
    caps = capabilities_for("gloo", version)
    for dtype in (F32, BF16, torch.int64):
        gap = caps.gap(CHUNK_SHAPED, None, dtype)
        assert gap is not None and gap.effect == "raises" and gap.op is None and gap.dtype is None
    assert "shaped as the input" in caps.gap(CHUNK_SHAPED).note
    assert capabilities_for("nccl", version).gap(CHUNK_SHAPED, None, F32) is None


def test_which_ccls_want_chunk_shaped_all_gather_outputs() -> None:
    """testccl (staged through Gloo's _allgather_base) declares the shape gap; the stand-in and NCCL do not."""
    from portspeed.testing.testdev.adapter import TestdevAccelerator

    assert TestdevAccelerator().capabilities("testccl").gap(CHUNK_SHAPED, None, BF16) is not None
    assert StandinAccelerator().capabilities().gap(CHUNK_SHAPED, None, F32) is None
    assert declared("cuda", CHUNK_SHAPED) is None


def test_gloo_sum_in_every_dtype_goes_straight_through() -> None:
    """What Gloo does right is not in the table (the router's hot path depends on it)."""
    caps = capabilities_for("gloo", "2.13.0")
    for coll in ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all"):
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
            assert caps.gap(coll, R.SUM, dtype) is None, (coll, dtype)


def test_standin_declares_vendor_like_gaps() -> None:
    """The stand-in adapter declares AVG, PREMUL_SUM, bf16 reduce_scatter and the list all_to_all."""
    caps = StandinAccelerator().capabilities()
    assert caps.backend == "standin"
    assert caps.gap("all_reduce", R.AVG, F32).effect == "raises"
    assert caps.gap("all_reduce", R.SUM, BF16) is None
    assert caps.gap("reduce_scatter_tensor", R.SUM, BF16).dtype is BF16
    assert caps.gap("reduce_scatter", R.SUM, BF16).dtype is BF16
    assert caps.gap("all_to_all") is not None
    assert caps.gap("all_reduce", R.MAX, F32) is None


def test_dtype_gaps_come_first() -> None:
    """A call with two gaps (AVG on bf16 reduce_scatter) reports the dtype gap, so the router upcasts first."""
    gap = StandinAccelerator().capabilities().gap("reduce_scatter_tensor", R.AVG, BF16)
    assert gap.dtype is BF16 and gap.op is None


def test_vendor_adapters_declare_their_backends_gaps() -> None:
    """HCCL (npu) has no bitwise ops; Habana HCCL no PRODUCT/AVG; CNCL float64 is wrong; oneCCL AVG; MCCL bf16."""
    assert declared("npu", "all_reduce", R.BOR, torch.int64) == "raises"
    assert declared("npu", "all_reduce", R.AVG) is None
    assert declared("hpu", "all_reduce", R.PRODUCT) == "raises"
    assert declared("hpu", "all_reduce", R.AVG) == "raises"
    assert declared("mlu", "all_reduce", R.SUM, torch.float64) == "wrong"
    assert declared("xpu", "all_reduce", R.AVG) == "raises"
    assert declared("musa", "all_reduce", R.SUM, BF16) == "raises"
    assert declared("cuda", "all_reduce", R.AVG) is None
    assert capabilities_for("nccl", "2.13").gaps == ()


def test_vendor_rows_are_not_in_the_built_in_tables() -> None:
    """A vendor backend's name alone says nothing (hccl is Ascend's and Habana's): its adapter decides."""
    for name in ("hccl", "cncl", "mccl", "xccl", "standin"):
        assert capabilities_for(name).gaps == (), name


def test_declared_gaps_apply_to_the_adapters_own_backend_only() -> None:
    """Overridden to Gloo (PORTSPEED_BACKEND), the npu adapter gets Gloo's table, not HCCL's gaps."""
    npu = adapter_class("npu")
    assert npu(backend="gloo").capabilities() == capabilities_for("gloo")
    assert npu().capabilities("gloo") == capabilities_for("gloo")
    assert npu().capabilities("HCCL").gap("all_reduce", R.BAND, torch.int64) is not None


def test_xpu_declaration_covers_both_oneccl_names() -> None:
    """xccl and oneCCL's ccl are one library: the xpu adapter's declaration answers for both."""
    xpu = adapter_class("xpu")
    assert xpu().capabilities("ccl").gap("all_reduce", R.AVG, F32) is not None
    assert xpu().capabilities("xccl").gap("all_reduce", R.AVG, F32) is not None


# ---------------------------------------------------------------------- the declaration type
def test_backend_gaps_become_gap_rows() -> None:
    """Each field becomes rows with the right effect; lists are accepted and stored as tuples."""
    gaps = BackendGaps(unsupported_ops=[dist.ReduceOp(R.MAX)], unsupported_dtypes=[("all_reduce", torch.float16)],
                       unsupported_collectives=["all_to_all"], wrong_dtypes=[("reduce", torch.float64)], note="acme")
    assert gaps.unsupported_ops == (R.MAX,) and isinstance(gaps.unsupported_dtypes, tuple)
    caps = gaps.capabilities("acmeccl")
    assert caps.backend == "acmeccl" and any("acme" in n for n in caps.notes)
    # every reducing collective lacks MAX, all_to_all is missing; the output-shape gap has its own field
    assert {c for c in ROUTED_COLLECTIVES if caps.gap(c, R.MAX, F32)} == set(REDUCING_COLLECTIVES) | {"all_to_all"}
    assert caps.gap(CHUNK_SHAPED, None, F32) is None
    assert caps.gap("all_reduce", R.SUM, torch.float16).effect == "raises"
    assert caps.gap("reduce", R.SUM, torch.float16) is None
    assert caps.gap("reduce", R.SUM, torch.float64).effect == "wrong"
    assert caps.gap("all_to_all").effect == "raises"
    assert caps.gap("all_reduce", R.SUM, F32) is None
    assert not any("no capability table" in n for n in caps.notes)


def test_chunk_shaped_all_gather_is_one_row_for_any_op_and_dtype() -> None:
    """chunk_shaped_all_gather=True becomes one 'raises' row for all_gather_into_tensor (any op, any dtype)."""
    caps = BackendGaps(chunk_shaped_all_gather=True, note="acme").capabilities("acmeccl")
    rows = [g for g in caps.gaps if g.collective == CHUNK_SHAPED]
    assert len(rows) == 1 and rows[0].effect == "raises" and "acme" in rows[0].note
    assert caps.gap(CHUNK_SHAPED, None, torch.int64) is rows[0] and caps.gap(CHUNK_SHAPED, R.SUM, BF16) is rows[0]
    assert caps.gap("all_reduce", R.SUM, F32) is None
    assert BackendGaps().capabilities("acmeccl").gap(CHUNK_SHAPED, None, F32) is None


def test_backend_gaps_add_to_a_built_in_table() -> None:
    """Declared on Gloo, the gaps add to Gloo's own rows (PREMUL_SUM stays a gap)."""
    caps = BackendGaps(unsupported_ops=[R.MAX]).capabilities("gloo")
    assert caps.gap("all_reduce", R.MAX, F32) is not None
    assert caps.gap("all_reduce", R.PREMUL_SUM, F32) is not None


@pytest.mark.parametrize("kwargs,match", [
    ({"unsupported_collectives": ["all_gather"]}, "'all_gather' is not a collective the router can rewrite"),
    ({"unsupported_collectives": "all_to_all"}, "not one string"),
    ({"unsupported_dtypes": [("all_reduce", "bf16")]}, r"\(collective, torch.dtype\) pairs"),
    ({"wrong_dtypes": [("allreduce", torch.float64)]}, "'allreduce'"),
    ({"unsupported_ops": ["avg"]}, "'avg'"),
    ({"unsupported_collectives": ["all_gather_into_tensor"]}, "declare chunk_shaped_all_gather=True"),
    ({"unsupported_dtypes": [("all_gather_into_tensor", torch.bfloat16)]}, "only reshapes the output"),
    ({"chunk_shaped_all_gather": "yes"}, "takes True or False"),
])
def test_backend_gaps_reject_what_the_router_cannot_use(kwargs: dict, match: str) -> None:
    """A declaration naming something the router cannot rewrite fails at once, saying what to write."""
    with pytest.raises((ValueError, TypeError), match=match):
        BackendGaps(**kwargs)


def test_backend_without_table_goes_straight_through_with_a_note() -> None:
    """A backend with no table (ucc) gets no gaps and a note saying so."""
    caps = capabilities_for("ucc")
    assert caps.gaps == () and any("no capability table" in n for n in caps.notes)


def test_torch_outside_checked_range_uses_nearest_row_and_says_so() -> None:
    """torch 2.5 / 3.0 use the nearest checked row and note it."""
    old = capabilities_for("gloo", "2.5.1")
    assert old.gap("all_reduce", R.AVG, F32) is not None
    assert any("outside the checked range" in n for n in old.notes)
    new = capabilities_for("gloo", "3.0.0")
    assert new.gap("all_reduce", R.AVG, F32) is None and new.notes


def test_installed_torch_is_the_default_version() -> None:
    """Without a version the installed torch is used (local build suffixes are ignored)."""
    assert capabilities_for("gloo").torch_version == torch.__version__.split("+")[0]


def test_bad_torch_version_names_the_value() -> None:
    """A version that is not PEP 440 raises naming it."""
    with pytest.raises(ValueError, match="not-a-version"):
        capabilities_for("gloo", "not-a-version")


def test_describe_rows_are_printable() -> None:
    """describe() gives one dict per gap with op and dtype names."""
    rows = capabilities_for("gloo", "2.7").describe()
    assert {"collective": "all_reduce", "op": "AVG", "dtype": "any", "effect": "raises"}.items() <= rows[
        [r["collective"] == "all_reduce" and r["op"] == "AVG" for r in rows].index(True)].items()


def test_op_type_canonicalises_and_rejects_non_ops() -> None:
    """ReduceOp objects map to the one RedOpType member; anything else raises naming it."""
    assert op_type(dist.ReduceOp(R.AVG)) is R.AVG
    assert op_type(dist._make_nccl_premul_sum(2.0)) is R.PREMUL_SUM
    with pytest.raises(TypeError, match="'sum'"):
        op_type("sum")


def test_gap_and_capabilities_records() -> None:
    """Gap normalises its op; Capabilities lists the collectives it affects."""
    g = Gap("all_reduce", "raises", "test", dist.ReduceOp(R.MAX))
    assert g.op is R.MAX and g.matches(R.MAX, F32) and not g.matches(R.SUM, F32)
    caps = Capabilities("x", gaps=(g,))
    assert caps.missing == frozenset({"all_reduce"}) and caps.affects("all_reduce") and not caps.affects("reduce")


@pytest.mark.parametrize("name", list(KNOWN_BACKENDS) + ["GLOO"])
def test_known_backend_names_pass(name: str) -> None:
    """Every known backend name passes the check, in any case."""
    check_backend_name(name)


@pytest.mark.parametrize("name", ["nccll", "cuda:nccl", "", "   "])
def test_unknown_backend_names_raise_listing_known_ones(name: str) -> None:
    """An unknown or empty name raises UnknownBackendError that lists the known backends."""
    with pytest.raises(UnknownBackendError, match="gloo") as info:
        check_backend_name(name)
    assert "nccl" in str(info.value)


def test_gloo_2_14_row_is_checked_and_equals_2_13() -> None:
    """torch 2.14.1's conformance run (2026-11-26) gave the 2.13 gaps: a checked row, with no 'outside' note."""
    row, prev = capabilities_for("gloo", "2.14.1"), capabilities_for("gloo", "2.13.0")
    assert row.notes == () and row.torch_version == "2.14.1"
    assert {(g.collective, g.effect, g.op, g.dtype) for g in row.gaps} == \
        {(g.collective, g.effect, g.op, g.dtype) for g in prev.gaps}
    assert any("outside the checked range 2.6-2.15" in n for n in capabilities_for("gloo", "2.16.0").notes)


def test_gloo_2_15_row_is_checked_and_equals_2_13() -> None:
    """torch 2.15.0's conformance run (2026-11-27, 2 and 3 ranks) gave the 2.13 gaps again: a checked row."""
    row, prev = capabilities_for("gloo", "2.15.0"), capabilities_for("gloo", "2.13.0")
    assert row.notes == () and row.torch_version == "2.15.0"
    assert {(g.collective, g.effect, g.op, g.dtype) for g in row.gaps} == \
        {(g.collective, g.effect, g.op, g.dtype) for g in prev.gaps}
