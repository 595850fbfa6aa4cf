"""Two Megatron-LM imports that cannot succeed off CUDA, answered by declared import-finder patches.

An attribute patch needs its module to import first; these two modules cannot:

* ``megatron.core.transformer.custom_layers.batch_invariant_kernels`` runs ``import triton``
  at its top, and ``megatron.training.initialize`` imports it unconditionally (for
  ``--batch-invariant-mode``). A CPU build of torch has no triton. When triton cannot be
  found and the adapter is not CUDA, the import gets a small portspeed module (marked
  ``__portspeed_standin__``) with the same four public functions: the mode reads as off,
  and turning it on raises an error that says to drop ``--batch-invariant-mode``.
  triton itself is never faked, so torch's own probes still see it missing.
* ``megatron.core.datasets.helpers_cpp``, the dataset index builder. A Megatron-LM source
  checkout on PYTHONPATH shadows the installed megatron-core wheel's ``megatron.core``, and
  the checkout has only ``helpers.cpp`` (``compile_helpers`` would run ``make`` in it, with
  the system python3 and pybind11). When no other finder finds the module, the wheel's
  prebuilt extension of the *same* megatron-core version is loaded under that name.

Both are ``Patch(kind="finder")`` records (``PATCHES``): the manager puts them on
``sys.meta_path`` when the Megatron patch set applies (the batch-invariant one first, only
off CUDA; the helpers one last, so a real module always wins), reports them (`portspeed
patches`), lets ``PORTSPEED_DISABLE`` turn them off, gates them on the megatron-core range,
and takes them off on ``revert()``.

Limits: the helpers redirect refuses (and the normal ImportError follows) when the
imported ``megatron.core`` reports a version other than the installed megatron-core.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
from pathlib import Path
from typing import Any, Iterator


from portspeed.accelerator import get_accelerator
from portspeed.errors import PortspeedError
from portspeed.accelerator.conditions import translated
from portspeed.patching.record import FINDER, FINDER_TARGET, Patch
from portspeed.versions import distribution_version

from ._training_common import log_once
from .ranges import CORE, DISTRIBUTION

__all__ = ["PATCHES", "BATCH_INVARIANT", "HELPERS_CPP", "BATCH_INVARIANT_FINDER", "HELPERS_FINDER",
           "wheel_helpers_path"]

log = logging.getLogger("portspeed.megatron")

BATCH_INVARIANT = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
HELPERS_CPP = "megatron.core.datasets.helpers_cpp"



class BatchInvariantModeUnavailable(PortspeedError):
    """--batch-invariant-mode was asked for where its triton kernels cannot run."""


def _batch_invariant_standin(name: str) -> types.ModuleType:
    """The stand-in module: batch-invariant mode reads as off and cannot be turned on."""
    mod = types.ModuleType(name, "portspeed stand-in: batch-invariant kernels need triton, absent here")
    state = {"enabled": False}

    def is_batch_invariant_mode_enabled() -> bool:
        return state["enabled"]

    def enable_batch_invariant_mode() -> None:
        raise BatchInvariantModeUnavailable(
            f"--batch-invariant-mode needs Megatron's triton kernels, and triton is not installed for the "
            f"{get_accelerator().name!r} adapter; drop --batch-invariant-mode"
        )

    def disable_batch_invariant_mode() -> None:
        state["enabled"] = False

    @contextlib.contextmanager
    def set_batch_invariant_mode(enabled: bool = True) -> Iterator[None]:
        if enabled:
            enable_batch_invariant_mode()
        yield

    for fn in (is_batch_invariant_mode_enabled, enable_batch_invariant_mode, disable_batch_invariant_mode,
               set_batch_invariant_mode):
        fn.__module__ = name
        setattr(mod, fn.__name__, fn)
    mod.__all__ = ["set_batch_invariant_mode", "is_batch_invariant_mode_enabled",
                   "disable_batch_invariant_mode", "enable_batch_invariant_mode"]
    mod.__portspeed_standin__ = True
    return mod


class _StandinLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _batch_invariant_standin(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        log.info("portspeed: %s imports triton, which is not installed; using a stand-in "
                 "(batch-invariant mode unavailable)", module.__name__)


def _triton_missing() -> bool:
    try:
        return importlib.util.find_spec("triton") is None
    except (ImportError, ValueError):
        return True


class _BatchInvariantFinder(importlib.abc.MetaPathFinder):
    """First on sys.meta_path: answers only BATCH_INVARIANT, only without triton (the patch applies only off CUDA)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != BATCH_INVARIANT or not _triton_missing():
            return None
        return importlib.util.spec_from_loader(fullname, _StandinLoader())


def wheel_helpers_path() -> Path | None:
    """The installed megatron-core wheel's prebuilt helpers_cpp extension, if it ships one."""
    import importlib_metadata  # here, not at import: the backport's finder would reroute every metadata lookup

    try:
        files = importlib_metadata.files("megatron-core") or []
    except importlib_metadata.PackageNotFoundError:
        return None
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    for f in files:
        p = str(f)
        if p.startswith("megatron/core/datasets/helpers_cpp") and p.endswith(suffixes):
            located = Path(str(f.locate()))
            if located.is_file():
                return located
    return None


def _imported_core_version() -> str | None:
    pkg = sys.modules.get("megatron.core.package_info")
    if pkg is None:
        try:
            pkg = importlib.import_module("megatron.core.package_info")
        except ImportError:
            return None
    return getattr(pkg, "__version__", None)


class _HelpersFinder(importlib.abc.MetaPathFinder):
    """Last on sys.meta_path: only reached when nothing else found HELPERS_CPP."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != HELPERS_CPP:
            return None
        located = wheel_helpers_path()
        installed_version = distribution_version("megatron-core")
        imported_version = _imported_core_version()
        if located is None or installed_version is None:
            return None
        if imported_version is None or str(installed_version) != imported_version:
            log.warning("portspeed: %s is missing from the imported megatron.core (version %s) and the installed "
                        "megatron-core is %s; not substituting its prebuilt helpers across versions",
                        fullname, imported_version, installed_version)
            return None
        log_once("helpers_cpp", "portspeed: %s is not built in the Megatron-LM checkout; using the prebuilt one "
                 "of the installed megatron-core %s (%s)", fullname, installed_version, located)
        return importlib.util.spec_from_file_location(fullname, located)


BATCH_INVARIANT_FINDER = _BatchInvariantFinder()
HELPERS_FINDER = _HelpersFinder()

PATCHES: list[Patch] = [
    Patch(name="megatron.training.batch_invariant_kernels.standin", target=FINDER_TARGET, kind=FINDER,
          impl=BATCH_INVARIANT_FINDER, placement="first", distribution=DISTRIBUTION, versions=CORE, when=translated,
          reason=(f"{BATCH_INVARIANT} imports triton at its top and megatron.training.initialize imports it "
                  "unconditionally; without triton it gets a stand-in where batch-invariant mode reads as off "
                  "and turning it on raises")),
    Patch(name="megatron.core.datasets.helpers_cpp.prebuilt", target=FINDER_TARGET, kind=FINDER,
          impl=HELPERS_FINDER, placement="last", distribution=DISTRIBUTION, versions=CORE,
          reason=(f"a Megatron-LM checkout shadows the wheel's megatron.core and has no built {HELPERS_CPP}; "
                  "when nothing else finds it, the installed wheel's prebuilt one of the same version is loaded")),
]
