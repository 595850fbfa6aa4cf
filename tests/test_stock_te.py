"""Stock ``pretrain_gpt.py`` with Megatron's defaults (no ``--transformer-impl``): the portable Transformer Engine.

Needs a Megatron-LM checkout in ``MEGATRON_LM_ROOT`` (skipped otherwise, with the reason);
``make test-stock`` runs it. Megatron's default ``--transformer-impl transformer_engine`` builds the
GPT layers from ``transformer_engine.pytorch``, which portspeed serves (``portspeed/portable_te``)
off CUDA.

One TE-spec TP1 run trains 3 iterations and saves a checkpoint (its keys are the TE spec's:
``linear_qkv.layer_norm_weight``, ``_extra_state``: checked). Every run then fine-tunes 10
iterations from it (``--load --finetune``):

- the TE-spec runs TP2, PP2, DP2, TP2 + sequence parallel and TP2xPP2 must equal the TE-spec TP1
  run within 1e-5 per iteration (fp32);
- the local-spec TP1 run (``--transformer-impl local``) must equal the TE-spec TP1 run within 1e-5:
  the same initial weights come from the same checkpoint, with no conversion step, because
  Megatron's local GPT layer spec maps its norm keys onto the TE spec's in the distributed
  checkpoint (``sharded_state_dict_keys_map``: ``input_layernorm.`` ->
  ``self_attention.linear_qkv.layer_norm_``, ``pre_mlp_layernorm.`` -> ``mlp.linear_fc1.layer_norm_``),
  and the TE modules' ``_extra_state`` entries are not asked for by the local model.

The TE runs must say the portable Transformer Engine is in use; the local run must not.

bf16 (``--bf16``, from the same checkpoint): the TE-spec TP2 run and the local-spec TP1 run are
each within 2e-3 of the TE-spec TP1 run, the band the local spec's TP2-vs-TP1 bf16 test uses.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.stock import SKIP_REASON, run_stock_gpt

from portspeed.parity.losslog import parse_megatron_log

pytestmark = [pytest.mark.megatron, pytest.mark.stock,
              pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")]

TOLERANCE = 1e-5  # absolute, per iteration, fp32
BF16_TOLERANCE = 2e-3  # the local spec's bf16 band (tests/test_stock_more_layouts.py)
ITERS = 10
USED = "uses portspeed's portable Transformer Engine"

#: name -> (processes, extra flags)
LAYOUTS = {
    "tp2": (2, ("--tensor-model-parallel-size", "2")),
    "pp2": (2, ("--pipeline-model-parallel-size", "2")),
    "dp2": (2, ()),
    "tp2sp": (2, ("--tensor-model-parallel-size", "2", "--sequence-parallel")),
    "tp2pp2": (4, ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")),
    "cp2": (2, ("--context-parallel-size", "2")),
    "tp2cp2": (4, ("--tensor-model-parallel-size", "2", "--context-parallel-size", "2", "--sequence-parallel")),
}


def _losses(text: str) -> dict[int, float]:
    out = {i.iteration: i.lm_loss for i in parse_megatron_log(text).iterations}
    assert len(out) == ITERS, f"expected {ITERS} logged iterations, got {sorted(out)}"
    return out


def _checkpoint_keys(path: Path) -> list[str]:
    import torch.distributed.checkpoint as dcp

    return list(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


@pytest.fixture(scope="module")
def te_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("stock_te")
    ckpt = work / "ckpt"
    run_stock_gpt(1, work / "save.log", "--train-iters", "3", "--eval-interval", "1000", "--save", str(ckpt),
                  "--save-interval", "3", transformer_impl=None)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    finetune = ("--train-iters", str(ITERS), "--eval-interval", "1000", "--load", str(ckpt), "--finetune")
    text = run_stock_gpt(1, work / "te_tp1.log", *finetune, transformer_impl=None)
    return {"work": work, "ckpt": ckpt, "finetune": finetune, "text": text, "losses": _losses(text)}


def _compare(ref: dict[int, float], got: dict[int, float], what: str, tol: float = TOLERANCE) -> None:
    print(f"{what}: max |lm loss - TE-spec TP1| = {max(abs(ref[k] - got[k]) for k in ref):.2e}")  # figures, -rP
    bad = [(k, ref[k], got[k]) for k in ref if abs(ref[k] - got[k]) > tol]
    assert not bad, f"{what}: iterations outside {tol} of the TE-spec TP1 run: {bad}"


def test_te_spec_checkpoint_and_log(te_run: dict) -> None:
    """The default run built TE-spec layers (checkpoint keys) from the portable TE (one log line)."""
    assert USED in te_run["text"]
    keys = _checkpoint_keys(te_run["ckpt"] / "iter_0000003")
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in keys
    assert any(k.startswith("decoder.layers.mlp.linear_fc1._extra_state") for k in keys)
    assert not any("input_layernorm" in k for k in keys)


def test_local_spec_equals_te_spec(te_run: dict) -> None:
    """--transformer-impl local from the same checkpoint: the same losses within 1e-5; nothing served."""
    text = run_stock_gpt(1, te_run["work"] / "local_tp1.log", *te_run["finetune"], transformer_impl="local")
    assert USED not in text
    _compare(te_run["losses"], _losses(text), "local spec TP1")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_te_spec_layouts_equal_tp1(te_run: dict, layout: str) -> None:
    """No --transformer-impl flag, TP2 / PP2 / DP2 / TP2+SP / TP2xPP2: equal to TE-spec TP1 within 1e-5."""
    nproc, flags = LAYOUTS[layout]
    text = run_stock_gpt(nproc, te_run["work"] / f"te_{layout}.log", *te_run["finetune"], *flags,
                         transformer_impl=None)
    assert USED in text
    _compare(te_run["losses"], _losses(text), f"TE spec {layout}")


@pytest.mark.testdev
@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2", "tp2sp", "tp2pp2", "cp2", "tp2cp2"])
def test_te_spec_on_the_test_device_equals_cpu_tp1(te_run: dict, layout: str) -> None:
    """The TE spec on portspeed's test device (a test device, not hardware): equal to the **CPU** TE-spec TP1 run.

    A cross-device comparison: the portable TE's weights, RNG tracker and collectives must live on
    the device, so a tensor left on the host or a collective on the wrong device shows here.
    """
    nproc, flags = LAYOUTS[layout]
    text = run_stock_gpt(nproc, te_run["work"] / f"te_testdev_{layout}.log", *te_run["finetune"], *flags,
                         accelerator="testdev", transformer_impl=None)
    assert USED in text
    _compare(te_run["losses"], _losses(text), f"TE spec {layout} on the test device")


def test_bf16_te_spec_within_the_local_band(te_run: dict) -> None:
    """--bf16: TE-spec TP2 (on CPU and on the test device) and local-spec TP1 within 2e-3 of CPU TE-spec TP1."""
    work, flags = te_run["work"], (*te_run["finetune"], "--bf16")
    ref = _losses(run_stock_gpt(1, work / "te_bf16_tp1.log", *flags, transformer_impl=None))
    tp2 = _losses(run_stock_gpt(2, work / "te_bf16_tp2.log", *flags, "--tensor-model-parallel-size", "2",
                                transformer_impl=None))
    local = _losses(run_stock_gpt(1, work / "local_bf16_tp1.log", *flags, transformer_impl="local"))
    # the test device, TP2, against the CPU TP1 run (a cross-device comparison)
    dev = _losses(run_stock_gpt(2, work / "te_bf16_tp2_testdev.log", *flags, "--tensor-model-parallel-size", "2",
                                transformer_impl=None, accelerator="testdev"))
    _compare(ref, tp2, "bf16 TE spec TP2", BF16_TOLERANCE)
    _compare(ref, local, "bf16 local spec TP1", BF16_TOLERANCE)
    _compare(ref, dev, "bf16 TE spec TP2 on the test device", BF16_TOLERANCE)


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A TE-spec MoE checkpoint (4 experts, top-2, SequentialMLP) after 3 iterations, and its EP1 fine-tune."""
    work = tmp_path_factory.mktemp("stock_te_moe")
    moe = ("--num-experts", "4", "--moe-router-topk", "2", "--eval-interval", "1000")
    ckpt = work / "ckpt"
    run_stock_gpt(1, work / "save.log", *moe, "--train-iters", "3", "--save", str(ckpt), "--save-interval", "3",
                  transformer_impl=None)
    finetune = (*moe, "--train-iters", str(ITERS), "--load", str(ckpt), "--finetune")
    return {"work": work, "finetune": finetune,
            "ep1": _losses(run_stock_gpt(1, work / "ep1.log", *finetune, transformer_impl=None))}


