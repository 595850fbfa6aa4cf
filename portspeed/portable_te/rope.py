"""``te.pytorch.attention.rope.apply_rotary_pos_emb``: rotary position embedding on plain torch.

Why: Megatron's ``apply_rope_fusion`` (on by default in Megatron-LM's arguments for RoPE models,
``--no-rope-fusion`` turns it off) takes its fused RoPE from Transformer Engine
(``megatron.core.extensions.transformer_engine.fused_apply_rotary_pos_emb``); without it
``TransformerConfig`` raises "apply_rope_fusion is not available. Please install TE >= 1.4." and
the attention asserts "apply_rope_fusion is not available." The fusion is a kernel detail: the
result is the rotation every RoPE implementation computes, written here once in torch operations.

What it computes: ``t`` is ``[s, b, h, d]`` (``sbhd``) or ``[b, s, h, d]`` (``bshd``) and
``freqs`` ``[s', 1, 1, r]`` with ``s' >= s`` (the first ``s`` positions are used); the first ``r``
channels of ``t`` are rotated, the rest pass through: ``t * cos(freqs) + rotate(t) * sin(freqs)``,
where ``rotate`` pairs the two halves of the ``r`` channels (``[-x2, x1]``) or, with
``interleaved``, neighbouring channels (``(x0, x1) -> (-x1, x0)``). The arithmetic is done in fp32
and the result cast back to ``t``'s dtype, as TE's fused kernel does. ``fused`` is accepted and
changes nothing (there is one implementation).

Refused, naming what avoids it: packed sequences (``thd`` / ``cu_seqlens``), context parallelism
(``cp_size > 1``), ``start_positions`` (inference with per-sequence offsets).
"""

from __future__ import annotations

from typing import Any

import torch

from .refuse import refuse, refuse_if

__all__ = ["apply_rotary_pos_emb"]


def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if not interleaved:
        first, second = x.chunk(2, dim=-1)
        return torch.cat((-second, first), dim=-1)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd",
                         start_positions: torch.Tensor | None = None, interleaved: bool = False,
                         fused: bool = False, cu_seqlens: torch.Tensor | None = None, cp_size: int = 1,
                         cp_rank: int = 0, **options: Any) -> torch.Tensor:
    """See the module docstring."""
    if tensor_format == "thd" or cu_seqlens is not None:
        refuse("rotary embedding of packed sequences (thd, cu_seqlens)", "use unpacked sbhd/bshd inputs")
    if tensor_format not in ("sbhd", "bshd"):
        refuse(f"rotary embedding in tensor_format={tensor_format!r}", "use sbhd or bshd")
    refuse_if(int(cp_size or 1) > 1, "context parallelism in the fused rotary embedding (--context-parallel-size > 1)",
              "use --context-parallel-size 1")
    refuse_if(start_positions is not None, "rotary embedding with start_positions", "do not pass start_positions")
    for key, value in options.items():
        refuse_if(value is not None, f"the Transformer Engine rotary embedding option {key}={value!r}",
                  f"do not pass {key}")
    seq_dim = 0 if tensor_format == "sbhd" else 1
    seq = t.shape[seq_dim]
    if freqs.shape[0] < seq:
        raise ValueError(f"freqs cover {freqs.shape[0]} positions, the input has {seq}")
    f = freqs[:seq].float()  # [s, 1, 1, r]
    if tensor_format == "bshd":
        f = f.transpose(0, 1)  # [1, s, 1, r]
    rot = f.shape[-1]
    if rot > t.shape[-1] or rot % 2:
        raise ValueError(f"rotary dimension {rot} does not fit the head dimension {t.shape[-1]}")
    x, rest = t[..., :rot], t[..., rot:]
    xf = x.float()
    out = (xf * torch.cos(f) + _rotate(xf, interleaved) * torch.sin(f)).to(t.dtype)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
