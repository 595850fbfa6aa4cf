"""Stock Megatron-LM ``pretrain_gpt.py`` on the bare test device in TP2, against CPU TP1: a new vendor's day one.

Why by hand: it needs a Megatron-LM git directory (``MEGATRON_LM_GIT``) and a few minutes per run on 2 cores.
What it does, on leg 1 (``.venv``: Megatron-LM core_v0.16.1 by default):

1. conformance (device, kernels, collectives) on ``examples/day_one_adapter.py`` on the bare test device with every
   fault (``PORTSPEED_TESTDEV_BARE=all``: its CCL a stub, no memory info, no shallow-copy kernel, a wrong SDPA,
   gelu and layer_norm, random ops on the host generator), as the vendor runs it; the lines it prints are pasted at
   the end of a copy of the file, which is all the adapter there is;
2. a CPU TP1 run of the stock script saves the shared checkpoint (``INIT_ITERS`` iterations; layouts draw their
   initial weights differently, so both sides fine-tune from the same weights, as benchmarks/stock_matrix.py does);
3. per path (``--transformer-impl local``: Megatron's own layers, torch's layer_norm; ``transformer_engine``,
   Megatron's default: portspeed's portable TE), CPU TP1 and the bare device TP2 fine-tune ``ITERS`` iterations
   from it through ``portspeed run`` (the unedited script) and their lm losses are compared: max |difference| over
   the iterations, within ``TOLERANCE``.

    MEGATRON_LM_GIT=/work/.mirror/NVIDIA+Megatron-LM/repo make test-stock-bare
    .venv/bin/python benchmarks/stock_bare_device.py --git $MEGATRON_LM_GIT [--paths local] [--keep DIR]

The test device is a C++ PrivateUse1 device portspeed builds on demand, not hardware.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from stock_matrix import (INIT_ITERS, ITERS, MODEL, TOLERANCE, Leg, TagRun, export, first_error,  # noqa: E402
                          now_utc)

TAG = "core_v0.16.1"
ADAPTER = REPO / "examples" / "day_one_adapter.py"
PATHS = ("local", "transformer_engine")


def pasted_adapter(leg: Leg, work: Path) -> tuple[Path, list[str]]:
    """Conformance on the day-one file on the bare device; a copy with the printed lines pasted, and the lines."""
    env = leg.env() | {"PORTSPEED_TESTDEV_BARE": "all"}
    res = subprocess.run([str(leg.python), "-m", "portspeed.cli", "conformance", "--adapter",
                          f"{ADAPTER}:DayOneAccelerator", "--suites", "device,kernels,collectives"],
                         env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    (work / "conformance.log").write_text(res.stdout + res.stderr)
    lines = res.stdout.splitlines()
    heads = [i for i, ln in enumerate(lines) if "paste" in ln and not ln.startswith("  [")]
    if res.returncode != 1 or len(heads) != 1:
        raise RuntimeError(f"conformance on the bare device printed no lines to paste (exit {res.returncode}); "
                           f"see {work / 'conformance.log'}")
    pasted = lines[heads[0] + 1:]
    path = work / "day_one_pasted.py"
    path.write_text(ADAPTER.read_text().rstrip("\n") + "\n" + "\n".join(pasted) + "\n")
    return path, pasted


def finetune(run: TagRun, name: str, nproc: int, impl: str, env: dict[str, str], *flags: str) -> tuple[dict, str]:
    """One fine-tune through ``portspeed run`` with ``env`` on top of the leg's; (losses by iteration, error)."""
    base = run.env
    run.env = base | env
    try:
        return run.finetune(name, "run", nproc, ("--transformer-impl", impl, *flags), te=True)
    finally:
        run.env = base


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--git", default=os.environ.get("MEGATRON_LM_GIT"), help="Megatron-LM git directory")
    p.add_argument("--tag", default=TAG, help="a tag megatron-core of leg 1 runs (default %(default)s)")
    p.add_argument("--venv", default=str(REPO / ".venv"), help="leg 1")
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    p.add_argument("--keep", type=Path, help="keep the tree and logs under this folder")
    args = p.parse_args(argv)
    if not args.git or not Path(args.git).is_dir():
        p.error("set MEGATRON_LM_GIT (or --git) to a Megatron-LM git directory, e.g. the fetch tool's "
                "/work/.mirror/NVIDIA+Megatron-LM/repo")
    leg = Leg(Path(args.venv).absolute() / "bin" / "python")
    if not leg.python.is_file():
        p.error(f"{leg.python} is missing: build leg 1 first (make venv)")
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    base, tree, work = export(Path(args.git), args.tag, "stock-bare", args.keep)
    run = TagRun(tree, work, leg)
    bad = 0
    try:
        adapter, lines = pasted_adapter(leg, work)
        print("lines conformance printed, pasted:\n" + "\n".join(lines), flush=True)
        rc, text = run.launch("save", "run", 1, *MODEL, "--train-iters", str(INIT_ITERS), "--eval-interval",
                              str(INIT_ITERS), "--save", str(run.ckpt), "--save-interval", str(INIT_ITERS))
        if rc != 0:
            raise RuntimeError(f"the CPU checkpoint save failed: {first_error(text)}")
        bare = {"PORTSPEED_ACCELERATOR": f"{adapter}:DayOneAccelerator", "PORTSPEED_TESTDEV_BARE": "all"}
        for impl in args.paths:
            t0 = time.monotonic()
            ref, err = finetune(run, f"cpu-tp1-{impl}", 1, impl, {"PORTSPEED_ACCELERATOR": "cpu"})
            got, err2 = ("", "") if err else finetune(run, f"bare-tp2-{impl}", 2, impl, bare,
                                                    "--tensor-model-parallel-size", "2")
            if err or err2:
                bad += 1
                print(f"{impl}: FAIL: {err or err2}", flush=True)
                continue
            worst = max(abs(got[i] - ref[i]) for i in ref)
            bad += worst > TOLERANCE
            print(f"{impl}: CPU TP1 {[ref[i] for i in sorted(ref)]}, bare device TP2 {[got[i] for i in sorted(got)]}: "
                  f"max |diff| {worst:.2e} ({'equal' if worst <= TOLERANCE else 'NOT equal'} within {TOLERANCE:g}; "
                  f"{time.monotonic() - t0:.0f} s)", flush=True)
    finally:
        run.restore()
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
        else:
            print(f"logs in {work}")
    print(f"{args.tag}, {now_utc()}, {(time.monotonic() - start) / 60:.1f} min in all on {os.cpu_count()} cores")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
