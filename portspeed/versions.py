"""Versions that gates compare against: what is installed, and what is really imported.

Why two answers: a Megatron-LM checkout on ``PYTHONPATH`` (the usual way to run the stock
scripts) shadows the installed megatron-core wheel, so the distribution metadata names one
release while another one runs. Gates must follow the code that runs. For distributions
listed in ``SOURCE_PACKAGES`` the version is read from the package that ``import`` resolves
to (already imported, or found on ``sys.path`` without importing it: the set-up runs before
Megatron's first module); ``gate_version`` says when that differs from the metadata.

``SUPPORTED`` is the range each framework was tested with; a version outside it is one no
patch was checked against, and the manager warns about it (an error under
PORTSPEED_STRICT=1). The installed-metadata lookup uses the standard library's
``importlib.metadata``: the backport's ``version()`` imports email.policy on first use,
which costs more than every version gate of an import together.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.machinery
import importlib.metadata as _metadata
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from packaging.version import Version

__all__ = ["SOURCE_PACKAGES", "SUPPORTED", "GateVersion", "distribution_version",
           "gate_version", "package_info_version", "source_version"]

#: distribution -> the package whose ``package_info.py`` (MAJOR, MINOR, PATCH, PRE_RELEASE) names the
#: release of the code that is imported.
SOURCE_PACKAGES: dict[str, str] = {"megatron-core": "megatron.core"}

#: distribution -> the range its patches were checked against (README, supported matrix). The runs behind
#: each bound: megatron-core 0.15.3-0.19.x, the stock matrix at core_v0.15.3 ... core_v0.19.0 launched from
#: the checkout's root and from elsewhere (benchmarks/stock_matrix.py, table in docs/megatron.md) and CI's
#: 0.16.1 / 0.19.2; torch 2.13.0 in CI leg 1; 2.15.0 in CI leg 2 from 2026-11-27 (Python 3.12, megatron-core
#: 0.19.2, DeepSpeed 0.19.8, the Bridge: LEG2_TESTS 411 passed, and the torch_hooks cases of test_trace.py and
#: test_nan_check.py; Gloo's capability row from `portspeed conformance --declared-gaps`, 2 and 3 ranks; by hand
#: the test device's suite, stock core_v0.19.0's files, and the stock matrix at every tag core_v0.15.3 ... main
#: from the checkout's root and from elsewhere, 2026-11-27/28: docs/supported.md, "torch 2.15.0"); 2.14.1 in leg 2 until
#: then, now by hand (`make test-leg2-torch2.14`), and on 3.11 (docs/benchmarks.md, "Gloo on torch 2.14.1"); the
#: torch floor by hand on 2026-11-26 (Python 3.11, PyPI's CUDA wheels run on CPU, megatron-core 0.16.1,
#: DeepSpeed 0.19.8): 2.6.0, 2.8.0 and 2.11.0 pass tests/test_collective_conformance.py, test_router.py
#: and test_capabilities.py, 2.6.0 also test_megatron_core_parity.py (its testdev cases not run). Gaps
#: declared there: Gloo's PREMUL_SUM rows by release (capabilities), and below torch 2.13 a routed
#: collective breaks a torch.compile graph (test_router.py). 2.7, 2.9, 2.10 and 2.12 not run.
SUPPORTED: dict[str, str] = {
    "megatron-core": ">=0.15,<0.20",
    "deepspeed": ">=0.19,<0.20",
    "torch": ">=2.6,<2.16",
}


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


def package_info_version(text: str) -> Version | None:
    """The release named by a Megatron-style ``package_info.py`` (constants only; nothing is executed)."""
    from packaging.version import InvalidVersion, Version

    consts: dict[str, object] = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if isinstance(node.value, ast.Constant):
                consts[node.targets[0].id] = node.value.value
    if not all(k in consts for k in ("MAJOR", "MINOR", "PATCH")):
        return None
    try:
        return Version(f"{consts['MAJOR']}.{consts['MINOR']}.{consts['PATCH']}{consts.get('PRE_RELEASE') or ''}")
    except InvalidVersion:
        return None


def _package_dir(package: str) -> str | None:
    """Directory of ``package`` as ``import`` would find it, importing nothing that is not imported yet."""
    mod = sys.modules.get(package)
    if mod is not None and getattr(mod, "__file__", None):
        return os.path.dirname(mod.__file__)
    top, _, rest = package.partition(".")
    if top in sys.modules:
        locations = list(getattr(sys.modules[top], "__path__", []) or [])
    else:
        spec = importlib.machinery.PathFinder.find_spec(top)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        candidate = os.path.join(loc, *rest.split(".")) if rest else loc
        if os.path.isfile(os.path.join(candidate, "__init__.py")):
            return candidate
    return None


def source_version(distribution: str) -> tuple[Version | None, str | None]:
    """(version, directory) of the package ``import`` resolves to for ``distribution``; (None, None) if unknown."""
    package = SOURCE_PACKAGES.get(distribution)
    if package is None:
        return None, None
    where = _package_dir(package)
    if where is None:
        return None, None
    try:
        with open(os.path.join(where, "package_info.py"), encoding="utf-8") as fh:
            return package_info_version(fh.read()), where
    except (OSError, SyntaxError, ValueError):
        return None, where


@dataclasses.dataclass(frozen=True)
class GateVersion:
    """The version a gate uses, where it came from, and the installed one when they differ."""

    version: Version | None
    source: str  # "metadata", or the directory of the imported package
    installed: Version | None

    @property
    def shadowed(self) -> bool:
        """True when the imported code is not the installed distribution's release."""
        return self.source != "metadata" and self.installed is not None and self.installed != self.version

    def describe(self, distribution: str) -> str:
        """One line for logs and reports."""
        if self.shadowed:
            return (f"{distribution} {self.version} imported from {self.source} (shadows the installed "
                    f"{distribution} {self.installed}; gates follow the imported code)")
        if self.source != "metadata" and self.installed is None:
            return f"{distribution} {self.version} imported from {self.source} (not installed as a distribution)"
        return f"{distribution} {self.version}"


def gate_version(distribution: str) -> GateVersion:
    """The version gates compare against: the imported package's release where known, else the metadata's."""
    installed = distribution_version(distribution)
    version, where = source_version(distribution)
    if version is not None and where is not None:
        return GateVersion(version, where, installed)
    return GateVersion(installed, "metadata", installed)
