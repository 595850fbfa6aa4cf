"""The probe's cost on a GPU: the example trainer's step with probing off, module statistics, op statistics and
``--probe-nan``, one GPU, A/B in one run (part of gpu_check.sh; ``--device cpu`` for a tiny dry run).

Why a GPU part: the probe computes its statistics on the device and reads them back once per iteration; on the
CPU "the device" is the host, so only a GPU shows whether the per-module kernels and the one transfer stay cheap.
Every configuration probes EVERY iteration (``PORTSPEED_PROBE_ITERATIONS=1:N``), so the median step is a probed
step; ``--probe-nan`` watches every iteration by design. Prints one JSON object: median step ms per
configuration, the ratio to probing off, and the disk one probed iteration takes.

    python benchmarks/check_probe_cuda.py [--device cuda|cpu] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEP = "step time ms: "
SIZES = {
    "cuda": (["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
              "--vocab-size", "32000", "--micro-batch-size", "4", "--global-batch-size", "4"], 20, 4),
    "cpu": (["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--vocab-size", "128", "--micro-batch-size", "2", "--global-batch-size", "2"], 4, 1),
}
CONFIGS = {  # name -> probe environment (besides the folder and the iterations)
    "off": None,
    "module": {"PORTSPEED_PROBE_LEVEL": "module"},
    "op": {"PORTSPEED_PROBE_LEVEL": "op"},
    # watches every iteration, records the first
    "nan": {"PORTSPEED_PROBE_NAN": "1", "PORTSPEED_PROBE_ITERATIONS": "1:1"},
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(device: str, probe: dict[str, str] | None, folder: Path, timeout: float) -> list[float]:
    args, iters, skip = SIZES[device]
    env = {**os.environ, "PORTSPEED_ACCELERATOR": device, "PYTHONWARNINGS": "ignore"}
    if probe is not None:
        env.update({"PORTSPEED_PROBE_DIR": str(folder), "PORTSPEED_PROBE_ITERATIONS": f"1:{iters}"})
        env.update(probe)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
           "--master-port", str(_port()), str(REPO / "examples" / "pretrain_gpt.py"), *args, "--iters", str(iters),
           "--print-step-time"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"exit {out.returncode}: {(out.stderr or out.stdout)[-800:]}")
    times = [float(line[len(STEP):]) for line in out.stdout.splitlines() if line.startswith(STEP)]
    if len(times) <= skip:
        raise RuntimeError("no 'step time ms' lines after the warm-up steps")
    return times[skip:]


def _disk_per_iteration(folder: Path) -> float | None:
    steps = [p for p in folder.glob("step*") if p.is_dir()]
    if not steps:
        return None
    total = sum(f.stat().st_size for s in steps for f in s.rglob("*") if f.is_file())
    return total / len(steps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=sorted(SIZES))
    p.add_argument("--out", type=Path, default=None, help="write check_probe_cuda.json here too")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per run")
    args = p.parse_args(argv)
    result: dict[str, object] = {"device": args.device}
    medians: dict[str, float] = {}
    root = Path(tempfile.mkdtemp(prefix="probe_cost_"))
    try:
        for name, probe in CONFIGS.items():
            folder = root / name
            try:
                medians[name] = statistics.median(_run(args.device, probe, folder, args.timeout))
            except Exception as exc:  # noqa: BLE001 - a failed configuration is a row of the result
                result[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[-600:]
                continue
            if probe is not None and name != "nan":
                result[f"{name}_bytes_per_iteration"] = _disk_per_iteration(folder)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["median_step_ms"] = medians
    if "off" in medians:
        result["ratio_to_off"] = {k: round(v / medians["off"], 3) for k, v in medians.items() if k != "off"}
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "check_probe_cuda.json").write_text(json.dumps(result, indent=1))
    return 0 if "ratio_to_off" in result and not any(k.endswith("_error") for k in result) else 1


if __name__ == "__main__":
    sys.exit(main())
