"""Stock ``pretrain_gpt.py`` with a mixture of experts over expert parallelism, against the one-rank run.

The model: 4 experts, top-2 routing, the all-to-all token dispatcher, local experts
(``SequentialMLP``: no grouped GEMM, which needs CUDA kernels), and the router's
load-balancing loss (``aux_loss`` with coefficient 1e-2, so it is part of the trained loss,
and logged as ``load_balancing_loss``). Layouts, each fine-tuned 10 iterations from one
TP1/EP1 checkpoint (``helpers.stock_parity``):

* ``ep2``: 2 ranks, expert-parallel 2 (the experts split, tokens sent to their experts with
  all-to-all; the dense part data-parallel 2);
* ``tp2_sp_ep2``: 4 ranks, tensor-parallel 2 with sequence parallelism (Megatron requires it
  for MoE with TP) and expert-parallel 2.

The linear layers have no bias (``--disable-bias-linear``), as MoE checkpoints ship
(Mixtral, Qwen-MoE). With biased local experts Megatron itself fails, on GPU as well
(core_v0.16.1 and core_v0.19.0, ``transformer/mlp.py``): the expert adds its bias in place,
``output += output_bias * per_token_scale``, to the output of the row-parallel linear's
``_ReduceFromModelParallelRegion``, which returns its input as is, and autograd forbids
modifying that view in place ("Output 0 of _ReduceFromModelParallelRegion is a view and is
being modified inplace"). Not portspeed's to patch: it is Megatron's own bug on every device.

Tolerance: both the lm loss and the load-balancing loss within 1e-5 of the one-rank run per
iteration, the dense fp32 band. Measured (core_v0.16.1 and core_v0.19.0, docs/megatron.md):
equal to the log's precision (|d| <= 1e-6) in both layouts, every iteration. Routing is a
top-k over router probabilities, so a token whose 2nd and 3rd expert probabilities tie to
within the layouts' reduction-order noise (~1e-7 relative in fp32) could go to another expert
in one layout; that would move the loss by a token's share of a different expert output
(orders of magnitude above 1e-5), so a flip fails this test instead of hiding in a wide band.
None happened here; should one appear with another seed or model, compare the router
probabilities of that iteration before widening the band.
"""

from __future__ import annotations

import pytest
from helpers.stock import SKIP_REASON
from helpers.stock_parity import SharedCheckpoint, field_diff, max_diff

pytestmark = [pytest.mark.megatron, pytest.mark.stock, pytest.mark.multiproc,
              pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")]

TOLERANCE = 1e-5

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
       "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2",
       # as MoE models ship (Mixtral, Qwen-MoE); with biased local experts Megatron itself fails (see the docstring)
       "--disable-bias-linear"]

#: name -> (processes, layout flags)
LAYOUTS = {
    "ep2": (2, ["--expert-model-parallel-size", "2"]),
    "tp2_sp_ep2": (4, ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                       "--sequence-parallel"]),
}


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict:
    shared = SharedCheckpoint(tmp_path_factory.mktemp("stock_moe"), MOE)
    return {"shared": shared, "tp1": shared.finetune("tp1", 1)}


def test_the_router_loss_is_trained_and_logged(moe: dict) -> None:
    """The one-rank run has 4 local experts and logs a positive load-balancing loss every iteration."""
    log = moe["shared"].logs["tp1"]
    assert "SequentialMLP" in log or "experts" in log, "no expert module in the model printout"
    lb = [it.extra.get("load_balancing_loss") for it in moe["tp1"].iterations]
    assert all(v is not None and v > 0 for v in lb), f"load_balancing_loss per iteration: {lb}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_layout_matches_one_rank(moe: dict, layout: str) -> None:
    nproc, flags = LAYOUTS[layout]
    run = moe["shared"].finetune(layout, nproc, *flags)
    it, worst = max_diff(moe["tp1"], run)
    lb_it, lb_worst = field_diff(moe["tp1"], run, "load_balancing_loss")
    print(f"moe {layout} vs tp1: max |lm loss diff| {worst:.3g} at iteration {it}; "
          f"max |load_balancing_loss diff| {lb_worst:.3g} at iteration {lb_it}")
    assert worst <= TOLERANCE, f"{layout}: lm loss at iteration {it} differs from TP1 by {worst:.3g}"
    assert lb_worst <= TOLERANCE, f"{layout}: load-balancing loss at iteration {lb_it} differs by {lb_worst:.3g}"
