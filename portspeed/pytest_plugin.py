"""pytest plugin (entry point ``pytest11``): loss-parity fixtures. See portspeed.parity for the fixtures' logic."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("portspeed")
    group.addoption("--update-golden", action="store_true", default=False,
                    help="rewrite portspeed golden loss files instead of comparing against them")
