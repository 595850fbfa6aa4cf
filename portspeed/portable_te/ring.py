"""Context parallelism as a ring: key/value blocks travel rank to rank, partial attentions merge by log-sum-exp.

Why a ring: the all-gather form (``comm.gather_sequence``) gives every context-parallel rank the
whole sequence's keys and values, the memory of CP1. Here each rank keeps its own key/value
block and one in flight (about ``2 / cp`` of the sequence's keys and values) and attends its
queries to one block at a time, as Transformer Engine's ``p2p`` context parallelism does.

Layout (Megatron's load balancing): the sequence is ``2 cp`` equal chunks and CP rank ``r`` holds
chunk ``r`` then chunk ``2 cp - 1 - r`` (``packed.cp_positions``). With a causal mask, step ``i``
attends to the block of rank ``s = (r - i) mod cp``:

- ``s == r`` (step 0): the two local chunks are in increasing global order, so plain top-left
  causal attention over the local tokens is exact;
- ``s < r``: both local query chunks come after chunk ``s`` and before chunk ``2 cp - 1 - s``:
  all queries against the first half of the block, no mask;
- ``s > r``: only the second query chunk (``2 cp - 1 - r``) sees the block, and sees all of it.

Without a mask every step is a full block. Blocks go through the kernel registry
(``kernels.kernel("attention_lse")`` and its backward, contracts in
``portspeed.accelerator.kernel_ops``); partial outputs merge in float32:
``lse = max + log1p(exp(min - max))``, ``out = sum_i out_i * exp(lse_i - lse)``.

Packed sequences (``thd``, ``packed.py``): every sequence is split the same way (TE's
``thd_get_partitioned_indices``, which Megatron's ``get_thd_batch_on_this_cp_rank`` calls): rank
``r`` holds chunks ``r`` and ``2 cp - 1 - r`` of each sequence, sequences back to back, so a
sequence starts at the same local offset on every rank. The ring then carries the whole local
token stream (one message per step, as unpacked) and each step runs the rule above once per
sequence (``segments``: local query start and length, key start and length), merging per
sequence; tokens outside every sequence (padding at the end of the stream) get zeros.

Attention dropout (training): the blocks run ``ring_dropout.py``'s explicit arithmetic with a keep
mask per block drawn inside the RNG tracker's fork; the merge above then gives dropout of the
whole row's softmax (see there for what is and is not equal to the all-gather form).

Backward (its own autograd function): each block's gradient is computed with the *final* output and
log-sum-exp; ``dq`` stays local, the key/value gradient of a block is accumulated in float32 as it
follows its block around the ring, one hop behind it, and arrives at its owner after the last step.

Message order: every exchange is one ``batch_isend_irecv`` holding exactly one send (to the next
rank) and one receive (from the previous rank), each a single packed buffer (keys and values, and
the travelling gradient, in one message); an exchange is waited for before the next is posted, and
every rank posts the same sequence of exchanges. So between any two ranks at most one message per
direction is ever in flight, and nothing can be matched to the wrong receive on a backend that
matches by posting order regardless of tags (Gloo: ``patches/megatron/core_p2p.py``), even at CP2
where the previous and the next rank are the same. Even ranks post the send first, odd ranks the
receive first, so a backend whose sends block until received cannot deadlock either.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.distributed as dist

from . import ring_dropout

__all__ = ["ring_attention", "ring_serves", "merge_partial", "block_kernels", "Segment"]

log = logging.getLogger("portspeed.portable_te")
_told: set[str] = set()  # fallbacks already logged in this process

#: one sequence in this rank's tokens: (query start, query length, key start, key length)
Segment = tuple[int, int, int, int]
Kernels = tuple[Callable[..., tuple[torch.Tensor, torch.Tensor]], Callable[..., tuple[torch.Tensor, ...]]]


def block_kernels() -> Kernels:
    """The registry's ``attention_lse`` and ``attention_lse_backward`` (vendor -> torch -> reference)."""
    from .kernels import kernel  # the per-op registry; imported late: it reads the active adapter's declarations

    return kernel("attention_lse"), kernel("attention_lse_backward")


