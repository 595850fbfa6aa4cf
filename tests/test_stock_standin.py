"""Stock Megatron-LM asked for NCCL runs on the stand-in vendor CCL, rewrites included, and matches Gloo.

The stand-in (``portspeed.testing.standin_ccl``, a Python c10d backend named as a stand-in)
lacks ReduceOp.AVG, which Megatron's distributed optimizer uses for its gradient
reduce-scatter with ``--ddp-average-in-collective``. The router must rewrite that call
inside real training (the log names the rewrite once), and the per-iteration losses must
equal those of the same command on Gloo within 1e-5 (fp32). Needs a Megatron-LM checkout
in ``MEGATRON_LM_ROOT`` (tag core_v0.16.1; skipped otherwise) and six/regex/pyyaml (failing,
naming them, without them: ``pip install -e '.[stock]'``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.stock import SKIP_REASON, bad_rows, run_stock_gpt

from portspeed.parity.losslog import parse_megatron_log
from portspeed.parity.tolerance import compare, tolerance_for

pytestmark = [pytest.mark.megatron, pytest.mark.stock, pytest.mark.multiproc]

FLAGS = ("--train-iters", "6", "--eval-interval", "6",
         "--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-average-in-collective")


@pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")
def test_stock_distributed_optimizer_on_standin_matches_gloo(tmp_path: Path) -> None:
    gloo = run_stock_gpt(2, tmp_path / "gloo.log", *FLAGS, accelerator="cpu")
    standin = run_stock_gpt(2, tmp_path / "standin.log", *FLAGS, accelerator="standin")
    assert "distributed_backend ............................. nccl" in standin  # Megatron asked for NCCL
    rewrites = [line for line in standin.splitlines() if "rewritten (avg_as_sum)" in line]
    assert rewrites and all("reduce_scatter_tensor" in line for line in rewrites), \
        "the stand-in lacks AVG: the router must have rewritten Megatron's reduce-scatter"
    assert "rewritten" not in gloo  # Gloo on torch 2.13 does AVG itself: nothing to rewrite
    ref = parse_megatron_log(gloo, source="gloo")
    run = parse_megatron_log(standin, source="standin")
    assert len(ref.iterations) == 6
    result = compare(ref, run, tolerance_for("fp32"))
    assert result.ok, bad_rows(result)
