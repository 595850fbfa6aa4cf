"""portspeed's torch quantizer (``portspeed.integrations.ds_quantizer``) against DeepSpeed's own CUDA kernels.

Why a script (not a test): DeepSpeed's ``QuantizerBuilder`` kernels build and run only on an NVIDIA GPU, which CI
has not. On a lent one, from the repository root:

    python benchmarks/check_ds_quantizer_cuda.py --copy-to build/dsq_csrc     # here: DeepSpeed's sources, once
    python benchmarks/check_ds_quantizer_cuda.py --csrc build/dsq_csrc         # there (carry build/dsq_csrc)

It JIT-builds DeepSpeed's own sources (``ops/csrc/quantization`` and ``includes``, with the nvcc flags DeepSpeed's
``CUDAOpBuilder`` uses, ``--use_fast_math`` included), runs ``quantize``, ``dequantize``, ``swizzle_quant`` and
``quantized_reduction`` on the same fp16 inputs through both, and prints, per op: how many integer codes are
equal, the largest code difference, the largest relative difference of the stored scales, and how many
dequantized fp16 values are bit-equal. Nothing is asserted; the figures go to docs/deepspeed.md. Without a GPU,
``--device cpu --no-build`` runs the torch side alone (its dry run). The sources are DeepSpeed's (Apache-2.0):
copied into an ignored folder for the run, never into the repository.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from portspeed.integrations import ds_quantizer as tq  # noqa: E402

SOURCES = ("pt_binding.cpp", "quantize.cu", "quantize_intX.cu", "dequantize.cu", "swizzled_quantize.cu",
           "quant_reduce.cu")


def copy_sources(dest: Path) -> None:
    """DeepSpeed's quantizer sources and headers from the installed DeepSpeed into ``dest``."""
    import deepspeed

    csrc = Path(deepspeed.__file__).parent / "ops" / "csrc"
    shutil.copytree(csrc / "includes", dest / "includes", dirs_exist_ok=True)
    (dest / "quantization").mkdir(parents=True, exist_ok=True)
    for name in SOURCES:
        shutil.copy2(csrc / "quantization" / name, dest / "quantization" / name)
    print(f"copied DeepSpeed {deepspeed.__version__}'s quantizer sources to {dest}")


def build(csrc: Path) -> Any:
    from torch.utils.cpp_extension import load

    major = int(torch.version.cuda.split(".")[0])
    std = "-std=c++20" if major >= 13 or torch.version.cuda >= "12.5" else "-std=c++17"
    cap = "".join(map(str, torch.cuda.get_device_capability()))
    start = time.perf_counter()
    mod = load(name="ds_quantizer_ref", sources=[str(csrc / "quantization" / s) for s in SOURCES],
               extra_include_paths=[str(csrc / "includes")],
               extra_cflags=["-O3", std, "-g", "-Wno-reorder"],
               extra_cuda_cflags=["-O3", "--use_fast_math", std, "-U__CUDA_NO_HALF_OPERATORS__",
                                  "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
                                  f"-gencode=arch=compute_{cap},code=sm_{cap}", "-DBF16_AVAILABLE",
                                  "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT162_OPERATORS__",
                                  "-U__CUDA_NO_BFLOAT16_CONVERSIONS__"],
               verbose=False)
    print(f"built DeepSpeed's quantizer for sm_{cap} in {time.perf_counter() - start:.0f} s")
    return mod


def _codes(data: torch.Tensor, bits: int) -> torch.Tensor:
    return tq._unpack(data.cpu(), bits).int()


