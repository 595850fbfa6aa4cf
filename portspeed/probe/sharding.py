"""How each recorded tensor is spread over the ranks of a parallel group: one table, module type + config.

Why from the module type and the config, not from parameter attributes: an output has no such
attribute, and what matters for comparing two layouts is how Megatron computes the output
(a column-parallel linear's output is split on its last dim; a row-parallel one is reduced to a
full copy, reduce-scattered on the sequence under sequence parallelism, or left a partial sum
with explicit expert communication). The compare combines split statistics exactly, compares
full copies rank by rank and refuses partial and unknown entries across layouts.

A layout is ``{"kind": "full" | "split" | "partial" | "unknown", "groups": [...], "dims": {...}}``:
``groups`` lists the groups of size > 1 the tensor is spread over (split or partial) or, for
``full``, copied over; a group of size > 1 that is not listed holds full copies; ``dims`` gives
the split dimension per group (negative: from the end). Under TP1 / CP1 / EP1 everything is full.

Megatron's activations are ``[sequence, batch, hidden]`` inside the decoder, ``[batch,
sequence, hidden]`` out of the embeddings' lookups; context parallelism splits the sequence into
chunks in Megatron's load-balanced order (the compare knows the order, the layout says the dim).
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Parallel", "UNKNOWN", "output_layout", "param_layout", "op_layout", "unknown", "grad_layout", "FULL"]

FULL = "full"
UNKNOWN = "unknown"

_COLUMN = {"ColumnParallelLinear", "TEColumnParallelLinear", "TELayerNormColumnParallelLinear"}
_ROW = {"RowParallelLinear", "TERowParallelLinear"}
_CORE_ATTENTION = {"DotProductAttention", "TEDotProductAttention"}
#: outputs shaped [s, b, h] (the residual stream and what keeps its shape): split on the sequence under SP
_HIDDEN = {"TransformerLayer", "TransformerBlock", "LanguageModelEmbedding", "MoELayer", "FusedLayerNorm",
           "WrappedTorchNorm", "LayerNorm", "RMSNorm", "TENorm", "FusedRMSNorm", "L2Norm", "Dropout", "IdentityOp"}
#: modules whose first output is their row-parallel linear's (Attention: linear_proj; MLP: linear_fc2)
_ROW_OWNERS = {"SelfAttention": "linear_proj", "CrossAttention": "linear_proj", "Attention": "linear_proj",
               "MLP": "linear_fc2"}
#: [tokens, ...] of this rank's (SP-local) tokens
_TOKENWISE = {"TopKRouter", "Router"}
#: [b, s, h] lookups
_LOOKUP_BS = {"Embedding"}
_NORMS = {"FusedLayerNorm", "WrappedTorchNorm", "LayerNorm", "RMSNorm", "TENorm", "FusedRMSNorm", "L2Norm"}


@dataclasses.dataclass(frozen=True)
class Parallel:
    """The parallel sizes a layout depends on (Megatron's names; 1 and False without Megatron)."""

    tp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    dp: int = 1
    sp: bool = False
    distributed_optimizer: bool = False


def _make(split: dict[str, int], partial: list[str], full: list[str], p: Parallel) -> dict[str, Any]:
    sizes = {"tp": p.tp, "cp": p.cp, "ep": p.ep, "dp": p.dp}
    split = {g: d for g, d in split.items() if sizes[g] > 1}
    partial = [g for g in partial if sizes[g] > 1]
    if partial:
        return {"kind": "partial", "groups": partial + [g for g in split if g not in partial],
                "dims": split}
    if split:
        return {"kind": "split", "groups": list(split), "dims": split}
    return {"kind": FULL, "groups": [g for g in full if sizes[g] > 1], "dims": {}}


def _unknown(p: Parallel) -> dict[str, Any]:
    if p.tp == 1 and p.cp == 1 and p.ep == 1:
        return {"kind": FULL, "groups": [], "dims": {}}
    return {"kind": UNKNOWN, "groups": [g for g, n in (("tp", p.tp), ("cp", p.cp), ("ep", p.ep)) if n > 1],
            "dims": {}}


def _row(module: Any, p: Parallel) -> dict[str, Any]:
    if getattr(module, "explicit_expert_comm", False):
        return _make({"cp": 0}, ["tp"], [], p)
    if p.sp:
        return _make({"tp": 0, "cp": 0}, [], [], p)
    return _make({"cp": 0}, [], ["tp"], p)


#: modules known by their place (the last segment of their path) whatever their class
_HEADS = {"q_layernorm", "k_layernorm"}  # [s, b, heads, head_dim]: this rank's heads
_PROBS = {"scale_mask_softmax", "attention_dropout"}  # [b, heads, sq, sk]: attention probabilities


def unknown(p: Parallel) -> dict[str, Any]:
    """An input's layout, or any tensor with no rule: full when nothing is parallel, else unknown."""
    return _unknown(p)


def output_layout(module: Any, index: int, p: Parallel, name: str = "") -> dict[str, Any]:
    """The layout of output ``index`` (0-based over the module's flattened outputs) of ``module``, whose path
    ends in ``name``."""
    cls = type(module).__name__
    if name in _HEADS:
        return _make({"tp": -2, "cp": 0}, [], [], p)
    if name in _PROBS or cls == "FusedScaleMaskSoftmax":
        return _make({"tp": 1}, [], [], p)
    if cls in _COLUMN:
        if index == 0:
            return _make({"tp": -1, "cp": 0}, [], [], p)
        return _make({"tp": 0}, [], [], p)  # the bias handed back (skip_bias_add): this rank's shard
    if cls in _ROW:
        if index == 0:
            return _row(module, p)
        return _make({}, [], ["tp"], p)  # the bias handed back: not split
    if cls in _ROW_OWNERS:
        inner = getattr(module, _ROW_OWNERS[cls], None)
        if inner is not None and type(inner).__name__ in _ROW:
            return _row(inner, p) if index == 0 else _make({}, [], ["tp"], p)
        return _unknown(p)
    if cls in _CORE_ATTENTION:
        return _make({"tp": -1, "cp": 0}, [], [], p)  # heads are the last dim's blocks
    if cls in _HIDDEN:
        return _make({"tp": 0, "cp": 0} if p.sp else {"cp": 0}, [], [] if p.sp else ["tp"], p)
    if cls in _TOKENWISE:
        return _make({"tp": 0, "cp": 0} if p.sp else {"cp": 0}, [], [] if p.sp else ["tp"], p)
    if cls == "VocabParallelEmbedding":
        if getattr(module, "reduce_scatter_embeddings", False):
            return _make({"tp": 0, "cp": 1}, [], [], p)  # transposed to [s, b, h] and reduce-scattered
        return _make({"cp": 1}, [], ["tp"], p)
    if cls in _LOOKUP_BS:
        return _make({"cp": 1}, [], ["tp"], p)
    if cls == "RotaryEmbedding":
        return _make({"cp": 0}, [], ["tp"], p)
    return _unknown(p)


def grad_layout(module: Any, index: int, p: Parallel, name: str = "") -> dict[str, Any]:
    """The layout of the gradient of output ``index``: the output's, except for the bias a linear layer hands back
    (``skip_bias_add``: output 1 of a linear, of ``SelfAttention`` and ``MLP``): it is added to this rank's tokens
    only, so its gradient is a sum over them, partial over cp, and over tp where the output is split on the
    sequence (a row-parallel linear under sequence parallelism)."""
    cls = type(module).__name__
    owner = getattr(module, _ROW_OWNERS[cls], None) if cls in _ROW_OWNERS else module
    kind = type(owner).__name__
    if index > 0 and (kind in _ROW or kind in _COLUMN):
        partial = (["tp"] if p.sp and kind in _ROW else []) + ["cp"]
        out = output_layout(module, index, p, name)
        split = {g: d for g, d in out.get("dims", {}).items() if g not in partial}
        made = _make(split, partial, out["groups"] if out["kind"] == FULL else [], p)
        if made["kind"] == "partial":
            return made
    return output_layout(module, index, p, name)


def param_layout(module: Any, name: str, p: Parallel, *, shard: bool = False) -> dict[str, Any]:
    """The layout of parameter ``name`` of ``module`` (its gradient and its value); ``shard``: this rank holds
    the distributed optimizer's shard of it (split over dp)."""
    cls = type(module).__name__
    dp = {"dp": 0} if shard else {}
    full_dp = [] if shard else ["dp"]
    if cls in _COLUMN and name in ("weight", "bias"):
        return _make({"tp": 0, **dp}, [], full_dp, p)
    if cls in _ROW and name == "weight":
        return _make({"tp": 1, **dp}, [], full_dp, p)
    if cls == "VocabParallelEmbedding" and name == "weight":
        return _make({"tp": 0, **dp}, [], full_dp, p)
    if (cls in _ROW and name == "bias") or cls in _NORMS or cls in _LOOKUP_BS or cls in _TOKENWISE \
            or (cls in _COLUMN and name.startswith("layer_norm")):
        return _make(dp, [], ["tp", *full_dp], p)
    if p.tp == 1 and p.ep == 1:
        return _make(dp, [], full_dp, p)
    return {"kind": UNKNOWN, "groups": [g for g, n in (("tp", p.tp), ("ep", p.ep)) if n > 1], "dims": {}}


def op_layout(module: Any, reduced: bool, p: Parallel) -> dict[str, Any]:
    """The layout of an op's output inside ``module`` (None: outside any module): inside a row-parallel linear
    a partial sum until its reduce (``reduced``: a collective ran in this call already), inside a
    column-parallel one split, inside a norm the norm's output layout; anything else unknown across layouts."""
    if module is None:
        return _unknown(p)
    cls = type(module).__name__
    if cls in _ROW:
        return output_layout(module, 0, p) if reduced else _make({"cp": 0}, ["tp"], [], p)
    if cls in _COLUMN or cls in _NORMS:
        return output_layout(module, 0, p)
    return _unknown(p)
