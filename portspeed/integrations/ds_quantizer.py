"""DeepSpeed's quantizer op in torch operators: what ``QuantizerBuilder().load()`` returns, on any device.

Why: ZeRO++'s quantized weights (qwZ, ``zero_quantized_weights``) and quantized gradients (qgZ,
``zero_quantized_gradients``) load DeepSpeed's ``QuantizerBuilder``, whose kernels are CUDA C++
only; DeepSpeed's CPU accelerator answers "not implemented" and other devices have nothing. This
module is the op module itself (DeepSpeed calls ``quantize``, ``dequantize``, ``swizzle_quant``,
``quantized_reduction`` on it and passes ``Symmetric`` back), written in torch operators, so it
runs wherever the tensors live. ``portspeed.integrations.ds_op_builders`` serves it as the
default for ``QuantizerBuilder`` on every adapter that declares no kernel of its own.

Semantics, as DeepSpeed 0.19's ``csrc/quantization`` computes them (read, not copied):

- values are read as fp16 (the CUDA kernels read every input through ``__half*``; a bf16 or fp32
  tensor is converted here, where the kernels would reinterpret its bits);
- groups are contiguous runs of ``numel / groups`` elements; statistics in fp32 of the fp16 values;
- symmetric: ``s = 2**bits / (2 * absmax)`` (1 for an all-zero group), ``q = clamp(rne(x * s))`` in
  ``[-2**(bits-1), 2**(bits-1) - 1]``, stored ``1 / s`` (``[groups, 1]`` fp32);
- asymmetric: ``s = 2**bits / (max - min)``, offset ``(max + min) / 2``, ``q = clamp(rne((x - offset) * s))``,
  stored ``[1 / s, offset]``; where the kernel's thread block covers more elements than a group holds
  (or its warp reduction reads lanes the block lacks), zeros take part in min and max (``reads_zero``);
- int4: two codes per byte, the element with the lower index in the high nibble;
- dequantize: ``q * stored (+ offset)`` in fp32, returned as fp16 (``dequantize_fp32``: fp32);
- ``swizzle_quant``: groups laid out ``[nodes, devices, pipeline, groups]`` are quantized and written
  ``[pipeline, devices, nodes, groups]``, so the intra-node all-to-all sends each device its slices;
- ``quantized_reduction``: ``devices`` quantized tensors are dequantized to fp16, summed in fp16 (in
  device order) and quantized again in ``out_groups`` groups.

Band, against DeepSpeed's own kernels built from its sources on an H100 (``benchmarks/check_ds_quantizer_cuda.py``,
docs/deepspeed.md): integer codes equal but for about 1 in 10^5 one step apart (DeepSpeed's ``--use_fast_math``
division where ``x * s`` lies within an ulp of a rounding boundary), stored scales within 2e-7 relative,
dequantized fp16 values bit-equal (after a reduction 99%, the rest one fp16 ulp or one code apart). One difference is
kept on purpose: DeepSpeed's asymmetric ``quantized_reduction`` reads tensor j's parameters at ``j * groups`` floats,
half their offset (this module
reads them where they are); qgZ uses the symmetric one. Limits: groups of a multiple of 8 elements
(DeepSpeed's 16-byte loads read past other sizes), int4 needs an even group size. DeepSpeed's inference-only
``dequantize_int*_to_half_experimental`` are not provided.
"""

from __future__ import annotations

import collections
import enum
import threading

import torch

__all__ = ["Asymmetric", "QuantizationType", "Symmetric", "counters", "dequantize", "dequantize_fp32", "quantize",
           "quantized_reduction", "reads_zero", "reset_counters", "swizzle_quant"]


class QuantizationType(enum.IntEnum):
    """DeepSpeed's ``quantize::Type`` (its pybind enum exports both names on the module)."""

    Symmetric = 0
    Asymmetric = 1


Symmetric = QuantizationType.Symmetric
Asymmetric = QuantizationType.Asymmetric

_calls: collections.Counter[str] = collections.Counter()
_lock = threading.Lock()


def counters() -> dict[str, int]:
    """How many times each op ran in this process (tests and records prove ZeRO++ used them)."""
    with _lock:
        return dict(_calls)


def reset_counters() -> None:
    """Set every op's count back to zero."""
    with _lock:
        _calls.clear()


def _count(op: str) -> None:
    with _lock:
        _calls[op] += 1


def _check(bits: int, qtype: int, what: str) -> QuantizationType:
    if bits not in (4, 8):
        raise ValueError(f"{what}: num_bits {bits} is not supported; DeepSpeed's quantizer packs 8 or 4 bits")
    try:
        return QuantizationType(int(qtype))
    except ValueError:
        raise ValueError(f"{what}: quantization type {qtype!r} is neither Symmetric (0) nor Asymmetric (1)") from None


