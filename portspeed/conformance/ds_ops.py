"""DeepSpeed op checks of the conformance kit: the quantizer ZeRO++ loads on this adapter, against a float reference.

Why: ZeRO++ (qwZ, qgZ) trains through whatever serves DeepSpeed's ``QuantizerBuilder`` on the device:
the adapter's own kernels (``Accelerator.deepspeed_ops()``) or portspeed's torch implementation
(``portspeed.integrations.ds_quantizer``). A wrong code, scale or layout there changes every weight
and gradient ZeRO++ moves. Each op runs on the adapter's device on small fp16 inputs (8 and 4 bits,
symmetric and asymmetric, groups of 8 to 4096, the qgZ layouts) and is compared with
``reference_quantize``: the same formulas in float64 on the host, written out plainly.

Bands (``QUANTIZER_BANDS``), from DeepSpeed's own CUDA kernels measured against these formulas on an
H100 (docs/deepspeed.md): codes at most 1 apart and at most 1e-3 of them differing (fp32 rounding at
a tie), stored scales within 1e-6 relative, dequantized fp16 values within one fp16 ulp (2^-10
relative), and a reduction within one output step plus one fp16 rounding per summed device.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from portspeed.conformance.report import Report

__all__ = ["QUANTIZER_BANDS", "compare_quantizer", "quantizer_for", "reference_quantize", "run_ds_op_checks"]

SUITE = "kernels"

#: how far a quantizer may be from ``reference_quantize`` (see the module docstring)
QUANTIZER_BANDS = {"code_diff": 1, "code_mismatch_fraction": 1e-3, "scale_rel": 1e-6, "value_rel": 2.0 ** -10}


def reference_quantize(x: torch.Tensor, bits: int, symmetric: bool,
                       zero_in_range: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (int64), step (``1 / s``) and offset per group of ``x`` (``[groups, per]``, fp16 values), in float64.

    Symmetric: ``s = 2**bits / (2 * max|x|)``; asymmetric: ``s = 2**bits / (max - min)`` around
    ``(max + min) / 2`` (with 0 in the range where DeepSpeed's kernel reads zero padding); codes
    rounded half to even and clamped to ``[-2**(bits-1), 2**(bits-1) - 1]``.
    """
    v = x.double()
    if symmetric:
        top = v.abs().amax(dim=1)
        scale = torch.where(top == 0, 1.0, 2.0 ** bits / (2 * top))
        offset = torch.zeros_like(top)
    else:
        hi, lo = v.amax(dim=1), v.amin(dim=1)
        if zero_in_range:
            hi, lo = hi.clamp(min=0), lo.clamp(max=0)
        scale = torch.where(hi == lo, 1.0, 2.0 ** bits / (hi - lo))
        offset = (hi + lo) / 2
    codes = torch.round((v - offset[:, None]) * scale[:, None]).clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return codes.long(), 1 / scale, offset


