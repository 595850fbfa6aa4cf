"""``validate_args`` off CUDA: CUDA-kernel defaults fall back to torch paths, and the CUDA launch-queue check.

A GPU user's command line leaves three CUDA-kernel options at Megatron's defaults, and
each one stops a run where its kernel does not exist:

* ``persist_layer_norm`` (on unless ``--no-persist-layer-norm``): without apex the local
  spec uses torch's LayerNorm, which asserts the option is off;
* ``gradient_accumulation_fusion`` (on unless ``--no-gradient-accumulation-fusion``):
  ColumnParallelLinear raises without apex's ``fused_weight_gradient_mlp_cuda``;
* ``masked_softmax_fusion`` (on unless ``--no-masked-softmax-fusion``): with ``--bf16`` or
  ``--fp16`` the softmax imports ``scaled_masked_softmax_cuda``.

After Megatron validates the arguments, each one whose kernel cannot be imported is
turned off, and one line says so (rank 0, once per run), so the user need not discover
the flags. The torch path that runs instead is Megatron's own, but in fp16/bf16 not the
same function: each weight gradient is rounded to the parameter dtype before it is added
to ``main_grad`` (the fused kernel accumulated the fp32 GEMM result), and softmax runs in
the input dtype unless ``attention_softmax_in_fp32`` (the kernel always computes in fp32);
``core_fallbacks`` says it per option and the log line repeats it.

Before validation: with tensor or context parallelism Megatron asserts
``CUDA_DEVICE_MAX_CONNECTIONS=1`` (one CUDA launch queue, so communication kernels keep
program order). Off CUDA every operation already runs in program order, so an unset
variable is set to ``1``, with one line saying so; a value the user set is left alone.

``--moe-grouped-gemm`` on the portable Transformer Engine: Megatron-LM's ``validate_args``
asserts ``torch.cuda.get_device_capability()[0] >= 8`` ("Unsupported compute capability for
GroupedGEMM kernels"): the check stands for "this GPU has the grouped-GEMM kernels". Off CUDA
the translated capability is (0, 0), so the check fails although the experts' grouped linear
that will run is the portable Transformer Engine's (``portable_te/grouped.py``, one matmul per
expert on any device). When that layer is the one Megatron will build (the TE path, the
portable TE patch applied, not ``--moe-use-legacy-grouped-gemm``), the flag is hidden from that
one check while Megatron validates, then restored, with one line saying so. Otherwise the check
stays and ``training_cuda_only`` refuses the legacy grouped GEMM by name.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from portspeed.accelerator import get_accelerator
from portspeed.accelerator.conditions import translated
from portspeed.patching.record import WRAP, Patch

from ._training_common import log_once, portable_te_path
from .core_fallbacks import FALLBACKS
from .ranges import DISTRIBUTION, TRAINING

__all__ = ["PATCHES", "KERNEL_FALLBACKS", "fall_back_to_torch_paths", "portable_grouped_gemm"]

#: (args attribute that enables it, value that turns it off, attribute to set, module of the kernel, flag)
KERNEL_FALLBACKS: tuple[tuple[str, str, Any, str, str], ...] = (
    ("persist_layer_norm", "no_persist_layer_norm", True, "apex", "--no-persist-layer-norm"),
    ("gradient_accumulation_fusion", "gradient_accumulation_fusion", False, "fused_weight_gradient_mlp_cuda",
     "--no-gradient-accumulation-fusion"),
    ("masked_softmax_fusion", "masked_softmax_fusion", False, "scaled_masked_softmax_cuda",
     "--no-masked-softmax-fusion"),
)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _enabled(args: Any, attr: str, off_value: Any) -> bool:
    return hasattr(args, attr) and getattr(args, attr) != off_value


def _one_launch_queue(args: Any) -> None:
    parallel = getattr(args, "tensor_model_parallel_size", 1) > 1 or getattr(args, "context_parallel_size", 1) > 1
    fsdp = getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False)
    if parallel and not fsdp and "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
        log_once("cuda_device_max_connections",
                 "portspeed: set CUDA_DEVICE_MAX_CONNECTIONS=1 for Megatron's tensor-parallel check; "
                 "the %s adapter runs operations in program order, so it changes nothing there",
                 get_accelerator().name)


def portable_grouped_gemm(args: Any) -> bool:
    """``--moe-grouped-gemm`` will build the portable TE's GroupedLinear (not TE's CUDA kernel, not the legacy one)."""
    return (bool(getattr(args, "moe_grouped_gemm", False)) and not getattr(args, "moe_use_legacy_grouped_gemm", False)
            and portable_te_path(args))


def fall_back_to_torch_paths(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of validate_args(args, defaults): see the module docstring."""
    margs = args[0] if args else kwargs.get("args")
    hide_grouped_gemm = margs is not None and portable_grouped_gemm(margs)
    if margs is not None:
        _one_launch_queue(margs)
    if hide_grouped_gemm:
        margs.moe_grouped_gemm = False
        log_once("grouped_gemm", "portspeed: --moe-grouped-gemm: Megatron checks for a CUDA compute capability >= 8 "
                 "(its grouped-GEMM kernels); the experts run the portable Transformer Engine's GroupedLinear "
                 "(one matmul per expert) on the %s adapter instead, so that check is skipped", get_accelerator().name)
    try:
        result = wrapped(*args, **kwargs)
    finally:
        if hide_grouped_gemm:
            margs.moe_grouped_gemm = True
    if margs is not None:
        name = get_accelerator().name
        for feature, attr, off_value, module, flag in KERNEL_FALLBACKS:
            if _enabled(margs, attr, off_value) and not _importable(module):
                setattr(margs, attr, off_value)
                log_once(f"fallback:{feature}",
                         "portspeed: %s needs %r (a CUDA kernel), not installed for the %s adapter; using "
                         "Megatron's torch path instead (as with %s): %s", feature, module, name, flag,
                         FALLBACKS.get(feature, "the same function"))
    return result


PATCHES: list[Patch] = [
    Patch(
        name="megatron.training.validate_args.torch_paths",
        target="megatron.training.arguments:validate_args",
        kind=WRAP,
        impl=fall_back_to_torch_paths,
        distribution=DISTRIBUTION,
        versions=TRAINING,
        when=translated,
        reason="Megatron's defaults enable CUDA-only kernels (persistent layer norm, gradient-accumulation "
        "fusion, masked-softmax fusion) and assert CUDA_DEVICE_MAX_CONNECTIONS=1 for tensor parallelism. "
        "The torch paths differ in fp16/bf16: weight gradients are rounded to the parameter dtype before "
        "accumulation, and softmax runs in the input dtype unless attention_softmax_in_fp32.",
    ),
]
