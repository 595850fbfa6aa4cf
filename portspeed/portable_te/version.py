"""The Transformer Engine version the portable one reports, one per megatron-core release.

Why it matters: Megatron asks ``is_te_min_version(v)`` some fifty times per release, and the
answer picks code paths: which keyword arguments reach the TE modules, which TE submodules are
imported at module level, whether grouped linears / activation ops are defined. The version is
chosen per release so that every such check takes a path the portable layers implement, and it
stays fixed (tests pin the paths it selects):

- **2.6.0** for megatron-core 0.15 to 0.19: at least 1.10 (``kv_channels`` as a pair,
  ``softmax_scale``, ``rng_tracker_name``, ``num_gqa_groups``, the keyword form of
  ``checkpoint``), at least 1.9 (``TEGroupedLinear`` is defined: the portable ``GroupedLinear``
  refuses with a message), below 2.7 (Megatron would import ``transformer_engine.pytorch.router``'s
  fused MoE kernels at module level with no fallback) and below 2.8 / 2.9 / 2.10 (their options,
  ``softmax_type``, qk-clip, ``num_splits``, are refused anyway).

A release outside the table gets the newest entry, and one log line says so.
"""

from __future__ import annotations

import logging

from packaging.version import Version

__all__ = ["DEFAULT", "VERSIONS", "te_version_for"]

log = logging.getLogger("portspeed.portable_te")

#: megatron-core "major.minor" -> the Transformer Engine version reported
VERSIONS: dict[str, str] = {"0.15": "2.6.0", "0.16": "2.6.0", "0.17": "2.6.0", "0.18": "2.6.0", "0.19": "2.6.0"}
DEFAULT = VERSIONS["0.19"]


def te_version_for(core_version: str | None) -> str:
    """The version reported to megatron-core ``core_version`` (its "major.minor" entry, else the newest)."""
    if core_version:
        v = Version(core_version)
        key = f"{v.major}.{v.minor}"
        if key in VERSIONS:
            return VERSIONS[key]
        log.warning("portspeed: megatron-core %s is not in the portable Transformer Engine's version table; "
                    "reporting Transformer Engine %s", core_version, DEFAULT)
    return DEFAULT
