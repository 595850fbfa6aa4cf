"""``te.pytorch.DotProductAttention``: scaled dot-product attention on plain torch, as TE's unfused path.

Why this shape: Megatron's ``TEDotProductAttention`` hands TE the query ``[sq, b, np, hn]`` and the
key / value ``[sk, b, ng, hn]`` of this tensor-parallel rank (layout ``sbhd``; ``bshd`` is the
same with the first two dimensions swapped), with ``ng`` key/value groups for grouped-query
attention (``num_gqa_groups``), and expects ``[sq, b, np * hn]`` back. The arithmetic is TE's
unfused one and Megatron's local ``DotProductAttention`` (scores ``q k^T * softmax_scale``, default
``1 / sqrt(kv_channels)``, masked positions out, softmax, dropout on the probabilities, then ``v``),
computed by the kernel serving ``kernel_ops.attention`` (``attention_kernel``): by default torch's
fused ``F.scaled_dot_product_attention`` (``sdpa.attention_torch``), the reference arithmetic with
``PORTSPEED_TE_KERNELS=reference``, or an adapter's declared kernel. Dropout runs inside the RNG
tracker's fork (outside it with sequence parallelism, as TE and Megatron do), only in training.

Masks (``attn_mask_type``): ``causal`` (upper triangle; a mask passed along is not needed),
``padding`` / ``arbitrary`` (the boolean ``attention_mask``, True = masked out), ``padding_causal``
(both), ``no_mask``.

Context parallelism (``cp_group`` of more than one rank, ``--context-parallel-size``): Megatron
gives each CP rank two chunks of every sequence, chunk ``r`` and chunk ``2 cp - 1 - r`` of ``2 cp``
equal chunks (load balance for the causal mask), and keeps the rest of the flow (loss, RoPE slices,
gradients) itself. Here (``_context_parallel``, the one CP call site) the key and value chunks
are all-gathered over the CP group (their gradients reduce-scattered back,
``comm.gather_sequence``) and the local queries attend to the whole sequence, the causal mask
built from the chunks' global positions: the all-gather form of context parallelism, for
``cp_comm_type`` ``all_gather`` (the same arithmetic as every other form: the communication pattern
is not visible in the result). ``p2p`` and ``a2a`` go instead to the ring (``ring.py``: key/value
blocks passed rank to rank, ``2 / cp`` of the sequence's keys and values per rank) unless
``ring.ring_serves`` says why not.
Hierarchical ``a2a+p2p`` (a list of groups) and padding masks with CP are refused.

Packed sequences (``qkv_format="thd"`` with ``cu_seqlens_q`` / ``_kv`` and their padded forms):
``packed.py``: torch's variable-length kernel where the device has one, else one attention per
sequence. Refused: sliding windows, non-vanilla softmax, attention bias, max-logit reporting,
fp8 attention.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from . import comm, ring, sdpa
from .base import PortableModule, check_config
from .packed import cp_positions, packed_attention
from .refuse import refuse, refuse_if

__all__ = ["DotProductAttention", "attention_kernel"]

#: the packed-sequence forward arguments (Megatron's PackedSeqParams fields TE takes)
_PACKED = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")
_MASK_TYPES = ("causal", "padding", "padding_causal", "no_mask", "arbitrary", "causal_bottom_right",
               "padding_causal_bottom_right")


_KERNELS: Any = None  # the op registry module once looked up (False: not in this tree, SDPA serves)


def attention_kernel() -> Callable[..., torch.Tensor]:
    """The implementation serving ``kernel_ops.attention``: the registry's choice (vendor, torch or reference,
    ``PORTSPEED_TE_KERNELS``), or torch's SDPA where the registry module is absent. Looked up once per process."""
    global _KERNELS
    if _KERNELS is None:
        try:
            from . import kernels as registry
        except ImportError:
            registry = False
        _KERNELS = registry
    return _KERNELS.kernel("attention") if _KERNELS else sdpa.attention_torch


