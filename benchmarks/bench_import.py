"""What importing the Megatron adaptor adds to a process start, measured A/B in fresh interpreters.

A: ``python -c "import torch"``; B: ``python -c "import torch, portspeed.megatron_adaptor"``.
Goal for B - A: +20 ms or less. The adaptor's set-up is deferred to the framework's first
import (portspeed.integrations.activation), so with ``--framework megatron.core`` (the default when it
is installed) two more arms show what that set-up adds there, where a training process
pays it: C: ``import torch, megatron.core``; D: ``import torch, portspeed.megatron_adaptor,
megatron.core``. D - C is the whole cost portspeed adds to the imports of a Megatron run.
Runs alternate A, B, (C, D,) A, B... so drift on a shared machine hits every arm alike; the
figures are the medians of the paired differences and the ratios of medians, for the
child's CPU time (user + system) and for wall time.
When the adaptor module is missing, B imports plain ``portspeed`` and the output says so.
Children run from .pyc files (PYTHONDONTWRITEBYTECODE is dropped for them) and, like any
``python -c``, import from the current directory first.

    OMP_NUM_THREADS=1 python benchmarks/bench_import.py --runs 20 --breakdown
    OMP_NUM_THREADS=1 python benchmarks/bench_import.py --runs 20 --framework none   # A/B only
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time


def _time_once(code: str, env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) for one fresh interpreter running ``code``.

    CPU time (user + system of that child alone, from wait4) is the steadier figure on a
    shared machine: waiting for a core counts in wall time but not in CPU time.
    """
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"`python -c {code!r}` failed with exit code {proc.returncode}; run it by hand to see why")
    return wall, usage.ru_utime + usage.ru_stime


_BREAKDOWN = r"""
import gc, json, sys, time
T = time.process_time
import torch
spent = {}
def timed(owner, attr, label):
    orig = getattr(owner, attr, None)
    if orig is None:
        return
    def run(*a, **k):
        t = T()
        try:
            return orig(*a, **k)
        finally:
            spent[label] = spent.get(label, 0.0) + (T() - t) * 1e3
    setattr(owner, attr, run)
gc_ms = [0.0, 0]
def on_gc(phase, info, _t=[0.0]):
    if phase == "start":
        _t[0] = T()
    elif info["generation"] == 2:
        gc_ms[0] += (T() - _t[0]) * 1e3
        gc_ms[1] += 1
gc.callbacks.append(on_gc)
t0 = T()
import portspeed
spent["import portspeed"] = (T() - t0) * 1e3
t1 = T()
import MODULE
spent["import MODULE (after portspeed)"] = (T() - t1) * 1e3
spent["import total after torch"] = (T() - t0) * 1e3
# The set-up the framework's first import runs (portspeed.integrations.activation), in parts: first the
# modules it loads, then its steps, timed through wrappers put on them here.
t2 = T()
import importlib
for name in ("wrapt", "packaging.specifiers", "portspeed.accelerator", "portspeed.translation.importer",
             "portspeed.patches.torch_cuda", "portspeed.patches.torch_distributed",
             "portspeed.patches.megatron", "portspeed.patches.deepspeed"):
    try:
        importlib.import_module(name)
    except ImportError:
        pass
spent["  loading the modules it uses (wrapt, packaging, portspeed's)"] = (T() - t2) * 1e3
mm = sys.modules["portspeed.patching.manager"]
timed(mm.PatchManager, "apply", "  PatchManager.apply")
timed(mm.PatchManager, "_sweep", "    of which rebinding sweep")
timed(mm.PatchManager, "_gate", "    of which gating (versions, conditions)")
timed(sys.modules["portspeed.translation.importer"], "enable", "  translation.enable (adapter selection inside)")
acc = sys.modules["portspeed.accelerator"]
timed(acc, "_entry_point_adapters", "    of which entry-point scans")
from portspeed.integrations import activation
activation.activate_waiting()
spent["set-up at the framework's first import"] = (T() - t2) * 1e3
spent["full (gen-2) garbage collections inside"] = gc_ms[0]
# How far the process is from the full collection torch's import left pending: a cliff that
# whoever allocates next pays (here, or at the next import after this one).
full = gc_ms[1]
keep = []
while gc_ms[1] == full and len(keep) < 500000:
    keep.append([])
headroom = len(keep) if gc_ms[1] > full else None
print(json.dumps({"ms": spent, "gen2": full, "modules": len(sys.modules), "headroom": headroom}))
"""


