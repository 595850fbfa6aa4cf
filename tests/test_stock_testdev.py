"""Stock Megatron-LM ``pretrain_gpt.py`` on the test device equals the CPU TP1 run.

The test device (portspeed's C++ PrivateUse1 device with its own CCL; a test device, not
hardware) is chosen with ``PORTSPEED_ACCELERATOR=testdev``; everything else is the command
line and data of ``tests/test_stock_megatron.py`` (same indexed dataset, same shared
checkpoint, ``--distributed-backend nccl`` left as Megatron's default). Each layout's
per-iteration lm loss must equal the single-process **CPU** run within 1e-5 (fp32): a
cross-device comparison. Needs a Megatron-LM checkout in ``MEGATRON_LM_ROOT``; skipped
otherwise, with the reason (``make test-stock``).
"""

from __future__ import annotations

import pytest

from test_stock_megatron import LAYOUTS, TOLERANCE, _losses, _train, needs_checkout, stock  # noqa: F401

pytestmark = [pytest.mark.megatron, pytest.mark.stock, pytest.mark.multiproc, pytest.mark.testdev]


@needs_checkout
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stock_layout_on_testdev_matches_cpu_tp1(stock: dict, layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """TP2, PP2, DP2 and TP2xPP2 on the test device: lm loss = CPU TP1's within 1e-5 at every iteration."""
    nproc, tp, pp = LAYOUTS[layout]
    monkeypatch.setenv("PORTSPEED_ACCELERATOR", "testdev")
    text = _train(stock["work"], f"testdev-{layout}", nproc, tp, pp, stock["data"], *stock["finetune"])
    assert "distributed_backend ............................. nccl" in text, "Megatron's default backend was changed"
    losses = _losses(text, f"testdev-{layout}")
    base = stock["baseline"]
    assert sorted(losses) == sorted(base)
    deltas = {it: abs(losses[it] - base[it]) for it in base}
    worst = max(deltas, key=deltas.get)
    assert deltas[worst] <= TOLERANCE, (
        f"testdev {layout}: iteration {worst} lm loss {losses[worst]} vs CPU TP1 {base[worst]} "
        f"(|d|={deltas[worst]:.2e})")
