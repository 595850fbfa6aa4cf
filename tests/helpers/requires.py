"""Importing what a test needs: a package the set-up installs is required, never skipped.

The set-up (``make venv``: ``pip install -e '.[test]'``; ``make test-stock`` adds
``.[stock]``) installs every package the suite uses, so a missing one is a broken install:
the test fails and says what to install. Only hardware and checkouts this machine does
not have (a GPU, ``MEGATRON_LM_ROOT``, ``MEGATRON_LM_GIT``) are reasons to skip.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

import pytest

__all__ = ["importable", "require"]


def importable(module: str) -> bool:
    """Whether ``module`` can be found (without importing it; a missing parent package counts as not found)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def require(module: str, install: str) -> ModuleType:
    """The imported ``module``; if it is missing, fail (a collection error at module level) naming ``install``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        error = str(exc)
    pytest.fail(f"{module} is not installed, and the test set-up installs it (make venv, or {install}): {error}",
                pytrace=False)
