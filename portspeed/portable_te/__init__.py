"""portspeed's portable Transformer Engine: what Megatron-Core calls of ``transformer_engine.pytorch``, on plain torch.

Why: Megatron-LM's default ``--transformer-impl transformer_engine`` builds every GPT layer from
Transformer Engine modules, and NVIDIA's TE has no build off CUDA. This plugin implements the
API subset Megatron's TE integration (``megatron/core/extensions/transformer_engine.py``) uses
for a dense GPT, on torch operations that run on any adapter, and refuses, by name, what it does
not implement. It is portspeed's, and never poses as NVIDIA's package: it is served only to the
Megatron modules that build TE layers (``serve.IMPORTERS``), by the declared patch
``megatron.core.transformer_engine.portable`` (``patches/megatron/core_portable_te.py``), and
never when a Transformer Engine is installed. See docs/transformer-engine.md.

Modules: ``linear`` (Linear, LayerNormLinear: column / row parallel, sequence parallel,
fuse_wgrad_accumulation), ``norms`` (LayerNorm, RMSNorm), ``attention`` (DotProductAttention),
``rope`` (rotary embedding, for ``apply_rope_fusion``), ``rng`` (the RNG tracker, checkpoint),
``comm`` (the tensor-parallel autograd collectives),
``base`` (device placement, ``_extra_state``), ``refuse`` (the refusals), ``version`` (the version
reported per megatron-core release), ``namespace`` (the served module tree), ``serve`` (the reach).
"""

from __future__ import annotations

__all__: list[str] = []
