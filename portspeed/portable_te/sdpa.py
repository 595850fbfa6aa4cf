"""Attention kernels for the portable Transformer Engine: torch's fused SDPA, and the reference it is checked against.

Why: ``F.scaled_dot_product_attention`` is the one attention every serious device backend implements
(flash / memory-efficient / cuDNN on CUDA, the CPU flash kernel, a PrivateUse1 device's
``_scaled_dot_product_fused_attention_overrideable``), so routing the portable TE through it makes
a port fast without knowing the device. The reference (TE's unfused arithmetic: scores, masked
positions set to -10000, softmax in fp32, dropout on the probabilities) stays as the checked
fallback and the oracle (``PORTSPEED_TE_KERNELS=reference``).

Each function has the signature of its contract in ``portspeed.accelerator.kernel_ops``:

- ``attention_torch`` / ``attention_reference``: the boolean mask is True where a position **may**
  attend (SDPA's convention); ``causal`` None, ``"top_left"`` or ``"bottom_right"``. A row with
  nothing to attend gives the mean of ``v`` over all keys (what the reference's -10000 fill gives),
  whichever kernel runs: such rows are opened for the kernel (so its backward sees finite values)
  and replaced by that mean, which costs one reduction over the mask and one ``where``.
- ``attention_lse_*`` and ``attention_lse_backward_*``: one block with its float32 log-sum-exp, and
  the block's gradient given the *final* (merged) ``out`` and ``lse``, for ring context
  parallelism. The torch versions call the aten ops that return the log-sum-exp (CPU flash; CUDA
  flash, else memory-efficient with its lse padded to a multiple of 32); elsewhere the reference.
  The aten ops need equal head counts: grouped K/V are expanded, and dK / dV summed back per group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["attention_torch", "attention_reference", "attention_lse_torch", "attention_lse_reference",
           "attention_lse_backward_torch", "attention_lse_backward_reference", "causal_allowed", "torch_unavailable"]

#: ``enable_gqa=`` reached torch in 2.5
_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def _causal_lower_right(sq: int, sk: int) -> object | None:
    """torch's bottom-right causal bias (a fused variant on CUDA, a materialised mask elsewhere), or None.

    Imported at first use: ``torch.nn.attention.bias`` pulls in torch's inductor (about a second on the
    2-core machine), which Megatron's TE path pays only when it asks for a bottom-right mask.
    """
    try:
        from torch.nn.attention.bias import causal_lower_right
    except ImportError:  # pragma: no cover - torch < 2.3
        return None
    return causal_lower_right(sq, sk)
_HALF = (torch.float16, torch.bfloat16)


#: device types with an aten SDPA op that returns the log-sum-exp (and its backward given out and lse)
_LSE_DEVICES = ("cpu", "cuda")


def torch_unavailable(op: str, device_type: str) -> str | None:
    """Why the torch implementation of attention op ``op`` cannot serve on ``device_type`` (None: it can).

    The kernel registry (``kernels.py``) asks once per op: SDPA itself runs on every device (a vendor's fused
    kernel or torch's math path), the log-sum-exp ops exist per device only.
    """
    if op in ("attention_lse", "attention_lse_backward") and device_type not in _LSE_DEVICES:
        return (f"torch has no SDPA op returning the log-sum-exp on {device_type!r} (only on "
                f"{', '.join(_LSE_DEVICES)}); declare attention_lse in the adapter's kernels() for a fused ring")
    return None


def causal_allowed(sq: int, sk: int, bottom_right: bool, device: torch.device | None = None) -> torch.Tensor:
    """``[sq, sk]`` True where query ``i`` may see key ``j``: ``j <= i`` (top-left) or ``j <= i + sk - sq``."""
    offset = sk - sq if bottom_right else 0
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(diagonal=offset)


def _expand_heads(t: torch.Tensor, hq: int) -> torch.Tensor:
    return t if t.shape[1] == hq else t.repeat_interleave(hq // t.shape[1], dim=1)


def _native_gqa(q: torch.Tensor, attn_mask: object) -> bool:
    """Pass grouped K/V to SDPA as they are (``enable_gqa``) where that reaches a fused kernel; else expand them.

    CUDA: only flash and cuDNN take GQA (fp16/bf16, no mask); the memory-efficient kernel does not, so torch
    would fall back to its math path: expanding K/V keeps the efficient kernel. CPU: the flash kernel takes
    GQA (measured faster than an expansion, docs/transformer-engine.md). Other devices: torch hands the
    vendor's overrideable kernel K/V with fewer heads, its documented contract.
    """
    if not _HAS_GQA:
        return False
    if q.device.type == "cuda":
        return q.dtype in _HALF and attn_mask is None
    return True


def attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask: torch.Tensor | None,
                    causal: str | None, scale: float, dropout_p: float) -> torch.Tensor:
    """``kernel_ops.attention`` through ``F.scaled_dot_product_attention`` (see the module docstring)."""
    hq, sq, sk = q.shape[1], q.shape[2], k.shape[2]
    is_causal = False
    mask: object = attn_mask
    if causal == "top_left" and attn_mask is None:
        is_causal = True
    elif causal == "bottom_right" and attn_mask is None and sq <= sk and \
            (bias := _causal_lower_right(sq, sk)) is not None:
        mask = bias  # no row is empty when sq <= sk
    elif causal is not None:
        allowed = causal_allowed(sq, sk, causal == "bottom_right", q.device)
        mask = allowed if attn_mask is None else (attn_mask & allowed)
    dead = None
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:  # (a CausalBias is a float tensor subclass)
        dead = ~mask.any(dim=-1, keepdim=True)  # [..., sq, 1]: rows with nothing to attend
        if q.device.type == "cpu" and not bool(dead.any()):  # a free check on the host; elsewhere no sync
            dead = None
        else:
            mask = mask | dead  # open them for the kernel; replaced below
    gqa = k.shape[1] != hq
    if gqa and not _native_gqa(q, mask):
        k, v = _expand_heads(k, hq), _expand_heads(v, hq)
        gqa = False
    extra = {"enable_gqa": True} if gqa else {}
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                         scale=scale, **extra)
    if dead is not None:
        mean_v = _expand_heads(v.mean(dim=-2, keepdim=True), hq).to(out.dtype)  # [b, hq, 1, dv]
        out = torch.where(dead, mean_v, out)
    return out


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask: torch.Tensor | None,
                        causal: str | None, scale: float, dropout_p: float) -> torch.Tensor:
    """``kernel_ops.attention`` as TE's unfused path: ``softmax(q k^T * scale, masked = -10000) v``, in fp32."""
    hq, sq, sk = q.shape[1], q.shape[2], k.shape[2]
    k, v = _expand_heads(k, hq), _expand_heads(v, hq)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    allowed = attn_mask
    if causal is not None:
        tri = causal_allowed(sq, sk, causal == "bottom_right", q.device)
        allowed = tri if allowed is None else (allowed & tri)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -10000.0)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    return torch.matmul(probs, v)