def ring_serves(cp_comm_type: str | None, mask_type: str, dropout_p: float, sq: int, sk: int) -> bool:
    """Whether the ring serves this context-parallel attention (else the all-gather form does).

    ``p2p`` (Megatron's default) and ``a2a`` take the ring (``a2a``: TE's head all-to-all keeps ``1 / cp`` of the
    keys and values per rank, as the ring does, and both give the same arithmetic); ``all_gather`` keeps the
    all-gather form. With attention dropout the ring runs its own block arithmetic (``ring_dropout.py``; the
    ``attention_lse`` kernel contract has no dropout), said once.
    """
    if cp_comm_type == "all_gather":
        return False
    if "causal" in mask_type and sq != sk:
        _once("sq!=sk", f"portspeed: ring context parallelism needs as many queries as keys with a causal mask "
                        f"(got {sq} and {sk}); the all-gather form serves")
        return False
    if dropout_p > 0.0:
        _once("dropout", "portspeed: ring context parallelism with attention dropout: the blocks run in explicit "
                         "float32 arithmetic with their dropout masks (the fused block kernels have no dropout)",
              logging.INFO)
    if "ring" not in _told:
        _told.add("ring")
        log.info("portspeed: context parallelism (cp_comm_type %s) runs as a ring of key/value blocks", cp_comm_type)
    return True


def _once(key: str, message: str, level: int = logging.WARNING) -> None:
    if key not in _told:
        _told.add(key)
        log.log(level, message)


