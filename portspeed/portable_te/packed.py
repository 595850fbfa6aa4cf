"""Packed sequences (``qkv_format="thd"``) for the portable ``DotProductAttention``.

Why: with packed sequences (Megatron's ``PackedSeqParams``, sequence packing in SFT and in its
own ``test_attention.py``) the batch is one stream of tokens ``[t, heads, dim]`` holding several
sequences back to back, delimited by ``cu_seqlens_q`` / ``cu_seqlens_kv`` (cumulative lengths,
``[n + 1]``); a token attends only within its own sequence. TE's kernels do this in one call;
here torch's variable-length attention (``torch.nn.attention.varlen.varlen_attn``) does where the
device has a kernel for it (probed once per device type and dtype: on CPU it raises
NotImplementedError) and the call allows it (torch's SDPA serving attention, no dropout, no CP,
no padding between sequences, equal query and key lengths); otherwise it is one call of the
module's attention kernel per sequence, the same arithmetic.

- ``cu_seqlens_*_padded`` (given when each sequence is padded, for instance to a multiple of
  ``2 cp``): sequence ``i`` starts at ``padded[i]`` and its first ``cu[i + 1] - cu[i]`` tokens are
  real; the outputs of padding tokens are zero.
- Masks: ``padding_causal`` (Megatron turns ``causal`` into it for ``thd``) is causal within each
  sequence; ``padding`` / ``no_mask`` let a token see its whole sequence.
- Context parallelism: each CP rank holds ``1 / cp`` of every sequence, its two load-balancing
  chunks (as for unpacked inputs; TE's ``thd_get_partitioned_indices``, which Megatron's
  ``get_thd_batch_on_this_cp_rank`` uses): sequence ``i`` starts at ``cu[i] / cp`` on every rank.
  ``cp_comm_type`` ``p2p`` / ``a2a`` run the ring (``ring.py``, one ring for the whole token stream,
  each step attends every sequence to its own block) where ``ring.ring_serves`` allows;
  ``all_gather`` (and the ring's one fallback, a causal mask over unequal query and key lengths)
  all-gathers keys and values over the CP group (gradients reduce-scattered back) and each sequence's queries attend to
  that sequence's tokens from every rank, masked by global positions. Sequences padded differently from their real
  length are refused with CP (each CP rank's slice of the padding would need TE's exact layout);
  every sequence length must be a multiple of ``2 cp`` (TE asserts the same).

The output is ``[t, heads * dim]``, as TE returns for ``thd``.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

import torch

from . import comm, ring
from .refuse import refuse_if

__all__ = ["cp_positions", "packed_attention", "varlen_supported"]

_log = logging.getLogger(__name__)
_VARLEN: dict[tuple[str, torch.dtype], bool] = {}  # (device type, dtype) -> torch has a varlen kernel there


def cp_positions(local_len: int, cp: int, rank: int, device: torch.device) -> torch.Tensor:
    """Global positions of CP rank ``rank``'s ``local_len`` tokens: chunks ``rank``, ``2 cp - 1 - rank`` of ``2 cp``."""
    if cp == 1:
        return torch.arange(local_len, device=device)
    if local_len % 2:
        raise ValueError(f"context parallelism: a rank's share of a sequence ({local_len} tokens) must split into two "
                         f"equal chunks; use sequence lengths divisible by 2 x the context-parallel size ({2 * cp})")
    c = local_len // 2
    ar = torch.arange(c, device=device)
    return torch.cat((rank * c + ar, (2 * cp - 1 - rank) * c + ar))


def _bounds(cu: torch.Tensor, padded: torch.Tensor | None) -> tuple[list[int], list[int]]:
    """(start, real length) of every sequence in the token stream."""
    lengths = (cu[1:] - cu[:-1]).tolist()
    starts = (padded if padded is not None else cu)[:-1].tolist()
    return [int(s) for s in starts], [int(n) for n in lengths]


