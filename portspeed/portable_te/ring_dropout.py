"""Attention dropout inside the ring (``ring.py``): one key/value block at a time, the global softmax kept.

Why its own block arithmetic: the ``attention_lse`` kernel contract has no dropout, and attention
dropout acts on the probabilities of the *whole* row (``softmax`` over every key of the sequence),
which no block sees. It still factors over blocks: with the block's keep mask ``M`` (Bernoulli
``1 - p``) and ``D = M / (1 - p)``, the block returns ``sum_j exp(s_j - lse_b) D_j v_j`` with the
log-sum-exp ``lse_b`` of its *undropped* scores, and the ring's log-sum-exp merge turns the blocks
into ``sum_j softmax(s)_j D_j v_j`` over the whole row: dropout of the globally normalised
probabilities, exactly. The backward with the final ``out`` and ``lse`` is the reference one with
``dP = D * (dO v^T)``; ``rowsum(dO * out)`` is still the softmax term because ``out`` already
carries ``D``.

What "correct" means here (TE's ring and the all-gather form cannot agree bit for bit: a mask is
drawn per block, not per row of the gathered sequence, so the random stream is laid out
differently): given the masks the ring drew, output and gradients equal the single-process
attention with those masks placed at the blocks' global positions (``tests/test_te_ring.py``,
within 1e-5 fp32); the keep rate is ``1 - p``; a fixed tracker seed gives the same masks
(deterministic, and recomputed checkpoints see the same ones, since the masks are drawn inside
the RNG tracker's fork as the all-gather form's are); the backward uses the forward's masks
(kept as booleans, one byte per query-key pair that a block covers: a quarter of the float32
probabilities the all-gather form's math path keeps).

The blocks run in explicit float32 arithmetic (the score block of ``[b, h, s_local, s_local]``
materialised): dropout sends the all-gather form to SDPA's math path on CPU too.
"""

from __future__ import annotations

import torch

from .sdpa import causal_allowed

__all__ = ["dropout_mask", "dropout_block", "dropout_block_backward"]


def dropout_mask(shape: torch.Size, p: float, device: torch.device) -> torch.Tensor:
    """Boolean keep mask (True with probability ``1 - p``) from the current default generator of ``device``."""
    return torch.rand(shape, device=device) >= p


def _expand(t: torch.Tensor, hq: int) -> torch.Tensor:
    return t if t.shape[1] == hq else t.repeat_interleave(hq // t.shape[1], dim=1)


def _reduce(g: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[b, hq, s, d]`` -> ``[b, hkv, s, d]`` (the gradient of ``_expand``)."""
    b, hq, s, d = g.shape
    return g if hq == hkv else g.reshape(b, hkv, hq // hkv, s, d).sum(dim=2)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    s = torch.matmul(q.float(), _expand(k, q.shape[1]).float().transpose(-2, -1)) * scale
    if causal:
        s = s.masked_fill(~causal_allowed(q.shape[2], k.shape[2], False, q.device), float("-inf"))
    return s


def dropout_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, p: float, *, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One block with dropout: ``(out in q's dtype, lse float32 of the undropped scores)``; see the module docstring."""
    with torch.no_grad():
        s = _scores(q, k, causal, scale)
        lse = torch.logsumexp(s, dim=-1)
        probs = torch.exp(s - lse.unsqueeze(-1)) * keep / (1.0 - p)
        out = torch.matmul(probs, _expand(v, q.shape[1]).float())
    return out.to(q.dtype), lse


def dropout_block_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           out: torch.Tensor, lse: torch.Tensor, keep: torch.Tensor, p: float, *, causal: bool,
                           scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's share of the gradient of the merged, dropped-out attention (final ``out`` and ``lse``)."""
    hq = q.shape[1]
    with torch.no_grad():
        ke, ve = _expand(k, hq).float(), _expand(v, hq).float()
        do = grad_out.float()
        probs = torch.exp(_scores(q, k, causal, scale) - lse.float().unsqueeze(-1))  # this block's share of softmax
        drop = keep / (1.0 - p)
        dv = torch.matmul((probs * drop).transpose(-2, -1), do)
        delta = (do * out.float()).sum(dim=-1, keepdim=True)
        ds = probs * (torch.matmul(do, ve.transpose(-2, -1)) * drop - delta)
        dq = torch.matmul(ds, ke) * scale
        dk = torch.matmul(ds.transpose(-2, -1), q.float()) * scale
    return dq.to(q.dtype), _reduce(dk, k.shape[1]).to(k.dtype), _reduce(dv, v.shape[1]).to(v.dtype)
