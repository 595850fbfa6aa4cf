"""``--perf``'s cost on stock Megatron-LM ``pretrain_gpt.py`` at sequence 2,048, on the CPU and the test device:
recording off, module level and op level, each a fresh run, every timed iteration recorded.

Why a stock step beside the example's (``bench_perf.py``): the aims (module level <= 1.05x the step, op level
<= 1.5x) are stated for the stock script at a 2k-token step, where the per-call cost of the hooks and the dispatch
mode is weighed against real work. The step is timed by ``benchmarks/stock_step_timer.py`` in the worker's CPU
seconds (robust to a shared machine), as ``bench_probe_stock.py`` times the probe. The configurations run in
rounds (off, module, op, off, ...) so that a change in the machine's load falls on all of them; the ratio is each
configuration's median over the rounds against off's, on the same device.

    OMP_NUM_THREADS=1 MEGATRON_LM_ROOT=/path/to/Megatron-LM python benchmarks/bench_perf_stock.py
    ... --devices cpu --rounds 3 --stock-iters 8
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_te_kernels as te  # noqa: E402  (its stock_run: one stock run through portspeed run, step times)
from bench_probe_stock import add_stock_run_args  # noqa: E402

LEVELS = ("off", "module", "op")


def _env(device: str, level: str, folder: Path, iters: int) -> dict[str, str]:
    env = {"PORTSPEED_ACCELERATOR": device}
    if level != "off":
        env.update(PORTSPEED_PERF=str(folder), PORTSPEED_PERF_LEVEL=level, PORTSPEED_PERF_ITERATIONS=f"1:{iters}")
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", nargs="+", default=["cpu", "testdev"])
    p.add_argument("--rounds", type=int, default=2)
    add_stock_run_args(p)
    args = p.parse_args(argv)
    times: dict[tuple[str, str], list[float]] = {}
    root, failed = Path(tempfile.mkdtemp(prefix="perf_stock_")), False
    try:
        for r in range(args.rounds):
            for device in args.devices:
                for level in LEVELS:
                    folder = root / f"{device}-{level}-{r}"
                    row = te.stock_run(f"perf {device} {level} {r}", ["--attention-dropout", "0"],
                                       _env(device, level, folder, args.stock_iters), args)
                    if level != "off" and folder.is_dir():
                        files = [f for f in folder.rglob("*") if f.is_file()]
                        row["disk_kb"] = round(sum(f.stat().st_size for f in files) / 1024, 1)
                    print(json.dumps(row), flush=True)
                    if "time_s" in row:
                        times.setdefault((device, level), []).append(row["time_s"])
                    else:
                        failed = True
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for device in args.devices:
        off = times.get((device, "off"))
        if not off:
            continue
        base = statistics.median(off)
        print(json.dumps({"device": device, "off_cpu_s_per_step": round(base, 3),
                          **{level: round(statistics.median(times[(device, level)]) / base, 3)
                             for level in LEVELS[1:] if (device, level) in times}}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
