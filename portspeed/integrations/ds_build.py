"""Build DeepSpeed's host ops once, at set-up time: ``python -m portspeed.integrations.ds_build``.

Why: the project installs DeepSpeed with ``DS_BUILD_OPS=0`` (no op compiled at install), and
DeepSpeed JIT-compiles an op the first time a run loads it: minutes on a small machine, inside
whichever run comes first, with several ranks racing for one build lock. ``make ds-ops`` runs
this module once with ``TORCH_EXTENSIONS_DIR`` inside the venv, so the cache belongs to the
venv's torch and every later load is a file lookup.

The ops are DeepSpeed's own sources, compiled by torch's extension builder with the system
compiler:

- ``cpu_adam`` (``CPUAdamBuilder``): ``DeepSpeedCPUAdam``, the optimizer step of ZeRO-Offload;
- ``async_io`` (``AsyncIOBuilder``, which loads ``pin_memory`` first): ZeRO-Infinity's NVMe
  swapping; needs libaio's headers and library (Debian: ``libaio-dev``);
- ``deepspeed_shm_comm`` (``ShareMemCommBuilder``): loaded by stock DeepSpeed's CPU
  accelerator, so the stock baseline runs of the tests do not build it (portspeed's
  accelerator does not offer it).

An op that cannot be built fails with a message naming what to install (``HINTS``); the exit
status is 1 then, and the set-up stops.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

__all__ = ["HINTS", "OPS", "build", "main", "missing_prerequisite"]

#: op name -> DeepSpeed builder class name (in deepspeed.ops.op_builder.cpu)
OPS = {"cpu_adam": "CPUAdamBuilder", "async_io": "AsyncIOBuilder", "deepspeed_shm_comm": "ShareMemCommBuilder"}

#: what a failed build most likely lacks, per op
HINTS = {
    "async_io": "DeepSpeed's async I/O op needs libaio's headers and library: on Debian/Ubuntu run "
                "`apt-get install -y libaio-dev` as root (or `make sysdeps`); elsewhere install libaio's development "
                "package, or point CFLAGS/LDFLAGS at a libaio built from source",
    "cpu_adam": "DeepSpeed's CPU Adam op needs a C++ compiler and ninja: install g++ "
                "(Debian: `apt-get install -y g++`) and `pip install ninja`",
    "deepspeed_shm_comm": "DeepSpeed's shared-memory comm op needs a C++ compiler and ninja: install g++ and "
                          "`pip install ninja`",
}


def missing_prerequisite(op: str) -> str | None:
    """Why ``op`` cannot be built here (DeepSpeed's own compatibility probe), with what to install; None if it can."""
    from deepspeed.ops.op_builder import cpu

    builder = getattr(cpu, OPS[op])()
    if builder.is_compatible(verbose=False):
        return None
    return f"{op}: DeepSpeed's {OPS[op]} says it cannot be built on this machine. {HINTS[op]}"


def build(ops: list[str], log: Callable[[str], None] = print) -> int:
    """Build (or find already built) each op; return how many failed, each failure logged with its hint."""
    from deepspeed.ops.op_builder import cpu

    failed = 0
    cache = os.environ.get("TORCH_EXTENSIONS_DIR", "torch's default (~/.cache/torch_extensions)")
    for op in ops:
        why = missing_prerequisite(op)
        if why is not None:
            log(f"portspeed.integrations.ds_build: {why}")
            failed += 1
            continue
        start = time.monotonic()
        try:
            getattr(cpu, OPS[op])().load(verbose=False)
        except Exception as exc:  # a compiler error: the message, then what to install
            log(f"portspeed.integrations.ds_build: building {op} failed ({type(exc).__name__}: {exc}). {HINTS[op]}")
            failed += 1
            continue
        log(f"portspeed.integrations.ds_build: {op} ready in {cache} ({time.monotonic() - start:.1f} s)")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m portspeed.integrations.ds_build",
                                     description="JIT-build DeepSpeed's host ops into TORCH_EXTENSIONS_DIR")
    parser.add_argument("ops", nargs="*", metavar="OP", help=f"ops to build (default: all of {', '.join(OPS)})")
    args = parser.parse_args(argv)
    unknown = [op for op in args.ops if op not in OPS]
    if unknown:
        parser.error(f"unknown op(s) {', '.join(unknown)}; choose from {', '.join(OPS)}")
    return 1 if build(args.ops or list(OPS)) else 0


if __name__ == "__main__":
    sys.exit(main())
