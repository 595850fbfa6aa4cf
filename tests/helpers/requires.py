"""Importing what a test needs: a skip with the reason on a developer's partial install, a failure in CI.

The set-up (``make test``) installs every package the suite uses, so in CI (``CI`` set, as
``.ci/run`` runs) a missing one is a broken install and must fail the run, never pass it as
skips. Elsewhere a missing optional package skips the test and says what to install.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

__all__ = ["require"]


def require(module: str, install: str) -> ModuleType:
    """The imported ``module``; if it is missing: ImportError under CI, else a skip naming ``install``."""
    if os.environ.get("CI"):
        try:
            return importlib.import_module(module)
        except ImportError as exc:
            raise ImportError(f"{module} is missing in CI, where the set-up installs it ({install}): {exc}") from exc
    return pytest.importorskip(module, reason=f"{module} is not installed ({install})")
