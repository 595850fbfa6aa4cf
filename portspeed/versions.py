"""Installed distribution versions, looked up once through importlib-metadata."""

from __future__ import annotations

import functools

import importlib_metadata
from packaging.version import InvalidVersion, Version

__all__ = ["distribution_version", "clear_cache"]


@functools.lru_cache(maxsize=None)
def distribution_version(name: str) -> Version | None:
    """The installed version of distribution ``name``, or None when it is not installed."""
    try:
        raw = importlib_metadata.version(name)
    except importlib_metadata.PackageNotFoundError:
        return None
    try:
        return Version(raw)
    except InvalidVersion:
        return None


def clear_cache() -> None:
    """Forget looked-up versions (tests that install or fake distributions)."""
    distribution_version.cache_clear()