# --- one block with its log-sum-exp (ring context parallelism) -------------------------------------------------


def _flash_cuda_ok(q: torch.Tensor, k: torch.Tensor, causal: bool) -> bool:
    """CUDA's flash op: fp16/bf16, head dim <= 256 and a multiple of 8; its causal is bottom-right, so square only."""
    d = q.shape[-1]
    return q.dtype in _HALF and d <= 256 and d % 8 == 0 and (not causal or q.shape[2] == k.shape[2])


def attention_lse_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernel_ops.attention_lse`` through the per-device aten SDPA op that returns the log-sum-exp."""
    hq, sq = q.shape[1], q.shape[2]
    dev = q.device.type
    if dev not in _LSE_DEVICES:
        return attention_lse_reference(q, k, v, causal=causal, scale=scale)
    ke, ve = _expand_heads(k, hq), _expand_heads(v, hq)
    with torch.no_grad():
        if dev == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, ke, ve, 0.0, causal, scale=scale)
        elif _flash_cuda_ok(q, k, causal):
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, ke, ve, 0.0, causal, False,
                                                                          scale=scale)[:2]
        else:
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, ke, ve, None, True, 0.0, causal,
                                                                              scale=scale)[:2]
            lse = lse[..., :sq]  # padded to a multiple of 32 on CUDA
    return out, lse.float()


def attention_lse_backward_torch(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 out: torch.Tensor, lse: torch.Tensor, *, causal: bool,
                                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kernel_ops.attention_lse_backward`` through the aten backward op of the forward's kernel."""
    hq, sq, sk = q.shape[1], q.shape[2], k.shape[2]
    dev = q.device.type
    if dev not in _LSE_DEVICES:
        return attention_lse_backward_reference(grad_out, q, k, v, out, lse, causal=causal, scale=scale)
    ke, ve = _expand_heads(k, hq), _expand_heads(v, hq)
    grad_out, out = grad_out.to(q.dtype), out.to(q.dtype)
    lse = lse.float().contiguous()
    with torch.no_grad():
        if dev == "cpu":
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out, q, ke, ve, out, lse, 0.0, causal, scale=scale)
        elif _flash_cuda_ok(q, k, causal):
            none = torch.empty((), dtype=torch.int64, device=q.device)  # philox state: unused without dropout
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(  # no cu_seqlens: not varlen
                grad_out, q, ke, ve, out, lse, None, None, sq, sk, 0.0, causal, none, none, scale=scale)
        else:
            pad = -sq % 32
            lse_p = F.pad(lse, (0, pad)) if pad else lse
            none = torch.empty((), dtype=torch.int64, device=q.device)
            dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                grad_out, q, ke, ve, None, out, lse_p, none, none, 0.0, [True, True, True, False], causal,
                scale=scale)
    return dq, _sum_groups(dk, k.shape[1]), _sum_groups(dv, v.shape[1])


