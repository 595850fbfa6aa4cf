"""Stock ``pretrain_gpt.py --fp16`` with dynamic loss scaling: TP2 and PP2 against TP1, an overflow skipped.

Megatron's fp16 path keeps fp32 main weights and scales the loss before the fp16 backward;
``DynamicGradScaler`` skips the step when a gradient overflowed and halves the scale once its
hysteresis (``--hysteresis``, default 2) is used up. The overflow is provoked, not hoped for:
``--initial-loss-scale 2^21`` makes the backward overflow deterministically (the loss
gradient reaching the fp16 logits is about scale / (tokens per micro-batch x micro-batches)
= 2^21 / 256 = 8192 per unit of (p - y), and the layers' weight gradients, sums over the
tokens, grow past fp16's 65504), and ``--hysteresis 1`` halves the scale at every overflow:
measured at core_v0.16.1, iterations 1 and 2 overflow (2^21, 2^20), 3 trains at 2^19, 4
overflows again and the rest train at 2^18. Each run fine-tunes 10
iterations from one fp16 TP1 checkpoint (``--finetune`` starts a fresh scaler).

Asserted, per layout: the same iterations are skipped as in TP1 (Megatron's log line then
has no lm loss and counts ``number of skipped iterations: 1``), the loss scale halves at
each skipped iteration and stays once the gradients fit, at least one iteration is skipped
and most are not, and the losses of the trained iterations are within ``TOLERANCE`` of
TP1's. The band, 1e-3: fp16 activations are rounded to 11 significant bits after every
operation, so another reduction order (TP splits the GEMMs and reduces partial sums; PP only
moves activations) changes intermediate values by an fp16 ulp, and the fp32 loss averaged
over the batch by far less (observed 1.2e-5 TP2, 1.4e-5 PP2 at core_v0.16.1). 1e-3 is about 60x
that and a quarter of one fp16 ulp of the loss itself (2^-8 = 0.0039 between 4 and 8), so a
real fault in the scaled backward or the unscaling (a scale off by 2, a wrongly skipped or
applied step) cannot hide in it.
"""

from __future__ import annotations

import re

import pytest
from helpers.stock import SKIP_REASON
from helpers.stock_parity import SharedCheckpoint

from portspeed.parity.losslog import LossRecord

pytestmark = [pytest.mark.megatron, pytest.mark.stock, pytest.mark.multiproc,
              pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")]

INITIAL_SCALE = 2.0 ** 21
TOLERANCE = 1e-3  # absolute, per trained iteration, fp16 vs fp16 (see the module docstring)
FP16 = ["--fp16", "--initial-loss-scale", str(int(INITIAL_SCALE)), "--hysteresis", "1"]

#: name -> (processes, layout flags)
LAYOUTS = {
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
}


def _skips_and_scales(record: LossRecord) -> tuple[list[int], list[float]]:
    skipped = [it.iteration for it in record.iterations if it.skipped or it.extra.get("skipped_iterations", 0) > 0]
    scales = [it.extra["loss_scale"] for it in record.iterations]
    return skipped, scales


@pytest.fixture(scope="module")
def fp16(tmp_path_factory: pytest.TempPathFactory) -> dict:
    # the shared checkpoint trains its 3 iterations at a scale that fits (2^18), so it is not the initial weights
    shared = SharedCheckpoint(tmp_path_factory.mktemp("stock_fp16"), FP16, init=["--initial-loss-scale", "262144"])
    return {"shared": shared, "tp1": shared.finetune("tp1", 1)}


def test_overflow_is_skipped_and_the_scale_halves(fp16: dict) -> None:
    """TP1: the first iteration overflows and is skipped; each skip halves the scale, a trained step keeps it."""
    record = fp16["tp1"]
    skipped, scales = _skips_and_scales(record)
    print(f"fp16 tp1: skipped iterations {skipped}; loss scales {scales}")
    assert skipped and skipped[0] == 1, f"no overflow at iteration 1 (skipped: {skipped}, scales {scales})"
    assert len(skipped) <= 5, f"too few trained iterations left to compare: skipped {skipped}"
    scale = INITIAL_SCALE
    for it in record.iterations:
        i = it.iteration
        # the log shows the scale after the step: halved by a skip (hysteresis 1), kept by a trained step
        scale = scale / 2 if i in skipped else scale
        assert it.extra["loss_scale"] == scale, f"iteration {i}: loss scale {it.extra['loss_scale']}, expected {scale}"
        # a skipped step accumulates no loss: core_v0.16 prints no lm loss, core_v0.19 prints 0
        assert (not it.lm_loss) == (i in skipped), f"iteration {i}: lm loss {it.lm_loss}, skipped {i in skipped}"
    log = fp16["shared"].logs["tp1"]
    # (with --log-interval 1 the second line counts the first two iterations: Megatron's logging quirk)
    counted = {int(m) for m in re.findall(r"iteration\s+(\d+)/.*number of skipped iterations:\s+[1-9]", log)}
    assert counted == set(skipped), f"Megatron's log counts skips at {sorted(counted)}, parsed {skipped}"
    losses = [it.lm_loss for it in record.iterations if it.iteration not in skipped]
    assert losses[-1] < losses[0], f"fp16 TP1 did not learn after the skips: {losses}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp16_layout_matches_tp1(fp16: dict, layout: str) -> None:
    nproc, flags = LAYOUTS[layout]
    run = fp16["shared"].finetune(layout, nproc, *flags)
    ref = fp16["tp1"]
    assert _skips_and_scales(run) == _skips_and_scales(ref), (
        f"{layout}: skips/scales {_skips_and_scales(run)} vs TP1 {_skips_and_scales(ref)}")
    a, b = ref.by_iteration(), run.by_iteration()
    skipped = set(_skips_and_scales(ref)[0])
    deltas = {i: abs(a[i].lm_loss - b[i].lm_loss) for i in a if i not in skipped}
    worst = max(deltas, key=deltas.get)
    print(f"fp16 {layout} vs tp1: max |lm loss diff| {deltas[worst]:.3g} at iteration {worst} "
          f"over {len(deltas)} trained iterations")
    assert deltas[worst] <= TOLERANCE, f"{layout}: iteration {worst} differs from fp16 TP1 by {deltas[worst]:.3g}"
