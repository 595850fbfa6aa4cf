"""Tensor statistics computed on the device and read back once per iteration.

Why on the device: a ``.item()`` per module would stop the device's queue at every hook and
make probing cost what it measures. Each tensor's statistics are queued as a small float64
tensor on the tensor's own device; ``StatsBatch.read()`` joins them and moves them to the host in
one transfer per device, at the iteration's end.

Two records per tensor:

- **full** (``add_full``): ``[Max, Min, Sum, Norm, NaN count, Inf count]`` in float64, over a float64
  copy (widening is exact, so Max and Min are the tensor's own); Sum and Norm are computed in
  float64 over every element, so one non-finite element makes them non-finite; the Mean is Sum /
  count on the host.
- **flag** (``add_flag``): ``[Max, Min]``, one ``aminmax`` pass in the tensor's own dtype (widened
  after). Max and Min propagate a NaN, and an Inf is the Max or the Min, so both are finite exactly
  when every element is (``--probe-nan`` on every iteration). One min/max pass costs about a third
  of a float64 sum on the CPU, which is what the flags used before.

Everything runs on a ``detach()``-ed view (nothing joins autograd's graph), with torch-function
handling off while an op-level mode is pushed (it must not see the probe's own arithmetic); nothing
is written, no random number is drawn.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

__all__ = ["FULL", "FLAG", "StatsBatch", "describe", "empty_stats", "finish_full", "finish_flag"]

#: fields of a full record, in order
FULL = ("Max", "Min", "Sum", "Norm", "ps_nan", "ps_inf")
#: fields of a flag record
FLAG = ("Max", "Min")
_F64 = torch.float64
_NO_GUARD = contextlib.nullcontext()


def describe(t: torch.Tensor) -> dict[str, Any]:
    """What is known on the host without reading the tensor: msprobe's type, dtype, shape, requires_grad."""
    return {"type": "torch.Tensor", "dtype": str(t.dtype), "shape": list(t.shape), "requires_grad": t.requires_grad}


def empty_stats() -> dict[str, Any]:
    """The statistics of a tensor with no elements (or of a kind that has none: complex, meta)."""
    return {"Max": None, "Min": None, "Mean": None, "Norm": None, "ps_nan": 0, "ps_inf": 0}


def _measurable(t: torch.Tensor) -> bool:
    return t.numel() > 0 and not t.is_complex() and t.device.type != "meta"


#: above this many elements the statistics read the tensor in place (each reduction widening as it reads) rather
#: than from a float64 copy: the copy saves torch calls, which is what a small tensor costs, but writes and re-reads
#: twice the bytes, which is what a large one costs on an accelerator
COPY_BELOW = 1 << 16
#: on the CPU a large tensor's Sum and Norm come from float64 copies of chunks this long: the CPU's widening
#: reductions (``sum(dtype=float64)``) convert element by element and took 2-3x the time of a copy and a float64
#: reduction (1M float32 elements, one thread); chunks keep the copy's memory at 8 MiB whatever the tensor
CPU_CHUNK = 1 << 20


def _count(flags: torch.Tensor) -> torch.Tensor:
    """How many of ``flags`` are set, as a float64 0-d tensor. ``count_nonzero``, not ``sum``: summing a bool tensor
    widens it to int64 element by element and took 4-7x as long as the count (1M elements on the CPU, one thread)."""
    return torch.count_nonzero(flags).to(_F64)


