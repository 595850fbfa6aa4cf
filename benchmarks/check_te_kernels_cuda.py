"""The portable TE's non-attention kernels on a GPU: every torch implementation against its reference, the
fused norms' numerics in bf16, and GroupedLinear through torch's grouped_mm against its loop.

Why a script (not a test): CI has no GPU. On a lent one, ``python benchmarks/check_te_kernels_cuda.py`` (torch
with CUDA; no Megatron; portspeed from this tree: ``PYTHONPATH=benchmarks/gpu_site:.``) prints what to record in
docs/transformer-engine.md's kernel table; ``--device cpu`` is its dry run. Nothing is asserted; about 20 s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from portspeed.accelerator import get_accelerator, set_accelerator  # noqa: E402
from portspeed.conformance.kernels import compare_implementations  # noqa: E402
from portspeed.portable_te import kernels, norms  # noqa: E402
from portspeed.portable_te.grouped import GroupedLinear  # noqa: E402


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    d = (a.float() - b.float()).abs()
    return (f"max |diff| {d.max().item():.2e} (max |ref| {b.float().abs().max().item():.2e}), "
            f"{(a != b).float().mean().item() * 100:.3f}% of elements differ")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    dev = torch.device(p.parse_args().device)
    acc = get_accelerator()
    cap = torch.cuda.get_device_capability() if dev.type == "cuda" else None
    print(f"torch {torch.__version__}, adapter {acc.name!r}, device {dev}"
          + (f" ({torch.cuda.get_device_name()}, capability {cap})" if cap else ""))
    print("has_grouped_mm:", {str(dt).replace("torch.", ""): acc.has_grouped_mm(dt)
                              for dt in (torch.bfloat16, torch.float16, torch.float32)})
    print("registry:", ", ".join(f"{c.op}={c.impl}" for c in kernels.choices()))

    print("\ntorch implementation vs reference (values and gradients; bands fp32 1e-4, bf16 3e-2):")
    for op, bad in compare_implementations(dev).items():
        print(f"  {op:<24} {'ok' if bad is None else 'FAIL ' + bad}")

    print("\nnorms, x [4096, 4096] * 3, bf16 (weight bf16), torch vs reference:")
    g = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(4096, 4096, generator=g, device=dev) * 3).bfloat16()
    w = (1 + 0.1 * torch.randn(4096, generator=g, device=dev)).bfloat16()
    b = (0.1 * torch.randn(4096, generator=g, device=dev)).bfloat16()
    print("  rms_norm   ", _diff(norms.rms_norm_torch(x, w, 1e-5), norms.rms_norm_reference(x, w, 1e-5)))
    print("  layer_norm ", _diff(norms.layer_norm_torch(x, w, b, 1e-5), norms.layer_norm_reference(x, w, b, 1e-5)))
    xf, wf = x.float(), w.float()
    print("  rms_norm fp32", _diff(norms.rms_norm_torch(xf, wf, 1e-5), norms.rms_norm_reference(xf, wf, 1e-5)))
    print("  F.rms_norm path: fused kernel" if dev.type == "cuda" and hasattr(torch.ops.aten, "_fused_rms_norm")
          else "  F.rms_norm path: decomposition")

    print("\nGroupedLinear, 8 experts 1024 -> 2048, 4096 tokens (one expert empty), bf16: grouped path vs loop:")
    base = type(acc)

    class Loop(base):  # type: ignore[misc, valid-type]
        def has_grouped_mm(self, dtype: torch.dtype) -> bool:
            return False

    results = []
    for cls in (Loop, base):
        set_accelerator(cls())
        kernels.reset()
        torch.manual_seed(0)
        layer = GroupedLinear(8, 1024, 2048, bias=True, device=dev, params_dtype=torch.bfloat16,
                              init_method=lambda t: torch.nn.init.normal_(t, std=0.02))
        inp = torch.randn(4096, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
        out = layer(inp, [512, 0, 1024, 512, 512, 512, 512, 512])
        out.backward(torch.ones_like(out))
        results.append((kernels.choice("grouped_mm").impl, out.detach(), inp.grad, layer.weight2.grad))
    print(f"  paths: {results[0][0]} vs {results[1][0]}")
    for name, i in (("output", 1), ("input grad", 2), ("weight2 grad", 3)):
        print(f"  {name:<12}", _diff(results[1][i], results[0][i]))


if __name__ == "__main__":
    main()
