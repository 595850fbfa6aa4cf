"""Stock ``pretrain_gpt.py`` with a Llama/Qwen2-style dense model: TP2, PP2 and TP2xPP2 equal TP1.

The model is what Llama and Qwen2 checkpoints look like to Megatron: rotary position
embeddings, SwiGLU, RMSNorm, grouped-query attention (4 heads, 2 query groups, so TP2 keeps
one group per rank), untied input/output embeddings, no bias in the linear layers except
QKV's (Qwen2's ``--add-qkv-bias``). Every layout fine-tunes 10 iterations from one TP1
checkpoint (``helpers.stock_parity``) and must equal the single-process run within 1e-5 per
iteration in fp32: the layouts only reorder the same fp32 reductions (observed figures in
docs/megatron.md).

Needs ``MEGATRON_LM_ROOT`` (core_v0.16.1 in .venv, core_v0.17+ in .venv312; skipped, with
the reason, without it).
"""

from __future__ import annotations

import pytest
from helpers.stock import SKIP_REASON
from helpers.stock_parity import SharedCheckpoint, field_diff, max_diff

pytestmark = [pytest.mark.megatron, pytest.mark.stock, pytest.mark.multiproc,
              pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")]

TOLERANCE = 1e-5  # fp32: the same sums in another order

LLAMA = ["--position-embedding-type", "rope", "--swiglu", "--normalization", "RMSNorm",
         "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
         "--disable-bias-linear", "--add-qkv-bias"]

#: name -> (processes, layout flags)
LAYOUTS = {
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "tp2pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict:
    shared = SharedCheckpoint(tmp_path_factory.mktemp("stock_llama"), LLAMA)
    return {"shared": shared, "tp1": shared.finetune("tp1", 1)}


def test_the_model_is_llama_shaped(llama: dict) -> None:
    """Megatron's own argument dump shows the Llama/Qwen2 options took effect (not silently defaulted)."""
    log = llama["shared"].logs["tp1"]
    for arg, value in (("position_embedding_type", "rope"), ("swiglu", "True"), ("normalization", "RMSNorm"),
                       ("num_query_groups", "2"), ("untie_embeddings_and_output_weights", "True"),
                       ("add_bias_linear", "False"), ("add_qkv_bias", "True")):
        assert f" {arg} " in log and any(line.split()[-1:] == [value] for line in log.splitlines()
                                         if line.strip().startswith(f"{arg} ")), f"{arg} is not {value} in the log"
    losses = [it.lm_loss for it in llama["tp1"].iterations]
    assert losses[-1] < losses[0], f"TP1 did not learn: {losses}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_llama_layout_matches_tp1(llama: dict, layout: str) -> None:
    nproc, flags = LAYOUTS[layout]
    run = llama["shared"].finetune(layout, nproc, *flags)
    it, worst = max_diff(llama["tp1"], run)
    gn_it, gn_worst = field_diff(llama["tp1"], run, "grad_norm")
    print(f"llama {layout} vs tp1: max |lm loss diff| {worst:.3g} at iteration {it}; "
          f"max |grad norm diff| {gn_worst:.3g} at iteration {gn_it}")
    assert worst <= TOLERANCE, f"{layout}: iteration {it} differs from TP1 by {worst:.3g} (> {TOLERANCE})"
