"""A/B of the portable Transformer Engine's kernels: fused torch operators vs the reference arithmetic.

Why: the portable TE must be fast by construction (issue 23): attention through
``F.scaled_dot_product_attention`` instead of matmul-softmax-matmul, and the whole stock step no
slower than Megatron's local spec. Nothing here is asserted; it prints a table (medians, one
thread) and, with ``--json``, writes the rows. Parts (``--parts``, default all three):

- ``attention``: one causal forward+backward (b 1, 16 heads, head dim 64; GQA: 4 key/value heads)
  at each ``--seqs`` length, fp32 and bf16, ``fused`` vs ``reference``: median time and peak memory
  above the case's baseline (inputs made, nothing run). On CPU each case runs in a forked process
  (peak RSS from ``resource``'s maxrss minus the child's baseline; time is the process's CPU time,
  which other load on a shared host leaves alone); on CUDA in this process
  (``torch.cuda.max_memory_allocated``, peak stats reset per case), with the SDPA backend torch
  chose (``torch._fused_sdp_choice``). A reference case whose score matrices would not fit in the
  memory available is skipped with the reason printed.
- ``stock``: stock ``pretrain_gpt.py`` (``MEGATRON_LM_ROOT``; fp32, 2 layers, hidden 512, 8 heads,
  sequence 2048, micro-batch 1, ``--attention-dropout 0``) on CPU: the default TE path (portable TE)
  vs ``--transformer-impl local`` vs ``PORTSPEED_TE_KERNELS=reference``, and the TE path once with
  Megatron's default attention dropout (0.1): median step time and peak RSS of the whole run.
- ``moe``: the same stock script with 4 experts (top-2): ``--moe-grouped-gemm`` (TEGroupedMLP over the
  portable ``GroupedLinear``) vs SequentialMLP: median step time and peak RSS.

    OMP_NUM_THREADS=1 MEGATRON_LM_ROOT=/path/to/Megatron-LM python benchmarks/bench_te_kernels.py
    python benchmarks/bench_te_kernels.py --quick                 # small sizes, a few minutes
    python benchmarks/bench_te_kernels.py --parts attention --device cuda --seqs 1024,2048,4096,8192,16384
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
HEADS, HEAD_DIM, GQA_GROUPS = 16, 64, 4
STEP = re.compile(r"STEP_CPU_S ([0-9.]+) WALL_S ([0-9.]+)")


# --------------------------------------------------------------------------------------------- attention
def attention_impls() -> dict[str, Callable[..., Any]]:
    """impl name -> ``fn(q, k, v, scale)``, causal attention on ``[b, h, s, d]`` (k / v may have fewer heads).

    The one place that says what "fused" and "reference" are: the portable TE's kernel registry's
    ``torch`` and ``reference`` implementations of the ``attention`` op (``portable_te/sdpa.py``).
    """
    from portspeed.portable_te import sdpa

    def fused(q, k, v, scale):
        return sdpa.attention_torch(q, k, v, attn_mask=None, causal="top_left", scale=scale, dropout_p=0.0)

    def reference(q, k, v, scale):
        return sdpa.attention_reference(q, k, v, attn_mask=None, causal="top_left", scale=scale, dropout_p=0.0)

    return {"fused": fused, "reference": reference}


#: aten op (a substring of its name) -> the SDPA backend it is; the first that ran names the backend
BACKEND_OPS = (("_scaled_dot_product_flash_attention_for_cpu", "flash (cpu)"),
               ("_scaled_dot_product_flash_attention", "flash"), ("_scaled_dot_product_cudnn_attention", "cudnn"),
               ("_scaled_dot_product_efficient_attention", "efficient"),
               ("_scaled_dot_product_fused_attention_overrideable", "overrideable"),
               ("_scaled_dot_product_attention_math", "math"))


def sdpa_backend(step: Callable[[], Any]) -> str:
    """Which SDPA backend one call of ``step`` ran, from the profiler's aten op names (CPU activity: works anywhere)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    names = " ".join(e.key for e in prof.key_averages())
    return next((backend for op, backend in BACKEND_OPS if op in names), "none")


def reference_bytes(seq: int, dtype: str) -> int:
    """About what the reference holds at its peak: scores, fp32 probabilities and their gradients.

    12 bytes per score: measured here 799 MB (fp32) and 797 MB (bf16) at 2k, ~3.2 GB at 4k (16 heads).
    """
    return int(HEADS * seq * seq * 12)


