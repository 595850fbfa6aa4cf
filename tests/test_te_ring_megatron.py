"""Ring context parallelism under Megatron: TP2 x CP2 through Megatron's ``TEDotProductAttention``.

Four Gloo ranks, Megatron's TE attention served by the portable Transformer Engine, built under
``initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)``: ring = all-gather =
TP1/CP1 (``sbhd`` and ``thd``, GQA, causal), a planted merge error breaking it. The ring on its own (one and
two ranks): test_te_ring.py.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from helpers.launch import torchrun
from helpers.ring_checks import check_rows

pytestmark = pytest.mark.usefixtures("_cpu")


@pytest.fixture
def _cpu(portspeed_env) -> None:
    portspeed_env(PORTSPEED_ACCELERATOR="cpu")


_TP2CP2 = textwrap.dedent(
    """
    import json, sys
    sys.argv = ["tp2cp2_ring"]                            # no --transformer-impl: Megatron's default, the TE path
    import portspeed.megatron_adaptor
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from portspeed.portable_te import attention, ring

    ps.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
    model_parallel_cuda_manual_seed(0)
    tp, tr = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    cp, cr = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    good_merge = ring.merge_partial

    def no_lse_merge(out_acc, lse_acc, out, lse):  # planted: a plain average instead of the lse-weighted merge
        out_acc.add_(out.float()).mul_(0.5)

    NP, NG, D = 4, 2, 8                                   # GQA: per TP rank 2 heads, 1 key/value group
    hp, gp = NP // tp, NG // tp
    cfg = dict(num_layers=1, hidden_size=NP * D, num_attention_heads=NP, num_query_groups=NG, kv_channels=D,
               attention_dropout=0.0, tensor_model_parallel_size=tp, context_parallel_size=cp)
    out = {"tp": tp, "cp": cp, "tp_rank": tr, "cp_rank": cr}

    def chunks(a, b):                                     # this CP rank's two chunks of tokens a..b
        c = (b - a) // (2 * cp)
        return list(range(a + cr * c, a + (cr + 1) * c)) + list(range(b - (cr + 1) * c, b - cr * c))

    torch.manual_seed(0)                                  # the same full tensors on every rank
    S, B, T = 16, 2, 24
    cu = torch.tensor([0, 8, 24], dtype=torch.int32)
    full = {"sbhd": [torch.randn(S, B, n, D) for n in (NP, NG, NG)] + [torch.randn(S, B, NP * D)],
            "thd": [torch.randn(T, n, D) for n in (NP, NG, NG)] + [torch.randn(T, NP * D)]}
    where = {"sbhd": torch.tensor(chunks(0, S)), "thd": torch.tensor(chunks(0, 8) + chunks(8, 24))}
    heads = [slice(tr * hp, (tr + 1) * hp), slice(tr * gp, (tr + 1) * gp), slice(tr * gp, (tr + 1) * gp)]
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                             cu_seqlens_kv_padded=cu, max_seqlen_q=16, max_seqlen_kv=16)
    for fmt in ("sbhd", "thd"):
        Q, K, V, G = full[fmt]
        mask = "causal" if fmt == "sbhd" else "padding_causal"
        # TP1 / CP1: the single-process attention over every head and the whole sequence
        ref_attn = attention.DotProductAttention(NP, D, num_gqa_groups=NG, qkv_format=fmt, attn_mask_type=mask)
        q, k, v = (t.clone().requires_grad_() for t in (Q, K, V))
        y = ref_attn(q, k, v, **({"cu_seqlens_q": cu, "cu_seqlens_kv": cu} if fmt == "thd" else {}))
        y.backward(G)
        loc = where[fmt]
        y_heads = y.reshape(*y.shape[:-1], NP, D)[..., heads[0], :].flatten(-2)
        ref = [y_heads[loc]] + [t.grad[loc][..., h, :] for t, h in zip((q, k, v), heads)]
        got = {}
        for name, comm, merge in (("ring", "p2p", good_merge), ("allgather", "all_gather", good_merge),
                                  ("plant-merge", "p2p", no_lse_merge)):
            ring.merge_partial = merge
            te = TEDotProductAttention(TransformerConfig(**cfg, cp_comm_type=comm), layer_number=1,
                                       attn_mask_type=AttnMaskType.causal, attention_type="self", cp_comm_type=comm)
            assert isinstance(te, attention.DotProductAttention), type(te).__mro__
            ql, kl, vl = (t[loc][..., h, :].clone().requires_grad_() for t, h in zip((Q, K, V), heads))
            yl = te(ql, kl, vl, None, AttnMaskType.causal, packed_seq_params=packed if fmt == "thd" else None)
            yl.backward(G.reshape(*G.shape[:-1], NP, D)[..., heads[0], :].flatten(-2)[loc])
            got[name] = [yl.detach(), ql.grad, kl.grad, vl.grad]
        ring.merge_partial = good_merge
        for name, tensors in got.items():
            out[f"{fmt}-causal {name}-vs-cp1"] = [(a - b).abs().max().item() for a, b in zip(tensors, ref)]
        out[f"{fmt}-causal ring-vs-allgather"] = [(a - b).abs().max().item()
                                                  for a, b in zip(got["ring"], got["allgather"])]
    out["rank"] = dist.get_rank()
    print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    """
)


@pytest.mark.megatron
@pytest.mark.multiproc
def test_tp2_cp2_megatron_te_attention_ring_equals_all_gather_and_tp1_cp1(tmp_path: Path) -> None:
    """TP2 x CP2 (4 Gloo ranks): Megatron's ``TEDotProductAttention`` (served by the portable TE) built under
    ``initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)``, GQA, causal, ``sbhd`` and
    packed ``thd``: the ring (``p2p``) = the all-gather form = the TP1/CP1 attention within 1e-5 (output and
    q / k / v gradients of this rank's heads and tokens); a planted merge error breaks it (the ring ran)."""
    from helpers.requires import require

    require("megatron.core", "pip install -e '.[megatron]'")
    script = tmp_path / "tp2cp2_ring.py"
    script.write_text(_TP2CP2)
    res = torchrun(str(script), 4, timeout=300, env={"PORTSPEED_ACCELERATOR": "cpu"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    decoder = json.JSONDecoder()
    rows = [decoder.raw_decode(part.lstrip())[0] for part in res.stdout.split("RESULT ")[1:]]
    assert sorted(r["rank"] for r in rows) == [0, 1, 2, 3], res.stdout[-2000:]
    assert {(r["tp"], r["cp"]) for r in rows} == {(2, 2)}, rows
    assert {(r["tp_rank"], r["cp_rank"]) for r in rows} == {(0, 0), (0, 1), (1, 0), (1, 1)}, rows
    check_rows(rows, dropout=False)