class Tally:
    """Per op: codes compared and equal, the largest code difference, scale and fp16 value agreement."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, float]] = {}
        self.details: list[str] = []

    def add(self, op: str, mine: tuple, ref: tuple, bits: int, deq: tuple | None = None, case: str = "") -> None:
        row = self.rows.setdefault(op, {"cases": 0, "codes": 0, "codes_equal": 0, "max_code_diff": 0,
                                        "max_scale_rel": 0.0, "values": 0, "values_equal": 0, "max_value_rel": 0.0})
        row["cases"] += 1
        a, b = _codes(mine[0], bits), _codes(ref[0], bits)
        row["codes"] += a.numel()
        row["codes_equal"] += int((a == b).sum())
        if int((a - b).abs().max() if a.numel() else 0) > 1:
            groups = mine[1].shape[0]
            bad = ((a != b).reshape(groups, -1).any(dim=1)).nonzero().reshape(-1).tolist()
            g = bad[0]
            self.details.append(f"{op} {case}: {int((a != b).sum())} codes differ in groups {bad[:8]}; group {g}: "
                                f"mine {mine[1].reshape(groups, -1)[g].tolist()} DeepSpeed "
                                f"{ref[1].reshape(groups, -1)[g].tolist()}")
        row["max_code_diff"] = max(row["max_code_diff"], int((a - b).abs().max()) if a.numel() else 0)
        sa, sb = mine[1].float().cpu().reshape(-1), ref[1].float().cpu().reshape(-1)
        rel = ((sa - sb).abs() / sb.abs().clamp(min=1e-30)).max().item()
        row["max_scale_rel"] = max(row["max_scale_rel"], rel)
        if deq is not None:
            x, y = deq[0].cpu(), deq[1].cpu()
            row["values"] += x.numel()
            row["values_equal"] += int((x.view(torch.int16) == y.view(torch.int16)).sum())
            big = y.float().abs().max().item() or 1.0
            row["max_value_rel"] = max(row["max_value_rel"], (x.float() - y.float()).abs().max().item() / big)

    def render(self) -> str:
        out = [f"{'op':<44}{'cases':>6}{'codes equal':>22}{'max code diff':>15}{'max scale rel':>15}"
               f"{'fp16 values bit-equal':>26}{'max value rel':>15}"]
        for op, r in self.rows.items():
            codes = f"{r['codes_equal']}/{r['codes']}"
            vals = f"{r['values_equal']}/{r['values']}" if r["values"] else "-"
            out.append(f"{op:<44}{r['cases']:>6}{codes:>22}{r['max_code_diff']:>15}{r['max_scale_rel']:>15.2e}"
                       f"{vals:>26}{r['max_value_rel']:>15.2e}")
        return "\n".join(out)


def _input(groups: int, per: int, gen: torch.Generator, dev: torch.device) -> torch.Tensor:
    x = torch.randn(groups, per, generator=gen, device=dev) * torch.rand(groups, 1, generator=gen, device=dev) * 4
    if groups > 2:
        x[1] = 0  # an all-zero group
        x[2] = 0.75  # a constant group (asymmetric: max == min)
    return x.half()


def run(ds: Any, dev: torch.device, tally: Tally, seed: int = 0) -> None:
    gen = torch.Generator(device=dev).manual_seed(seed)
    impl = ds if ds is not None else tq
    sym, asym = impl.Symmetric, impl.Asymmetric
    for bits in (8, 4):
        for qtype, mine_t in ((sym, tq.Symmetric), (asym, tq.Asymmetric)):
            name = f"{bits}-bit {'sym' if mine_t == tq.Symmetric else 'asym'}"
            for per in (8, 16, 24, 64, 128, 136, 160, 256, 512, 1000, 1024, 2048, 4096, 6000, 8000):
                groups = 37
                x = _input(groups, per, gen, dev)
                ref = impl.quantize(x, groups, bits, qtype)
                mine = tq.quantize(x, groups, bits, mine_t)
                deq = (tq.dequantize(ref[0], ref[1], groups, bits, mine_t), impl.dequantize(ref[0], ref[1], groups,
                                                                                             bits, qtype))
                tally.add(f"quantize {name}", mine, ref, bits, deq, case=f"per {per}")
                if dev.type != "cpu":  # the same torch ops on the host
                    on_host = tq.quantize(x.cpu(), groups, bits, mine_t)
                    tally.add(f"quantize {name}, torch on cpu vs {dev.type}", on_host, mine, bits, case=f"per {per}")
            for nodes, devices, pipe in ((2, 1, 1), (2, 2, 1), (4, 2, 1), (2, 4, 2), (1, 8, 1)):
                for per in (8, 16, 64, 512, 1024, 9000):
                    groups = nodes * devices * pipe * 3
                    x = _input(groups, per, gen, dev)
                    ref = impl.swizzle_quant(x, groups, bits, qtype, pipe, nodes, devices)
                    mine = tq.swizzle_quant(x, groups, bits, mine_t, pipe, nodes, devices)
                    tally.add(f"swizzle_quant {name}", mine, ref, bits, case=f"{nodes}x{devices}x{pipe} per {per}")
            for devices in (1, 2, 4, 8, 16):
                for per in (8, 16, 64, 256, 512, 4096):
                    out_groups = 6
                    in_groups = out_groups * devices
                    parts = [impl.quantize(_input(out_groups, per, gen, dev), out_groups, bits, qtype)
                             for _ in range(devices)]
                    data = torch.cat([p[0].reshape(-1) for p in parts])
                    scales = torch.cat([p[1] for p in parts])
                    ref = impl.quantized_reduction(data, scales, in_groups, out_groups, bits, qtype, devices)
                    mine = tq.quantized_reduction(data, scales, in_groups, out_groups, bits, mine_t, devices)
                    deq = (tq.dequantize(mine[0], mine[1], out_groups, bits, mine_t),
                           impl.dequantize(ref[0], ref[1], out_groups, bits, qtype))
                    tally.add(f"quantized_reduction {name}", mine, ref, bits, deq, case=f"D {devices} per {per}")
                    if mine_t == tq.Asymmetric and devices > 1:
                        # DeepSpeed's kernel offsets tensor j's parameters by j * groups floats, not 2 * j * groups
                        flat = scales.reshape(-1)
                        index = torch.arange(devices, device=dev)[:, None] * out_groups + \
                            2 * torch.arange(out_groups, device=dev)[None, :]
                        shifted = torch.stack((flat[index], flat[index + 1]), dim=-1).reshape(in_groups, 2)
                        mine = tq.quantized_reduction(data, shifted, in_groups, out_groups, bits, mine_t, devices)
                        tally.add(f"quantized_reduction {name}, DeepSpeed's offsets", mine, ref, bits,
                                  case=f"D {devices} per {per}")


def input_dtypes(ds: Any, dev: torch.device) -> list[str]:
    """qgZ's path (swizzle_quant, then dequantize) on fp16, bf16 and fp32 gradients: the error of the round trip.

    DeepSpeed's coalesced_collectives hands the gradient to swizzle_quant in its own dtype; the kernel reads
    ``__half``. portspeed's ops convert to fp16 first.
    """
    impl = ds if ds is not None else tq
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3)).to(dev)
    lines = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        row = []
        for name, ops in (("DeepSpeed" if ds is not None else "torch (dry run)", impl), ("portspeed", tq)):
            data, scales = ops.swizzle_quant(x.to(dtype), 64, 4, ops.Symmetric, 1, 2, 1)
            back = tq.dequantize(data, scales, 64, 4, tq.Symmetric).float().reshape(-1)
            # swizzled [nodes 2, devices 1, groups]: the identity layout for 1 device per node
            err = ((back - x.reshape(-1).float()).abs().max() / x.abs().max()).item()
            row.append(f"{name} {err:.3f}")
        lines.append(f"  {str(dtype).replace('torch.', ''):<9} " + ", ".join(row))
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--copy-to", type=Path, help="copy DeepSpeed's quantizer sources here and stop")
    p.add_argument("--csrc", type=Path, default=Path("build/dsq_csrc"), help="DeepSpeed's ops/csrc (copied)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-build", action="store_true", help="the torch side alone (dry run, e.g. --device cpu)")
    args = p.parse_args()
    if args.copy_to:
        copy_sources(args.copy_to)
        return 0
    dev = torch.device(args.device)
    print(f"torch {torch.__version__}, device {dev}"
          + (f" ({torch.cuda.get_device_name()})" if dev.type == "cuda" else ""))
    ds = None if args.no_build else build(args.csrc)
    tally = Tally()
    start = time.perf_counter()
    run(ds, dev, tally)
    print(f"\n{'torch ops vs themselves (dry run)' if ds is None else 'torch ops vs DeepSpeed CUDA kernels'}, "
          f"{time.perf_counter() - start:.1f} s:\n{tally.render()}")
    print("\nqgZ's swizzle_quant + dequantize, int4 groups of 64, largest error over the largest |x| "
          "(one int4 step is 0.125):\n" + "\n".join(input_dtypes(ds, dev)))
    if tally.details:
        print("\ncases with a code more than 1 apart:\n" + "\n".join(tally.details))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "ds_quantizer_cuda.json").write_text(json.dumps(tally.rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