def merge_partial(out_acc: torch.Tensor, lse_acc: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold one block's ``(out, lse)`` into the float32 accumulators, in place (rows with a finite lse)."""
    new = torch.maximum(lse_acc, lse) + torch.log1p(torch.exp(-(lse_acc - lse).abs()))
    out_acc.mul_(torch.exp(lse_acc - new).unsqueeze(-1)).add_(out.float() * torch.exp(lse - new).unsqueeze(-1))
    lse_acc.copy_(new)


class _Packer:
    """One flat buffer holding several tensors (one message per exchange); bytes when the dtypes differ."""

    def __init__(self, specs: Sequence[tuple[torch.Size, torch.dtype]], device: torch.device) -> None:
        dtypes = {dtype for _, dtype in specs}
        self.dtype = dtypes.pop() if len(dtypes) == 1 else torch.uint8
        self.device, self.specs = device, list(specs)
        # widest items first, so every byte offset is aligned for the dtype stored there
        order = sorted(range(len(specs)), key=lambda i: -specs[i][1].itemsize)
        offset, slots = 0, {}
        for i in order:
            shape, dtype = specs[i]
            n = math.prod(shape) * (dtype.itemsize if self.dtype == torch.uint8 else 1)
            slots[i] = (offset, n)
            offset += n
        self.slots, self.numel = [slots[i] for i in range(len(specs))], offset

    def empty(self) -> torch.Tensor:
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def view(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        """Tensor ``i`` of ``buf`` (a view: writing it writes the buffer)."""
        offset, n = self.slots[i]
        shape, dtype = self.specs[i]
        flat = buf[offset:offset + n]
        return (flat.view(dtype) if self.dtype == torch.uint8 else flat).view(shape)

    def span(self, buf: torch.Tensor, first: int, last: int) -> torch.Tensor:
        """The contiguous part of ``buf`` holding tensors ``first..last`` (laid out next to each other)."""
        lo = min(self.slots[i][0] for i in range(first, last + 1))
        hi = max(self.slots[i][0] + self.slots[i][1] for i in range(first, last + 1))
        return buf[lo:hi]


class _Ring:
    """This rank's place in the CP group: global ranks of its neighbours, and the exchange."""

    def __init__(self, group: Any) -> None:
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group)
        self.next, self.prev = ranks[(self.rank + 1) % self.size], ranks[(self.rank - 1) % self.size]

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> list:
        """Post one send to the next rank and one receive from the previous (see the module docstring)."""
        if self.size == 1:  # a ring of one: the message comes straight back
            recv.copy_(send)
            return []
        ops = [dist.P2POp(dist.isend, send, self.next, self.group), dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return dist.batch_isend_irecv(ops if self.rank % 2 == 0 else ops[::-1])


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _block(step: int, ring: _Ring, causal: bool, half: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) of step ``step``'s block (see the module docstring)."""
    every = slice(None)
    if not causal:
        return every, every, False
    if step == 0:
        return every, every, True
    src = (ring.rank - step) % ring.size
    return (every, slice(0, half), False) if src < ring.rank else (slice(half, None), every, False)


def _within(sub: slice, start: int, length: int) -> slice:
    """``sub`` (relative to a sequence of ``length`` tokens) as rows of the token stream, the sequence at ``start``."""
    lo, hi, _ = sub.indices(length)
    return slice(start + lo, start + hi)


def _steps(step: int, ring: _Ring, causal: bool, segments: Sequence[Segment]) -> list[tuple[slice, slice, bool]]:
    """(query rows, key rows, causal) of step ``step``'s block of every sequence, in the token stream."""
    blocks = []
    for qs, ql, ks, kl in segments:
        if ql == 0 or kl == 0:
            continue
        rows, keys, blk_causal = _block(step, ring, causal, ql // 2)
        blocks.append((_within(rows, qs, ql), _within(keys, ks, kl), blk_causal))
    return blocks


def _rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
    """Sequence rows of ``[b, h, s, d]`` (or ``[b, h, s]``)."""
    return t[:, :, rows]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, causal: bool,
                scale: float, kernels: Kernels, segments: tuple[Segment, ...], dropout_p: float,
                rng_fork: Callable[[], ContextManager] | None) -> torch.Tensor:
        fwd, _ = kernels
        masks: list[torch.Tensor] = []  # with dropout: each block's keep mask, in the order the blocks run
        ring = _Ring(group)
        kv = _Packer([(k.shape, k.dtype), (v.shape, v.dtype)], k.device)
        cur, spare = kv.empty(), kv.empty()
        kv.view(cur, 0).copy_(k)
        kv.view(cur, 1).copy_(v)
        # float32 accumulators: one sequence of every row (unpacked) starts from its step-0 block (no extra buffer
        # alive during that block's kernel); packed ones start from zeros (rows outside every sequence, padding at
        # the end of the stream, stay zero)
        whole = segments == ((0, q.shape[2], 0, k.shape[2]),)
        out_acc = None if whole else q.new_zeros(q.shape[:3] + v.shape[3:], dtype=torch.float32)
        lse_acc = None if whole else q.new_zeros(q.shape[:3], dtype=torch.float32)
        for step in range(ring.size):
            works = ring.exchange(cur, spare) if step + 1 < ring.size else []  # the next block, during this one
            kb, vb = (k, v) if step == 0 else (kv.view(cur, 0), kv.view(cur, 1))
            for rows, keys, blk_causal in _steps(step, ring, causal, segments):
                qb, kbb, vbb = _rows(q, rows), _rows(kb, keys), _rows(vb, keys)
                if dropout_p > 0.0:
                    with rng_fork() if rng_fork is not None else contextlib.nullcontext():
                        masks.append(ring_dropout.dropout_mask(qb.shape[:3] + kbb.shape[2:3], dropout_p, q.device))
                    out, lse = ring_dropout.dropout_block(qb, kbb, vbb, masks[-1], dropout_p, causal=blk_causal,
                                                          scale=scale)
                else:
                    out, lse = fwd(qb, kbb, vbb, causal=blk_causal, scale=scale)
                if out_acc is None:
                    out_acc, lse_acc = out.float(), lse.float().clone()
                elif step == 0:  # every query row of a sequence is in its step-0 block
                    _rows(out_acc, rows).copy_(out)
                    _rows(lse_acc, rows).copy_(lse)
                else:
                    merge_partial(_rows(out_acc, rows), _rows(lse_acc, rows), out, lse.float())
                del out, lse  # not alive during the next block's kernel (peak memory)
            _wait(works)
            cur, spare = spare, cur
        if out_acc is None:  # no token on this rank
            out_acc = q.new_zeros(q.shape[:3] + v.shape[3:], dtype=torch.float32)
            lse_acc = q.new_zeros(q.shape[:3], dtype=torch.float32)
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse_acc)
        ctx.group, ctx.causal, ctx.scale, ctx.kernels, ctx.segments = group, causal, scale, kernels, segments
        ctx.dropout_p, ctx.masks = dropout_p, masks
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        _, bwd = ctx.kernels
        ring = _Ring(ctx.group)
        # one message: the block's keys and values (slots 0, 1) and the float32 gradient of the block
        # one hop behind it (slots 2, 3); the gradient slots are laid out first (widest dtype first)
        msg = _Packer([(k.shape, k.dtype), (v.shape, v.dtype), (k.shape, torch.float32), (v.shape, torch.float32)],
                      k.device)
        cur, spare = msg.empty(), msg.empty()
        msg.view(cur, 0).copy_(k)
        msg.view(cur, 1).copy_(v)
        kv_span = (lambda buf: msg.span(buf, 0, 1))
        grad_span = (lambda buf: msg.span(buf, 2, 3))
        whole = ctx.segments == ((0, q.shape[2], 0, k.shape[2]),)
        dq = None if whole else torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # as out_acc above
        masks = iter(ctx.masks)  # the forward's keep masks, in the same block order
        last = ring.size - 1
        for step in range(ring.size):
            # the exchange carries: step 0 the keys/values only (nothing has a gradient yet), the last step the
            # gradient only (no later block), the steps between both
            if step == 0:
                works = ring.exchange(kv_span(cur), kv_span(spare))
            elif step == last:
                works = ring.exchange(grad_span(cur), grad_span(spare))
            else:
                works = ring.exchange(cur, spare)
            kb, vb = (k, v) if step == 0 else (msg.view(cur, 0), msg.view(cur, 1))
            grads = []
            for rows, keys, blk_causal in _steps(step, ring, ctx.causal, ctx.segments):
                blk = (_rows(grad_out, rows), _rows(q, rows), _rows(kb, keys), _rows(vb, keys), _rows(out, rows),
                       _rows(lse, rows))
                if ctx.dropout_p > 0.0:
                    dq_b, dk_b, dv_b = ring_dropout.dropout_block_backward(*blk, next(masks), ctx.dropout_p,
                                                                           causal=blk_causal, scale=ctx.scale)
                else:
                    dq_b, dk_b, dv_b = bwd(*blk, causal=blk_causal, scale=ctx.scale)
                if dq is None:
                    dq = dq_b.float()
                else:
                    _rows(dq, rows).add_(dq_b)
                grads.append((keys, dk_b, dv_b))
                del dq_b, dk_b, dv_b
            _wait(works)
            dk_acc, dv_acc = msg.view(spare, 2), msg.view(spare, 3)  # the gradient so far of the block just computed
            if step == 0:
                dk_acc.zero_()
                dv_acc.zero_()
            for keys, dk_b, dv_b in grads:
                _rows(dk_acc, keys).add_(dk_b.float())
                _rows(dv_acc, keys).add_(dv_b.float())
            grads = dk_b = dv_b = None  # none alive during the next block's kernel (peak memory)
            cur, spare = spare, cur
        if dq is None:  # no token on this rank
            dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        # the last block computed here belongs to the next rank: send its finished gradient home, get ours
        _wait(ring.exchange(grad_span(cur), grad_span(spare)))
        dk, dv = msg.view(spare, 2).to(k.dtype), msg.view(spare, 3).to(v.dtype)
        return dq.to(q.dtype), dk, dv, None, None, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, *, causal: bool, scale: float,
                   kernels: Kernels | None = None, segments: Sequence[Segment] | None = None,
                   dropout_p: float = 0.0, rng_fork: Callable[[], ContextManager] | None = None) -> torch.Tensor:
    """Attention of this CP rank's queries over the whole sequence, key/value blocks passed around the ring.

    ``q`` ``[b, hq, s, d]``, ``k`` / ``v`` ``[b, hkv, s, d]``: this rank's ``s`` tokens (its two chunks, see
    the module docstring); ``causal`` is the causal mask over global positions. ``segments`` (packed sequences,
    ``b`` 1): each sequence's local query and key rows, every sequence attended on its own; default one sequence
    of all rows. ``dropout_p`` > 0: attention dropout (``ring_dropout.py``), the masks drawn inside ``rng_fork()``
    (Megatron's RNG tracker's ``fork``, or the default generator without one). Returns ``[b, hq, s, d]`` in
    ``q``'s dtype; differentiable. ``kernels`` (the block forward and backward) defaults to the registry's.
    """
    if segments is None:
        segments = ((0, q.shape[2], 0, k.shape[2]),)
    for qs, ql, ks, kl in segments:
        if causal and ql % 2:
            raise ValueError(f"ring context parallelism: a rank's share of a sequence ({ql} tokens) must split into "
                             f"two equal chunks; use sequence lengths divisible by 2 x the context-parallel size")
        if causal and ql != kl:
            raise ValueError(f"ring context parallelism with a causal mask needs as many keys as queries per rank "
                             f"(got {ql} queries, {kl} keys)")
        if qs < 0 or ks < 0 or qs + ql > q.shape[2] or ks + kl > k.shape[2]:
            raise ValueError(f"ring context parallelism: sequence rows {qs}:{qs + ql} / {ks}:{ks + kl} outside this "
                             f"rank's {q.shape[2]} query / {k.shape[2]} key tokens")
    # no contiguous copies: the key/value message buffer is one already, and the kernels take strided blocks
    return _RingAttention.apply(q, k, v, group, causal, scale, kernels if kernels is not None else block_kernels(),
                                tuple(tuple(int(x) for x in seg) for seg in segments), float(dropout_p), rng_fork)
