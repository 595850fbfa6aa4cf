"""A/B: a training step of examples/pretrain_gpt.py on the test device vs on the CPU.

The test device (a C++ PrivateUse1 device, not hardware) runs every operator through the
CPU kernels behind a checked fallback that copies operands to the host and results back,
and its CCL stages every collective through host buffers: correctness, not speed. This
measures what that costs, so the test-device tests can be budgeted.

The trainer prints each step's time (``--print-step-time``, measured around one training
step in the process); the first ``--warmup`` steps are dropped. Runs alternate
cpu/testdev and testdev/cpu; the ratio of the medians is printed::

    OMP_NUM_THREADS=1 python benchmarks/bench_testdev_step.py --reps 2 --layout tp2
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {"tp1": (1, []), "tp2": (2, ["--tp", "2"]), "pp2": (2, ["--pp", "2"])}
_STEP = re.compile(r"step time ms: (\S+)")


def run(adapter: str, nproc: int, extra: list[str], iters: int) -> list[float]:
    from portspeed.testing import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), str(REPO / "examples" / "pretrain_gpt.py"), *extra,
           "--iters", str(iters), "--print-step-time"]
    env = {**os.environ, "PORTSPEED_ACCELERATOR": adapter, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{adapter} run failed:\n{res.stderr[-3000:]}")
    return [float(m.group(1)) for m in _STEP.finditer(res.stdout)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="tp1")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    nproc, extra = LAYOUTS[args.layout]
    steps: dict[str, list[float]] = {"cpu": [], "testdev": []}
    for rep in range(args.reps):
        for adapter in (("cpu", "testdev") if rep % 2 == 0 else ("testdev", "cpu")):
            times = run(adapter, nproc, extra, args.iters)[args.warmup:]
            steps[adapter] += times
            print(f"rep {rep} {adapter:8s} step median {statistics.median(times):.1f} ms over {len(times)}", flush=True)
    cpu, dev = statistics.median(steps["cpu"]), statistics.median(steps["testdev"])
    print(f"layout {args.layout}: step median cpu {cpu:.1f} ms, testdev {dev:.1f} ms, testdev/cpu {dev / cpu:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
