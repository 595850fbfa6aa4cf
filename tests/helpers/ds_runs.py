"""The DeepSpeed example's runs for tests/test_deepspeed.py (and its child environment for test_deepspeed_adaptor.py).

``train`` runs ``examples/deepspeed_train.py`` on real ranks (``portspeed.testing.run_ranks``) and returns rank 0's
record; the run lists, tolerances and the environment a child gets are named once here.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from portspeed.testing import run_ranks

__all__ = ["ADAPTERS", "ADAM_OFFLOAD_RUNS", "ALL_RUNS", "CLEAN", "DS_OPS_DIR", "EXAMPLE", "FP16_RUNS", "OFFLOAD_RUNS",
           "OVERFLOW_AT", "OVERFLOW_RUNS", "SAVE_AT", "STEPS", "TESTDEV", "TESTDEV_FP16_RUNS", "TESTDEV_RUNS",
           "TIMEOUT", "TOL", "assert_within", "clean_env", "rel", "tail", "train"]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "deepspeed_train.py")
ALL_RUNS = "0:fp32,1:fp32,2:fp32,3:fp32,0:bf16,1:bf16,2:bf16,3:bf16"
#: ZeRO-Offload runs with the client SGD (optimizer state and step on the host), only in the stock and test-device runs
OFFLOAD_RUNS = "2:fp32:offload,3:fp32:offload"
#: ZeRO-Offload with DeepSpeed's Adam, i.e. its CPU Adam op (built by `make ds-ops`), and ZeRO-3 parameter offload
ADAM_OFFLOAD_RUNS = "2:fp32:offload+adam,3:fp32:offload+adam,3:fp32:offload_param+adam"
#: fp16 with dynamic loss scaling (client SGD); stock DeepSpeed refuses fp16 on its CPU accelerator
FP16_RUNS = "0:fp16,2:fp16"
#: the same with step OVERFLOW_AT's scaled gradients made to overflow
OVERFLOW_RUNS = "0:fp16:overflow,2:fp16:overflow"
OVERFLOW_AT = 2
#: What runs on the test device in CI (3:bf16 meets a testccl gap the router rewrites), compared with stock CPU
TESTDEV_RUNS = "1:fp32,2:fp32,3:fp32,1:bf16,2:bf16,3:bf16," + OFFLOAD_RUNS + "," + ADAM_OFFLOAD_RUNS
#: ... and the fp16 runs there, compared with the CPU adapter's (stock DeepSpeed refuses fp16 on CPU)
TESTDEV_FP16_RUNS = FP16_RUNS + "," + OVERFLOW_RUNS
STEPS, SAVE_AT = 6, 3
TOL = {"fp32": 1e-5, "bf16": 5e-3, "fp16": 1e-3}
#: DeepSpeed's host ops, JIT-built once by `make ds-ops` into this cache inside the venv (every child gets it)
DS_OPS_DIR = Path(sys.prefix) / "torch_extensions"
TIMEOUT = 300.0


#: what a child must not inherit: this run's portspeed settings and DeepSpeed's own accelerator choice
CLEAN = ("PORTSPEED_*", "DS_ACCELERATOR*")


def clean_env(**extra: str) -> dict[str, str]:
    """The whole environment for ``run_ranks`` (it takes one as is): this one without ``CLEAN``, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PORTSPEED_", "DS_ACCELERATOR"))}
    env.update(OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=str(DS_OPS_DIR), **extra)
    return env


def train(tmp: Path, name: str, world: int, *args: str, env: dict[str, str] | None = None,
           pre: str | None = None) -> dict[str, Any]:
    """Run the example on ``world`` ranks; return rank 0's JSON record (fail with every rank's output)."""
    out = tmp / f"{name}.json"
    argv = [EXAMPLE, "--runs", ALL_RUNS, "--steps", str(STEPS), "--out", str(out), *args]
    if pre is not None:  # code to run first in each rank (e.g. select the stand-in adapter)
        argv = ["-c", pre + "\nimport runpy, sys\nsys.argv = sys.argv[1:]\n"
                "runpy.run_path(sys.argv[0], run_name='__main__')", *argv]
    results = run_ranks(argv, world, timeout=TIMEOUT, env=env or clean_env())
    failed = [r for r in results if r.returncode != 0]
    if failed or not out.exists():
        msg = "\n".join(f"--- rank {r.rank} rc={r.returncode}\n{tail(r.stderr)}" for r in results)
        pytest.fail(f"{name}: the training run failed\n{msg}")
    return json.loads(out.read_text())


def tail(stderr: str, chars: int = 6000) -> str:
    """The end of a rank's stderr without the FutureWarning noise of deprecated collectives."""
    lines = [ln for ln in stderr.splitlines()
             if "FutureWarning" not in ln and ln.strip() != "return func(*args, **kwargs)"]
    return "\n".join(lines)[-chars:]


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)

#: a child's selection of portspeed's test device (a test device, not hardware)
TESTDEV = {"PORTSPEED_ACCELERATOR": "testdev"}

#: the adapters a case runs on: the CPU adapter, and portspeed's test device (a test device, not hardware)
ADAPTERS = ["cpu", pytest.param("testdev", marks=pytest.mark.testdev)]


def assert_within(got: list[float], ref: list[float], key: str, what: str, steps: int = STEPS) -> float:
    """Per-step losses within the dtype's band of ``key`` (``TOL``); returns the worst relative difference."""
    tol = TOL[key.split(":")[1]]
    assert len(got) == len(ref) == steps, f"{key} {what}: {got} vs {ref}"
    worst = max(rel(a, b) for a, b in zip(got, ref))
    assert worst <= tol, f"{key} {what}: worst relative difference {worst:.3g} > {tol} ({got} vs {ref})"
    return worst
