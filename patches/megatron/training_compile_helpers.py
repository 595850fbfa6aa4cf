"""``compile_helpers`` runs ``make`` in the source tree; skip it when the helpers extension is importable.

``megatron.training.initialize`` calls ``megatron.core.datasets.utils.compile_helpers`` on
rank 0 at every start. It runs ``make`` with the system ``python3`` and pybind11 inside the
package folder: in a read-only Megatron-LM checkout, or without pybind11, it fails and
exits. The megatron-core wheel ships the extension prebuilt, and ``training_imports``
makes it importable from a checkout; when ``megatron.core.datasets.helpers_cpp`` can be
found the build is skipped, otherwise Megatron's own build runs as before.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from portspeed.patching.record import WRAP, Patch

from ._training_common import log
from .ranges import DISTRIBUTION, TRAINING

__all__ = ["PATCHES", "skip_build_when_prebuilt"]

HELPERS = "megatron.core.datasets.helpers_cpp"


def _helpers_found() -> bool:
    try:
        return importlib.util.find_spec(HELPERS) is not None
    except (ImportError, ValueError):
        return False


def skip_build_when_prebuilt(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper: no ``make`` when the extension is already importable."""
    if _helpers_found():
        log.info("portspeed: %s is prebuilt; skipping Megatron's `make` of the dataset helpers", HELPERS)
        return None
    return wrapped(*args, **kwargs)


PATCHES: list[Patch] = [
    Patch(
        name="megatron.training.compile_helpers",
        target="megatron.core.datasets.utils:compile_helpers",
        kind=WRAP,
        impl=skip_build_when_prebuilt,
        distribution=DISTRIBUTION,
        versions=TRAINING,
        reason="Megatron-LM runs `make` for the dataset helpers at every start, which fails without "
        "pybind11 or in a read-only checkout although a prebuilt extension is importable.",
    ),
]
