"""The megatron-core releases the Megatron patches are gated on, stated once and derived from one range.

Why one place: a range written beside each patch drifts from the others and from the range
portspeed claims to support. Every range here starts from ``portspeed.versions.SUPPORTED``
(``megatron-core >=0.15,<0.20``, the releases the patches were checked against):

- ``CORE``: the Megatron-Core patches, from the first supported release on and open-ended,
  so a newer release keeps them (with the untested-release warning ``SUPPORTED`` gives)
  until the drift check (``portspeed patches --check``) says a target moved;
- every narrower range is built with ``narrowed(spec, reason, kind=, evidence=)``, which
  refuses one that starts before ``CORE`` and records why beside the range (``NARROWED``), in
  one of two kinds (``portspeed.patching.narrowing``): ``UPSTREAM``, the target appears,
  disappears or is fixed upstream at the edge (silent; ``tests/test_narrowing.py`` checks the
  edge against the recorded fingerprints of the ``watch`` source), or ``NOT_RUN``, never run
  outside the range (a supported release outside it gets one line at activation).

Gates compare against the release of the ``megatron.core`` that is imported (a Megatron-LM
checkout shadows the wheel; see ``portspeed.versions``). Example::

    from .ranges import DISTRIBUTION, TRAINING
    Patch(..., distribution=DISTRIBUTION, versions=TRAINING)
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from portspeed.patching.narrowing import NOT_RUN, UPSTREAM, NarrowRange
from portspeed.versions import SUPPORTED

__all__ = ["CORE", "DDP_OFFLOAD", "DISTRIBUTION", "LEGACY_FUSED_KERNELS", "MOE_TE_GEMM_UNBOUND", "NARROWED",
           "NOT_RUN", "SCRIPT_MOVES_BATCHES", "TRAINING", "UPSTREAM", "narrowed"]

#: The distribution every Megatron patch is gated on: megatron.training has no distribution of its
#: own, so its patches follow the megatron-core release of the checkout (package_info.py).
DISTRIBUTION = "megatron-core"


def _floor(spec: str) -> Version:
    """The lowest release ``spec`` can admit (its largest ``>=`` / ``>`` / ``==`` bound)."""
    bounds = [Version(s.version) for s in SpecifierSet(spec) if s.operator in (">=", ">", "==", "~=")]
    if not bounds:
        raise ValueError(f"range {spec!r} has no lower bound; every Megatron patch range starts somewhere")
    return max(bounds)


#: Every Megatron-Core patch: the first supported release on, open-ended (">=0.15").
CORE: str = f">={_floor(SUPPORTED[DISTRIBUTION])}"

#: every narrowed() range, in the order stated below (each carries its kind, reason and evidence).
NARROWED: list[NarrowRange] = []


def narrowed(spec: str, reason: str, *, kind: str, evidence: str, watch: tuple[str, ...] = ()) -> NarrowRange:
    """``spec``, checked to start no earlier than ``CORE``, with why it is narrower, recorded in ``NARROWED``.

    ``kind`` is ``UPSTREAM`` (the target appears, disappears or is fixed upstream at the edge:
    silent; ``watch`` names the source whose recorded fingerprints show the edge) or ``NOT_RUN``
    (never run outside it: a supported release outside it gets one line at activation).
    ``evidence`` names the run or the source line that shows the reason.
    """
    if _floor(spec) < _floor(CORE):
        raise ValueError(f"range {spec!r} starts before the supported megatron-core range {CORE!r}")
    rng = NarrowRange(spec, kind=kind, reason=reason, evidence=evidence, watch=watch)
    NARROWED.append(rng)
    return rng


#: megatron.training (Megatron-LM's own package, in the wheel only from 0.17): every supported tag
#: runs the stock pretrain_gpt.py with these patches (core_v0.15.3 to main: the stock matrix,
#: ``benchmarks/stock_matrix.py``, table in docs/megatron.md), so it is CORE, open-ended.
TRAINING: str = CORE
#: ``_ParamAndGradBuffer.offload_to_cpu`` appeared in 0.16 (the 0.15.3 wheel has no such method).
DDP_OFFLOAD: str = narrowed(
    ">=0.16", "_ParamAndGradBuffer.offload_to_cpu first appears in megatron-core 0.16", kind=UPSTREAM,
    evidence="megatron/core/distributed/param_and_grad_buffer.py:964 at core_v0.16.1 (def offload_to_cpu); "
             "no such method at core_v0.15.3",
    watch=("megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBuffer.offload_to_cpu",))
#: 0.15 and 0.16 leave ``te_general_gemm`` unbound without Transformer Engine; 0.17 binds it to None itself.
MOE_TE_GEMM_UNBOUND: str = narrowed(
    ">=0.15,<0.17", "megatron-core 0.17 binds te_general_gemm to None itself when Transformer Engine is missing",
    kind=UPSTREAM,
    evidence="megatron/core/transformer/moe/moe_utils.py:52 at core_v0.17.1 ((..., te_general_gemm) = (None, ...)); "
             "0.15.3 and 0.16.1 only import it, inside a try",
    watch=("megatron.core.transformer.moe.moe_utils:te_general_gemm",))
#: ``megatron.legacy.fused_kernels`` is gone from core_v0.17.0 on.
LEGACY_FUSED_KERNELS: str = narrowed(
    ">=0.15,<0.17", "megatron.legacy.fused_kernels is gone from core_v0.17.0 on", kind=UPSTREAM,
    evidence="megatron/legacy/fused_kernels/__init__.py:17 at core_v0.16.1 (def load(args)); the folder is "
             "gone at core_v0.17.1",
    watch=("megatron.legacy.fused_kernels:load",))
#: core_v0.18's stock ``pretrain_gpt.py`` is the first to call ``.cuda()`` in its own ``get_batch``.
SCRIPT_MOVES_BATCHES: str = narrowed(
    ">=0.18", "from core_v0.18 the stock pretrain_gpt.py moves batches with .cuda() in its own get_batch",
    kind=UPSTREAM,
    evidence="pretrain_gpt.py:98 at core_v0.18.2 (batch[key] = batch[key].cuda(non_blocking=True)); up to "
             "core_v0.17.1 get_batch hands the batch to megatron.training.utils",
    watch=("pretrain_gpt:get_batch",))
