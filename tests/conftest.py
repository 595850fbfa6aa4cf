"""Shared fixtures: a clean PORTSPEED_* environment with the adapter selection forgotten.

Settings (``portspeed.config``) are read once and cached, and the adapter is selected once
per process; a test that changes either must leave both as it found them. ``portspeed_env``
does that for every test that asks for it (or applies it with ``usefixtures``).
"""

from __future__ import annotations

import os
from typing import Callable, Iterator

import pytest

from portspeed import config
from portspeed.accelerator import reset_accelerator


def _portspeed_vars() -> list[str]:
    """The settings' variables; the test device's build variables (PORTSPEED_TESTDEV_*) stay as the run set them."""
    return [k for k in os.environ if k.startswith("PORTSPEED_") and not k.startswith("PORTSPEED_TESTDEV_")]


@pytest.fixture
def portspeed_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """Start with no PORTSPEED_* variable and no selected adapter; yield ``set_env(NAME=value | None, ...)``.

    Each ``set_env`` call re-reads the settings and forgets the selection; teardown restores
    the environment, the settings and the selection state.
    """
    for var in _portspeed_vars():
        monkeypatch.delenv(var, raising=False)
    config.reload()
    reset_accelerator()

    def set_env(**values: str | None) -> None:
        for name, value in values.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        config.reload()
        reset_accelerator()

    yield set_env
    monkeypatch.undo()
    config.reload()
    reset_accelerator()
