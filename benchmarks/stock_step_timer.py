"""``portspeed run --adaptor benchmarks.stock_step_timer``: the Megatron adaptor, plus each training step's CPU time.

Why: on a shared host the wall time Megatron logs per iteration measures the other processes as much as
this one; the worker's own CPU time (one thread) does not. After ``megatron.training.training`` loads,
its ``train_step`` is wrapped to print ``STEP_CPU_S <cpu seconds> WALL_S <wall seconds>`` per call
(benchmarks/bench_te_kernels.py reads them). Benchmark-only: nothing else changes.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import time
from typing import Any

import portspeed.megatron_adaptor  # noqa: F401  (what `portspeed run` imports by default)

TARGET = "megatron.training.training"


def _wrap(module: Any) -> None:
    original = module.train_step

    def train_step(*args: Any, **kwargs: Any) -> Any:
        c0, t0 = time.process_time(), time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            print(f"STEP_CPU_S {time.process_time() - c0:.6f} WALL_S {time.perf_counter() - t0:.6f}", flush=True)

    module.train_step = train_step


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        _wrap(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if TARGET in sys.modules:
    _wrap(sys.modules[TARGET])
else:  # just before the path finder: portspeed's own finders (activation, the translation's scope) come first
    _at = next((i for i, f in enumerate(sys.meta_path) if f is importlib.machinery.PathFinder), len(sys.meta_path))
    sys.meta_path.insert(_at, _Finder())
