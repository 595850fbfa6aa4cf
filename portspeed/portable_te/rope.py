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
changes nothing: which arithmetic runs is the kernel registry's choice (``kernels``, op ``rope``:
a vendor's fused RoPE, else ``rope_torch``, the rotation written into one output, else
``rope_reference``, the formula above over fp32 copies).

Packed sequences (``tensor_format="thd"``, ``t`` ``[t, h, d]`` with ``cu_seqlens``, Megatron's
``fused_apply_rotary_pos_emb_thd``): every sequence's positions start at 0; with context parallelism
(``cp_size`` > 1) each sequence holds ``1 / cp`` of its tokens here, the CP rank's two
load-balancing chunks, whose global positions pick the frequencies.

Refused, naming what avoids it: context parallelism on unpacked inputs (Megatron slices the
frequencies itself there and never asks), ``start_positions`` (inference with per-sequence offsets).
"""

from __future__ import annotations

from typing import Any

import torch

from .kernels import kernel
from .packed import cp_positions
from .refuse import refuse, refuse_if

__all__ = ["apply_rotary_pos_emb", "rope_reference", "rope_torch"]


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
    refuse_if(start_positions is not None, "rotary embedding with start_positions", "do not pass start_positions")
    for key, value in options.items():
        refuse_if(value is not None, f"the Transformer Engine rotary embedding option {key}={value!r}",
                  f"do not pass {key}")
    if tensor_format == "thd":
        refuse_if(cu_seqlens is None, "rotary embedding in tensor_format='thd' without cu_seqlens", "pass cu_seqlens")
        return _packed(t, freqs, cu_seqlens, interleaved, int(cp_size or 1), int(cp_rank or 0))
    if tensor_format not in ("sbhd", "bshd"):
        refuse(f"rotary embedding in tensor_format={tensor_format!r}", "use sbhd, bshd or thd")
    refuse_if(cu_seqlens is not None, "cu_seqlens with tensor_format sbhd/bshd", "pass tensor_format='thd'")
    refuse_if(int(cp_size or 1) > 1, "context parallelism in the fused rotary embedding of unpacked inputs",
              "use --context-parallel-size 1, or packed (thd) inputs")
    seq_dim = 0 if tensor_format == "sbhd" else 1
    seq = t.shape[seq_dim]
    if freqs.shape[0] < seq:
        raise ValueError(f"freqs cover {freqs.shape[0]} positions, the input has {seq}")
    f = freqs[:seq].float()  # [s, 1, 1, r]
    if tensor_format == "bshd":
        f = f.transpose(0, 1)  # [1, s, 1, r]
    return _rotated(t, f, interleaved)


def _packed(t: torch.Tensor, freqs: torch.Tensor, cu_seqlens: torch.Tensor, interleaved: bool, cp: int,
            rank: int) -> torch.Tensor:
    """``t`` ``[t, h, d]``: each packed sequence rotated from position 0 (its CP rank's chunks' positions)."""
    lengths = ((cu_seqlens[1:] - cu_seqlens[:-1]) // cp).tolist()
    if sum(lengths) != t.shape[0]:
        raise ValueError(f"cu_seqlens {cu_seqlens.tolist()} (over {cp} CP ranks) cover {sum(lengths)} tokens, "
                         f"the input has {t.shape[0]}")
    out = []
    for piece, n in zip(torch.split(t, lengths), lengths):
        pos = cp_positions(int(n), cp, rank, t.device)
        if n and int(pos.max()) >= freqs.shape[0]:
            raise ValueError(f"freqs cover {freqs.shape[0]} positions, a packed sequence needs {int(pos.max()) + 1}")
        out.append(_rotated(piece.unsqueeze(1), freqs[pos].float(), interleaved).squeeze(1))
    return torch.cat(out) if out else t


def _rotated(t: torch.Tensor, f: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The first ``f.shape[-1]`` channels of ``t`` rotated by the angles ``f`` (broadcast), in fp32, cast back."""
    rot = f.shape[-1]
    if rot > t.shape[-1] or rot % 2:
        raise ValueError(f"rotary dimension {rot} does not fit the head dimension {t.shape[-1]}")
    return kernel("rope")(t, f, interleaved=interleaved)


def rope_reference(t: torch.Tensor, freqs: torch.Tensor, *, interleaved: bool) -> torch.Tensor:
    """The ``rope`` contract as first written: ``x cos + rotate(x) sin`` over fp32 copies, concatenated."""
    rot = freqs.shape[-1]
    x, rest = t[..., :rot], t[..., rot:]
    xf = x.float()
    out = (xf * torch.cos(freqs) + _rotate(xf, interleaved) * torch.sin(freqs)).to(t.dtype)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def rope_torch(t: torch.Tensor, freqs: torch.Tensor, *, interleaved: bool) -> torch.Tensor:
    """The ``rope`` contract written into one output: no rotated copy, no concatenation.

    Each half (or each of the even / odd channels) is computed once as ``a cos - b sin`` /
    ``b cos + a sin`` in fp32 and stored into its channels of ``out``; the pass-through channels are
    copied once. Equal to ``rope_reference`` bit for bit (``a + (-b) s`` is ``a - b s`` in IEEE).
    """
    rot = freqs.shape[-1]
    out = torch.empty_like(t)
    if rot < t.shape[-1]:
        out[..., rot:] = t[..., rot:]
    cos, sin = torch.cos(freqs), torch.sin(freqs)
    if interleaved:
        first, second = slice(0, rot, 2), slice(1, rot, 2)
    else:
        first, second = slice(0, rot // 2), slice(rot // 2, rot)
    a, b = t[..., first].float(), t[..., second].float()
    out[..., first] = a * cos[..., first] - b * sin[..., first]
    out[..., second] = b * cos[..., second] + a * sin[..., second]
    return out
