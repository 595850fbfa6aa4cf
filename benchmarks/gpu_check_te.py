"""gpu_check.py's TE part: the portable Transformer Engine served to Megatron on CUDA too, and the SDPA ops a step runs.

Why apart: the import plumbing below is not what the check measures; ``gpu_check.py te-step`` calls
``serve_portable_te()`` before the example builds its model, and ``sdpa_ops`` after.
"""

from __future__ import annotations

import builtins
import importlib.abc
import importlib.machinery
import sys
from typing import Any

__all__ = ["sdpa_ops", "serve_portable_te"]


class _ServedLoader(importlib.abc.Loader):
    """Runs a Megatron module with an ``__import__`` that falls back to the portable TE (see serve_portable_te)."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        from portspeed.portable_te import serve

        given = module.__dict__.get("__builtins__", builtins.__dict__)
        given = given if isinstance(given, dict) else given.__dict__
        inner = given["__import__"]  # portspeed's scoped import where it translates (CPU), else the builtin

        def served(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
            try:
                return inner(name, globals, locals, fromlist, level)
            except ModuleNotFoundError:
                mod = serve.served_import(name, globals, fromlist, level)
                if mod is None:
                    raise
                return mod

        module.__dict__["__builtins__"] = {**given, "__import__": served}
        self._loader.exec_module(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _ServedFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of every ``megatron.*`` module that the path finder finds."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not fullname.startswith("megatron."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ServedLoader(spec.loader)
        return spec


def serve_portable_te() -> None:
    """Serve the portable TE to Megatron's TE importers in this process, on CUDA too.

    Why: portspeed serves it only off CUDA (on a GPU, NVIDIA's Transformer Engine is the one to
    install; ``patches/megatron/core_portable_te.py``), but this check measures the portable TE's
    kernels on the GPU. The same rule as the patch (``portable_te.serve.served_import``: Megatron's TE
    importers only, nothing in ``sys.modules``) behind a finder placed just before the path finder, so
    portspeed's own finders (activation; the translation's scope off CUDA, which this import wraps) come first.
    The patch is blocked (``PORTSPEED_DISABLE``) so that CPU and CUDA take this one route.
    """
    from portspeed.portable_te import serve

    installed = serve.nvidia_installed()
    if installed:
        raise SystemExit(f"a Transformer Engine distribution ({installed}) is installed; the portable one would not "
                         "be what runs. Run the check in an environment without it")
    at = next((i for i, f in enumerate(sys.meta_path) if f is importlib.machinery.PathFinder), len(sys.meta_path))
    sys.meta_path.insert(at, _ServedFinder())


def sdpa_ops(step: Any) -> list[str]:
    """The aten SDPA ops one call of ``step`` runs (profiler op names; CPU activity only, so it works anywhere)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    names = {e.key for e in prof.key_averages()}
    return sorted(n for n in names if "scaled_dot_product" in n or n.startswith(("aten::_flash_attention",
                                                                               "aten::_efficient_attention",
                                                                               "aten::_cudnn_attention")))
