"""Per-rank peak memory of context-parallel attention: the ring (``cp_comm_type p2p``) vs the all-gather form.

Why: the all-gather form gives every CP rank the whole sequence's keys and values (and their
gradients), the memory of CP1; the ring (``portspeed/portable_te/ring.py``) keeps about
``2 / cp`` of them. Issue 23's goal: at CP4 and sequence 8k, ring <= 0.6 x all-gather.

Each arm runs in its own ``torch.distributed.run`` job of ``--cp`` ranks on Gloo (CPU, one thread
per rank): the portable ``DotProductAttention`` (causal, ``sbhd``, fp32 unless ``--dtype``) on this
rank's share of the sequence (Megatron's two chunks), one forward+backward. Per rank: peak RSS
(``resource.getrusage`` maxrss) after the step minus the same before it (inputs made, process
group and kernel registry warmed up with a tiny step), and the step's time. Nothing is
asserted; it prints a table (and ``--json`` writes the rows).

    OMP_NUM_THREADS=1 python benchmarks/bench_cp_ring.py                      # CP4, 8k, 16 heads, hd 64
    OMP_NUM_THREADS=1 python benchmarks/bench_cp_ring.py --cp 2 --seq 2048    # quick
    OMP_NUM_THREADS=1 python benchmarks/bench_cp_ring.py --seq 4096 --dropout 0.1  # attention dropout (training)
    OMP_NUM_THREADS=1 python benchmarks/bench_cp_ring.py --thd 4                # 4 packed sequences (thd)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ARMS = {"ring": "p2p", "all-gather": "all_gather"}


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from portspeed.portable_te import attention

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(cp)))
    dtype = getattr(torch, args.dtype)

    def inputs(seq: int) -> tuple:
        local = seq // cp
        gen = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(local, args.batch, args.heads, args.head_dim, generator=gen, dtype=dtype)
                   .requires_grad_() for _ in range(3))
        grad = torch.randn(local, args.batch, args.heads * args.head_dim, generator=gen, dtype=dtype)
        fmt = {"qkv_format": "thd", "attn_mask_type": "padding_causal"} if args.thd else {"attn_mask_type": "causal"}
        module = attention.DotProductAttention(args.heads, args.head_dim, cp_group=group,
                                               attention_dropout=args.dropout, cp_global_ranks=list(range(cp)),
                                               cp_comm_type=args.comm, **fmt)
        if args.thd:  # equal sequences packed back to back: [t, h, d], the global cu_seqlens
            q, k, v = (t.detach().flatten(0, 1).requires_grad_() for t in (q, k, v))
            grad = grad.flatten(0, 1)
            n = args.thd if seq == args.seq else 1
            module.packed = {key: torch.arange(0, seq * args.batch + 1, seq * args.batch // n, dtype=torch.int32)
                             for key in ("cu_seqlens_q", "cu_seqlens_kv")}
        return module, q, k, v, grad

    def step(module: Any, q: Any, k: Any, v: Any, grad: Any) -> float:
        dist.barrier()
        t = time.perf_counter()
        module(q, k, v, **getattr(module, "packed", {})).backward(grad)
        dist.barrier()
        return time.perf_counter() - t

    step(*inputs(2 * cp * 8))  # warm-up: kernel choice, the Gloo pair connections, lazy imports
    case = inputs(args.seq)
    base = _maxrss_mb()  # inputs made
    seconds = step(*case)
    peak = _maxrss_mb()
    row = {"arm": args.arm, "rank": rank, "base_mb": round(base, 1), "peak_mb": round(peak, 1),
           "delta_mb": round(peak - base, 1), "seconds": round(seconds, 3)}
    (args.out / f"{args.arm}-{rank}.json").write_text(json.dumps(row))  # one file per rank: stdout is shared
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_arm(arm: str, args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.cp), "--master-addr",
               "127.0.0.1", "--master-port", str(_free_port()), __file__, "--worker", "--arm", arm, "--comm",
               ARMS[arm], "--seq", str(args.seq), "--heads", str(args.heads), "--head-dim", str(args.head_dim),
               "--batch", str(args.batch), "--dtype", args.dtype, "--dropout", str(args.dropout), "--thd",
               str(args.thd), "--out", out]
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.setdefault("PORTSPEED_ACCELERATOR", "cpu")
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
        rows = [json.loads(p.read_text()) for p in sorted(Path(out).glob(f"{arm}-*.json"))]
    if res.returncode != 0 or len(rows) != args.cp:
        raise SystemExit(f"{arm}: exit {res.returncode}\n{res.stderr[-3000:]}")
    return sorted(rows, key=lambda r: r["rank"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--dropout", type=float, default=0.0, help="attention dropout (the module in training mode)")
    ap.add_argument("--thd", type=int, default=0, help="pack the batch as N equal sequences (qkv_format thd)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--arm", default="ring", help=argparse.SUPPRESS)
    ap.add_argument("--comm", default="p2p", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    rows = {arm: _run_arm(arm, args) for arm in ARMS}
    kernels = os.environ.get("PORTSPEED_TE_KERNELS", "default (vendor -> torch -> reference)")
    print(f"CP{args.cp}, sequence {args.seq}, b {args.batch}, {args.heads} heads, head dim {args.head_dim}, "
          f"{args.dtype}, causal, attention dropout {args.dropout}, "
          f"{f'{args.thd} packed sequences (thd)' if args.thd else 'sbhd'}, one thread per rank, Gloo; "
          f"kernels: {kernels}")
    print(f"{'arm':<11} {'per-rank peak - baseline (MB)':<34} {'max (MB)':>9} {'step s (max)':>13}")
    worst = {}
    for arm, rs in rows.items():
        worst[arm] = max(r["delta_mb"] for r in rs)
        per_rank = ", ".join(f"{r['delta_mb']:.0f}" for r in rs)
        print(f"{arm:<11} {per_rank:<34} {worst[arm]:>9.0f} "
              f"{max(r['seconds'] for r in rs):>13.2f}")
    if worst["all-gather"] > 0:
        print(f"ring / all-gather (max per-rank peak): {worst['ring'] / worst['all-gather']:.2f}  (goal <= 0.6)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
