"""DeepSpeed's quantizer in torch (``portspeed.integrations.ds_quantizer``) and the op-builder slot that serves it.

The ops are checked against the float reference of ``portspeed conformance`` (formulas in float64) and
on hand-made inputs whose codes, bytes and layouts are known; planted faults show the reference check
fails. DeepSpeed's own CUDA kernels gave the same codes on an H100 (all but 1 in 10^5, one step apart;
``benchmarks/check_ds_quantizer_cuda.py``, docs/deepspeed.md). The slot runs in a child interpreter
that imports DeepSpeed through the adaptor.
"""

from __future__ import annotations

import types

import pytest
import torch

from helpers.launch import child_json
from portspeed.conformance.ds_ops import compare_quantizer, reference_quantize
from portspeed.integrations import ds_quantizer as q


def test_ops_match_the_float_reference() -> None:
    """quantize, dequantize, swizzle_quant and quantized_reduction are within QUANTIZER_BANDS of float64 formulas."""
    assert compare_quantizer(q, "cpu") is None


def _with(**ops: object) -> types.SimpleNamespace:
    names = ("quantize", "dequantize", "swizzle_quant", "quantized_reduction", "Symmetric", "Asymmetric")
    return types.SimpleNamespace(**{**{n: getattr(q, n) for n in names}, **ops})


def test_planted_faults_fail_the_reference_check() -> None:
    """A quantizer that truncates, skips the swizzle, or averages instead of summing is named by the check."""
    def truncating(x: torch.Tensor, groups: int, bits: int, qtype: int) -> list[torch.Tensor]:
        return [q.quantize(x * 0.98, groups, bits, qtype)[0], q.quantize(x, groups, bits, qtype)[1]]

    def unswizzled(x: torch.Tensor, groups: int, bits: int, qtype: int, pipe: int, nodes: int,
                   devices: int) -> list[torch.Tensor]:
        return q.swizzle_quant(x, groups, bits, qtype, pipe, nodes * devices, 1)

    def averaging(data: torch.Tensor, scales: torch.Tensor, ig: int, og: int, bits: int, qtype: int,
                  devices: int) -> list[torch.Tensor]:
        out, stored = q.quantized_reduction(data, scales, ig, og, bits, qtype, devices)
        return [out, stored / devices]

    assert "quantize 8-bit symmetric" in (compare_quantizer(_with(quantize=truncating), "cpu") or "")
    assert "swizzle_quant 8-bit symmetric, 2 nodes x 2 devices" in (
        compare_quantizer(_with(swizzle_quant=unswizzled), "cpu") or "")
    assert "quantized_reduction 8-bit symmetric" in (compare_quantizer(_with(quantized_reduction=averaging), "cpu")
                                                     or "")


def test_int4_codes_pack_the_first_element_in_the_high_nibble() -> None:
    """Symmetric int4 of [8, -2, 7, 0, 1, 2, 3, 4]: scale 1, 8 clamps to 7, bytes 0x7E 0x70 0x12 0x34 (DeepSpeed's)."""
    x = torch.tensor([[8.0, -2, 7, 0, 1, 2, 3, 4]])
    data, stored = q.quantize(x, 1, 4, q.Symmetric)
    assert data.dtype == torch.int8 and data.shape == (1, 4)
    assert data.view(torch.uint8).tolist() == [[0x7E, 0x70, 0x12, 0x34]]
    assert stored.tolist() == [[1.0]]
    back = q.dequantize(data, stored, 1, 4, q.Symmetric)
    assert back.dtype == torch.float16 and back.tolist() == [[7.0, -2, 7, 0, 1, 2, 3, 4]]


def test_swizzle_writes_groups_device_major() -> None:
    """Groups read [nodes, devices, g] are written [devices, nodes, g]: DeepSpeed's 0 1 2 3 -> 0 2 1 3 for 2 x 2."""
    x = torch.arange(1, 5, dtype=torch.float32).repeat_interleave(8).reshape(4, 8)  # group k holds k + 1
    data, stored = q.swizzle_quant(x, 4, 8, q.Symmetric, 1, 2, 2)
    assert data.shape == (32,)
    steps = (2 * torch.tensor([1.0, 3, 2, 4]) / 256).tolist()  # 1 / s of groups 0, 2, 1, 3
    assert stored.reshape(-1).tolist() == pytest.approx(steps, rel=1e-6)


def test_quantized_reduction_sums_the_devices() -> None:
    """Two devices' quantized tensors come back as their sum (DeepSpeed sums; qgZ divides by nodes only); a
    constant group's largest value takes code 127 of 128 steps, once per quantization."""
    a, b = torch.full((2, 8), 0.5), torch.full((2, 8), 0.25)
    qa, qb = q.quantize(a, 2, 8, q.Symmetric), q.quantize(b, 2, 8, q.Symmetric)
    out, stored = q.quantized_reduction(torch.cat([qa[0].reshape(-1), qb[0].reshape(-1)]),
                                        torch.cat([qa[1], qb[1]]), 4, 2, 8, q.Symmetric, 2)
    assert out.shape == (16,)
    total = q.dequantize(out, stored, 2, 8, q.Symmetric).float()
    assert torch.allclose(total, torch.full((16,), 0.75 * (127 / 128) ** 2), rtol=1e-3)


