"""Step time of stock ``pretrain_gpt.py`` on the TE spec (portable Transformer Engine) vs the local spec, CPU.

Why: the portable TE replaces Megatron's local layers on the default path; this says what that
costs per training step. Runs the two specs alternately (``--pairs`` times each, one process,
TP1, fp32, mock data) and reports the median ``elapsed time per iteration`` over the iterations
after the first ``--skip`` of every run, and the ratio TE / local. Nothing here is asserted.

    MEGATRON_LM_ROOT=/work/mlm/core_v0.16.1 python benchmarks/bench_te_spec.py --pairs 3
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)")


def run(root: str, impl: str | None, args: argparse.Namespace) -> list[float]:
    cmd = [sys.executable, "-m", "portspeed.cli", "run", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
           "--master-port", str(29500 + os.getpid() % 1000), f"{root}/pretrain_gpt.py",
           *(("--transformer-impl", impl) if impl else ()),
           "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
           "--num-layers", str(args.layers), "--hidden-size", str(args.hidden), "--num-attention-heads", "8",
           "--seq-length", str(args.seq), "--max-position-embeddings", str(args.seq), "--micro-batch-size", "4",
           "--global-batch-size", "8", "--lr", "1e-4", "--train-iters", str(args.iters), "--eval-interval", "1000",
           "--eval-iters", "0", "--log-interval", "1", "--num-workers", "0", "--attention-dropout", "0.0",
           "--hidden-dropout", "0.0", "--seed", "1234"]
    env = dict(os.environ, PORTSPEED_ACCELERATOR="cpu", OMP_NUM_THREADS=str(args.threads),
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"run failed ({impl or 'transformer_engine'}):\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    times = {int(m.group(1)): float(m.group(2)) for m in ITER.finditer(out.stdout + out.stderr)}
    return [t for i, t in sorted(times.items()) if i > args.skip]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--skip", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    root = os.environ.get("MEGATRON_LM_ROOT")
    if not root:
        raise SystemExit("set MEGATRON_LM_ROOT to a Megatron-LM checkout")
    te: list[float] = []
    local: list[float] = []
    for _ in range(args.pairs):
        te += run(root, None, args)
        local += run(root, "local", args)
    mt, ml = statistics.median(te), statistics.median(local)
    print(f"TE spec (portable TE): median {mt:.1f} ms/step over {len(te)} steps")
    print(f"local spec:            median {ml:.1f} ms/step over {len(local)} steps")
    print(f"ratio TE / local: {mt / ml:.3f}")


if __name__ == "__main__":
    main()
