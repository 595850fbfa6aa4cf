"""Lazy re-exports for package ``__init__`` modules (foundation: imports nothing of portspeed).

Why: ``import portspeed.megatron_adaptor`` sits at the top of every training script and
must cost almost nothing (docs/benchmarks.md, import). A sub-package's ``__init__`` names
its public API without importing the modules behind it; each name is loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, table: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``table`` maps a public name to the module that defines it.

    A module path starting with ``.`` is relative to ``package``. The value is cached in the
    package's namespace after the first lookup, so later accesses are plain attribute reads.
    """

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(importlib.import_module(package), name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(importlib.import_module(package))) | set(table))

    return __getattr__, __dir__
