"""One probed iteration's entries on this rank: msprobe's keys and fields, with their statistics pending.

Why pending: statistics are queued on the device when a hook sees a tensor
(``portspeed.probe.stats``) and read back once, at the iteration's end (``finish``). Until then a
tensor's place in an entry holds its slot. Entries are kept in the order this rank recorded them
(``ps_seq``): forward calls as they complete, a backward entry when its first gradient arrives.

Two depths: ``full`` (a probed iteration: every statistic) and flags only (``--probe-nan`` on an
iteration outside the range: each output's and gradient's float64 sum, enough to name the first
non-finite one).
"""

from __future__ import annotations

import fnmatch
import math
import os
from typing import Any, Iterator

import torch

from portspeed.probe import stats as st

__all__ = ["IterationRecord", "encode"]

_BUILTIN = (bool, int, float, str)


def encode(value: Any) -> Any:
    """A non-tensor value in msprobe's ``{type, value}`` form (None: null; sequences and dicts element-wise)."""
    if value is None:
        return None
    if isinstance(value, _BUILTIN):
        if isinstance(value, float) and not math.isfinite(value):
            return {"type": "float", "value": str(value)}
        return {"type": type(value).__name__, "value": value}
    if isinstance(value, torch.Size):
        return {"type": "torch.Size", "value": [int(x) for x in value]}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    if isinstance(value, slice):
        return {"type": "slice", "value": [None if v is None else int(v) for v in (value.start, value.stop, value.step)]}
    if value is Ellipsis:
        return {"type": "ellipsis", "value": "..."}
    if isinstance(value, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return {"type": f"torch.{type(value).__name__}", "value": str(value)}
    if _is_group(value):
        return _group(value)
    if type(value).__name__ in ("ReduceOp", "RedOpType"):
        return {"type": "torch.distributed.ReduceOp", "value": str(value)}
    return {"type": f"{type(value).__module__}.{type(value).__qualname__}", "value": None}


def _is_group(value: Any) -> bool:
    import torch.distributed as dist

    return dist.is_available() and isinstance(value, dist.ProcessGroup)


def _group(group: Any) -> dict[str, Any]:
    import torch.distributed as dist

    try:
        ranks = dist.get_process_group_ranks(group)
    except Exception:  # a group this rank is not in, or a stand-in without ranks: still a group
        ranks = None
    return {"type": "torch.ProcessGroup", "group_ranks": ranks}


class IterationRecord:
    """The entries of one iteration on one rank; ``full`` False records flags only (see the module docstring)."""

    def __init__(self, iteration: int, rank: int, *, full: bool, tensors: str | None = None,
                 tensor_dir: str | None = None) -> None:
        self.iteration = iteration
        self.rank = rank
        self.full = full
        self.batch = st.StatsBatch()
        self.entries: dict[str, dict[str, Any]] = {}
        self.micro_batch = -1
        self.chunk = 0
        self.micro_batches: dict[int, int] = {}  # chunk -> micro-batches seen
        self._tensors = tensors if full else None
        self._tensor_dir = tensor_dir
        self._saved: list[tuple[str, torch.Tensor]] = []
        self.meta_slots: dict[str, int] = {}  # run-meta values read with the statistics (a loss scale)

    # ------------------------------------------------------------ building entries
    def saves(self, key: str) -> bool:
        """Whether --probe-tensors asks for ``key``'s full tensors."""
        return self._tensors is not None and fnmatch.fnmatchcase(key, self._tensors)

    def tensor(self, t: torch.Tensor, key: str, field: str, index: int, layout: dict | None = None,
               save: bool = False) -> dict[str, Any]:
        """``t``'s record in entry ``key`` (its statistics pending); with ``save``, its full tensor is kept."""
        rec = st.describe(t)
        slot = self.batch.add_full(t) if self.full else self.batch.add_flag(t)
        rec["_slot"], rec["_numel"] = slot, t.numel()
        if layout is not None:
            rec["ps_layout"] = layout
        if save:
            name = f"{key}.{field}.{index}.pt"
            with torch.no_grad(), torch._C.DisableTorchFunction():
                self._saved.append((name, t.detach().clone()))
            rec["data_name"] = name
        return rec

    def value(self, v: Any, key: str, field: str, index: int, layout: dict | None = None,
              save: bool = False) -> Any:
        """A tensor's pending record, or any other value encoded (``layout`` / ``save`` apply to tensors)."""
        if isinstance(v, torch.Tensor):
            return self.tensor(v, key, field, index, layout, save)
        return encode(v)

    def add(self, key: str, entry: dict[str, Any]) -> dict[str, Any]:
        """Put ``entry`` under ``key`` with its order and the iteration (a key seen twice keeps the first)."""
        if key in self.entries:
            return self.entries[key]
        entry["ps_iteration"] = self.iteration
        entry["ps_seq"] = len(self.entries)
        self.entries[key] = entry
        return entry

    # ------------------------------------------------------------ the iteration's end
    def _tensor_records(self, entry: dict[str, Any]) -> Iterator[tuple[str, Any, dict[str, Any]]]:
        """(field, index or keyword, record) of every tensor in ``entry``."""
        for field, val in entry.items():
            if field.startswith("ps_") or not isinstance(val, (list, dict)):
                continue
            for i, rec in (val.items() if isinstance(val, dict) else enumerate(val)):
                for r in (rec if isinstance(rec, list) else [rec]):
                    if isinstance(r, dict) and r.get("type") == "torch.Tensor":
                        yield field, i, r

    def finish(self) -> dict[str, dict[str, Any]]:
        """Read every queued statistic (one transfer per device) and fill the entries; write no file."""
        values = self.batch.read()
        for entry in self.entries.values():
            for _field, _i, rec in self._tensor_records(entry):
                if "_numel" not in rec:
                    continue
                slot, n = rec.pop("_slot"), rec.pop("_numel")
                if slot is None:
                    rec.update(st.empty_stats())
                elif self.full:
                    rec.update(st.finish_full(values[slot], n))
                else:
                    rec.update(st.finish_flag(values[slot], n))
        self.meta_values = {k: values[s][0] for k, s in self.meta_slots.items()}
        return self.entries

    def save_tensors(self, folder: str) -> None:
        """Write the kept full tensors as ``<key>.<field>.<i>.pt`` (torch.save, on the CPU) into ``folder``."""
        if not self._saved:
            return
        os.makedirs(folder, exist_ok=True)
        with torch.no_grad(), torch._C.DisableTorchFunction():
            for name, t in self._saved:
                torch.save(t.cpu(), os.path.join(folder, name))
        self._saved = []

    def first_nonfinite(self) -> tuple[str, str, Any, dict[str, Any]] | None:
        """The first recorded (key, field, index, tensor record) with a non-finite element, in ps_seq order."""
        for key, entry in self.entries.items():
            if entry.get("ps_recompute"):
                continue
            for field, i, rec in self._tensor_records(entry):
                if field.startswith("input") and entry.get("ps_phase") == "forward":
                    continue  # an output turned non-finite where it was made, not where it was read
                if rec.get("ps_finite") is False or (rec.get("ps_nan") or 0) + (rec.get("ps_inf") or 0) > 0:
                    return key, field, i, rec
        return None