def available_bytes(device: str) -> int:
    """Memory a case may use now: MemAvailable on the host, free memory on the GPU."""
    if device == "cuda":
        import torch

        return int(torch.cuda.mem_get_info()[0])
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 1 << 62


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """Time one forward+backward case; peak memory above the baseline of inputs made, nothing run."""
    import torch

    device, seq, impl = case["device"], case["seq"], case["impl"]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[case["dtype"]]
    hkv = HEADS // GQA_GROUPS if case["kind"] == "gqa" else HEADS
    torch.manual_seed(0)
    q = torch.randn(1, HEADS, seq, HEAD_DIM, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, hkv, seq, HEAD_DIM, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(1, hkv, seq, HEAD_DIM, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(1, HEADS, seq, HEAD_DIM, device=device, dtype=dtype)
    fn, scale = attention_impls()[impl], 1.0 / math.sqrt(HEAD_DIM)
    cuda = device == "cuda"

    def step() -> float:
        """Seconds of one forward+backward: wall on CUDA (synchronised); this process's CPU time on the host,
        which one thread's work keeps whatever else the machine runs (wall time is kept as wall_s)."""
        for t in (q, k, v):
            t.grad = None
        if cuda:
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        fn(q, k, v, scale).backward(grad)
        if cuda:
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        return walls[-1] if cuda else time.process_time() - c0

    walls: list[float] = []

    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _maxrss_bytes()
    first = step()  # the warm-up run is the one whose peak counts (maxrss only grows)
    peak = (torch.cuda.max_memory_allocated() if cuda else _maxrss_bytes()) - base
    repeats = case["repeats"] if first < case["long_s"] else 1
    times = [step() for _ in range(repeats)]
    row = {**case, "time_s": statistics.median(times), "wall_s": statistics.median(walls[1:]), "n": len(times),
           "peak_mb": peak / 2**20, "clock": "wall" if cuda else "cpu"}
    if impl == "fused":
        row["backend"] = sdpa_backend(step)
    return row


def attention_cases(args: argparse.Namespace) -> list[dict[str, Any]]:
    cases = []
    for seq in args.seqs:
        for dtype in args.dtypes:
            for kind in ("mha", "gqa"):
                for impl in ("fused", "reference"):
                    cases.append({"device": args.device, "seq": seq, "dtype": dtype, "kind": kind, "impl": impl,
                                  "repeats": args.repeats, "long_s": args.long_s})
    return cases


def attention_part(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for case in attention_cases(args):
        what = f"attention {case['impl']} s={case['seq']} {case['dtype']} {case['kind']}"
        need = reference_bytes(case["seq"], case["dtype"]) if case["impl"] == "reference" else 0
        if args.device == "cuda":  # what the last case left in the caching allocator counts as free
            import torch

            torch.cuda.empty_cache()
        free = available_bytes(args.device)
        if need > 0.9 * free:
            rows.append({**case, "skipped": f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB available"})
            print(f"{what}: skipped ({rows[-1]['skipped']})", flush=True)
            continue
        try:
            if args.device == "cuda":
                row = run_case(case)
            else:
                row = _in_fork(case)
        except Exception as exc:  # noqa: BLE001 - one failed case is a row, not the end of the table
            if type(exc).__name__ == "OutOfMemoryError":  # the estimate above was short: a size limit, not a fault
                row = {**case, "skipped": f"out of memory ({free / 2**30:.1f} GiB were free)"}
            else:
                row = {**case, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        rows.append(row)
        if args.json:  # after every case: a run stopped by a timeout keeps what it measured
            Path(args.json).write_text(json.dumps(rows, indent=1))
        figures = ("time_s" in row and f"{row['time_s']:.4f} s (n={row['n']}), {row['peak_mb']:.0f} MB"
                   + (f", {row['backend']}" if "backend" in row else ""))
        print(f"{what}: {row.get('error') or row.get('skipped') or figures}", flush=True)
    return rows


def _in_fork(case: dict[str, Any]) -> dict[str, Any]:
    """Run one case in a forked child: its own maxrss (Linux starts a child's high-water mark at its RSS at
    the fork, the torch already imported), without paying a fresh interpreter's torch import per case."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one case, its row down the pipe, then out without running the parent's exit code
        os.close(read)
        try:
            payload = json.dumps(run_case(case))
        except BaseException as exc:  # noqa: BLE001 - said to the parent, which makes it the case's row
            payload = json.dumps({"child_error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        with os.fdopen(write, "w") as fh:
            fh.write(payload)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as fh:
        data = fh.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        raise RuntimeError(f"the case's process ended with status {status} and no result (killed: out of memory?)")
    row = json.loads(data)
    if "child_error" in row:
        raise RuntimeError(row["child_error"])
    return row


# --------------------------------------------------------------------------------------------- stock runs
STOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024", "--num-layers", "2",
         "--hidden-size", "512", "--num-attention-heads", "8", "--micro-batch-size", "1", "--global-batch-size", "1",
         "--lr", "1e-4", "--eval-interval", "1000", "--eval-iters", "0", "--log-interval", "1", "--num-workers", "0",
         "--seed", "1234"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
       "--disable-bias-linear"]


def stock_run(name: str, flags: list[str], env_extra: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """One stock pretrain_gpt.py run through ``portspeed run`` (the CPU adapter unless ``env_extra`` names one):
    median step time, peak RSS of the run."""
    root = os.environ.get("MEGATRON_LM_ROOT", "")
    row: dict[str, Any] = {"part": "stock", "name": name}
    if not (Path(root) / "pretrain_gpt.py").is_file():
        return {**row, "skipped": "MEGATRON_LM_ROOT is not set to a Megatron-LM checkout"}
    seq = str(args.stock_seq)
    cmd = [sys.executable, "-m", "portspeed.cli", "run", "--adaptor", "benchmarks.stock_step_timer",
           "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
           "--master-port", str(20000 + (os.getpid() * 7 + len(name)) % 20000), f"{root}/pretrain_gpt.py", *STOCK,
           "--seq-length", seq, "--max-position-embeddings", seq, "--train-iters", str(args.stock_iters), *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (args.portspeed_from, root, str(REPO),
                                                      os.environ.get("PYTHONPATH", "")) if p))
    env.update({"PORTSPEED_ACCELERATOR": "cpu", **env_extra})  # env_extra may name another adapter
    # a fresh parent per run: RUSAGE_CHILDREN's maxrss is the largest descendant it waited for (the worker)
    wrapper = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
               "print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")
    try:
        out = subprocess.run([sys.executable, "-c", wrapper, *cmd], env=env, capture_output=True, text=True,
                             timeout=args.case_timeout)
    except subprocess.TimeoutExpired:
        return {**row, "error": f"timed out after {args.case_timeout} s"}
    text = out.stdout + out.stderr
    if args.log_dir:
        Path(args.log_dir, f"stock_{name.replace(' ', '_')}.log").write_text(text)
    if out.returncode != 0:
        return {**row, "error": f"exit {out.returncode}: {text[-400:]}"}
    steps = [(float(c), float(w)) for c, w in STEP.findall(text)][args.stock_skip:]  # benchmarks/stock_step_timer.py
    rss = re.search(r"MAXRSS_KB (\d+)", text)
    if not steps or rss is None:
        return {**row, "error": "no step times or maxrss in the output"}
    return {**row, "time_s": statistics.median(c for c, _ in steps), "wall_s": statistics.median(w for _, w in steps),
            "n": len(steps), "peak_mb": int(rss.group(1)) / 1024, "clock": "cpu",
            "portable_te": "portable Transformer Engine" in text}


def stock_part(args: argparse.Namespace) -> list[dict[str, Any]]:
    no_drop = ["--attention-dropout", "0"]
    runs = [("TE path (torch kernels)", no_drop, {}), ("local spec", no_drop + ["--transformer-impl", "local"], {}),
            ("TE path, PORTSPEED_TE_KERNELS=reference", no_drop, {"PORTSPEED_TE_KERNELS": "reference"}),
            ("TE path, attention dropout 0.1", [], {})]
    return _runs(runs, args, "stock")


def moe_part(args: argparse.Namespace) -> list[dict[str, Any]]:
    flags = MOE + ["--attention-dropout", "0"]
    runs = [("MoE grouped experts (--moe-grouped-gemm)", flags + ["--moe-grouped-gemm"], {}),
            ("MoE SequentialMLP", flags, {}),
            ("MoE grouped experts, PORTSPEED_TE_KERNELS=reference", flags + ["--moe-grouped-gemm"],
             {"PORTSPEED_TE_KERNELS": "reference"})]
    return _runs(runs, args, "moe")


def _runs(runs: list, args: argparse.Namespace, part: str) -> list[dict[str, Any]]:
    rows = []
    for name, flags, env in runs:
        row = {**stock_run(name, flags, env, args), "part": part}
        rows.append(row)
        figures = "time_s" in row and (f"{row['time_s']:.3f} cpu s/step, {row['wall_s']:.3f} wall s/step "
                                       f"(n={row['n']}), peak RSS {row['peak_mb']:.0f} MB")
        print(f"{part} {name}: {row.get('error') or row.get('skipped') or figures}", flush=True)
    return rows


# --------------------------------------------------------------------------------------------- the table
def table(rows: list[dict[str, Any]]) -> str:
    """The rows as one text table; for attention the fused/reference ratios (goal at 4k: time <= 0.5, mem <= 1/8)."""
    lines = []
    att = [r for r in rows if "impl" in r]
    if att:
        clock = "cpu" if att[0].get("device") == "cpu" else "wall"
        lines.append(f"attention forward+backward, causal, b 1, {HEADS} heads (GQA: {HEADS // GQA_GROUPS} kv heads), "
                     f"head dim {HEAD_DIM}; {clock} seconds, peak MB above the inputs")
        lines.append(f"{'attention fwd+bwd':<24}{'fused s':>10}{'ref s':>10}{'time f/r':>9}{'fused MB':>10}"
                     f"{'ref MB':>10}{'mem f/r':>9}  fused backend")
        keys = sorted({(r["seq"], r["dtype"], r["kind"]) for r in att},
                      key=lambda k: (k[1] != "fp32", k[2] != "mha", k[0]))
        by_case = {(x["seq"], x["dtype"], x["kind"], x["impl"]): x for x in att}
        for seq, dtype, kind in keys:
            f, r = by_case.get((seq, dtype, kind, "fused"), {}), by_case.get((seq, dtype, kind, "reference"), {})
            lines.append(f"{f's={seq} {dtype} {kind}':<24}{_num(f, 'time_s', '.3f'):>10}{_num(r, 'time_s', '.3f'):>10}"
                         f"{_ratio(f, r, 'time_s'):>9}{_num(f, 'peak_mb', '.0f'):>10}{_num(r, 'peak_mb', '.0f'):>10}"
                         f"{_ratio(f, r, 'peak_mb'):>9}  {f.get('backend', '')}")
        for r in att:
            if "skipped" in r or "error" in r:
                lines.append(f"  {r['impl']} s={r['seq']} {r['dtype']} {r['kind']}: "
                             f"{'skipped: ' + r['skipped'] if 'skipped' in r else 'FAILED: ' + r['error']}")
    runs = [r for r in rows if "name" in r]
    if runs:
        lines.append(f"{'stock pretrain_gpt.py (CPU, one thread)':<50}{'cpu s/step':>11}{'wall s/step':>12}"
                     f"{'peak RSS MB':>13}")
        for r in runs:
            state = r.get("skipped") and f"skipped: {r['skipped']}" or r.get("error") and f"FAILED: {r['error'][:200]}"
            lines.append(f"{r['part'] + ': ' + r['name']:<50}" + (
                f"  {state}" if state else f"{r['time_s']:>11.3f}{r['wall_s']:>12.3f}{r['peak_mb']:>13.0f}"))
    return "\n".join(lines)


def _num(row: dict, key: str, fmt: str) -> str:
    return format(row[key], fmt) if key in row else "-"


def _ratio(a: dict, b: dict, key: str) -> str:
    return f"{a[key] / b[key]:.3f}" if key in a and key in b and b[key] > 0 else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="attention,stock,moe", help="comma-separated: attention, stock, moe")
    p.add_argument("--quick", action="store_true", help="small sizes: sequences 256,512; stock sequence 512, 4 iters")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the attention part runs")
    p.add_argument("--seqs", default=None, help="attention sequence lengths (default 1024,2048,4096,8192)")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per case after the warm-up (CPU 3, CUDA 20)")
    p.add_argument("--long-s", type=float, default=10.0, help="a case whose warm-up takes longer is timed once")
    p.add_argument("--stock-seq", type=int, default=None, help="stock sequence length (default 2048)")
    p.add_argument("--stock-iters", type=int, default=None, help="stock iterations (default 6; the first 2 untimed)")
    p.add_argument("--case-timeout", type=float, default=1800.0, help="seconds per stock run")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--log-dir", default=None, help="write the stock runs' logs here")
    p.add_argument("--portspeed-from", default="", metavar="DIR",
                   help="stock runs import portspeed from DIR (e.g. an exported older commit, for a before/after)")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_te_kernels: --device cuda, but torch.cuda.is_available() is False "
              f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); run it on a GPU or use --device cpu",
              file=sys.stderr)
        return 2
    args.seqs = [int(s) for s in (args.seqs or ("256,512" if args.quick else "1024,2048,4096,8192")).split(",")]
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = sorted(set(args.dtypes) - {"fp32", "bf16"})
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = sorted(set(parts) - {"attention", "stock", "moe"})
    if bad or unknown:
        p.error(f"unknown --dtypes {bad} / --parts {unknown}: use fp32,bf16 and attention,stock,moe")
    if args.repeats is None:
        args.repeats = 20 if args.device == "cuda" else (1 if args.quick else 3)
    args.stock_seq = args.stock_seq or (512 if args.quick else 2048)
    args.stock_iters = args.stock_iters or (4 if args.quick else 6)
    args.stock_skip = 2
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), attention on {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""), flush=True)
    rows: list[dict[str, Any]] = []
    if "attention" in parts:
        rows += attention_part(args)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    if "stock" in parts:
        rows += stock_part(args)
    if "moe" in parts:
        rows += moe_part(args)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