def test_moe_te_spec_ep2_equals_ep1(moe_ckpt: dict) -> None:
    """MoE on the TE spec (4 experts, top-2, no --moe-grouped-gemm: a SequentialMLP of portable TE linears):
    expert-parallel 2 equals 1 within 1e-5 from a shared checkpoint (dropless routing sees the same tokens;
    only reduction order differs; measured 1e-6, the log's resolution). The local spec cannot load this
    checkpoint: its MoE layer maps ``pre_mlp_layernorm`` onto ``mlp.linear_fc1.layer_norm_`` as if dense."""
    ep2 = _losses(run_stock_gpt(2, moe_ckpt["work"] / "ep2.log", *moe_ckpt["finetune"],
                                "--expert-model-parallel-size", "2", transformer_impl=None))
    _compare(moe_ckpt["ep1"], ep2, "MoE TE spec EP2 (vs EP1)")


@pytest.mark.parametrize("layout", ["ep1", "ep2", "ep2-testdev"])
def test_moe_grouped_gemm_equals_sequential_experts(moe_ckpt: dict, layout: str) -> None:
    """``--moe-grouped-gemm`` (TEGroupedMLP over the portable GroupedLinear) from the SequentialMLP checkpoint equals
    the SequentialMLP EP1 run within 1e-5: Megatron gives both expert layouts the same checkpoint keys, and the
    grouped layer does one matmul per expert, the sequential layer's arithmetic (so EP2 differs only in
    reduction order, as above). Megatron's compute-capability check for the flag is passed by portspeed, which
    says so in the log. ``ep2-testdev``: the same on the test device, against the CPU run."""
    nproc, extra = (1, ()) if layout == "ep1" else (2, ("--expert-model-parallel-size", "2"))
    accelerator = "testdev" if layout.endswith("testdev") else "cpu"
    text = run_stock_gpt(nproc, moe_ckpt["work"] / f"grouped_{layout}.log", *moe_ckpt["finetune"], *extra,
                         "--moe-grouped-gemm", transformer_impl=None, accelerator=accelerator)
    # TEGroupedMLP's parameters are experts.linear_fc1.weight<i>; SequentialMLP's experts.local_experts.<i>.*
    assert "mlp.experts.linear_fc1.weight0" in text and "local_experts" not in text, "no grouped experts were built"
    assert "--moe-grouped-gemm: Megatron checks for a CUDA compute capability" in text
    _compare(moe_ckpt["ep1"], _losses(text), f"MoE grouped GEMM {layout.upper()} (vs SequentialMLP EP1)")


def test_fp8_is_refused_at_start_up(tmp_path: Path) -> None:
    """--fp8-format on the portable TE stops the run before the first step, naming the flag (never ignored)."""
    log = tmp_path / "fp8.log"
    with pytest.raises(AssertionError, match="failed"):
        run_stock_gpt(1, log, "--train-iters", "2", "--eval-interval", "1000", "--fp8-format", "hybrid",
                      transformer_impl=None)
    text = log.read_text()
    assert "fp8 training (--fp8-format) is not implemented by portspeed's portable Transformer Engine" in text
    assert "lm loss" not in text