def varlen_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``varlen_attn`` runs on this device type and dtype: probed once on a two-token input, then cached."""
    key = (device.type, dtype)
    if key not in _VARLEN:
        ok = False
        try:
            from torch.nn.attention.varlen import varlen_attn

            t = torch.zeros(2, 1, 8, device=device, dtype=dtype)
            cu = torch.tensor([0, 2], dtype=torch.int32, device=device)
            varlen_attn(t, t, t, cu, cu, 2, 2)
            ok = True
        except (ImportError, NotImplementedError, RuntimeError) as exc:
            _log.info("packed sequences on %s %s: one attention per sequence (varlen_attn: %s)", device.type,
                      dtype, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        _VARLEN[key] = ok
    return _VARLEN[key]


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, causal: bool,
            scale: float) -> torch.Tensor:
    """q ``[t, np, hn]``, k / v ``[t, ng, hn]`` (tokens ``cu[-1]:`` are padding): ``[t, np, hn]`` in one call."""
    from torch.nn.attention.varlen import varlen_attn

    total, hq = int(cu[-1]), q.shape[1]
    params = inspect.signature(varlen_attn).parameters
    extra: dict[str, Any] = {}
    if causal:  # torch 2.10 took is_causal, later ones a (left, right) window
        extra.update({"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True})
    if k.shape[1] != hq:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(hq // t.shape[1], dim=1) for t in (k, v))
    cu = cu.to(device=q.device, dtype=torch.int32)
    out = varlen_attn(q[:total], k[:total], v[:total], cu, cu, max_len, max_len, scale=scale, **extra)
    if total < q.shape[0]:
        out = torch.cat((out, out.new_zeros((q.shape[0] - total,) + tuple(out.shape[1:]))))
    return out


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_type: str, scale: float,
                     attend: Callable[..., torch.Tensor], cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor,
                     cu_seqlens_q_padded: torch.Tensor | None = None, cu_seqlens_kv_padded: torch.Tensor | None = None,
                     cp_group: Any = None, cp_size: int = 1, cp_rank: int = 0, varlen: bool = False,
                     cp_comm_type: str | None = "all_gather", dropout_p: float = 0.0,
                     rng_fork: Callable[[], Any] | None = None) -> torch.Tensor:
    """q ``[t, np, hn]``, k / v ``[t, ng, hn]`` (this CP rank's tokens); returns ``[t, np * hv]``.

    ``attend(q, k, v, attn_mask, causal)`` is the module's attention on ``[1, h, s, d]`` tensors (the kernel
    contract's mask, True = may attend; scale and dropout inside); ``varlen`` allows torch's varlen kernel.
    With CP, ``cp_comm_type`` chooses ring or all-gather; the ring applies ``dropout_p`` (the dropout active in this
    call) itself, drawing inside ``rng_fork()`` (the module's RNG tracker fork, or None).
    """
    refuse_if("arbitrary" in mask_type, "arbitrary attention masks with packed sequences",
              "use a causal or padding mask")
    causal = "causal" in mask_type
    sq_starts, sq_lens = _bounds(cu_seqlens_q, cu_seqlens_q_padded)
    sk_starts, sk_lens = _bounds(cu_seqlens_kv, cu_seqlens_kv_padded)
    if len(sq_lens) != len(sk_lens):
        raise ValueError(f"packed sequences: {len(sq_lens)} query sequences but {len(sk_lens)} key/value sequences")
    local_kv = k.shape[0]
    if (varlen and cp_size == 1 and (sq_starts, sq_lens) == (sk_starts, sk_lens) and _back_to_back(sq_starts, sq_lens)
            and q.shape[-1] == v.shape[-1] and varlen_supported(q.device, q.dtype)):
        cu = torch.tensor([0] + [s + n for s, n in zip(sq_starts, sq_lens)], dtype=torch.int32)
        out = _varlen(q, k, v, cu, max(sq_lens), causal, scale)
        return out.reshape(out.shape[0], -1)
    if cp_size > 1:
        for cu, padded in ((cu_seqlens_q, cu_seqlens_q_padded), (cu_seqlens_kv, cu_seqlens_kv_padded)):
            refuse_if(padded is not None and not torch.equal(padded.to(cu.device), cu),
                      "packed sequences padded beyond their length with context parallelism",
                      "pack without padding between sequences (cu_seqlens_padded equal to cu_seqlens)")
        odd = sorted({n for n in sq_lens + sk_lens if n % (2 * cp_size)})
        if odd:
            raise ValueError(f"packed sequences with context parallelism: every sequence length must be a multiple of "
                             f"2 x the context-parallel size ({2 * cp_size}), as Megatron and TE split them into "
                             f"2 x cp chunks; got lengths {odd[:4]}: pack sequences of such lengths")
        sq_starts, sq_lens = [s // cp_size for s in sq_starts], [n // cp_size for n in sq_lens]
        sk_starts, sk_lens = [s // cp_size for s in sk_starts], [n // cp_size for n in sk_lens]
        unequal = next(((a, b) for a, b in zip(sq_lens, sk_lens) if a != b), (0, 0))
        if ring.ring_serves(cp_comm_type, mask_type, dropout_p, *unequal):
            out = ring.ring_attention(*(t.permute(1, 0, 2).unsqueeze(0) for t in (q, k, v)), cp_group, causal=causal,
                                      scale=scale, segments=list(zip(sq_starts, sq_lens, sk_starts, sk_lens)),
                                      dropout_p=dropout_p, rng_fork=rng_fork)
            return out.squeeze(0).permute(1, 0, 2).reshape(q.shape[0], -1)  # [1, np, t, hv] -> [t, np * hv]
        k, v = (comm.gather_sequence(t.contiguous(), cp_group) for t in (k, v))  # [cp * t, ng, hn]
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    pieces = []
    for qs, ql, ks, kl in zip(sq_starts, sq_lens, sk_starts, sk_lens):
        if ql == 0:
            continue
        qi = q[qs:qs + ql]
        kv_rows = [slice(r * local_kv + ks, r * local_kv + ks + kl) for r in range(cp_size)]
        ki = torch.cat([k[s] for s in kv_rows]) if cp_size > 1 else k[ks:ks + kl]
        vi = torch.cat([v[s] for s in kv_rows]) if cp_size > 1 else v[ks:ks + kl]
        allowed, kind = None, None
        if causal and cp_size > 1:
            qpos = cp_positions(ql, cp_size, cp_rank, q.device)
            kpos = torch.cat([cp_positions(kl, cp_size, r, q.device) for r in range(cp_size)])
            allowed = kpos[None, :] <= qpos[:, None]  # a key at or before the query, in global positions
        elif causal:  # bottom-right alignment when the lengths differ (cross attention)
            kind = "top_left" if ql == kl else "bottom_right"
        o = attend(*(t.permute(1, 0, 2).unsqueeze(0) for t in (qi, ki, vi)), allowed, kind)  # [1, np, ql, hv]
        pieces.append((qs, ql, o.squeeze(0).permute(1, 0, 2)))
    if not pieces:
        return out.reshape(out.shape[0], -1)
    rows = torch.cat([torch.arange(qs, qs + ql, device=q.device) for qs, ql, _ in pieces])
    out = out.index_copy(0, rows, torch.cat([o for _, _, o in pieces]))
    return out.reshape(out.shape[0], -1)


def _back_to_back(starts: list[int], lengths: list[int]) -> bool:
    """Sequences back to back from token 0 (no padding between them): what ``varlen_attn``'s ``cu_seq`` describes."""
    if not starts:
        return False
    pos = 0
    for s, n in zip(starts, lengths):
        if s != pos:
            return False
        pos += n
    return True
