"""Parameter entries: each parameter's gradient before the optimizer step, and its value after.

Which gradient: Megatron's ``main_grad`` where the parameter has one (the reduced, fp32
gradient the optimizer reads), else ``.grad``. With Megatron's distributed optimizer only this
rank's part of ``main_grad`` holds the reduced gradient after the reduce-scatter: the entry is that
shard (``optimizer._get_model_param_range_map(param)["param"]``: its start and end in the
flattened parameter), with ``ps_shard`` ``{start, end, numel}`` and a layout split over dp; a
parameter with no part on this rank gets an empty shard. Reading the ranges is local: no
collective is issued. After the step, the same shard of the model parameter (the optimizer wrote
it; other ranks' parts arrive with the all-gather, possibly in the next forward).

Keys: ``Module.<path>.<Class>.parameters_grad.0`` and ``.parameters_updated.0``, msprobe's shape
``{"weight": [tensor], "bias": [tensor]}``; a parameter shared by two modules is recorded once,
under the first.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from portspeed.probe import sharding as lay
from portspeed.probe.entries import IterationRecord
from portspeed.probe.modules import ModuleTable

__all__ = ["record_params", "optimizer_leaves"]


def optimizer_leaves(optimizer: Any) -> list[Any]:
    """The optimizers inside ``optimizer`` (Megatron's ChainedOptimizer holds several), or itself."""
    if optimizer is None:
        return []
    inner = getattr(optimizer, "chained_optimizers", None)
    if isinstance(inner, (list, tuple)):
        return [leaf for o in inner for leaf in optimizer_leaves(o)]
    return [optimizer]


def _shard_range(param: torch.nn.Parameter, leaves: Iterable[Any]) -> tuple[int, int] | None | bool:
    """(start, end) of this rank's shard of ``param`` under a distributed optimizer; False when no leaf shards
    parameters (the whole parameter is this rank's); None when one does and this rank holds none of it."""
    sharding = False
    for opt in leaves:
        gbuf_map = getattr(opt, "model_param_gbuf_map", None)
        if gbuf_map is None or not hasattr(opt, "_get_model_param_range_map"):
            continue
        sharding = True
        if param in gbuf_map:
            r = opt._get_model_param_range_map(param)["param"]
            return int(r.start), int(r.end)
    return None if sharding else False


def _tensor_of(param: torch.nn.Parameter, phase: str) -> torch.Tensor | None:
    if phase == "parameters_updated":
        return param.detach()
    grad = getattr(param, "main_grad", None)
    return grad if isinstance(grad, torch.Tensor) else param.grad


def record_params(record: IterationRecord, table: ModuleTable, parallel: lay.Parallel, phase: str,
                  optimizer: Any = None) -> int:
    """Add the ``phase`` entries (``parameters_grad`` or ``parameters_updated``) of every selected module with
    parameters; returns how many parameters were recorded."""
    leaves = optimizer_leaves(optimizer)
    seen: set[int] = set()
    count = 0
    for info in table.infos:
        if not info.selected:
            continue
        fields: dict[str, Any] = {}
        key = f"Module.{info.path}.{info.cls}.{phase}.0"

        def base(info: Any = info) -> dict[str, Any]:
            return {"ps_micro_batch": -1, "ps_chunk": info.chunk, "ps_phase": phase, "ps_module": info.path,
                    "ps_class": info.cls, "ps_local_path": info.local_path,
                    "ps_layer": info.layer if info.layer is not None else (
                        -1 if info.path.startswith("embedding") else table.num_layers),
                    **({"ps_expert": info.expert} if info.expert is not None else {})}

        save = record.saves(key)
        for name, param in info.module.named_parameters(recurse=False):
            if id(param) in seen or not param.requires_grad:
                continue
            seen.add(id(param))
            t = _tensor_of(param, phase)
            if t is None:
                if record.full:
                    fields[name] = [None]
                continue
            shard = _shard_range(param, leaves)
            meta: dict[str, Any] = {}
            if shard is not False:
                start, end = shard if shard is not None else (0, 0)
                t = t.view(-1)[start:end]
                meta = {"ps_shard": {"start": start, "end": end, "numel": param.numel()}}
            layout = lay.param_layout(info.module, name, parallel, shard=shard is not False)
            if record.full:
                rec = record.tensor(t, key, name, 0, layout, save)
                rec.update(meta)  # the same dict the record fills at the iteration's end: not a copy
                fields[name] = [rec]
            else:
                record.flag(t, key, name, 0, base(), layout)
            count += 1
        if fields:
            record.add(key, {**base(), **fields})
    return count
