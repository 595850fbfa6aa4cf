"""The probe's cost on stock Megatron-LM ``pretrain_gpt.py`` at sequence 2,048 on the CPU: probing off, module
statistics, op statistics and ``--probe-nan``, each a fresh run, every timed iteration probed.

Why a stock step beside the example's (``bench_probe.py``): the example's tiny model makes the per-tensor cost of
the statistics look large against a step of milliseconds; a 2k-token step of the stock script is closer to what a
porting team probes. The step is timed by ``benchmarks/stock_step_timer.py`` in the worker's CPU seconds (robust
to a shared machine), as ``bench_te_kernels.py --parts stock`` times it.

    OMP_NUM_THREADS=1 MEGATRON_LM_ROOT=/path/to/Megatron-LM python benchmarks/bench_probe_stock.py
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_te_kernels as te  # noqa: E402  (its stock_run: one stock run through portspeed run, step times)

CONFIGS = {"off": {}, "module": {"PORTSPEED_PROBE_LEVEL": "module"}, "op": {"PORTSPEED_PROBE_LEVEL": "op"},
           "nan": {"PORTSPEED_PROBE_NAN": "1"}}


def add_stock_run_args(p: argparse.ArgumentParser) -> None:
    """The switches of one stock run (``bench_te_kernels.stock_run``'s ``args``); shared with bench_perf_stock.py."""
    p.add_argument("--stock-seq", type=int, default=2048)
    p.add_argument("--stock-iters", type=int, default=6, help="iterations; the first --stock-skip untimed")
    p.add_argument("--stock-skip", type=int, default=2)
    p.add_argument("--case-timeout", type=float, default=1200.0)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--portspeed-from", default=None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_stock_run_args(p)
    args = p.parse_args(argv)
    rows, root = [], Path(tempfile.mkdtemp(prefix="probe_stock_"))
    try:
        for name, extra in CONFIGS.items():
            env = dict(extra)
            if extra:  # every iteration recorded (nan: watched; its dump only for a non-finite iteration)
                env.update({"PORTSPEED_PROBE_DIR": str(root / name)})
                if name != "nan":
                    env["PORTSPEED_PROBE_ITERATIONS"] = f"1:{args.stock_iters}"
            row = te.stock_run(f"probe {name}", ["--attention-dropout", "0"], env, args)
            steps = sorted((root / name).glob("step*")) if extra else []
            if steps:
                row["disk_per_iteration_kb"] = sum(f.stat().st_size for s in steps for f in s.rglob("*")
                                                   if f.is_file()) / len(steps) / 1024
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    off = next((r["time_s"] for r in rows if r["name"] == "probe off" and "time_s" in r), None)
    if off:
        print(json.dumps({r["name"]: round(r["time_s"] / off, 3) for r in rows if "time_s" in r}))
    return 0 if off and all("time_s" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
