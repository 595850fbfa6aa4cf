"""The scoped translation: framework modules, and only they, get the torch / torch.cuda views.

Contract
- The views themselves live beside this module: ``CudaView`` (``cuda_view``, the torch.cuda
  API answered by the active adapter, built from a table) and ``TorchView``
  (``torch_namespace``, torch with CUDA device arguments translated). Here they are made
  once per process (``cuda_view()``, ``torch_view()``) and handed out.
- ``enable()`` gives the views to *framework modules* (names under the prefixes in
  ``framework_prefixes()``: ``megatron``, plus ``PORTSPEED_FRAMEWORK_MODULES`` and
  ``add_framework_prefixes``): modules imported later get a ``__builtins__`` whose
  ``__import__`` returns the views for ``torch`` / ``torch.cuda`` (installed before the
  module body runs, so ``import torch`` and ``from torch.cuda import x`` bind the view);
  modules already imported have their bindings rebound. ``disable()`` undoes both.
  torch itself and every other library keep the real ``torch.cuda``.
- ``caller_is_framework()`` answers, for the Tensor/Module patches, whether the calling
  code is a framework module (prefixes cached for the hot path).

Limits: objects a framework module received from the real torch before ``enable()`` and
stored elsewhere than its globals (closures, containers) keep the real object, and
functions defined before ``enable()`` keep the builtins they were created with, so an
``import torch`` *inside* such a function binds the real torch (module-level names are
rebound; ``tests/test_megatron_core_parity.py::test_adaptor_imported_after_megatron``
trains with that order). On an adapter that runs CUDA natively
(``Accelerator.runs_cuda_natively``) nothing is translated: ``enable()`` is a no-op.

The names of ``torch_namespace`` (``names_cuda``, ``translate_device``, ``TorchView``,
``Generator``, ``FACTORIES``) and ``CudaView`` stay importable from here.

Example::

    from portspeed.translation import importer as translation
    translation.enable()           # megatron.* now sees torch.cuda answered by the adapter
    translation.is_framework_module("megatron.core.utils")   # True
"""

from __future__ import annotations

import builtins
import contextlib
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
import types
from typing import Any, Callable, Iterator

import torch

from portspeed.accelerator import get_accelerator
from portspeed.translation import scope as framework_modules
from portspeed.translation.cuda_view import CudaView
from portspeed.translation.scope import (DEFAULT_PREFIXES, FRAMEWORK_ENV, framework_prefixes, is_framework_module,
                                         valid_prefix)
from portspeed.translation.torch_namespace import FACTORIES, Generator, TorchView, names_cuda, translate_device
from portspeed.errors import ConfigError

__all__ = [
    "CudaView",
    "FACTORIES",
    "Generator",
    "TorchView",
    "FRAMEWORK_ENV",
    "add_framework_prefixes",
    "bypassed",
    "caller_is_framework",
    "cuda_view",
    "disable",
    "enable",
    "enabled",
    "framework_prefixes",
    "is_framework_module",
    "names_cuda",
    "reload_prefixes",
    "served_import",
    "torch_view",
    "translate_device",
]

log = logging.getLogger("portspeed.translation.importer")

_REAL_TORCH = torch
_REAL_CUDA = torch.cuda


_cuda_view: CudaView | None = None
_torch_view: TorchView | None = None


def cuda_view() -> CudaView:
    """The process-wide CudaView."""
    global _cuda_view
    if _cuda_view is None:
        _cuda_view = CudaView()
    return _cuda_view


def torch_view() -> TorchView:
    """The process-wide TorchView (its ``cuda`` is ``cuda_view()``)."""
    global _torch_view
    if _torch_view is None:
        _torch_view = TorchView(cuda_view())
    return _torch_view


# ---------------------------------------------------------------------- scoping
_lock = threading.RLock()
_enabled = False
_finder: "_ScopeFinder | None" = None
_scoped_modules: dict[str, tuple[types.ModuleType, Any, dict[str, Any]]] = {}


def add_framework_prefixes(*prefixes: str) -> None:
    """Name more framework packages (e.g. ``"deepspeed"``); applies to modules already imported if enabled."""
    for p in prefixes:
        if not valid_prefix(p):
            raise ConfigError(
                f"framework prefix {p!r} is not an importable module name other than torch; "
                "give a package name such as 'deepspeed'"
            )
    with _lock:
        for p in prefixes:
            if p not in framework_modules.extra_prefixes:
                framework_modules.extra_prefixes.append(p)
        if _enabled:
            _scope_loaded()


