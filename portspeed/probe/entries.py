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
import weakref
from typing import Any, Iterator, NamedTuple

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
        bounds = (value.start, value.stop, value.step)
        return {"type": "slice", "value": [None if v is None else int(v) for v in bounds]}
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


class _Flag(NamedTuple):
    """A tensor watched for non-finite values (flags only): where its Max and Min are queued, and its record's place."""

    slot: int | None  # in the statistics batch (None: an empty tensor)
    numel: int
    key: str  # the entry
    field: str
    index: int
    base: dict[str, Any]  # the entry's ps_* fields
    dtype: str
    shape: list[int]
    layout: dict | None


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
        self._pending: list[dict[str, Any]] = []  # tensor records whose statistics are queued
        self.flags: list[_Flag] = []  # flags only, in the order queued
        self.meta_slots: dict[str, int] = {}  # run-meta values read with the statistics (a loss scale)
        #: id -> (the tensor, its version, its storage address, slot): a tensor seen again unchanged is not re-measured
        self._seen: dict[int, tuple[weakref.ref, int, int, int | None]] = {}

    # ------------------------------------------------------------ building entries
    @property
    def saves_any(self) -> bool:
        """Whether --probe-tensors asks for any full tensor (inputs then need the keyword arguments too)."""
        return self._tensors is not None

    def saves(self, key: str) -> bool:
        """Whether --probe-tensors asks for ``key``'s full tensors."""
        return self._tensors is not None and fnmatch.fnmatchcase(key, self._tensors)

    def slot(self, t: torch.Tensor, same_as: torch.Tensor | None = None, fresh: bool = False) -> int | None:
        """The statistics slot of ``t``: queued once per tensor and version (the same tensor handed from module to
        module, a weight read by every micro-batch, is measured once), or ``same_as``'s slot (a view holding the
        same elements: ``view``, ``transpose``, ...). ``fresh``: measured again whatever was seen (a tensor a
        collective wrote: c10d's writes need not move the version counter)."""
        try:
            version = t._version
        except (RuntimeError, AttributeError):  # inference tensors have no version counter: never shared
            version = None
        hit = None if fresh else self._seen.get(id(t))
        if version is not None and hit is not None and hit[0]() is t and hit[1] == version and \
                hit[2] == t.data_ptr():
            return hit[3]
        if same_as is not None and version is not None and same_as.numel() == t.numel():
            slot = self.slot(same_as)
        else:
            slot = self.batch.add_full(t) if self.full else self.batch.add_flag(t)
        if version is not None:
            self._seen[id(t)] = (weakref.ref(t), version, t.data_ptr(), slot)
        return slot

    def tensor(self, t: torch.Tensor, key: str, field: str, index: int, layout: dict | None = None,
               save: bool = False, same_as: torch.Tensor | None = None, fresh: bool = False) -> dict[str, Any]:
        """``t``'s record in entry ``key`` (its statistics pending); with ``save``, its full tensor is kept."""
        rec = st.describe(t)
        rec["_slot"], rec["_numel"] = self.slot(t, same_as, fresh), t.numel()
        self._pending.append(rec)
        if layout is not None:
            rec["ps_layout"] = layout
        if save:
            name = f"{key}.{field}.{index}.pt"
            with torch.no_grad(), torch._C.DisableTorchFunction():
                self._saved.append((name, t.detach().clone()))
            rec["data_name"] = name
        return rec

    def value(self, v: Any, key: str, field: str, index: int, layout: dict | None = None,
              save: bool = False, same_as: torch.Tensor | None = None) -> Any:
        """A tensor's pending record, or any other value encoded (``layout`` / ``save`` / ``same_as`` apply to
        tensors)."""
        if isinstance(v, torch.Tensor):
            return self.tensor(v, key, field, index, layout, save, same_as)
        return encode(v)

    def flag(self, t: torch.Tensor, key: str, field: str, index: int, base: dict[str, Any],
             layout: dict | None = None) -> None:
        """Flags only: queue ``t``'s Max and Min as item ``index`` of ``field`` in entry ``key`` (whose ``ps_*``
        fields are ``base``); the entry is built only if the iteration turns out to hold a non-finite value."""
        self.flags.append(_Flag(self.slot(t), t.numel(), key, field, index, base, str(t.dtype), list(t.shape), layout))

    def _flag_entries(self, values: list[list[float]]) -> None:
        """The entries of a watched iteration, built from its flags (in the order they were queued)."""
        for f in self.flags:
            entry = self.entries.get(f.key)
            if entry is None:
                entry = self.add(f.key, dict(f.base))
            rec: dict[str, Any] = {"type": "torch.Tensor", "dtype": f.dtype, "shape": f.shape}
            if f.layout is not None:
                rec["ps_layout"] = f.layout
            rec.update(st.empty_stats() if f.slot is None else st.finish_flag(values[f.slot], f.numel))
            items = entry.setdefault(f.field, [])
            while len(items) <= f.index:
                items.append(None)
            items[f.index] = rec

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
        self._seen.clear()
        if any(f.slot is not None and not all(map(math.isfinite, values[f.slot])) for f in self.flags):
            self._flag_entries(values)  # a non-finite value: its iteration's dump is written, so build it
        for rec in self._pending:
            slot, n = rec.pop("_slot"), rec.pop("_numel")
            if slot is None:
                rec.update(st.empty_stats())
            elif self.full:
                rec.update(st.finish_full(values[slot], n))
            else:
                rec.update(st.finish_flag(values[slot], n))
        self._pending = []
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