def _breakdown(module: str, env: dict[str, str]) -> None:
    """One child: where the CPU time of ``import module`` goes (after torch), full GCs separated."""
    import json

    out = subprocess.run([sys.executable, "-c", _BREAKDOWN.replace("MODULE", module)], env=env,
                         check=True, capture_output=True, text=True).stdout
    data = json.loads(out.strip().splitlines()[-1])
    print(f"breakdown of one run (CPU ms; {data['modules']} modules loaded; {data['gen2']} full GC):")
    ms = data["ms"]
    order = ["import total after torch", "import portspeed", f"import {module} (after portspeed)",
             "set-up at the framework's first import",
             "  loading the modules it uses (wrapt, packaging, portspeed's)",
             "  translation.enable (adapter selection inside)", "    of which entry-point scans",
             "  PatchManager.apply", "    of which rebinding sweep", "    of which gating (versions, conditions)",
             "full (gen-2) garbage collections inside"]
    for label in order + [k for k in ms if k not in order]:
        if label in ms:
            print(f"  {label:64} {ms[label]:7.1f}")
    print("  (the set-up runs here through portspeed.integrations.activation.activate_waiting(), as the framework's "
          "first import would run it; a full GC lands inside whichever step allocates when the threshold is crossed)")
    if data["headroom"] is not None:
        print(f"  after the import, {data['headroom']} more container allocations set off the next full GC "
              "(torch leaves one pending; crossing it costs tens of ms, whoever allocates)")


def _module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


def main(argv: list[str] | None = None) -> int:
    """Run the A/B comparison and print medians, the paired difference and the ratio."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15, help="runs of each variant (default 15)")
    ap.add_argument("--module", default="portspeed.megatron_adaptor", help="what B imports after torch")
    ap.add_argument("--framework", default=None,
                    help="the framework module for arms C/D (default: megatron.core when installed; 'none': skip)")
    ap.add_argument("--breakdown", action="store_true", help="also print where one import spends its time")
    args = ap.parse_args(argv)
    if args.runs < 3:
        ap.error("--runs must be at least 3 to take a median")
    module = args.module
    if not _module_available(module):
        print(f"note: {module} is not importable here; measuring `import portspeed` instead")
        module = "portspeed"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # Measure what a user gets: imports from .pyc files. With PYTHONDONTWRITEBYTECODE set (some
    # sandboxes set it) a module edited since its .pyc was written is compiled again in every run.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    framework = args.framework
    if framework is None:
        framework = "megatron.core" if _module_available("megatron.core") else "none"
    arms = {"A": "import torch", "B": f"import torch, {module}"}
    if framework != "none":
        arms["C"] = f"import torch, {framework}"
        arms["D"] = f"import torch, {module}, {framework}"
    for code in arms.values():
        _time_once(code, env)  # warm the file cache and the .pyc files of every arm
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in arms}
    for _ in range(args.runs):
        for k, code in arms.items():
            times[k].append(_time_once(code, env))
    print(f"{args.runs} interleaved runs of each arm, python {sys.version.split()[0]}, OMP_NUM_THREADS=1, "
          ".pyc files written")
    pairs = [("A", "B", "import cost (goal +20 ms)")]
    if "C" in arms:
        pairs.append(("C", "D", "whole cost at the framework's import (import + set-up)"))
    for base, arm, title in pairs:
        print(f"{base} = {arms[base]!r}, {arm} = {arms[arm]!r}: {title}")
        for i, what in ((1, "CPU "), (0, "wall")):
            xa = [r[i] * 1e3 for r in times[base]]
            xb = [r[i] * 1e3 for r in times[arm]]
            diffs = [y - x for x, y in zip(xa, xb)]
            q = statistics.quantiles(diffs, n=4)
            ma, mb = statistics.median(xa), statistics.median(xb)
            print(f"  {what}: {base} median {ma:7.1f} ms, {arm} median {mb:7.1f} ms, {arm} - {base} paired median "
                  f"{statistics.median(diffs):+7.1f} ms (quartiles {q[0]:+.1f} .. {q[2]:+.1f}), "
                  f"ratio of medians {mb / ma:.3f}")
    if args.breakdown:
        _breakdown(module, env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
