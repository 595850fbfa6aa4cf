"""The hang recorder on real NCCL: torch's own flight recorder turned on by portspeed, its dump read by why-hung.

Why a script (not a test): CI has no NVIDIA GPU, so `tests/test_trace_torch.py` checks torch's settings and
why-hung on dumps from torch's Gloo recorder only. On a lent GPU (one GPU: NCCL refuses two ranks on one
device, so one rank) this runs `tests/data/trace_faults.py` under `portspeed run` twice:

  hang:  `--hang-timeout 8`, mode `skip` on one rank: its collectives complete, then it sits in Python; the
         watchdog dumps (SIGUSR1) and ends the job. torch's NCCL buffer must be dumped next to portspeed's.
  exit:  `PORTSPEED_TRACE_ON_EXIT=1`, mode `none`: dumped at a normal exit.

Then (``cost``) the recording frame's cost on NCCL, in one process (one rank): a 4 KB ``all_reduce`` raw, routed,
and routed with the recording frame; a 4 KB funcol ``all_reduce`` (waited) raw and recorded. Arms run in
alternating blocks of calls, each block closed by a device synchronisation; medians of the per-call block means.

For each dump folder it records: the files, the closing lines, torch's dump (version, entries, states, op
names, whether completion times are filled), `portspeed why-hung` on torch's dump alone (expected: exit 1,
no divergence), and torch's own reader (`python -m torch.distributed.flight_recorder.fr_trace`) on it.
Nothing is asserted; the JSON and the printed summary are what to record in docs/reliability.md.

    python benchmarks/check_trace_nccl.py --out /tmp/gpu_check            # on the GPU (cuda adapter, NCCL)
    python benchmarks/check_trace_nccl.py --out /tmp/tn --device cpu       # dry run (Gloo: no torch dump)
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "data" / "trace_faults.py"
TORCH_PREFIX = "torch_fr_trace_rank_"


def _launch(folder: Path, args: list[str], mode: str, extra: dict[str, str], timeout: float,
            adapter: str) -> dict[str, Any]:
    env = dict(os.environ, PORTSPEED_ACCELERATOR=adapter, PORTSPEED_FRAMEWORK_MODULES="__main__",
               PORTSPEED_TRACE_DIR=str(folder), PYTHONUNBUFFERED="1", **extra)
    cmd = [sys.executable, "-m", "portspeed.cli", "run", *args, "--nproc-per-node", "1", str(SCRIPT), mode]
    start = time.monotonic()
    try:
        p = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = "timeout", str(exc.stdout or "") + str(exc.stderr or "")
    return {"cmd": " ".join(cmd[2:]), "rc": rc, "seconds": round(time.monotonic() - start, 1),
            "closing": [ln for ln in out.splitlines() if ln.startswith("portspeed run:")][-8:],
            "files": sorted(os.listdir(folder)) if folder.exists() else []}


def _torch_dump(folder: Path) -> dict[str, Any]:
    path = folder / f"{TORCH_PREFIX}0"
    if not path.exists():
        return {"present": False}
    data = pickle.loads(path.read_bytes())
    entries = data.get("entries", [])
    return {"present": True, "bytes": path.stat().st_size, "version": data.get("version"),
            "keys": sorted(data), "entries": len(entries),
            "ops": sorted({e.get("profiling_name", "?") for e in entries}),
            "states": sorted({str(e.get("state")) for e in entries}),
            "completed_times": sum(1 for e in entries if e.get("time_discovered_completed_ns")),
            "started_times": sum(1 for e in entries if e.get("time_discovered_started_ns")),
            "frames_in_first": len(entries[0].get("frames", [])) if entries else 0,
            "pg_config": {k: v for k, v in list(data.get("pg_config", {}).items())[:3]}}


def _read_alone(folder: Path) -> dict[str, Any]:
    """why-hung and torch's own reader on torch's dump alone (portspeed's own files left out)."""
    alone = folder.parent / f"{folder.name}-torch-only"
    shutil.rmtree(alone, ignore_errors=True)
    alone.mkdir()
    shutil.copy(folder / f"{TORCH_PREFIX}0", alone)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    wh = subprocess.run([sys.executable, "-m", "portspeed.cli", "why-hung", str(alone)], env=env, cwd=REPO,
                        capture_output=True, text=True, timeout=60)
    fr = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(alone),
                         "--prefix", TORCH_PREFIX], env=env, capture_output=True, text=True, timeout=60)
    return {"why_hung_rc": wh.returncode, "why_hung": (wh.stdout + wh.stderr).splitlines()[:4],
            "fr_trace_rc": fr.returncode, "fr_trace_tail": (fr.stdout + fr.stderr).splitlines()[-4:]}