_hot_dotted: tuple[str, ...] = tuple(p + "." for p in DEFAULT_PREFIXES)
_hot_exact: tuple[str, ...] = DEFAULT_PREFIXES


def reload_prefixes() -> tuple[str, ...]:
    """Re-read the prefixes into the cache the hot path uses (enable() and add_framework_prefixes() call it)."""
    global _hot_dotted, _hot_exact
    prefixes = framework_prefixes()
    _hot_dotted, _hot_exact = tuple(p + "." for p in prefixes), prefixes
    return prefixes


def caller_is_framework(depth: int = 2) -> bool:
    """Whether the code ``depth`` frames up (1: the caller of the function calling this) is a framework module.

    Hot path (tensor method wrappers): uses the prefixes cached by ``reload_prefixes()``.
    """
    try:
        name = sys._getframe(depth).f_globals.get("__name__")
    except ValueError:  # pragma: no cover - shallow stack
        return False
    return name is not None and (name.startswith(_hot_dotted) or name in _hot_exact)


def served_import(name: str, globals: Any, fromlist: Any, level: int) -> Any:
    """What a framework module gets for an import that found no module (None: the ImportError stands).

    Nothing is served here. A declared patch may replace this function (the portable Transformer
    Engine's, ``patches/megatron/core_portable_te.py``) to serve a module to chosen framework
    importers only, without putting it in ``sys.modules``; it is asked only after the real import
    failed with ModuleNotFoundError, so an installed package always wins and successful imports
    pay nothing.
    """
    return None


