"""What keeping GroupedLinear's per-expert weights costs when a grouped GEMM kernel serves it.

Why: the portable TE's ``GroupedLinear`` keeps one parameter per expert (``weight0..n-1``: the
checkpoint keys Megatron shares between grouped and sequential experts), so a grouped kernel
(``grouped_mm``) gets the weights stacked at call time, and their gradient split back. This prints
that stack (with its backward) beside the layer's forward+backward through the loop and through the
stacked ``grouped_mm`` (on CPU torch's own ``grouped_mm`` is a loop: the difference there is the
stack, not a kernel). Medians of 5 after 2 warm-ups; nothing asserted.

    OMP_NUM_THREADS=1 python benchmarks/bench_grouped_stack.py [--device cuda]
        [--experts 8 --hidden 512 --ffn 1024 --tokens 2048]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch

from portspeed.accelerator import adapter_class, get_accelerator, set_accelerator
from portspeed.portable_te import kernels
from portspeed.portable_te.grouped import GroupedLinear


def _median(fn: Callable[[], Any], sync: Callable[[], None]) -> float:
    times = []
    for _ in range(7):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=2048)
    args = p.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    base = type(get_accelerator())

    class Loop(base):  # type: ignore[misc, valid-type]
        def has_grouped_mm(self, dtype: torch.dtype) -> bool:
            return False

    class Declares(base):  # type: ignore[misc, valid-type]
        def has_grouped_mm(self, dtype: torch.dtype) -> bool:  # on a GPU: what the adapter itself declares
            return True if args.device == "cpu" else super().has_grouped_mm(dtype)

    sync = (lambda: torch.cuda.synchronize()) if args.device == "cuda" else (lambda: None)
    print(f"GroupedLinear {args.experts} experts, {args.hidden} -> {args.ffn}, {args.tokens} tokens, "
          f"{args.device}: forward+backward, median ms")
    print(f"{'dtype':<10} {'loop':>9} {'stacked grouped_mm':>19} {'stack alone':>12}")
    for dtype in (torch.float32, torch.bfloat16):
        row = []
        for acc in (Loop(), Declares()):
            set_accelerator(acc)
            kernels.reset()
            torch.manual_seed(0)
            layer = GroupedLinear(args.experts, args.hidden, args.ffn, bias=False, device=args.device,
                                  params_dtype=dtype, init_method=torch.nn.init.normal_)
            x = torch.randn(args.tokens, args.hidden, dtype=dtype, device=args.device, requires_grad=True)
            splits = [args.tokens // args.experts] * args.experts
            splits[-1] += args.tokens - sum(splits)
            row.append(_median(lambda: layer(x, splits).sum().backward(), sync))
        weights = [getattr(layer, f"weight{i}") for i in range(args.experts)]
        stack = _median(lambda: torch.stack(weights).transpose(1, 2).sum().backward(), sync)
        print(f"{str(dtype).replace('torch.', ''):<10} {row[0] * 1e3:>9.1f} {row[1] * 1e3:>19.1f} {stack * 1e3:>12.1f}")


if __name__ == "__main__":
    main()
