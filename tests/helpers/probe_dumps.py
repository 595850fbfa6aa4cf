"""Synthetic probe dumps, written as docs/probe-format.md says a recorder writes them.

The comparison's tests build dumps from tensors they choose (float64 statistics of real torch
tensors), so every layout rule is checked against numbers computed here independently.

Example::

    r = RankDump(meta(tp=2), rank=0, ranks={"tp": 0})
    r.forward("decoder.layers.0.mlp.linear_fc1", "ColumnParallelLinear", [t[..., :32]], layer=0,
              layout=split("tp", dim=-1))
    r.write(tmp_path / "run")
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

__all__ = ["meta", "stats", "split", "full", "partial", "RankDump"]


def meta(*, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, dp: int = 1, sp: bool = False,
         micro_batches: int = 2, global_batch_size: int = 4, micro_batch_size: int = 2,
         dp_order: str = "contiguous", grad_scale: float = 1.0, dropout: bool = False,
         device: str = "cpu", dtype: str = "float32", level: str = "module", **over: Any) -> dict[str, Any]:
    """A run meta (the ``portspeed`` block) with the format doc's fields; ``over`` replaces any of them."""
    m = {"format": "portspeed-probe", "version": 1, "iteration": 1, "rank": 0, "world": tp * pp * cp * dp,
         "level": level, "framework": "megatron-core",
         "releases": {"portspeed": "0.1.0", "torch": "2.13.0", "megatron-core": "0.16.1"},
         "device": device, "backend": "gloo", "adapter": device, "dtype": dtype,
         "layout": {"tp": tp, "pp": pp, "vpp": None, "cp": cp, "ep": ep, "etp": 1, "dp": dp, "sp": sp,
                    "distributed_optimizer": False},
         "ranks": {"tp": 0, "pp": 0, "cp": 0, "ep": 0, "dp": 0},
         "dp_order": dp_order, "micro_batches": micro_batches, "micro_batch_size": micro_batch_size,
         "global_batch_size": global_batch_size, "grad_scale": grad_scale, "dropout": dropout,
         "model": {"num_layers": 4, "hidden_size": 8, "num_attention_heads": 2, "ffn_hidden_size": 32,
                   "vocab_size": 16, "num_moe_experts": None, "parameters": 1000},
         "nan_check": False}
    m.update(over)
    return m


def split(*groups: str, dim: int | None = None) -> dict[str, Any]:
    """Split over ``groups`` (each on ``dim``, when given: the recorder's ``dims``)."""
    return {"kind": "split", "groups": list(groups), "dims": {} if dim is None else {g: dim for g in groups}}


def full(*groups: str) -> dict[str, Any]:
    return {"kind": "full", "groups": list(groups)}


def partial(*groups: str) -> dict[str, Any]:
    return {"kind": "partial", "groups": list(groups)}


def stats(t: torch.Tensor, layout: dict[str, Any] | None = None) -> dict[str, Any]:
    """msprobe's tensor record with portspeed's float64 statistics and counts."""
    x = t.detach().to(torch.float64)
    n = x.numel()
    return {"type": "torch.Tensor", "dtype": str(t.dtype), "shape": list(t.shape),
            "Max": x.max().item() if n else None, "Min": x.min().item() if n else None,
            "Mean": (x.sum() / n).item() if n else None, "Norm": x.norm().item() if n else None,
            "requires_grad": False, "ps_nan": int(torch.isnan(x).sum()), "ps_inf": int(torch.isinf(x).sum()),
            "ps_layout": layout or full()}


class RankDump:
    """One rank's dump.json for one iteration, built entry by entry in recording order."""

    def __init__(self, run_meta: dict[str, Any], rank: int = 0, iteration: int = 1, **ranks: int) -> None:
        self.meta = copy.deepcopy(run_meta)
        self.meta.update(rank=rank, iteration=iteration)
        self.meta["ranks"] = {**self.meta["ranks"], **ranks}
        self.rank, self.iteration = rank, iteration
        self.data: dict[str, dict[str, Any]] = {}
        self._calls: dict[tuple[str, str], int] = {}

    def _key(self, module: str, cls: str, phase: str) -> str:
        n = self._calls.get((module, phase), 0)
        self._calls[(module, phase)] = n + 1
        return f"Module.{module}.{cls}.{phase}.{n}"

    def _ps(self, module: str, cls: str, phase: str, layer: int, mb: int, **extra: Any) -> dict[str, Any]:
        return {"ps_iteration": self.iteration, "ps_micro_batch": mb, "ps_chunk": 0, "ps_phase": phase,
                "ps_module": module, "ps_class": cls, "ps_local_path": module, "ps_layer": layer,
                "ps_seq": len(self.data), **extra}

    def forward(self, module: str, cls: str, outputs: list[torch.Tensor], *, layer: int, mb: int = 0,
                layout: dict[str, Any] | None = None, expert: int | None = None) -> str:
        extra = {} if expert is None else {"ps_expert": expert}
        key = self._key(module, cls, "forward")
        self.data[key] = {"input_args": [], "input_kwargs": {}, "output": [stats(t, layout) for t in outputs],
                          **self._ps(module, cls, "forward", layer, mb, **extra)}
        return key

    def op(self, module: str, name: str, outputs: list[torch.Tensor], *, layer: int, cls: str = "", index: int = 0,
           mb: int = 0, layout: dict[str, Any] | None = None) -> str:
        """A torch function called inside ``module`` (of class ``cls``): ``index`` is its place in the module call."""
        c = sum(1 for k in self.data if k.startswith(f"Functional.{name}."))
        key = f"Functional.{name}.{c}.forward"
        self.data[key] = {"input_args": [], "input_kwargs": {}, "output": [stats(t, layout) for t in outputs],
                          **self._ps(module, cls, "forward", layer, mb, ps_op=name, ps_op_index=index, ps_call=0)}
        return key

    def backward(self, module: str, cls: str, grads: list[torch.Tensor], *, layer: int, mb: int = 0,
                 layout: dict[str, Any] | None = None, expert: int | None = None) -> str:
        extra = {} if expert is None else {"ps_expert": expert}
        key = self._key(module, cls, "backward")
        self.data[key] = {"input": [stats(t, layout) for t in grads], "output": [],
                          **self._ps(module, cls, "backward", layer, mb, **extra)}
        return key

    def params(self, module: str, cls: str, tensors: dict[str, torch.Tensor], *, layer: int,
               phase: str = "parameters_grad", layout: dict[str, Any] | None = None,
               shard: tuple[int, int, int] | None = None) -> str:
        """``shard`` (start, end, numel): each tensor is that flat slice of its parameter (``ps_shard``)."""
        key = self._key(module, cls, phase)
        extra = {} if shard is None else {"ps_shard": dict(zip(("start", "end", "numel"), shard))}
        self.data[key] = {**{n: [{**stats(t, layout), **extra}] for n, t in tensors.items()},
                          **self._ps(module, cls, phase, layer, -1)}
        return key

    def write(self, root: str | Path) -> Path:
        d = Path(root) / f"step{self.iteration}" / f"rank{self.rank}"
        d.mkdir(parents=True, exist_ok=True)
        doc = {"task": "statistics", "level": "L0" if self.meta["level"] == "module" else "mix",
               "framework": "pytorch", "dump_data_dir": None, "portspeed": self.meta, "data": self.data}
        (d / "dump.json").write_text(json.dumps(doc, indent=1))
        (d / "construct.json").write_text(json.dumps({k: None for k in self.data}))
        return d
