"""The vendor kernel slot: the operations an adapter may serve with its own kernels, as contracts.

Why a slot: torch's fused operators (``F.scaled_dot_product_attention``, ``F.rms_norm``,
``grouped_mm``) already reach a vendor's kernel wherever the vendor registered it with torch's
dispatcher; what torch lacks (a fused RoPE, a fused SwiGLU, a log-sum-exp attention for
context parallelism, ...) a vendor declares here instead. The portable Transformer Engine picks,
per operation, **vendor → torch fused → reference** (``portspeed.portable_te.kernels``).

Each contract below is an empty function whose signature and docstring *are* the contract (as
pluggy's hook specifications): an adapter's kernel must accept the same parameters by the same
names (``check_kernel`` says which one it does not). An adapter declares its kernels by overriding
``Accelerator.kernels()`` to return ``{op name: function}``; the declaration is read in Python,
without loading the device runtime, so it may name functions by import path
(``"vendor_pkg.ops:fused_attention"``), resolved only when the op is first used.

Shapes use ``b`` batch, ``hq`` query heads, ``hkv`` key/value heads (``hq % hkv == 0``: the
kernel handles grouped-query attention itself), ``sq`` / ``sk`` sequence lengths, ``d`` head dim.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Mapping

import torch

from portspeed.config import TE_KERNEL_OPS
from portspeed.errors import PortspeedError

__all__ = ["KERNEL_BANDS", "KERNEL_OPS", "KernelContractError", "causal_allowed", "check_kernel", "check_declared",
           "resolve_kernel", "attention", "attention_lse", "attention_lse_backward", "rms_norm", "layer_norm", "rope",
           "swiglu", "grouped_mm"]

#: How close a kernel must come to the reference, per compute dtype: the largest |difference| over the largest
#: |reference|, for each output and each gradient (``portspeed conformance --suites kernels`` checks it). fp32
#: leaves room for a device's own reduction order (tf32 excluded); bf16 for a few roundings (2^-7 is 7.8e-3).
KERNEL_BANDS: dict[torch.dtype, float] = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


class KernelContractError(PortspeedError, TypeError):
    """An adapter declares a kernel that does not fit its operation's contract (unknown op, wrong signature,
    an import path that does not resolve)."""


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask: torch.Tensor | None,
              causal: str | None, scale: float, dropout_p: float) -> torch.Tensor:
    """Scaled dot-product attention.

    ``q`` ``[b, hq, sq, d]``, ``k`` / ``v`` ``[b, hkv, sk, d]``; ``attn_mask`` None or boolean,
    broadcastable to ``[b, hq, sq, sk]``, **True where a position may attend** (SDPA's convention);
    ``causal`` None, ``"top_left"`` or ``"bottom_right"`` (the diagonal aligned to the last key
    when ``sq != sk``); ``scale`` multiplies ``q k^T``; ``dropout_p`` is applied to the
    probabilities, drawing from the device's default generator (the caller enters Megatron's RNG
    tracker fork around the call). A row with no position to attend gives the mean of ``v`` over
    all keys (what Transformer Engine's unfused path gives). Returns ``[b, hq, sq, d]`` in
    ``q``'s dtype; differentiable.
    """


def causal_allowed(sq: int, sk: int, bottom_right: bool, device: torch.device | None = None) -> torch.Tensor:
    """The causal rule of ``attention`` as a mask: ``[sq, sk]``, True where query ``i`` may see key ``j``:
    ``j <= i`` (``"top_left"``) or ``j <= i + sk - sq`` (``"bottom_right"``)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(diagonal=sk - sq if bottom_right else 0)


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block with its log-sum-exp, for merging blocks (ring context parallelism).

    Shapes as ``attention``; no mask other than top-left ``causal``, no dropout. Returns
    ``(out [b, hq, sq, d] in q's dtype, lse [b, hq, sq] float32)`` with
    ``lse = log(sum_k exp(scale * q k^T))`` over the keys each query may attend. Not differentiated
    through autograd: ``attention_lse_backward`` is its gradient.
    """


def attention_lse_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           out: torch.Tensor, lse: torch.Tensor, *, causal: bool,
                           scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradient of ``attention_lse`` given the *final* ``out`` and ``lse`` of the merged attention.

    Passing the merged output and log-sum-exp (not the block's own) gives the block's share of the
    gradient of the merged result, as flash attention's backward does. Returns ``(dq, dk, dv)``
    shaped as ``q``, ``k``, ``v`` (``dk`` / ``dv`` with ``hkv`` heads).
    """


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x^2) + eps) * weight``, statistics in float32,
    result in ``x``'s dtype (``weight`` is already ``1 + w`` for zero-centred gamma); differentiable."""


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension, statistics in float32, result in ``x``'s dtype; differentiable."""


