"""The megatron-core releases the Megatron patches are gated on, stated once and derived from one range.

Why one place: a range written beside each patch drifts from the others and from the range
portspeed claims to support. Every range here starts from ``portspeed.versions.SUPPORTED``
(``megatron-core >=0.15,<0.20``, the releases the patches were checked against):

- ``CORE``: the Megatron-Core patches, from the first supported release on and open-ended,
  so a newer release keeps them (with the untested-release warning ``SUPPORTED`` gives)
  until the drift check (``portspeed patches --check``) says a target moved;
- every narrower range is built with ``narrowed(spec, reason)``, which refuses one that
  starts before ``CORE`` and records the reason beside the range (``NARROWED``).

Gates compare against the release of the ``megatron.core`` that is imported (a Megatron-LM
checkout shadows the wheel; see ``portspeed.versions``). Example::

    from .ranges import DISTRIBUTION, TRAINING
    Patch(..., distribution=DISTRIBUTION, versions=TRAINING)
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from portspeed.versions import SUPPORTED

__all__ = ["CORE", "DDP_OFFLOAD", "DISTRIBUTION", "LEGACY_FUSED_KERNELS", "MOE_TE_GEMM_UNBOUND", "NARROWED",
           "SCRIPT_MOVES_BATCHES", "TRAINING", "narrowed"]

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

#: (range, why it is narrower than CORE) for every narrowed() range, in the order stated below.
NARROWED: list[tuple[str, str]] = []


def narrowed(spec: str, reason: str) -> str:
    """``spec``, checked to start no earlier than ``CORE``, with ``reason`` recorded in ``NARROWED``.

    A patch whose target appeared or disappeared in some release, or which was checked only
    against some releases, gets a narrower range; the reason says which.
    """
    if _floor(spec) < _floor(CORE):
        raise ValueError(f"range {spec!r} starts before the supported megatron-core range {CORE!r}")
    NARROWED.append((spec, reason))
    return spec


#: megatron.training (Megatron-LM's own package, in the wheel only from 0.17) was checked against
#: Megatron-LM tags core_v0.16.1 to core_v0.19.0; open-ended like CORE.
TRAINING: str = narrowed(">=0.16", "megatron.training was checked against Megatron-LM core_v0.16.1 to core_v0.19.0; "
                                   "0.15 was never run with the stock scripts")
#: ``_ParamAndGradBuffer.offload_to_cpu`` appeared in 0.16 (the 0.15.3 wheel has no such method).
DDP_OFFLOAD: str = narrowed(">=0.16", "_ParamAndGradBuffer.offload_to_cpu first appears in megatron-core 0.16")
#: 0.15 and 0.16 leave ``te_general_gemm`` unbound without Transformer Engine; 0.17 binds it to None itself.
MOE_TE_GEMM_UNBOUND: str = narrowed(">=0.15,<0.17", "megatron-core 0.17 binds te_general_gemm to None itself")
#: ``megatron.legacy.fused_kernels`` is gone from core_v0.17.0 on (and megatron.training starts at 0.16).
LEGACY_FUSED_KERNELS: str = narrowed(">=0.16,<0.17", "megatron.legacy.fused_kernels is gone from core_v0.17.0 on")
#: core_v0.18's stock ``pretrain_gpt.py`` is the first to call ``.cuda()`` in its own ``get_batch``.
SCRIPT_MOVES_BATCHES: str = narrowed(">=0.18", "from core_v0.18 the stock pretrain_gpt.py moves batches with "
                                               ".cuda() in its own get_batch")