def _sum_norm(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum and L2 norm of a large floating tensor in float64: widening as it reads, or on the CPU chunk by chunk
    from float64 copies (the norm of the chunks' norms is the norm)."""
    if x.device.type != "cpu":
        return torch.sum(x, dtype=_F64), torch.linalg.vector_norm(x, dtype=_F64)
    parts = []
    for chunk in x.reshape(-1).split(CPU_CHUNK):
        y = chunk.to(_F64)
        parts.append(torch.stack([y.sum(), torch.linalg.vector_norm(y)]))
    both = torch.stack(parts)
    return both[:, 0].sum(), torch.linalg.vector_norm(both[:, 1])


def _counts(x: torch.Tensor, total: torch.Tensor) -> list[torch.Tensor]:
    """The NaN and Inf counts of ``x``, whose float64 sum is ``total``. A non-finite element makes the sum
    non-finite, so a finite sum means both are 0. On the CPU that is asked first (reading a CPU scalar is no device
    sync) and the two counting passes are skipped; elsewhere both are counted on the device, never read here."""
    if x.device.type == "cpu" and math.isfinite(total.item()):
        zero = torch.zeros((), dtype=_F64)
        return [zero, zero]
    return [_count(torch.isnan(x)), _count(torch.isinf(x))]


def _full(t: torch.Tensor) -> torch.Tensor:
    """``[Max, Min, Sum, Norm, NaN count, Inf count]`` in float64 (widening is exact: Max and Min are the tensor's
    own)."""
    x = t.detach()
    if x.numel() < COPY_BELOW or not x.is_floating_point():
        x = x.to(_F64)
        lo, hi = torch.aminmax(x)
        total = x.sum()
        return torch.stack([hi, lo, total, torch.linalg.vector_norm(x), *_counts(x, total)])
    lo, hi = torch.aminmax(x)
    total, norm = _sum_norm(x)
    return torch.stack([hi.to(_F64), lo.to(_F64), total, norm, *_counts(x, total)])


def _guarded() -> Any:
    """Torch-function handling off while an op-level mode is pushed (it must not see the probe's arithmetic)."""
    return torch._C.DisableTorchFunction() if torch._C._is_torch_function_mode_enabled() else _NO_GUARD


class StatsBatch:
    """The statistics queued in one iteration, each a slot; ``read()`` returns every slot's values on the host."""

    def __init__(self) -> None:
        #: (device, width) -> queued results of that width: 6 (full), 2 (flags), 1 (values, kept 0-d)
        self._parts: dict[tuple[torch.device, int], list[torch.Tensor]] = {}
        self._where: list[tuple[tuple[torch.device, int], int]] = []  # slot -> (its list, index in it)

    def __len__(self) -> int:
        return len(self._where)

    def _queue(self, values: torch.Tensor, width: int) -> int:
        parts = self._parts.setdefault((values.device, width), [])
        parts.append(values)
        self._where.append(((values.device, width), len(parts) - 1))
        return len(self._where) - 1

    def add_full(self, t: torch.Tensor) -> int | None:
        """Queue the full statistics of ``t``; the slot, or None for a tensor that has none (no elements, complex)."""
        if not _measurable(t):
            return None
        with _guarded():  # a detached tensor records no graph: no no_grad() needed
            return self._queue(_full(t), len(FULL))

    def add_flag(self, t: torch.Tensor) -> int | None:
        """Queue ``t``'s Max and Min (both finite exactly when every element is); None when it has no elements."""
        if not _measurable(t):
            return None
        with _guarded():
            lo, hi = torch.aminmax(t.detach())
            return self._queue(torch.stack([hi, lo]).to(_F64), len(FLAG))

    def add_value(self, t: torch.Tensor) -> int:
        """Queue a scalar tensor as it is (a loss scale)."""
        with _guarded():
            return self._queue(t.detach().to(_F64).reshape(()), 1)

    def read(self) -> list[list[float]]:
        """Every slot's values, in slot order: one stack and one host transfer per device and width. The batch is
        emptied."""
        host: dict[tuple[torch.device, int], list] = {}
        with _guarded():
            for key, parts in self._parts.items():
                values = torch.stack(parts).cpu().tolist()
                host[key] = values if key[1] != 1 else [[v] for v in values]
        out = [host[key][i] for key, i in self._where]
        self._parts, self._where = {}, []
        return out


def finish_full(values: list[float], numel: int) -> dict[str, Any]:
    """A full record's host values as msprobe's fields (Mean = Sum / count) plus ``ps_nan`` / ``ps_inf``."""
    hi, lo, total, norm, nan, inf = values
    return {"Max": hi, "Min": lo, "Mean": total / numel, "Norm": norm, "ps_nan": int(nan), "ps_inf": int(inf)}


def finish_flag(values: list[float], numel: int) -> dict[str, Any]:
    """A flag record's host values: Max and Min are known; ``ps_finite`` says whether every element is finite."""
    hi, lo = values
    return {"Max": hi, "Min": lo, "Mean": None, "Norm": None, "ps_nan": None, "ps_inf": None,
            "ps_finite": math.isfinite(hi) and math.isfinite(lo)}