def _codes(data: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed codes of DeepSpeed's stored layout (int4: two per byte, the first in the high nibble)."""
    raw = data.detach().cpu().reshape(-1).view(torch.uint8).long()
    if bits == 8:
        return (raw ^ 128) - 128
    return ((torch.stack((raw >> 4, raw & 15), dim=1).reshape(-1) ^ 8) - 8)


def _check_codes(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    diff = (got - want.reshape(-1)).abs()
    worst, share = int(diff.max()), float((diff > 0).double().mean())
    if worst > QUANTIZER_BANDS["code_diff"] or share > QUANTIZER_BANDS["code_mismatch_fraction"]:
        raise AssertionError(f"{what}: codes up to {worst} apart, {share:.2%} differ (band: 1 apart, at most "
                             f"{QUANTIZER_BANDS['code_mismatch_fraction']:.1%})")


def _check_params(what: str, stored: torch.Tensor, step: torch.Tensor, offset: torch.Tensor, symmetric: bool) -> None:
    got = stored.detach().double().cpu().reshape(step.numel(), -1)
    want = step[:, None] if symmetric else torch.stack((step, offset), dim=1)
    rel = ((got - want).abs() / want.abs().clamp(min=1e-30)).max().item()
    if rel > QUANTIZER_BANDS["scale_rel"]:
        raise AssertionError(f"{what}: stored parameters {rel:.2e} from the reference (band "
                             f"{QUANTIZER_BANDS['scale_rel']:.0e} relative)")


def compare_quantizer(ops: Any, device: Any, seed: int = 1234) -> str | None:
    """None if DeepSpeed's quantizer op module ``ops`` matches ``reference_quantize`` on ``device``; else the first
    failure, in words (the op, the case, what is off and the band)."""
    from portspeed.integrations.ds_quantizer import reads_zero

    gen = torch.Generator().manual_seed(seed)
    try:
        for bits in (8, 4):
            for symmetric in (True, False):
                qtype = ops.Symmetric if symmetric else ops.Asymmetric
                kind = f"{bits}-bit {'symmetric' if symmetric else 'asymmetric'}"
                for per in (8, 64, 4096):
                    x = (torch.randn(12, per, generator=gen) * torch.rand(12, 1, generator=gen) * 4).half()
                    x[1] = 0
                    what = f"quantize {kind}, 12 groups of {per}"
                    data, stored = ops.quantize(x.to(device), 12, bits, qtype)
                    codes, step, offset = reference_quantize(x, bits, symmetric, reads_zero("quantize", per))
                    _check_codes(what, _codes(data, bits), codes)
                    _check_params(what, stored, step, offset, symmetric)
                    values = ops.dequantize(data, stored, 12, bits, qtype).cpu()
                    want = (_codes(data, bits).double().reshape(12, per) * stored.double().cpu()[:, :1]
                            + (0 if symmetric else stored.double().cpu()[:, 1:2]))
                    rel = ((values.double() - want).abs() / want.abs().clamp(min=2.0 ** -14)).max().item()
                    if values.dtype != torch.float16 or rel > QUANTIZER_BANDS["value_rel"]:
                        return (f"dequantize {kind}, 12 groups of {per}: {values.dtype}, {rel:.2e} from codes x "
                                f"scales (DeepSpeed returns fp16, within one fp16 ulp)")
                for nodes, devices in ((2, 1), (2, 2)):
                    groups = nodes * devices * 3
                    x = torch.randn(groups, 16, generator=gen).half()
                    what = f"swizzle_quant {kind}, {nodes} nodes x {devices} devices, {groups} groups of 16"
                    data, stored = ops.swizzle_quant(x.to(device), groups, bits, qtype, 1, nodes, devices)
                    codes, step, offset = reference_quantize(x, bits, symmetric, reads_zero("swizzle", 16))
                    order = torch.arange(groups).reshape(nodes, devices, -1).permute(1, 0, 2).reshape(-1)
                    _check_codes(what, _codes(data, bits), codes[order])
                    _check_params(what, stored, step[order], offset[order], symmetric)
                if symmetric:  # DeepSpeed's kernel reads asymmetric parameters of tensor j at j x groups floats
                    bad = _check_reduction(ops, qtype, bits, kind, gen, device)
                    if bad:
                        return bad
    except AssertionError as exc:
        return str(exc)
    return None


def _check_reduction(ops: Any, qtype: Any, bits: int, kind: str, gen: torch.Generator, device: Any) -> str | None:
    devices, groups, per = 4, 6, 64
    xs = [(torch.randn(groups, per, generator=gen) * 2).half() for _ in range(devices)]
    parts = [ops.quantize(x.to(device), groups, bits, qtype) for x in xs]
    data = torch.cat([p[0].reshape(-1) for p in parts])
    stored = torch.cat([p[1] for p in parts])
    out, out_stored = ops.quantized_reduction(data, stored, groups * devices, groups, bits, qtype, devices)
    total = sum((_codes(p[0], bits).double().reshape(groups, per) * p[1].double().cpu()[:, :1]) for p in parts)
    got = _codes(out, bits).double().reshape(groups, per) * out_stored.double().cpu()[:, :1]
    top = total.abs().amax(dim=1, keepdim=True)
    allowed = top * (2.0 / 2 ** bits) + devices * top * 2.0 ** -11  # one output step + a fp16 rounding per device
    if ((got - total).abs() > allowed).any():
        worst = ((got - total).abs() / top).max().item()
        return (f"quantized_reduction {kind}, {devices} devices x {groups} groups of {per}: the reduced values are "
                f"{worst:.2e} of the group's largest from the float sum (band: one output step and {devices} fp16 "
                "roundings)")
    return None


def quantizer_for(acc: Any) -> tuple[Any, str]:
    """The op module that serves DeepSpeed's ``QuantizerBuilder`` on ``acc``, and where it comes from."""
    from portspeed.integrations.ds_op_builders import TORCH_OPS

    declared = type(acc).deepspeed_ops().get("QuantizerBuilder")
    spec = declared if declared is not None else TORCH_OPS["QuantizerBuilder"]
    origin = f"declared by the adapter: {spec}" if declared is not None else f"portspeed's torch ops, {spec}"
    if isinstance(spec, str):
        module, _, attr = spec.partition(":")
        spec = importlib.import_module(module)
        spec = getattr(spec, attr) if attr else spec
    if isinstance(spec, type):  # a DeepSpeed OpBuilder subclass: build and load it as DeepSpeed would
        spec = spec().load()
    return spec, origin


def run_ds_op_checks(acc: Any, report: Report) -> None:
    """Append the check of the quantizer ZeRO++ loads on ``acc`` (its own or portspeed's torch ops) to ``report``."""
    def check() -> None:
        ops, _ = quantizer_for(acc)
        bad = compare_quantizer(ops, acc.device(0))
        assert bad is None, bad

    try:
        origin = quantizer_for(acc)[1]
    except Exception as exc:  # a declaration that does not resolve fails its check, named
        report.add(SUITE, "DeepSpeed QuantizerBuilder (ZeRO++) matches the float reference", False,
                   f"{type(exc).__name__}: {exc}")
        return
    report.run(SUITE, f"DeepSpeed QuantizerBuilder (ZeRO++; {origin}) matches the float reference", check)