def _make_import(real_import: Callable[..., Any]) -> Callable[..., Any]:
    def scoped_import(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        try:
            mod = real_import(name, globals, locals, fromlist, level)
        except ModuleNotFoundError:
            served = served_import(name, globals, fromlist, level)
            if served is None:
                raise
            return served
        if level == 0 and name[:5] == "torch" and _enabled and (len(name) == 5 or name[5] == "."):
            if fromlist:
                if name == "torch":
                    return torch_view()
                if name == "torch.cuda":
                    return cuda_view()
                return mod
            return torch_view()
        return mod

    scoped_import.__portspeed_scoped__ = True  # type: ignore[attr-defined]
    return scoped_import


def _scoped_builtins() -> dict[str, Any]:
    b = dict(builtins.__dict__)
    b["__import__"] = _make_import(builtins.__import__)
    return b


_BUILTINS: dict[str, Any] | None = None


class _ScopedLoader(importlib.abc.Loader):
    """Delegates to the real loader; puts the scoped ``__builtins__`` in place before the body runs."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        if _enabled and _BUILTINS is not None:
            module.__dict__["__builtins__"] = _BUILTINS
        self._loader.exec_module(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _ScopeFinder(importlib.abc.MetaPathFinder):
    """Finds framework modules with the other finders and wraps their loader."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not is_framework_module(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ScopedLoader(spec.loader)
                return spec
        return None


def _view_objects() -> dict[int, tuple[Any, Any]]:
    """id(real object) -> (real, view object) for everything the views replace."""
    tv, cv = torch_view(), cuda_view()
    pairs: dict[int, tuple[Any, Any]] = {id(_REAL_TORCH): (_REAL_TORCH, tv), id(_REAL_CUDA): (_REAL_CUDA, cv)}
    for name in FACTORIES + ("autocast", "Generator"):
        real = getattr(_REAL_TORCH, name, None)
        if real is not None:
            pairs[id(real)] = (real, tv.__dict__[name])
    for name in ("_lazy_call", "_lazy_init", "get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all",
                 "initial_seed", "current_device", "device_count", "is_available", "synchronize", "set_device",
                 "current_stream", "default_stream", "Stream", "Event", "stream", "empty_cache", "memory_stats",
                 "memory_allocated", "max_memory_allocated", "nvtx", "device", "amp", "random",
                 "get_device_properties", "get_device_capability", "is_bf16_supported"):
        real = getattr(_REAL_CUDA, name, None)
        if real is not None:
            pairs[id(real)] = (real, getattr(cv, name))
    return pairs


def _scope_loaded() -> None:
    """Give already-imported framework modules the views (rebinding globals), once each."""
    pairs = None
    prefixes = reload_prefixes()
    dotted = tuple(p + "." for p in prefixes)
    for name, mod in list(sys.modules.items()):
        if mod is None or name in _scoped_modules or not (name in prefixes or name.startswith(dotted)):
            continue
        ns = getattr(mod, "__dict__", None)
        if not isinstance(ns, dict):
            continue
        if pairs is None:
            pairs = _view_objects()
        changed: dict[str, Any] = {}
        for key, value in list(ns.items()):
            hit = pairs.get(id(value))
            if hit is not None and hit[0] is value:
                changed[key] = value
                ns[key] = hit[1]
        _scoped_modules[name] = (mod, ns.get("__builtins__"), changed)
        ns["__builtins__"] = _BUILTINS


def _unscope_all() -> None:
    for name, (mod, old_builtins, changed) in list(_scoped_modules.items()):
        ns = mod.__dict__
        for key, real in changed.items():
            ns[key] = real
        if old_builtins is None:
            ns.pop("__builtins__", None)
        else:
            ns["__builtins__"] = old_builtins
    _scoped_modules.clear()
    # modules imported while enabled bound the views at import: put the real objects back
    reverse = {id(v): (v, r) for r, v in _view_objects().values()}
    for name, mod in list(sys.modules.items()):
        if mod is None or not is_framework_module(name):
            continue
        ns = getattr(mod, "__dict__", None)
        if not isinstance(ns, dict):
            continue
        if ns.get("__builtins__") is _BUILTINS:
            ns["__builtins__"] = builtins.__dict__
        for key, value in list(ns.items()):
            hit = reverse.get(id(value))
            if hit is not None and hit[0] is value:
                ns[key] = hit[1]


# ---------------------------------------------------------------------- modules already running
# A module whose body is executing when the translation is enabled (the entry script named as
# ``__main__`` that imports the adaptor on its first line, a Ray actor's module doing the same, or
# the ``__main__`` that `portspeed run`'s worker makes after the adaptor's import) runs in a frame
# that keeps the builtins it started with, so its later ``import torch`` would bind the real
# torch. When the user names modules of their own in PORTSPEED_FRAMEWORK_MODULES, a hook on
# ``builtins.__import__`` serves framework callers the views too; every other importer calls
# straight through. Without such names it is never installed (prefixes added at run time by
# ``add_framework_prefixes`` alone do not install it).
_global_hook: Callable[..., Any] | None = None
_hook_real_import: Callable[..., Any] | None = None


def _install_running_module_hook() -> None:
    global _global_hook, _hook_real_import
    if _global_hook is not None or not set(framework_modules.env_prefixes()) - set(DEFAULT_PREFIXES):
        return
    real = builtins.__import__
    scoped = _make_import(real)

    def framework_caller_import(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (),
                                level: int = 0) -> Any:
        who = globals.get("__name__") if isinstance(globals, dict) else None
        if _enabled and who is not None and (who.startswith(_hot_dotted) or who in _hot_exact):
            return scoped(name, globals, locals, fromlist, level)
        return real(name, globals, locals, fromlist, level)

    _global_hook, _hook_real_import = framework_caller_import, real
    builtins.__import__ = framework_caller_import


def _remove_running_module_hook() -> None:
    global _global_hook, _hook_real_import
    if _global_hook is not None and builtins.__import__ is _global_hook:
        builtins.__import__ = _hook_real_import
    _global_hook = _hook_real_import = None  # a hook wrapped by someone since stays, and calls through


def enable() -> bool:
    """Scope the views onto framework modules (now and at later imports); False where CUDA runs natively."""
    global _enabled, _finder, _BUILTINS
    with _lock:
        acc = get_accelerator()
        if acc.runs_cuda_natively:
            log.debug("portspeed: adapter %r runs CUDA natively; torch.cuda is not translated", acc.name)
            return False
        if _enabled:
            reload_prefixes()
            _scope_loaded()
            _install_running_module_hook()
            return True
        reload_prefixes()
        _BUILTINS = _scoped_builtins()
        _enabled = True
        _finder = _ScopeFinder()
        sys.meta_path.insert(0, _finder)
        _scope_loaded()
        _install_running_module_hook()
        return True


def disable() -> None:
    """Undo ``enable()``: remove the import hook and give framework modules the real torch back."""
    global _enabled, _finder
    with _lock:
        if not _enabled:
            return
        if _finder is not None and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
        _finder = None
        _remove_running_module_hook()
        _unscope_all()
        _enabled = False


def enabled() -> bool:
    """Whether the scoped translation is active."""
    return _enabled


@contextlib.contextmanager
def bypassed() -> Iterator[None]:
    """Turn the translation off for a block (benchmarks' B side) and back on after, if it was on."""
    was = _enabled
    if was:
        disable()
    try:
        yield
    finally:
        if was:
            enable()