def _mask_and_causal(mask_type: str, attention_mask: torch.Tensor | tuple | None) -> tuple[torch.Tensor | None,
                                                                                          str | None]:
    """Megatron's mask (True = masked out) and mask type -> the kernel contract's (True = may attend, causal)."""
    mask = None
    if mask_type in ("padding", "padding_causal", "arbitrary", "padding_causal_bottom_right"):
        if isinstance(attention_mask, tuple):
            refuse_if(attention_mask[0] is not attention_mask[1], "separate query/key padding masks", "pass one")
            attention_mask = attention_mask[0]
        mask = None if attention_mask is None else ~attention_mask
    causal = None
    if "causal" in mask_type:
        causal = "bottom_right" if "bottom_right" in mask_type else "top_left"
    return mask, causal


class DotProductAttention(PortableModule):
    """See the module docstring."""

    def __init__(self, num_attention_heads: int, kv_channels: int | tuple[int, int], num_gqa_groups: int | None = None,
                 attention_dropout: float = 0.0, qkv_format: str = "sbhd", attn_mask_type: str = "causal",
                 window_size: Any = None, sequence_parallel: bool = False, tp_size: int = 1,
                 get_rng_state_tracker: Callable | None = None, tp_group: Any = None, layer_number: int | None = None,
                 attention_type: str = "self", softmax_scale: float | None = None, **options: Any) -> None:
        super().__init__()
        check_config(self)
        self.set_context_parallel_group(options.pop("cp_group", None), options.pop("cp_global_ranks", None),
                                        options.pop("cp_stream", None), options.pop("cp_comm_type", "p2p"))
        refuse_if(window_size not in (None, (-1, -1), (-1, 0)), "sliding-window attention (--window-size)",
                  "drop --window-size")
        refuse_if(options.pop("softmax_type", "vanilla") != "vanilla",
                  "softmax types other than vanilla (--softmax-type)", "use --softmax-type vanilla")
        refuse_if(options.pop("return_max_logit", False), "max attention logits (--qk-clip, --log-max-attention-logit)",
                  "drop --qk-clip / --log-max-attention-logit")
        for key, value in options.items():
            refuse_if(value is not None, f"the Transformer Engine attention option {key}={value!r}",
                      f"do not pass {key}")
        if qkv_format not in ("sbhd", "bshd", "thd"):
            refuse(f"qkv_format={qkv_format!r}", "use sbhd, bshd or thd")
        if attn_mask_type not in _MASK_TYPES:
            refuse(f"attn_mask_type={attn_mask_type!r}", f"use one of {', '.join(_MASK_TYPES)}")
        tp = int(tp_size or 1)
        self.num_attention_heads = num_attention_heads
        self.num_gqa_groups = num_gqa_groups or num_attention_heads
        if self.num_attention_heads % self.num_gqa_groups:
            raise ValueError(f"num_attention_heads {num_attention_heads} is not a multiple of num_gqa_groups "
                             f"{self.num_gqa_groups}")
        self.heads_per_partition = num_attention_heads // tp
        self.groups_per_partition = max(self.num_gqa_groups // tp, 1)
        k_ch = kv_channels[0] if isinstance(kv_channels, tuple) else kv_channels
        self.kv_channels = kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k_ch)
        self.qkv_format, self.attn_mask_type, self.attention_type = qkv_format, attn_mask_type, attention_type
        self.layer_number, self.tp_group, self.sequence_parallel = layer_number, tp_group, sequence_parallel
        self.attention_dropout = torch.nn.Dropout(attention_dropout)
        self.get_rng_state_tracker = get_rng_state_tracker

    def set_context_parallel_group(self, cp_group: Any, cp_global_ranks: Any = None, cp_stream: Any = None,
                                   cp_comm_type: str | None = "p2p") -> None:
        """TE's API (Megatron calls it at build time and for dynamic CP): None or a group of one turns CP off."""
        if isinstance(cp_group, (list, tuple)):
            refuse(f"hierarchical context parallelism (cp_comm_type={cp_comm_type!r})",
                   "use --cp-comm-type p2p, all_gather or a2a")
        if cp_comm_type not in (None, "p2p", "all_gather", "a2a"):
            refuse(f"context parallelism with cp_comm_type={cp_comm_type!r}",
                   "use --cp-comm-type p2p, all_gather or a2a")
        self.cp_group, self.cp_comm_type = cp_group, cp_comm_type
        self.cp_size = comm.group_size(cp_group) if cp_group is not None else 1

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        """Load; a state dict without this module's ``_extra_state`` is complete, as with Transformer Engine.

        Why: Megatron's ``TEDotProductAttention.sharded_state_dict`` (read at core_v0.16.1, core_v0.19.0) puts nothing
        of the attention in a distributed checkpoint (only the learnable softmax offset, when there is one), so
        the state dict a dist-checkpoint load hands to ``load_state_dict`` has no ``...core_attention._extra_state``.
        NVIDIA's ``DotProductAttention`` keeps the key in ``state_dict()`` (its base module's fp8 metadata) and
        drops it from the missing keys when loading (a load-state-dict post hook); without the same, every strict
        load of a TE-spec model from a distributed checkpoint fails ("Missing key(s) in state_dict:
        ...core_attention._extra_state"). Only this module's own key is dropped, and only when it is absent.
        """
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        key = prefix + "_extra_state"
        if key not in state_dict and key in missing_keys:
            missing_keys.remove(key)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                causal: str | None) -> torch.Tensor:
        """The attention kernel on ``[b, h, s, d]``; dropout (training only) inside the RNG tracker's fork, outside
        it with sequence parallelism or without a tracker (as TE and Megatron do)."""
        p = self.attention_dropout.p if self.training else 0.0
        fn = attention_kernel()
        if p > 0.0 and not self.sequence_parallel and self.get_rng_state_tracker is not None:
            with self.get_rng_state_tracker().fork():
                return fn(q, k, v, attn_mask=attn_mask, causal=causal, scale=self.softmax_scale, dropout_p=p)
        return fn(q, k, v, attn_mask=attn_mask, causal=causal, scale=self.softmax_scale, dropout_p=p)

    def _dropout_fork(self) -> Callable[[], Any] | None:
        """The RNG tracker's ``fork`` that dropout draws in (ring CP), None where ``_attend`` draws outside one."""
        p = self.attention_dropout.p if self.training else 0.0
        if p > 0.0 and not self.sequence_parallel and self.get_rng_state_tracker is not None:
            return self.get_rng_state_tracker().fork
        return None

    def _varlen_allowed(self) -> bool:
        """Packed sequences may go to torch's variable-length kernel: SDPA serves attention and no dropout runs."""
        fn = attention_kernel()
        fn = getattr(fn, "__ps_served__", fn)  # the kernel under a probe's recording wrapper (kernels.served)
        return fn is sdpa.attention_torch and (not self.training or self.attention_dropout.p == 0.0)

    def forward(self, query_layer: torch.Tensor, key_layer: torch.Tensor, value_layer: torch.Tensor,
                attention_mask: torch.Tensor | tuple | None = None, qkv_format: str | None = None,
                attn_mask_type: str | None = None, **options: Any) -> torch.Tensor:
        refuse_if(options.pop("core_attention_bias_type", "no_bias") != "no_bias", "attention bias", "drop it")
        refuse_if(options.pop("core_attention_bias", None) is not None, "attention bias", "drop it")
        packed = {key: options.pop(key, None) for key in _PACKED}
        for key in ("max_seqlen_q", "max_seqlen_kv", "pad_between_seqs"):
            options.pop(key, None)  # sizes and a hint for TE's kernels: the sequences are read from cu_seqlens
        for key, value in options.items():
            refuse_if(value is not None, f"the Transformer Engine attention forward option {key}", f"do not pass {key}")
        fmt = qkv_format or self.qkv_format
        mask_type = attn_mask_type or self.attn_mask_type
        if fmt == "thd":
            refuse_if(packed["cu_seqlens_q"] is None or packed["cu_seqlens_kv"] is None,
                      "qkv_format='thd' without cu_seqlens_q / cu_seqlens_kv", "pass Megatron's PackedSeqParams")
            return packed_attention(query_layer, key_layer, value_layer, mask_type, self.softmax_scale,
                                    self._attend, varlen=self._varlen_allowed(), cp_group=self.cp_group,
                                    cp_size=self.cp_size,
                                    cp_rank=_rank_in(self.cp_group) if self.cp_size > 1 else 0,
                                    cp_comm_type=self.cp_comm_type,
                                    dropout_p=self.attention_dropout.p if self.training else 0.0,
                                    rng_fork=self._dropout_fork(), **packed)
        if fmt not in ("sbhd", "bshd"):
            refuse(f"qkv_format={fmt!r}", "use sbhd, bshd or thd")
        refuse_if(any(v is not None for v in packed.values()), "cu_seqlens with qkv_format sbhd/bshd",
                  "pass qkv_format='thd' for packed sequences")
        if fmt == "sbhd":  # -> [b, h, s, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query_layer, key_layer, value_layer))
        else:
            q, k, v = (t.permute(0, 2, 1, 3) for t in (query_layer, key_layer, value_layer))
        if self.cp_size > 1:
            refuse_if("padding" in mask_type or mask_type == "arbitrary",
                      f"attention masks of type {mask_type!r} with context parallelism", "use a causal or no mask")
            out = self._context_parallel(q, k, v, mask_type)
        else:
            out = self._attend(q, k, v, *_mask_and_causal(mask_type, attention_mask))  # [b, np, sq, hv]
        if fmt == "sbhd":
            out = out.permute(2, 0, 1, 3)
        else:
            out = out.permute(0, 2, 1, 3)
        return out.reshape(out.shape[0], out.shape[1], -1)

    def _context_parallel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_type: str) -> torch.Tensor:
        """Attention of this CP rank's queries ``[b, np, s_local, d]`` over the whole sequence (the one CP call site).

        The all-gather form: keys and values gathered over the CP group, the causal mask from the chunks' global
        positions; ``all_gather`` takes it, ``p2p`` / ``a2a`` take the ring where ``ring.ring_serves`` allows.
        """
        p = self.attention_dropout.p if self.training else 0.0
        if ring.ring_serves(self.cp_comm_type, mask_type, p, q.shape[2], k.shape[2]):
            return ring.ring_attention(q, k, v, self.cp_group, causal="causal" in mask_type, scale=self.softmax_scale,
                                       dropout_p=p, rng_fork=self._dropout_fork())
        cp, rank = self.cp_size, _rank_in(self.cp_group)
        k, v = (self._gather_over_cp(t) for t in (k, v))
        mask = None
        if "causal" in mask_type:
            qpos = cp_positions(q.shape[2], cp, rank, q.device)
            kpos = torch.cat([cp_positions(q.shape[2], cp, i, q.device) for i in range(cp)])
            mask = kpos[None, :] <= qpos[:, None]  # a key at or before the query, in global positions
        return self._attend(q, k, v, mask, None)

    def _gather_over_cp(self, t: torch.Tensor) -> torch.Tensor:
        """``[b, h, s_local, d]`` -> ``[b, h, cp * s_local, d]`` in CP-rank order; gradients reduce-scattered back."""
        seq_first = t.permute(2, 0, 1, 3).contiguous()
        return comm.gather_sequence(seq_first, self.cp_group).permute(1, 2, 0, 3)


def _rank_in(group: Any) -> int:
    """This process's rank in ``group``."""
    import torch.distributed as dist

    return dist.get_rank(group)

