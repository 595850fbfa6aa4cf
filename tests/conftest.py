"""Shared fixtures: a clean PORTSPEED_* environment with the adapter selection forgotten.

Settings (``portspeed.config``) are read once and cached, and the adapter is selected once
per process; a test that changes either must leave both as it found them. ``portspeed_env``
does that for every test that asks for it (or applies it with ``usefixtures``).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
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


@pytest.fixture(autouse=True)
def _portspeed_vars_put_back() -> Iterator[None]:
    """Every test leaves the PORTSPEED_* variables as it found them (the test device's build variables aside).

    Why: `portspeed run` run in-process (the refusal tests) sets variables for its workers in its own
    process, which is the test session's (``PORTSPEED_HANG_TIMEOUT``, ``PORTSPEED_PROBE_*``, the dump folder);
    monkeypatch restores only what the test set itself, so a later test's child processes inherited them
    (a hang timeout left behind turned recording on in an unrelated run).
    """
    before = dict((k, os.environ[k]) for k in _portspeed_vars())
    yield
    now = _portspeed_vars()
    if set(now) != set(before) or any(os.environ[k] != v for k, v in before.items()):
        for k in now:
            del os.environ[k]
        os.environ.update(before)
        config.reload()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failing test whose child processes aborted carries every thread's native backtrace (their core files,
    read by gdb in ``helpers.launch``): "Fatal Python error: Aborted" alone names neither the thread nor the cause."""
    from helpers import launch

    if call.when == "setup":
        launch.ABORTS.clear()
    outcome = yield
    report = outcome.get_result()
    if report.failed and launch.ABORTS:
        report.sections.append(("native backtraces of aborted children", "\n".join(launch.ABORTS)[-30000:]))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cold-python", action="store_true",
                     help="start every child Python cold (no warm Python forking them: portspeed.testing.warm)")


def pytest_sessionstart(session: pytest.Session) -> None:
    """The warm Python: torch imported once, every child Python of the tests forked from it (tests/helpers/launch.py).

    Why: most of a multi-rank test's time on the 2-core CI machine was its processes importing torch."""
    config = session.config
    xdist_controller = bool(config.getoption("numprocesses", None)) and not hasattr(config, "workerinput")
    if not config.getoption("--cold-python") and not xdist_controller:  # xdist's workers start their own
        from helpers import launch

        launch.start_warm(Path(tempfile.mkdtemp(prefix="portspeed-warm-")))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    from helpers import launch

    if launch.WARM is not None:
        terminalreporter.write_line(launch.WARM.summary())


def pytest_unconfigure(config: pytest.Config) -> None:
    from helpers import launch

    launch.stop_warm()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the test's fixtures (a module fixture's runs included): warm unless marked ``cold_python``."""
    from helpers import launch

    launch.USE_WARM = item.get_closest_marker("cold_python") is None
