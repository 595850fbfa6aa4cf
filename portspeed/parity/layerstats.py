"""Retired: per-layer statistics were replaced by probe dumps; the old names say what replaced them.

``LayerStatsRecorder`` needed the training loop edited and recorded leaf modules' first outputs
only; ``portspeed run --probe DIR`` records every module's outputs, gradients and parameters with
no edit, and ``portspeed compare --probe REF_DIR RUN_DIR`` names the first divergence, across
layouts too (docs/accuracy.md). Keeping both would leave two ways to do one thing, so every old
name raises `LayerStatsError` with that sentence. This module goes after 2027-06-30.
"""

from __future__ import annotations

from typing import Any, NoReturn

from portspeed.errors import PortspeedError

__all__ = ["LayerStatsRecorder", "LayerStatsError", "compare_layers", "load_layer_stats", "main_compare_layers",
           "REPLACED_BY"]

#: what to do instead, in one line
REPLACED_BY = ("portspeed.parity.layerstats (LayerStatsRecorder, compare --layers) was replaced by probe dumps: "
               "record each run with `portspeed run --probe DIR ...` (no edit to the script), then "
               "`portspeed compare --probe REF_DIR RUN_DIR` (docs/accuracy.md)")


class LayerStatsError(PortspeedError, ValueError):
    """An old layer-statistics name was used: the message says what replaced it."""


def _retired(*args: Any, **kwargs: Any) -> NoReturn:
    raise LayerStatsError(REPLACED_BY)


class LayerStatsRecorder:
    """Retired: raises `LayerStatsError` naming `portspeed run --probe DIR`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _retired()


compare_layers = load_layer_stats = main_compare_layers = _retired
