"""What the PatchManager tests (tests/test_manager.py, tests/test_manager_gating.py) patch, and their fixtures.

``Modules`` writes real modules into a temporary directory under a unique package name; they are imported
for real and removed from sys.modules afterwards (as wrapt's own post-import hook tests do), so no test sees
another's modules or patches.
"""

from __future__ import annotations

import importlib
import itertools
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest


from portspeed.patching.manager import PatchManager
from portspeed.patching.record import Patch

__all__ = ["Modules", "imp", "replace", "status", "tag", "wrap"]

_counter = itertools.count()

TARGET = '''
def f(x):
    return ("f", x)

def other(x):
    return ("other", x)

class C:
    def m(self, x):
        return ("m", x)

    @staticmethod
    def s(x):
        return ("s", x)

    @classmethod
    def c(cls, x):
        return (cls.__name__, x)

class Sub(C):
    pass
'''

USER = '''
from {t} import f, C
from {t} import f as g
import {t} as z

class D:
    h = f

class E(C):
    pass
'''


class Modules:
    """Writes modules under one unique package in a tmp dir; forgets them at teardown."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pkg = f"pstgt{next(_counter)}_{id(self) % 10000}"
        (root / self.pkg).mkdir()
        (root / self.pkg / "__init__.py").write_text("")

    def write(self, name: str, source: str) -> str:
        """Write ``<pkg>.<name>`` and return its dotted name (not imported)."""
        (self.root / self.pkg / f"{name}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        return f"{self.pkg}.{name}"

    def target(self, name: str = "t") -> str:
        return self.write(name, TARGET)

    def user(self, target: str, name: str = "u") -> str:
        return self.write(name, USER.format(t=target))

    def cleanup(self) -> None:
        for name in [n for n in sys.modules if n == self.pkg or n.startswith(self.pkg + ".")]:
            del sys.modules[name]


def tag(label: str) -> Callable[..., Any]:
    """A wrapt-style wrapper that tags the result, so call nesting is visible."""

    def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        return (label, wrapped(*args, **kwargs))

    return wrapper


def wrap(name: str, target: str, label: str | None = None, **kw: Any) -> Patch:
    return Patch(name=name, target=target, kind="wrap", impl=tag(label or name), reason="test wrapper", **kw)


def replace(name: str, target: str, impl: Any, **kw: Any) -> Patch:
    return Patch(name=name, target=target, kind="replace", impl=impl, reason="test replacement", **kw)


def status(m: PatchManager, name: str) -> dict[str, Any]:
    return next(d for d in m.report() if d["name"] == name)


def imp(name: str) -> Any:
    return importlib.import_module(name)


@pytest.fixture
def env(portspeed_env: Callable[..., None]) -> Callable[..., None]:
    """Set PORTSPEED_* variables for one test (tests/conftest.py's portspeed_env, by its short name here)."""
    return portspeed_env


@pytest.fixture
def mods(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Modules]:
    monkeypatch.syspath_prepend(str(tmp_path))
    m = Modules(tmp_path)
    yield m
    m.cleanup()


@pytest.fixture
def mgr(env: Callable[..., None]) -> Iterator[PatchManager]:
    m = PatchManager()
    yield m
    m.revert()