def _sum_groups(g: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[b, hq, s, d]`` -> ``[b, hkv, s, d]``: the gradient of ``repeat_interleave`` over the head dimension."""
    b, hq, s, d = g.shape
    return g if hq == hkv else g.reshape(b, hkv, hq // hkv, s, d).sum(dim=2)


def _block_scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """fp32 scores ``q k^T * scale`` with -inf where top-left causal forbids (every row keeps key 0)."""
    s = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    if causal:
        s = s.masked_fill(~causal_allowed(q.shape[2], k.shape[2], False, q.device), float("-inf"))
    return s


def attention_lse_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernel_ops.attention_lse`` in explicit fp32 arithmetic."""
    hq = q.shape[1]
    with torch.no_grad():
        s = _block_scores(q, _expand_heads(k, hq), causal, scale)
        lse = torch.logsumexp(s, dim=-1)
        out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), _expand_heads(v, hq).float())
    return out.to(q.dtype), lse


def attention_lse_backward_reference(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     out: torch.Tensor, lse: torch.Tensor, *, causal: bool,
                                     scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kernel_ops.attention_lse_backward`` in explicit fp32 arithmetic: with the final ``lse`` the block's
    probabilities are its share of the merged softmax, and ``rowsum(dO * O)`` uses the merged output."""
    hq = q.shape[1]
    with torch.no_grad():
        ke, ve = _expand_heads(k, hq).float(), _expand_heads(v, hq).float()
        do = grad_out.float()
        p = torch.exp(_block_scores(q, ke, causal, scale) - lse.float().unsqueeze(-1))  # [b, hq, sq, sk]
        dv = torch.matmul(p.transpose(-2, -1), do)
        delta = (do * out.float()).sum(dim=-1, keepdim=True)
        ds = p * (torch.matmul(do, ve.transpose(-2, -1)) - delta)
        dq = torch.matmul(ds, ke) * scale
        dk = torch.matmul(ds.transpose(-2, -1), q.float()) * scale
    return (dq.to(q.dtype), _sum_groups(dk, k.shape[1]).to(k.dtype), _sum_groups(dv, v.shape[1]).to(v.dtype))