def _split(numel: int, groups: int, bits: int, what: str) -> int:
    """Elements per group, or a ValueError naming the shapes (DeepSpeed's kernels would read past them)."""
    if groups < 1 or numel % groups:
        raise ValueError(f"{what}: {numel} elements do not split into {groups} equal groups; pass a group count that "
                         f"divides the element count")
    per = numel // groups
    if bits == 4 and per % 2:
        raise ValueError(f"{what}: int4 packs two codes per byte, so a group needs an even element count, not {per}")
    return per


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def reads_zero(kernel: str, per: int, bits: int = 8) -> bool:
    """Whether DeepSpeed's ``kernel`` takes 0 into a group's statistics (asymmetric min and max).

    Its thread block loads more elements than a group of ``per`` holds (zero-filled), or its warp
    reduction reads lanes the block does not have (fewer than 32 threads behind a block-wide
    reduction: those lanes read 0 on an H100, ``benchmarks/check_ds_quantizer_cuda.py``).
    """
    if kernel == "quantize":  # launch_quant: 8 halves per load; up to 128 elements one load per thread
        if per <= 128:
            return _next_pow2(-(-per // 8)) * 8 > per
        threads = min(256, _next_pow2(-(-per // 16)))
        return threads < 32 or -(-per // (threads * 16)) * threads * 16 > per
    if kernel == "swizzle":  # launch_swizzled_quant: 32 to 512 threads, 2 loads each per step
        threads = min(512, max(32, _next_pow2(-(-per // 16))))
        return -(-per // (threads * 16)) * threads * 16 > per
    # launch_dequant_reduce: ``bits`` bytes (8 values) per thread per step, up to 1024 threads; even unroll from 4
    per_bytes = per * bits // 8
    threads = min(1024, _next_pow2(-(-per_bytes // bits)))
    unroll = -(-per_bytes // (threads * bits))
    if unroll >= 4:
        unroll += unroll % 2
    return threads < 32 or unroll * threads * 8 > per


def _quantize_groups(x: torch.Tensor, bits: int, qtype: QuantizationType,
                     padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (int8, one per element) and stored parameters of ``x``: ``[groups, per]`` fp32 holding fp16 values."""
    levels = float(1 << bits)
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if qtype == Symmetric:
        absmax = x.abs().amax(dim=1)
        scale = torch.where(absmax == 0, torch.ones_like(absmax), levels / (2 * absmax))
        shifted, stored = x, scale.reciprocal().unsqueeze(1)
    else:
        hi, lo = x.amax(dim=1), x.amin(dim=1)
        if padded:  # the kernel's zero-filled loads are part of the statistics
            hi, lo = hi.clamp(min=0), lo.clamp(max=0)
        scale = torch.where(hi == lo, torch.ones_like(hi), levels / (hi - lo))
        offset = (hi + lo) / 2
        shifted, stored = x - offset.unsqueeze(1), torch.stack((scale.reciprocal(), offset), dim=1)
    codes = torch.round(shifted * scale.unsqueeze(1)).clamp_(qmin, qmax).to(torch.int8)
    return codes, stored


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Flat int8 codes as DeepSpeed stores them: as is (int8), or two per byte, the first in the high nibble."""
    flat = codes.reshape(-1)
    if bits == 8:
        return flat
    pairs = flat.to(torch.int16).reshape(-1, 2) & 0xF
    return ((pairs[:, 0] << 4) | pairs[:, 1]).to(torch.uint8).view(torch.int8)


def _unpack(data: torch.Tensor, bits: int) -> torch.Tensor:
    """The signed codes of flat stored ``data`` (int8), as int16."""
    flat = data.reshape(-1)
    if bits == 8:
        return flat.to(torch.int16)
    raw = flat.view(torch.uint8).to(torch.int16)
    nibbles = torch.stack((raw >> 4, raw & 0xF), dim=1).reshape(-1)
    return (nibbles ^ 8) - 8  # sign-extend 4 bits


def _decode(codes: torch.Tensor, stored: torch.Tensor, groups: int, qtype: QuantizationType) -> torch.Tensor:
    """fp32 values of ``codes`` (flat) with their groups' stored parameters."""
    params = stored.reshape(groups, -1).float()
    values = codes.reshape(groups, -1).float() * params[:, :1]
    return values + params[:, 1:2] if qtype == Asymmetric else values


def _shape(shape: torch.Size, bits: int, pack: bool) -> list[int]:
    out = list(shape) or [1]
    if bits == 4:
        out[-1] = out[-1] // 2 if pack else out[-1] * 2
    return out


def quantize(input_vals: torch.Tensor, groups: int, num_bits: int,
             quant_type: int) -> list[torch.Tensor]:
    """``[codes, params]``: ``input_vals`` quantized in ``groups`` contiguous groups (the last dim halves for int4)."""
    qtype = _check(num_bits, quant_type, "quantize")
    per = _split(input_vals.numel(), groups, num_bits, "quantize")
    _count("quantize")
    x = input_vals.detach().to(torch.float16).float().reshape(groups, per)
    codes, stored = _quantize_groups(x, num_bits, qtype, padded=reads_zero("quantize", per))
    return [_pack(codes, num_bits).reshape(_shape(input_vals.shape, num_bits, pack=True)), stored]


def _dequantize(data: torch.Tensor, params: torch.Tensor, groups: int, num_bits: int, quant_type: int,
                dtype: torch.dtype, op: str) -> torch.Tensor:
    qtype = _check(num_bits, quant_type, op)
    codes = _unpack(data, num_bits)
    _split(codes.numel(), groups, num_bits, op)
    _count(op)
    values = _decode(codes, params, groups, qtype)
    return values.to(dtype).reshape(_shape(data.shape, num_bits, pack=False))


def dequantize(quantized_data: torch.Tensor, params: torch.Tensor, groups: int, num_bits: int,
               quant_type: int) -> torch.Tensor:
    """fp16 values of ``quantized_data`` (codes from ``quantize``), ``params`` its ``[groups, 1|2]`` parameters."""
    return _dequantize(quantized_data, params, groups, num_bits, quant_type, torch.float16, "dequantize")


def dequantize_fp32(quantized_data: torch.Tensor, params: torch.Tensor, groups: int, num_bits: int,
                    quant_type: int) -> torch.Tensor:
    """``dequantize`` with fp32 values."""
    return _dequantize(quantized_data, params, groups, num_bits, quant_type, torch.float32, "dequantize_fp32")


def swizzle_quant(input_vals: torch.Tensor, groups: int, num_bits: int, quant_type: int, pipeline_size: int,
                  nodes: int, devices_per_node: int) -> list[torch.Tensor]:
    """``[codes (flat), params]``: quantize in ``groups`` groups and lay them out for qgZ's two all-to-alls.

    The input's groups are read ``[nodes, devices_per_node, pipeline_size, g]`` and written
    ``[pipeline_size, devices_per_node, nodes, g]`` (codes and parameters alike).
    """
    qtype = _check(num_bits, quant_type, "swizzle_quant")
    per = _split(input_vals.numel(), groups, num_bits, "swizzle_quant")
    parts = nodes * devices_per_node * pipeline_size
    if min(nodes, devices_per_node, pipeline_size) < 1 or groups % parts:
        raise ValueError(f"swizzle_quant: {groups} groups do not split over {nodes} nodes x {devices_per_node} devices "
                         f"x {pipeline_size} pipeline slices; pass a group count divisible by {parts}")
    _count("swizzle_quant")
    x = input_vals.detach().to(torch.float16).float().reshape(groups, per)
    codes, stored = _quantize_groups(x, num_bits, qtype, padded=reads_zero("swizzle", per))
    layout = (nodes, devices_per_node, pipeline_size, groups // parts)
    codes = codes.reshape(*layout, per).permute(2, 1, 0, 3, 4)
    stored = stored.reshape(*layout, -1).permute(2, 1, 0, 3, 4).reshape(groups, -1)
    return [_pack(codes, num_bits), stored]


def quantized_reduction(input_vals: torch.Tensor, input_scales: torch.Tensor, in_groups: int, out_groups: int,
                        num_bits: int, quant_type: int, devices_per_node: int) -> list[torch.Tensor]:
    """``[codes, params]``: the sum of ``devices_per_node`` quantized tensors, quantized in ``out_groups`` groups.

    ``input_vals`` holds the tensors one after another (what the intra-node all-to-all received),
    ``input_scales`` their ``in_groups`` groups' parameters; the output's last dimension is the
    input's divided by ``devices_per_node``.
    """
    qtype = _check(num_bits, quant_type, "quantized_reduction")
    devices = devices_per_node
    codes = _unpack(input_vals, num_bits)
    if devices < 1 or in_groups % devices or codes.numel() % devices:
        raise ValueError(f"quantized_reduction: {codes.numel()} codes in {in_groups} groups do not split over "
                         f"{devices} devices; pass counts divisible by devices_per_node")
    per_tensor = codes.numel() // devices
    _split(codes.numel(), in_groups, num_bits, "quantized_reduction")
    out_per = _split(per_tensor, out_groups, num_bits, "quantized_reduction")
    _count("quantized_reduction")
    values = _decode(codes, input_scales, in_groups, qtype).to(torch.float16).reshape(devices, per_tensor)
    total = values[0]
    for j in range(1, devices):  # fp16 sums in device order, as the kernel's __half2 accumulator
        total = total + values[j]
    padded = reads_zero("reduce", out_per, num_bits)
    out_codes, stored = _quantize_groups(total.float().reshape(out_groups, out_per), num_bits, qtype, padded)
    shape = list(input_vals.shape) or [1]
    shape[-1] //= devices
    return [_pack(out_codes, num_bits).reshape(shape), stored]