def rope(t: torch.Tensor, freqs: torch.Tensor, *, interleaved: bool) -> torch.Tensor:
    """Rotary embedding: ``t`` ``[..., d]`` and float32 angles ``freqs`` broadcastable to ``[..., r]``
    (``r <= d``, even): the first ``r`` channels rotated (``[-x2, x1]`` halves, or neighbouring pairs
    with ``interleaved``), the rest passed through; arithmetic in float32, result in ``t``'s dtype."""


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., 2n]`` -> ``silu(x[..., :n]) * x[..., n:]``; differentiable."""


def grouped_mm(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Grouped GEMM: ``x`` ``[m, k]`` sorted by group, ``weights`` ``[g, k, n]``, ``offsets`` int32
    ``[g]`` cumulative group ends (``offsets[-1] == m``); row block ``i`` times ``weights[i]``,
    ``[m, n]``; differentiable (as ``torch.nn.functional.grouped_mm``)."""


#: op name -> its contract, for each operation of the one list (``portspeed.config.TE_KERNEL_OPS``; a name there
#: without a contract above fails here, at import)
KERNEL_OPS: dict[str, Callable] = {op: globals()[op] for op in TE_KERNEL_OPS}


def check_kernel(op: str, kernel: Callable) -> str | None:
    """None if ``kernel`` fits the contract of ``op``; else what does not fit, in a few words."""
    spec = KERNEL_OPS.get(op)
    if spec is None:
        return f"unknown operation {op!r} (known: {', '.join(KERNEL_OPS)})"
    if not callable(kernel):
        return f"{kernel!r} is not callable"
    try:
        got = inspect.signature(kernel)
    except (TypeError, ValueError):
        return None  # a builtin without a signature: accepted, checked by `portspeed conformance`
    want = inspect.signature(spec)
    params = got.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    missing = [name for name in want.parameters if name not in params]
    if missing:
        return f"missing parameter(s) {', '.join(missing)} (the contract: {op}{want})"
    positional = [n for n, p in want.parameters.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    got_positional = [n for n, p in params.items()
                      if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if got_positional[:len(positional)] != positional:
        return (f"positional parameters ({', '.join(got_positional)}) are not in the contract's order "
                f"({', '.join(positional)}); the contract: {op}{want}")
    extra = [n for n, p in params.items() if n not in want.parameters and p.default is inspect.Parameter.empty
             and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if extra:
        return f"required parameter(s) the contract does not pass: {', '.join(extra)} (the contract: {op}{want})"
    return None


def _is_path(value: Any) -> bool:
    """``"package.module:attr"`` (``attr`` may be dotted)."""
    if not isinstance(value, str) or value.count(":") != 1:
        return False
    mod, attr = value.split(":")
    return all(p.isidentifier() for p in mod.split(".")) and all(p.isidentifier() for p in attr.split("."))


def check_declared(adapter: str, declared: Mapping[str, Any]) -> None:
    """Refuse an adapter's ``kernels()`` declaration that does not fit, naming the adapter and the op.

    Functions are checked against their contract now; import paths only for their form (they are
    imported, and checked, at first use: ``resolve_kernel``), so activation loads nothing.
    """
    if not isinstance(declared, Mapping):
        raise KernelContractError(f"adapter {adapter!r}: kernels() returned {type(declared).__name__}, "
                                  "not a dict {operation: function or 'module:attr'}")
    for op, kernel in declared.items():
        if op not in KERNEL_OPS:
            raise KernelContractError(f"adapter {adapter!r} declares a kernel for {op!r}, which is not an "
                                      f"operation; the operations: {', '.join(KERNEL_OPS)}")
        if isinstance(kernel, str):
            if not _is_path(kernel):
                raise KernelContractError(f"adapter {adapter!r}, kernel {op!r}: {kernel!r} is not an import path "
                                          "of the form 'package.module:function'")
            continue
        why = check_kernel(op, kernel)
        if why is not None:
            raise KernelContractError(f"adapter {adapter!r}, kernel {op!r}: {why}; fix the kernel or drop it "
                                      "from kernels() (portspeed.accelerator.kernel_ops documents each contract)")


def resolve_kernel(adapter: str, op: str, kernel: Any) -> Callable:
    """The function a declaration names (importing an import path now), checked against the contract of ``op``."""
    fn = kernel
    if isinstance(kernel, str):
        mod, attr = kernel.split(":")
        try:
            fn = importlib.import_module(mod)
            for part in attr.split("."):
                fn = getattr(fn, part)
        except (ImportError, AttributeError) as exc:
            raise KernelContractError(f"adapter {adapter!r}, kernel {op!r}: cannot import {kernel!r} "
                                      f"({type(exc).__name__}: {exc})") from exc
    why = check_kernel(op, fn)
    if why is not None:
        raise KernelContractError(f"adapter {adapter!r}, kernel {op!r} ({kernel!r}): {why}")
    return fn