def test_asymmetric_range_takes_in_the_kernels_zero_padding() -> None:
    """Asymmetric, a constant group of 0.75: with 24 elements DeepSpeed's block loads 32 (zeros in the range, offset
    0.375), with 16 none (offset 0.75, step 1), as its kernels gave on an H100."""
    padded = q.quantize(torch.full((1, 24), 0.75), 1, 8, q.Asymmetric)[1]
    exact = q.quantize(torch.full((1, 16), 0.75), 1, 8, q.Asymmetric)[1]
    assert padded.tolist() == [[pytest.approx(0.75 / 256), 0.375]]
    assert exact.tolist() == [[1.0, 0.75]]
    codes, step, offset = reference_quantize(torch.full((1, 24), 0.75).half(), 8, False, zero_in_range=True)
    assert offset.item() == 0.375 and step.item() == pytest.approx(0.75 / 256)


def test_inputs_are_read_as_fp16_and_counted() -> None:
    """fp32 and bf16 inputs quantize as their fp16 values (what DeepSpeed's kernels read); every op call is counted."""
    q.reset_counters()
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    for a, b in zip(q.quantize(x, 4, 8, q.Symmetric), q.quantize(x.half(), 4, 8, q.Symmetric)):
        assert torch.equal(a, b)
    q.dequantize(*q.quantize(x, 4, 8, q.Symmetric), 4, 8, q.Symmetric)
    assert q.counters() == {"quantize": 3, "dequantize": 1}


@pytest.mark.parametrize("call, says", [
    (lambda: q.quantize(torch.zeros(10), 3, 8, q.Symmetric), "10 elements do not split into 3 equal groups"),
    (lambda: q.quantize(torch.zeros(8), 1, 3, q.Symmetric), "num_bits 3 is not supported"),
    (lambda: q.quantize(torch.zeros(6), 2, 4, q.Symmetric), "needs an even element count, not 3"),
    (lambda: q.quantize(torch.zeros(8), 1, 8, 7), "neither Symmetric (0) nor Asymmetric (1)"),
    (lambda: q.swizzle_quant(torch.zeros(48), 6, 8, q.Symmetric, 1, 2, 2), "do not split over 2 nodes x 2 devices"),
])
def test_bad_arguments_are_refused_in_one_line(call: object, says: str) -> None:
    """Shapes DeepSpeed's kernels would read past, and unknown bit widths or types, raise naming what to pass."""
    with pytest.raises(ValueError) as info:
        call()  # type: ignore[operator]
    assert says in str(info.value) and "\n" not in str(info.value)


def test_op_builder_slot_serves_torch_ops_vendor_kernels_and_names_the_fix() -> None:
    """DeepSpeed gets portspeed's torch quantizer by default, an adapter's declared op module or builder instead,
    refusals that name the fix, and one-line errors for declarations that cannot be right."""
    got = child_json("""
        import json, types
        import portspeed.deepspeed_adaptor, deepspeed
        import deepspeed.ops.op_builder as ob
        from deepspeed.accelerator import get_accelerator
        from deepspeed.ops.op_builder.builder import OpBuilder
        from portspeed.adapters.cpu import CpuAccelerator
        from portspeed.errors import PortspeedError
        from portspeed.integrations import ds_quantizer
        from portspeed.integrations.ds_op_builders import served_builder

        out = {"default": ob.QuantizerBuilder().load() is ds_quantizer,
               "served_by": ob.QuantizerBuilder.served_by,
               "create": type(get_accelerator().create_op_builder("QuantizerBuilder")).__name__}
        for name in ("TransformerBuilder", "FusedLambBuilder"):
            try:
                getattr(ob, name)().load()
            except PortspeedError as exc:
                out[name] = str(exc)
        own = types.SimpleNamespace(**{n: getattr(ds_quantizer, n) for n in (
            "quantize", "dequantize", "swizzle_quant", "quantized_reduction", "Symmetric", "Asymmetric")})

        class OwnBuilder(OpBuilder):
            NAME = "acme_fused_adam"
            def __init__(self, name=None): super().__init__(name=self.NAME)
            def absolute_name(self): return "acme.fused_adam"
            def sources(self): return []

        def adapter(ops):
            return type("Acme", (CpuAccelerator,), {"name": "acme", "deepspeed_ops": classmethod(lambda c: ops)})()

        acme = adapter({"QuantizerBuilder": own, "FusedAdamBuilder": OwnBuilder})
        out["vendor_module"] = served_builder("QuantizerBuilder", acme)().load() is own
        out["vendor_builder"] = served_builder("FusedAdamBuilder", acme) is OwnBuilder
        for case, ops in {"typo": {"QuantiserBuilder": own}, "missing": {"QuantizerBuilder": types.SimpleNamespace()},
                          "path": {"QuantizerBuilder": "acme_missing.ops"}}.items():
            try:
                served_builder("QuantizerBuilder", adapter(ops))
                out[case] = "accepted"
            except PortspeedError as exc:
                out[case] = str(exc)
        print(json.dumps(out))
    """, timeout=300, env={"PORTSPEED_ACCELERATOR": "cpu"}, drop=("PORTSPEED_*", "DS_ACCELERATOR*"))
    assert got["default"] and got["served_by"] == "portspeed's torch implementation"
    assert got["create"] == "QuantizerBuilder"
    assert "declare a kernel for it in the adapter's deepspeed_ops()" in got["TransformerBuilder"]
    assert "use DeepSpeed's torch path, a torch optimizer passed to deepspeed.initialize" in got["FusedLambBuilder"]
    assert got["vendor_module"] and got["vendor_builder"]
    assert "names 'QuantiserBuilder', which is not one of DeepSpeed's op builders (did you mean 'QuantizerBuilder'?)" \
        in got["typo"]
    assert "lacks quantize, dequantize, swizzle_quant, quantized_reduction, Symmetric, Asymmetric" in got["missing"]
    assert "'acme_missing.ops', which does not resolve" in got["path"]
    for case in ("typo", "missing", "path", "TransformerBuilder"):
        assert "\n" not in got[case], got[case]
