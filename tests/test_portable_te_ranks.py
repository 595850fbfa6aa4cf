"""The portable Transformer Engine on two ranks (Gloo, torchrun) against the single-process layers.

Column- and row-parallel layers, with and without sequence parallelism, equal the single-process layer built
from the same full weights (forward, input and weight gradients); context-parallel attention (CP2, Megatron's
two chunks a rank) equals the single-process attention at each rank's positions. The layers in one process:
test_portable_te.py.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from helpers.launch import torchrun


@pytest.fixture(autouse=True)
def _cpu(portspeed_env) -> None:
    portspeed_env(PORTSPEED_ACCELERATOR="cpu")


TP2_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist, torch.nn.functional as F
    from portspeed.portable_te import linear
    dist.init_process_group("gloo")
    rank, out = dist.get_rank(), {}
    g = dist.new_group([0, 1])
    torch.manual_seed(0)
    W1, B1 = torch.randn(8, 6), torch.randn(8)         # column: out 8 -> 4 per rank
    W2, B2 = torch.randn(6, 8), torch.randn(6)         # row: in 8 -> 4 per rank
    X = torch.randn(4, 2, 6)                            # [s, b, h]
    G = torch.randn(4, 2, 6)
    def ref():
        x = X.clone().requires_grad_()
        w1, b1, w2 = (t.clone().requires_grad_() for t in (W1, B1, W2))
        y = F.linear(F.linear(F.layer_norm(x, (6,)), w1, b1), w2) + B2
        y.backward(G)
        return y, x.grad, w1.grad, w2.grad
    ry, rgx, rgw1, rgw2 = ref()
    for sp in (False, True):
        col = linear.LayerNormLinear(6, 8, parallel_mode="column", tp_group=g, sequence_parallel=sp, device="cpu")
        row = linear.Linear(8, 6, parallel_mode="row", tp_group=g, sequence_parallel=sp, device="cpu")
        with torch.no_grad():
            col.weight.copy_(W1.chunk(2, 0)[rank]); col.bias.copy_(B1.chunk(2, 0)[rank])
            row.weight.copy_(W2.chunk(2, 1)[rank]); row.bias.copy_(B2)
        x = (X.chunk(2, 0)[rank] if sp else X).clone().requires_grad_()
        y = row(col(x))
        y.backward(G.chunk(2, 0)[rank] if sp else G)
        want_y = ry.chunk(2, 0)[rank] if sp else ry
        want_gx = rgx.chunk(2, 0)[rank] if sp else rgx
        out[f"sp{int(sp)}"] = {
            "y": (y - want_y).abs().max().item(),
            "gx": (x.grad - want_gx).abs().max().item(),
            "gw1": (col.weight.grad - rgw1.chunk(2, 0)[rank]).abs().max().item(),
            "gw2": (row.weight.grad - rgw2.chunk(2, 1)[rank]).abs().max().item(),
            "tp_attr": [col.weight.tensor_model_parallel, col.weight.partition_dim, row.weight.partition_dim],
        }
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()
    """
)


