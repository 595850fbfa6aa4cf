"""A new vendor's device in one file: "Acme", which is portspeed's test device under another name.

Nothing is packaged or installed; name the file and the class wherever an adapter name goes:

    PORTSPEED_ACCELERATOR=examples/vendor_adapter.py:AcmeAccelerator portspeed info
    portspeed conformance --adapter examples/vendor_adapter.py:AcmeAccelerator
    PORTSPEED_ACCELERATOR=examples/vendor_adapter.py:AcmeAccelerator portspeed run --nproc-per-node 2 \\
        examples/pretrain_gpt.py --tp 2 --transformer-impl transformer_engine --normalization RMSNorm

The device is portspeed's TEST DEVICE, NOT HARDWARE (a C++ PrivateUse1 device "testdev" whose
kernels compute on the host, and its CCL "testccl"); a vendor writes the same file for its own
device type, CCL and kernels. docs/writing-an-adapter.md walks through it, part by part.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from portspeed.vendor import BackendGaps, PrivateUse1Accelerator, causal_allowed

#: how many times each kernel below ran in this process: proof that portspeed called these, not its own
CALLS: collections.Counter[str] = collections.Counter()


def attention(q, k, v, *, attn_mask, causal, scale, dropout_p):  # noqa: ANN001, ANN201 - the contract's signature
    """Through torch's SDPA, which reaches the device's fused kernel; masks made to the contract's rules here."""
    CALLS["attention"] += 1
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each K/V head serves hq / hkv query heads
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    allowed = attn_mask
    if causal is not None:
        rule = causal_allowed(q.shape[2], k.shape[2], causal == "bottom_right", q.device)
        allowed = rule if allowed is None else allowed & rule
    if allowed is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale)
    empty = ~allowed.any(-1, keepdim=True)  # rows with no key to attend give the mean of v (the contract)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | empty, dropout_p=dropout_p, scale=scale)
    return torch.where(empty, v.mean(-2, keepdim=True), out)


def attention_lse(q, k, v, *, causal, scale):  # noqa: ANN001, ANN201
    """The device's own log-sum-exp attention operator (``torch.ops.testdev.attention_lse_forward``)."""
    from portspeed.testing.testdev import kernels

    CALLS["attention_lse"] += 1
    return kernels.attention_lse(q, k, v, causal=causal, scale=scale)


def attention_lse_backward(grad_out, q, k, v, out, lse, *, causal, scale):  # noqa: ANN001, ANN201
    """Its gradient, given the merged ``out`` and ``lse`` (``torch.ops.testdev.attention_lse_backward``)."""
    from portspeed.testing.testdev import kernels

    CALLS["attention_lse_backward"] += 1
    return kernels.attention_lse_backward(grad_out, q, k, v, out, lse, causal=causal, scale=scale)


def rms_norm(x, weight, eps):  # noqa: ANN001, ANN201
    """The device's fused RMSNorm, forward and backward (``torch.ops.testdev.rms_norm_forward`` / ``_backward``)."""
    from portspeed.testing.testdev import kernels

    CALLS["rms_norm"] += 1
    return kernels.rms_norm(x, weight, eps)


def grouped_mm(x, weights, offsets):  # noqa: ANN001, ANN201
    """One matmul per expert's block of rows, on the device (autograd gives the gradients)."""
    CALLS["grouped_mm"] += 1
    ends = offsets.tolist()
    return torch.cat([x[start:end] @ w for start, end, w in zip([0] + ends[:-1], ends, weights)])


class AcmeAccelerator(PrivateUse1Accelerator):
    """Acme accelerators (the test device) with the Acme CCL (testccl)."""

    name = "acme"
    device_type = "testdev"  # torch.device("testdev", i)
    backend = "testccl"
    vendor_modules = ("portspeed.testing.testdev.runtime",)  # imported when selected: registers device and CCL
    vendor_package = "portspeed's test device (make testdev)"
    auto_detect = False  # chosen only by name: a CPU run never switches to it
    backend_gaps = BackendGaps(  # what testccl lacks; `portspeed conformance` prints a line left out here
        unsupported_ops=[dist.ReduceOp.AVG, dist.ReduceOp.PREMUL_SUM],
        unsupported_dtypes=[("reduce_scatter", torch.bfloat16), ("reduce_scatter_tensor", torch.bfloat16)],
        chunk_shaped_all_gather=True,  # staged through Gloo, which wants each output chunk shaped as the input
        groups_hold_host_threads=True,  # each group keeps a staging Gloo group until destroyed
        note="the Acme CCL (testccl)",
    )

    @classmethod
    def kernels(cls) -> dict[str, Any]:
        return {"attention": attention, "attention_lse": attention_lse,
                "attention_lse_backward": attention_lse_backward, "rms_norm": rms_norm, "grouped_mm": grouped_mm}
