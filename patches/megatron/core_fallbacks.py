"""Megatron-Core defaults that need a CUDA kernel fall back to the torch path, with one log line each.

On an adapter that does not run CUDA natively ``TransformerConfig.__post_init__`` turns
off the options whose only implementation is a CUDA kernel (or apex / Transformer Engine,
which have no CPU build), before Megatron validates the config; ``core_common.note_fallback``
logs each one once per process. ``WrappedTorchNorm`` (the torch LayerNorm used without apex)
accepts ``sequence_parallel`` by marking its parameters the way Megatron's fused norms do,
so ``finalize_model_grads`` all-reduces their gradients across the tensor-parallel group.

**The torch path is not always the same function.** What changes, read from
megatron-core's own code (``FALLBACKS`` says it per option, and the log line repeats it):

- ``gradient_accumulation_fusion``: the kernel (``wgrad_gemm_accum_fp32``) adds the
  weight-gradient GEMM's fp32 result straight into ``main_grad``; the torch path computes
  ``grad_output.t() @ input`` in the parameter dtype and DDP's hook adds it to
  ``main_grad``. In bf16/fp16 training each micro-batch's weight gradient is therefore
  rounded to bf16/fp16 before it is accumulated (in fp32 training nothing changes).
- ``masked_softmax_fusion``: the kernel runs only for fp16/bf16 scores and always computes
  in fp32. The torch path upcasts to fp32 only when ``attention_softmax_in_fp32`` (the
  default) is set, and otherwise computes softmax in the input dtype; even upcast, its
  backward uses the fp32 probabilities where the kernel's uses the fp16/bf16-rounded ones.
- ``bias_activation_fusion`` with GELU: the fused ``bias_gelu`` is the tanh approximation;
  the unfused path is ``F.gelu`` (exact erf), up to 4.7e-4 apart per element, in any dtype.
  SwiGLU computes the same function fused or not.
- the others compute the same function in another order (rounding may differ in the
  last bits); they were not compared bit for bit.
"""

from __future__ import annotations

import copy
from typing import Any

from portspeed.accelerator.conditions import translated
from portspeed.patching.record import WRAP, Patch

from .core_common import note_fallback
from .ranges import CORE, DISTRIBUTION

__all__ = ["FALLBACKS", "PATCHES"]

#: config field -> why it falls back, and what the torch path changes numerically (see the module docstring).
FALLBACKS: dict[str, str] = {
    "masked_softmax_fusion": "scaled_masked_softmax_cuda is a CUDA extension; torch softmax is used: in fp16/bf16 it "
                             "upcasts to fp32 only with attention_softmax_in_fp32 (the default), and its backward "
                             "uses fp32 probabilities where the kernel used fp16/bf16-rounded ones",
    "persist_layer_norm": "the persistent LayerNorm is an apex CUDA kernel; torch LayerNorm is used",
    "memory_efficient_layer_norm": "memory-efficient LayerNorm is an apex CUDA kernel; torch LayerNorm is used",
    "gradient_accumulation_fusion": "fused_weight_gradient_mlp_cuda is a CUDA extension; torch computes each weight "
                                    "gradient in the parameter dtype before DDP adds it to main_grad, so in fp16/bf16 "
                                    "it is rounded to that dtype first (the kernel accumulated the fp32 GEMM result)",
    "bias_activation_fusion": "bias-gelu/swiglu fusion compiles a CUDA/Triton kernel; unfused torch ops are used "
                              "(GELU: exact erf instead of the fused tanh approximation, up to 4.7e-4 apart)",
    "bias_dropout_fusion": "bias-dropout-add fusion compiles a CUDA/Triton kernel; unfused torch ops are used",
    "apply_rope_fusion": "fused RoPE is a Transformer Engine / CUDA kernel; torch RoPE is used",
    "cross_entropy_loss_fusion": "fused cross entropy compiles a CUDA/Triton kernel; torch cross entropy is used",
}


def config_post_init(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Turn CUDA-kernel-only options off before Megatron's own validation runs."""
    for field, why in FALLBACKS.items():
        if getattr(instance, field, False):
            object.__setattr__(instance, field, False)
            note_fallback(field, why)
    return wrapped(*args, **kwargs)


def torch_norm_new(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """WrappedTorchNorm(config, ...) with sequence_parallel: build the norm, mark its params sequence-parallel."""
    config = args[0] if args else kwargs.get("config")
    if config is None or not getattr(config, "sequence_parallel", False):
        return wrapped(*args, **kwargs)
    plain = copy.copy(config)
    object.__setattr__(plain, "sequence_parallel", False)
    if args:
        args = (plain,) + tuple(args[1:])
    else:
        kwargs = dict(kwargs, config=plain)
    norm = wrapped(*args, **kwargs)
    for p in norm.parameters():
        setattr(p, "sequence_parallel", True)
    return norm


_COMMON = dict(distribution=DISTRIBUTION, versions=CORE, when=translated)

PATCHES: list[Patch] = [
    Patch(name="megatron.core.fallbacks.config",
          target="megatron.core.transformer.transformer_config:TransformerConfig.__post_init__",
          kind=WRAP, impl=config_post_init,
          reason="options whose only implementation is a CUDA kernel fall back to Megatron's torch path off CUDA; "
                 "in fp16/bf16 that path rounds each weight gradient to the parameter dtype before accumulating it "
                 "(gradient_accumulation_fusion) and computes softmax in the input dtype unless "
                 "attention_softmax_in_fp32 (masked_softmax_fusion); fused bias-GELU was the tanh approximation, "
                 "the torch path is exact GELU",
          **_COMMON),
    Patch(name="megatron.core.fallbacks.torch_norm_sp", target="megatron.core.transformer.torch_norm:WrappedTorchNorm",
          kind=WRAP, impl=torch_norm_new,
          reason="without apex the torch LayerNorm refuses sequence parallelism; mark its params so their grads are "
                 "all-reduced over TP",
          **_COMMON),
]