def _two_rank_results(script: Path, code: str) -> list[dict]:
    """Run ``code`` on two Gloo ranks (torchrun) and return the JSON each printed after ``RESULT ``."""
    script.write_text(code)
    res = torchrun(str(script), 2, timeout=240, env={"PORTSPEED_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # the two ranks share one stdout: a line may carry both results (print writes the text and the newline
    # apart), so every "RESULT " marker is decoded where it stands
    decoder = json.JSONDecoder()
    rows = [decoder.raw_decode(part.lstrip())[0] for part in res.stdout.split("RESULT ")[1:]]
    assert len(rows) == 2, res.stdout[-2000:]
    return rows


@pytest.mark.multiproc
def test_two_rank_column_and_row_parallel_equal_single_process(tmp_path: Path) -> None:
    rows = _two_rank_results(tmp_path / "tp2.py", TP2_SCRIPT)
    for row in rows:
        for sp, d in row.items():
            assert d["tp_attr"] == [True, 0, 1], d
            for key in ("y", "gx", "gw1", "gw2"):
                assert d[key] <= 1e-5, f"{sp} {key}: {d[key]}"


CP2_SCRIPT = textwrap.dedent(
    """
    import json
    import torch, torch.distributed as dist
    from portspeed.portable_te import attention
    dist.init_process_group("gloo")
    rank, cp, out = dist.get_rank(), 2, {}
    group = dist.new_group([0, 1])
    torch.manual_seed(0)
    S, B, NP, NG, D = 8, 2, 4, 2, 8
    Q, K, V = torch.randn(S, B, NP, D), torch.randn(S, B, NG, D), torch.randn(S, B, NG, D)
    G = torch.randn(S, B, NP * D)
    c = S // (2 * cp)
    mine = torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])
    for fmt in ("sbhd", "bshd"):
        for mask in ("causal", "no_mask"):
            full = attention.DotProductAttention(NP, D, num_gqa_groups=NG, qkv_format=fmt, attn_mask_type=mask)
            part = attention.DotProductAttention(NP, D, num_gqa_groups=NG, qkv_format=fmt, attn_mask_type=mask,
                                                 cp_group=group, cp_global_ranks=[0, 1], cp_comm_type="p2p")
            lay = (lambda t: t) if fmt == "sbhd" else (lambda t: t.transpose(0, 1).contiguous())
            q, k, v = (lay(t).clone().requires_grad_() for t in (Q, K, V))
            y = full(q, k, v)
            y.backward(lay(G))
            ql, kl, vl = (lay(t[mine]).clone().requires_grad_() for t in (Q, K, V))
            yl = part(ql, kl, vl)
            yl.backward(lay(G[mine]))
            pick = (lambda t: t[mine]) if fmt == "sbhd" else (lambda t: t[:, mine])
            out[fmt + "-" + mask] = {
                "y": (yl - pick(y)).abs().max().item(), "gq": (ql.grad - pick(q.grad)).abs().max().item(),
                "gk": (kl.grad - pick(k.grad)).abs().max().item(), "gv": (vl.grad - pick(v.grad)).abs().max().item()}
    # packed sequences (thd) of 8 and 4 tokens: each CP rank holds its two chunks of each sequence
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    Qp, Kp, Vp, Gp = torch.randn(12, NP, D), torch.randn(12, NG, D), torch.randn(12, NG, D), torch.randn(12, NP * D)
    local = []
    for a, b in ((0, 8), (8, 12)):
        c2 = (b - a) // (2 * cp)
        local += list(range(a + rank * c2, a + (rank + 1) * c2)) + list(range(b - (rank + 1) * c2, b - rank * c2))
    local = torch.tensor(local)
    full = attention.DotProductAttention(NP, D, num_gqa_groups=NG, qkv_format="thd", attn_mask_type="padding_causal")
    part = attention.DotProductAttention(NP, D, num_gqa_groups=NG, qkv_format="thd", attn_mask_type="padding_causal",
                                         cp_group=group, cp_global_ranks=[0, 1])
    q, k, v = (t.clone().requires_grad_() for t in (Qp, Kp, Vp))
    y = full(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    y.backward(Gp)
    ql, kl, vl = (t[local].clone().requires_grad_() for t in (Qp, Kp, Vp))
    yl = part(ql, kl, vl, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu)
    yl.backward(Gp[local])
    out["thd-padding_causal"] = {"y": (yl - y[local]).abs().max().item(),
                                 "gq": (ql.grad - q.grad[local]).abs().max().item(),
                                 "gk": (kl.grad - k.grad[local]).abs().max().item(),
                                 "gv": (vl.grad - v.grad[local]).abs().max().item()}
    print("RESULT " + json.dumps({"rank": rank, **out}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    """
)


def test_two_rank_context_parallel_attention_equals_single_process(tmp_path: Path) -> None:
    """Context parallelism (CP2, Megatron's two-chunks-per-rank split): each rank's output and its q/k/v gradients
    equal the single-process attention over the whole sequence at that rank's positions (causal and no mask,
    GQA, both layouts); the key/value gradients come back to their owners through the reduce-scatter."""
    rows = _two_rank_results(tmp_path / "cp2.py", CP2_SCRIPT)
    assert sorted(r["rank"] for r in rows) == [0, 1], rows
    for row in rows:
        for case, d in row.items():
            if case == "rank":
                continue
            for key in ("y", "gq", "gk", "gv"):
                assert d[key] <= 1e-5, f"rank {row['rank']} {case} {key}: {d[key]}"