def cost(blocks: int = 40, per_block: int = 200) -> dict[str, Any]:
    """The recording frame's cost on this device's backend (NCCL on a GPU), one rank, in this process."""
    import datetime
    import statistics

    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import portspeed
    from portspeed.comm import router

    os.environ["PORTSPEED_TRACE"] = "2000"
    os.environ.setdefault("PORTSPEED_TRACE_DIR", "/tmp/check_trace_nccl_cost")
    from portspeed import config
    from portspeed.trace import wrappers as trace_wrappers
    from portspeed.trace import funcol as trace_funcol

    config.reload()
    cuda = torch.cuda.is_available()
    if cuda:
        from portspeed.adapters.cuda import CudaAccelerator as Adapter
    else:
        from portspeed.adapters.cpu import CpuAccelerator as Adapter
    portspeed.set_accelerator(Adapter())
    raw = dist.all_reduce
    routed = router.COLLECTIVE_ROUTES["all_reduce"](raw)
    recorded = trace_wrappers.traced("all_reduce", router.COLLECTIVE_ROUTES["all_reduce"])(raw)
    raw_f = funcol.all_reduce
    rec_f = trace_funcol.traced("all_reduce")(raw_f)
    port = 29500 + os.getpid() % 2000
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=60))
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    t = torch.ones(1024, device=dev)
    group = dist.group.WORLD
    arms = {"raw": lambda: raw(t), "raw_again": lambda: raw(t), "routed": lambda: routed(t),
            "routed_recorded": lambda: recorded(t),
            "funcol_raw": lambda: raw_f(t, "sum", group).wait(),
            "funcol_recorded": lambda: rec_f(t, "sum", group).wait()}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for fn in arms.values():
        for _ in range(50):
            fn()
    sync()
    means: dict[str, list[float]] = {k: [] for k in arms}
    names = list(arms)
    for b in range(blocks):
        order = names[b % len(names):] + names[:b % len(names)]
        for name in order:
            fn = arms[name]
            sync()
            s0 = time.perf_counter()
            for _ in range(per_block):
                fn()
            sync()
            means[name].append((time.perf_counter() - s0) / per_block * 1e6)
    med = {k: statistics.median(v) for k, v in means.items()}
    dist.destroy_process_group()
    return {"us_per_call": {k: round(v, 2) for k, v in med.items()},
            "ratios": {"raw_again/raw": round(med["raw_again"] / med["raw"], 3),
                       "routed/raw": round(med["routed"] / med["raw"], 3),
                       "routed_recorded/raw": round(med["routed_recorded"] / med["raw"], 3),
                       "routed_recorded/routed": round(med["routed_recorded"] / med["routed"], 3),
                       "funcol_recorded/funcol_raw": round(med["funcol_recorded"] / med["funcol_raw"], 3)},
            "method": f"{blocks} rounds of alternating blocks of {per_block} calls, synchronised; "
                      "medians of block means"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/check_trace_nccl"))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--cost-only", action="store_true", help="only the in-process cost A/B")
    args = p.parse_args()
    if args.cost_only:
        print(json.dumps(cost(), indent=1))
        return 0
    import torch

    adapter = args.device
    result: dict[str, Any] = {"torch": torch.__version__,
                              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
                              "nccl": ".".join(map(str, torch.cuda.nccl.version())) if args.device == "cuda" else None}
    for name, flags, mode, extra in (("hang", ["--hang-timeout", "8"], "skip", {}),
                                     ("exit", [], "none", {"PORTSPEED_TRACE": "100", "PORTSPEED_TRACE_ON_EXIT": "1"})):
        folder = args.out / f"trace_nccl_{name}"
        shutil.rmtree(folder, ignore_errors=True)
        run = _launch(folder, flags, mode, extra, 120, adapter)
        run["torch_dump"] = _torch_dump(folder)
        if run["torch_dump"]["present"]:
            run["read_alone"] = _read_alone(folder)
        result[name] = run
        print(f"== {name}: rc {run['rc']} in {run['seconds']} s; files {run['files']}")
        for ln in run["closing"]:
            print("   ", ln[:240])
        print("    torch dump:", json.dumps(run["torch_dump"], default=str)[:900])
        if "read_alone" in run:
            print("    torch dump alone:", json.dumps(run["read_alone"], default=str)[:900])
    try:  # in a child: the recorder and the patches it sets up must not touch this process
        c = subprocess.run([sys.executable, __file__, "--cost-only", "--device", args.device], cwd=REPO,
                           capture_output=True, text=True, timeout=180)
        result["cost"] = (json.loads(c.stdout[c.stdout.index("{"):]) if c.returncode == 0
                          else {"error": c.stderr[-1500:]})
    except Exception as exc:
        result["cost"] = {"error": repr(exc)}
    print("== cost:", json.dumps(result["cost"])[:1500])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "trace_nccl.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
