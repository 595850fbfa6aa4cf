"""Installed distribution versions, looked up once per process.

The lookup uses the standard library's ``importlib.metadata`` (the code the importlib-metadata
backport is published from; torch has loaded it already). The backport's ``version()`` imports
email.policy on first use, which costs more than every version gate of an import together.
"""

from __future__ import annotations

import functools
import importlib.metadata as _metadata
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from packaging.version import Version

__all__ = ["distribution_version", "clear_cache"]


@functools.lru_cache(maxsize=None)
def distribution_version(name: str) -> Version | None:
    """The installed version of distribution ``name``, or None when it is not installed."""
    from packaging.version import InvalidVersion, Version

    try:
        raw = _metadata.version(name)
    except _metadata.PackageNotFoundError:
        return None
    try:
        return Version(raw)
    except InvalidVersion:
        return None


def clear_cache() -> None:
    """Forget looked-up versions (tests that install or fake distributions)."""
    distribution_version.cache_clear()
