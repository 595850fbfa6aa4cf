"""Ring context parallelism in the portable Transformer Engine (``portspeed/portable_te/ring.py``).

- one process: the float32 log-sum-exp merge of two key blocks equals attention over both (a plain
  average does not); the one-message packing round-trips mixed dtypes;
- two ranks (CP2; Gloo on CPU, and the test device through portspeed's router): through
  ``DotProductAttention``, the ring (``cp_comm_type="p2p"``, and ``"a2a"``) equals the all-gather
  form (``"all_gather"``) and the single-process attention (CP1) within 1e-5 in float32, output and
  q / k / v gradients, causal and not, MHA and GQA, with the registry's block kernels (torch's and
  the reference); a planted merge error (no log-sum-exp correction) and a planted chunk-order error
  (earlier- and later-rank blocks swapped) each break the comparison, which proves the ring ran;
  the same for packed ``thd`` sequences (8 and 16 tokens, every sequence split in 2 cp chunks as
  TE's ``thd_get_partitioned_indices`` does); attention dropout inside the ring (``sbhd`` and
  ``thd``) equals the CP1 attention given the masks the ring drew (``helpers.ring_checks.check_dropout``);
- four ranks (TP2 x CP2, Megatron's ``TEDotProductAttention``): test_te_ring_megatron.py.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.launch import torchrun
from helpers.ring_checks import check_rows

from portspeed.portable_te import ring
from portspeed.portable_te.sdpa import attention_lse_reference

pytestmark = pytest.mark.usefixtures("_cpu")


@pytest.fixture
def _cpu(portspeed_env) -> None:
    portspeed_env(PORTSPEED_ACCELERATOR="cpu")


def test_merge_of_two_key_blocks_equals_attention_over_both() -> None:
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 12, 8), torch.randn(2, 4, 12, 8)
    want, _ = attention_lse_reference(q, k, v, causal=False, scale=0.35)
    out_a, lse_a = attention_lse_reference(q, k[:, :, :7], v[:, :, :7], causal=False, scale=0.35)
    out_b, lse_b = attention_lse_reference(q, k[:, :, 7:], v[:, :, 7:], causal=False, scale=0.35)
    acc, lse = out_a.float().clone(), lse_a.clone()
    ring.merge_partial(acc, lse, out_b, lse_b)
    assert (acc - want).abs().max() < 1e-6
    assert (acc - (out_a + out_b) / 2).abs().max() > 1e-2  # a plain average is not the merge


def test_one_message_packs_mixed_dtypes() -> None:
    specs = [(torch.Size([2, 3]), torch.bfloat16), (torch.Size([3]), torch.bfloat16),
             (torch.Size([2, 2]), torch.float32)]
    packer = ring._Packer(specs, torch.device("cpu"))
    buf = packer.empty()
    assert buf.dtype == torch.uint8 and buf.numel() == 2 * 6 + 2 * 3 + 4 * 4
    values = [torch.randn(s).to(d) for s, d in specs]
    for i, t in enumerate(values):
        packer.view(buf, i).copy_(t)
    for i, t in enumerate(values):
        assert torch.equal(packer.view(buf, i), t)
    assert packer.span(buf, 0, 1).numel() == 2 * 9  # the two bf16 tensors lie next to each other


def test_which_form_serves_context_parallelism(caplog: pytest.LogCaptureFixture) -> None:
    """p2p and a2a take the ring, all_gather the all-gather form; active dropout runs in the ring (said once); a
    causal mask over unequal query/key lengths falls back to the all-gather form, said once."""
    ring._told.clear()
    assert ring.ring_serves("p2p", "causal", 0.0, 8, 8) and ring.ring_serves("a2a", "no_mask", 0.0, 8, 8)
    assert ring.ring_serves(None, "causal", 0.0, 8, 8)  # TE's default cp_comm_type is p2p
    assert not ring.ring_serves("all_gather", "causal", 0.0, 8, 8)
    assert not ring.ring_serves("all_gather", "causal", 0.1, 8, 8)
    assert ring.ring_serves("p2p", "no_mask", 0.0, 8, 4)
    with caplog.at_level("INFO", logger="portspeed.portable_te"):
        assert ring.ring_serves("p2p", "causal", 0.1, 8, 8)
        assert ring.ring_serves("p2p", "causal", 0.1, 8, 8)
        assert not ring.ring_serves("p2p", "causal", 0.0, 8, 4)
    said = [r.getMessage() for r in caplog.records]
    assert sum("attention dropout" in m for m in said) == 1, said
    assert sum("as many queries as keys" in m for m in said) == 1, said
    with pytest.raises(ValueError, match="divisible by 2 x the context-parallel size"):
        ring.ring_attention(*(torch.zeros(1, 2, 5, 4) for _ in range(3)), None, causal=True, scale=1.0)


def test_packed_sequence_lengths_must_split_into_2cp_chunks() -> None:
    """With CP every packed sequence is split in 2 cp chunks (TE asserts it too): other lengths are refused by name,
    not floor-divided into misaligned chunks."""
    from portspeed.portable_te.packed import packed_attention

    t = torch.zeros(7, 2, 4)
    cu = torch.tensor([0, 8, 14], dtype=torch.int32)  # 14 - 8 = 6 tokens: not a multiple of 4
    with pytest.raises(ValueError, match=r"multiple of 2 x the context-parallel size \(4\).*\[6\]"):
        packed_attention(t, t, t, "padding_causal", 1.0, None, cu, cu, cp_size=2, cp_rank=0, cp_comm_type="p2p")


_CP2 = textwrap.dedent(
    """
    import json, os
    import torch, torch.distributed as dist
    if os.environ.get("PORTSPEED_ACCELERATOR") == "testdev":
        import portspeed, portspeed.megatron_adaptor as adaptor
        adaptor.activate()  # the router and the device translation: "nccl" is the test device's CCL
        acc = portspeed.get_accelerator()
        acc.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        dev = acc.device()
    else:
        dist.init_process_group("gloo")
        dev = torch.device("cpu")
    from portspeed.portable_te import attention, ring
    from portspeed.portable_te.kernels import choice

    good_merge, good_block = ring.merge_partial, ring._block

    def no_lse_merge(out_acc, lse_acc, out, lse):  # planted: a plain average instead of the lse-weighted merge
        out_acc.add_(out.float()).mul_(0.5)

    def swapped_block(step, r, causal, half):  # planted: earlier- and later-rank blocks swapped
        rows, keys, c = good_block(step, r, causal, half)
        if step == 0 or not causal:
            return rows, keys, c
        every = slice(None)
        return (slice(half, None), every, False) if rows == every else (every, slice(0, half), False)

    rank, cp = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(cp)))
    out = {"rank": rank, "device": str(dev), "kernel": choice("attention_lse").impl}
    torch.manual_seed(0)
    S, B, D = 16, 2, 8
    c = S // (2 * cp)
    mine = torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])
    for heads, groups in ((4, 4), (4, 2)):
        Q, K, V = torch.randn(S, B, heads, D), torch.randn(S, B, groups, D), torch.randn(S, B, groups, D)
        G = torch.randn(S, B, heads * D)
        for mask in ("causal", "no_mask"):
            full = attention.DotProductAttention(heads, D, num_gqa_groups=groups, attn_mask_type=mask)
            q, k, v = (t.clone().requires_grad_() for t in (Q, K, V))
            y = full(q, k, v)  # CP1, on the host: the reference
            y.backward(G)
            ref = [t[mine] for t in (y, q.grad, k.grad, v.grad)]
            got = {}
            for name, comm, merge, block in (("ring", "p2p", good_merge, good_block),
                                              ("allgather", "all_gather", good_merge, good_block),
                                              ("a2a", "a2a", good_merge, good_block),
                                              ("plant-merge", "p2p", no_lse_merge, good_block),
                                              ("plant-order", "p2p", good_merge, swapped_block)):
                ring.merge_partial, ring._block = merge, block
                part = attention.DotProductAttention(heads, D, num_gqa_groups=groups, attn_mask_type=mask,
                                                     cp_group=group, cp_global_ranks=list(range(cp)), cp_comm_type=comm)
                ql, kl, vl = (t[mine].to(dev).requires_grad_() for t in (Q, K, V))
                yl = part(ql, kl, vl)
                yl.backward(G[mine].to(dev))
                got[name] = [t.detach().cpu() for t in (yl, ql.grad, kl.grad, vl.grad)]
            ring.merge_partial, ring._block = good_merge, good_block
            case = f"h{heads}g{groups}-{mask}"
            for name, tensors in got.items():
                out[f"{case} {name}-vs-cp1"] = [(a - b).abs().max().item() for a, b in zip(tensors, ref)]
            out[f"{case} ring-vs-allgather"] = [(a - b).abs().max().item()
                                                for a, b in zip(got["ring"], got["allgather"])]
    # packed sequences (thd) of 8 and 16 tokens: rank r holds chunks r and 2cp-1-r of EVERY sequence, sequences
    # back to back (TE's thd_get_partitioned_indices, as Megatron's get_thd_batch_on_this_cp_rank splits them)
    cu = torch.tensor([0, 8, 24], dtype=torch.int32)
    local = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        c2 = (b - a) // (2 * cp)
        local += list(range(a + rank * c2, a + (rank + 1) * c2)) + list(range(b - (rank + 1) * c2, b - rank * c2))
    local = torch.tensor(local)
    T = int(cu[-1])
    for heads, groups in ((4, 4), (4, 2)):
        Q, K, V = torch.randn(T, heads, D), torch.randn(T, groups, D), torch.randn(T, groups, D)
        G = torch.randn(T, heads * D)
        for mask in ("padding_causal", "padding"):
            full = attention.DotProductAttention(heads, D, num_gqa_groups=groups, qkv_format="thd", attn_mask_type=mask)
            q, k, v = (t.clone().requires_grad_() for t in (Q, K, V))
            y = full(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)
            y.backward(G)
            ref = [t[local] for t in (y, q.grad, k.grad, v.grad)]
            got = {}
            for name, comm, merge, block in (("ring", "p2p", good_merge, good_block),
                                              ("allgather", "all_gather", good_merge, good_block),
                                              ("plant-merge", "p2p", no_lse_merge, good_block),
                                              ("plant-order", "p2p", good_merge, swapped_block)):
                ring.merge_partial, ring._block = merge, block
                part = attention.DotProductAttention(heads, D, num_gqa_groups=groups, qkv_format="thd",
                                                     attn_mask_type=mask, cp_group=group,
                                                     cp_global_ranks=list(range(cp)), cp_comm_type=comm)
                ql, kl, vl = (t[local].to(dev).requires_grad_() for t in (Q, K, V))
                cud = cu.to(dev)
                yl = part(ql, kl, vl, cu_seqlens_q=cud, cu_seqlens_kv=cud, cu_seqlens_q_padded=cud,
                          cu_seqlens_kv_padded=cud)
                yl.backward(G[local].to(dev))
                got[name] = [t.detach().cpu() for t in (yl, ql.grad, kl.grad, vl.grad)]
            ring.merge_partial, ring._block = good_merge, good_block
            case = f"thd-h{heads}g{groups}-{mask.replace('padding_', '')}"
            for name, tensors in got.items():
                out[f"{case} {name}-vs-cp1"] = [(a - b).abs().max().item() for a, b in zip(tensors, ref)]
            out[f"{case} ring-vs-allgather"] = [(a - b).abs().max().item()
                                                for a, b in zip(got["ring"], got["allgather"])]

    # attention dropout inside the ring: given the keep masks the ring drew (recorded with the blocks they belong to),
    # output and gradients equal the CP1 attention with those masks at the blocks' global places; the keep rate is
    # 1 - p; the same tracker seed draws the same masks; the caller's generator is left alone (the tracker's fork)
    from portspeed.portable_te import ring_dropout
    from portspeed.portable_te.rng import CudaRNGStatesTracker
    P = 0.3
    good_mask, good_steps = ring_dropout.dropout_mask, ring._steps
    seen = {"masks": [], "blocks": [], "on": False}

    def recording_mask(shape, p, device):
        m = good_mask(shape, p, device)
        seen["masks"].append(m.cpu())
        return m

    def recording_steps(step, r, causal, segments):
        blocks = good_steps(step, r, causal, segments)
        if seen["on"]:
            seen["blocks"] += [((r.rank - step) % r.size, rows, keys) for rows, keys, _ in blocks]
        return blocks

    ring_dropout.dropout_mask, ring._steps = recording_mask, recording_steps
    objects = dist.new_group(list(range(cp)), backend="gloo")  # the recorded masks travel as Python objects
    heads, groups = 4, 2
    for fmt in ("sbhd", "thd"):
        if fmt == "sbhd":
            n = S
            owner = [torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * cp - 1 - r) * c, (2 * cp - r) * c)])
                     for r in range(cp)]
            seq = torch.zeros(n, dtype=torch.long)
            Q, K, V = torch.randn(n, B, heads, D), torch.randn(n, B, groups, D), torch.randn(n, B, groups, D)
            G = torch.randn(n, B, heads * D)
        else:
            n, owner = T, []
            for r in range(cp):
                idx = []
                for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
                    c2 = (b - a) // (2 * cp)
                    idx += list(range(a + r * c2, a + (r + 1) * c2)) + list(range(b - (r + 1) * c2, b - r * c2))
                owner.append(torch.tensor(idx))
            seq = torch.bucketize(torch.arange(n), cu[1:], right=True)
            Q, K, V = torch.randn(n, 1, heads, D), torch.randn(n, 1, groups, D), torch.randn(n, 1, groups, D)
            G = torch.randn(n, 1, heads * D)
        mine_f = owner[rank]
        runs = []
        for seed in (7, 7, 8):
            tracker = CudaRNGStatesTracker()
            tracker.add("model-parallel-rng", seed)
            kw = {"qkv_format": "thd", "attn_mask_type": "padding_causal"} if fmt == "thd" else {}
            part = attention.DotProductAttention(heads, D, num_gqa_groups=groups, attention_dropout=P,
                                                 get_rng_state_tracker=lambda: tracker, cp_group=group,
                                                 cp_global_ranks=list(range(cp)), cp_comm_type="p2p", **kw)
            part.train()
            sq = (lambda t: t.squeeze(1)) if fmt == "thd" else (lambda t: t)
            ql, kl, vl = (sq(t[mine_f]).to(dev).requires_grad_() for t in (Q, K, V))
            seen.update(masks=[], blocks=[], on=True)
            state = torch.get_rng_state()
            cud = cu.to(dev)
            yl = part(ql, kl, vl, **({"cu_seqlens_q": cud, "cu_seqlens_kv": cud, "cu_seqlens_q_padded": cud,
                                      "cu_seqlens_kv_padded": cud} if fmt == "thd" else {}))
            seen["on"] = False
            out[f"dropout-{fmt} caller-rng-kept"] = bool(torch.equal(state, torch.get_rng_state()))
            masks, blocks = list(seen["masks"]), list(seen["blocks"])
            yl.backward(sq(G[mine_f]).to(dev))
            runs.append((yl.detach().cpu(), masks, blocks, [t.grad.cpu() for t in (ql, kl, vl)]))
        y_a, masks, blocks, grads = runs[0]
        out[f"dropout-{fmt} same-seed-equal"] = bool(torch.equal(y_a, runs[1][0]))
        out[f"dropout-{fmt} other-seed-differs"] = bool(not torch.equal(y_a, runs[2][0]))
        kept = torch.cat([m.flatten() for m in masks]).float()
        out[f"dropout-{fmt} keep-rate"] = [kept.mean().item(), kept.numel(), len(masks), len(blocks)]
        # the CP1 reference (float64) with every rank's drawn masks at their blocks' global places (1 elsewhere:
        # no effect); the masks of the other ranks' queries enter this rank's key/value gradients
        everyone = [None] * cp
        dist.all_gather_object(everyone, (rank, blocks, masks), group=objects)
        b = Q.shape[1]
        Mg = torch.ones(b, heads, n, n, dtype=torch.float64)
        for who, who_blocks, who_masks in everyone:
            for (src, rows, keys), m in zip(who_blocks, who_masks):
                qi, ki = owner[who][rows], owner[src][keys]
                Mg[:, :, qi[:, None], ki[None, :]] = m.double()
        q, k, v = (t.double().permute(1, 2, 0, 3).clone().requires_grad_() for t in (Q, K, V))  # [b, h, n, d]
        ke, ve = (t.repeat_interleave(heads // groups, dim=1) for t in (k, v))
        pos = torch.arange(n)
        allowed = (pos[None, :] <= pos[:, None]) & (seq[None, :] == seq[:, None])
        sc = (q @ ke.transpose(-2, -1) / D ** 0.5).masked_fill(~allowed, float("-inf"))
        y = (torch.softmax(sc, dim=-1) * Mg / (1 - P)) @ ve                           # [b, h, n, d]
        y = y.permute(2, 0, 1, 3).reshape(n, b, heads * D)
        y.backward(G.double())
        gq, gk, gv = (t.grad.permute(2, 0, 1, 3) for t in (q, k, v))                  # [n, b, h, d]
        fl = (lambda t: t.squeeze(1)) if fmt == "thd" else (lambda t: t)
        ref = [fl(y[mine_f]), fl(gq[mine_f]), fl(gk[mine_f]), fl(gv[mine_f])]
        out[f"dropout-{fmt} ring-vs-cp1-same-masks"] = [(a.double() - r).abs().max().item()
                                                       for a, r in zip([y_a] + grads, ref)]
    ring_dropout.dropout_mask, ring._steps = good_mask, good_steps
    print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    """
)


def _cp_results(tmp_path: Path, nproc: int = 2, **env: str) -> list[dict]:
    script = tmp_path / "cp_ring.py"
    script.write_text(_CP2)
    res = torchrun(str(script), nproc, timeout=240, env={"PORTSPEED_ACCELERATOR": "cpu", **env})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    decoder = json.JSONDecoder()
    rows = [decoder.raw_decode(part.lstrip())[0] for part in res.stdout.split("RESULT ")[1:]]
    assert sorted(r["rank"] for r in rows) == list(range(nproc)), res.stdout[-2000:]
    return rows


@pytest.mark.multiproc
def test_cp2_ring_equals_all_gather_and_cp1_on_gloo(tmp_path: Path) -> None:
    """CP2 on CPU / Gloo, the registry's block kernels (torch's CPU flash op with its log-sum-exp)."""
    rows = _cp_results(tmp_path)
    assert {(r["device"], r["kernel"]) for r in rows} == {("cpu", "torch")}, rows
    check_rows(rows)


@pytest.mark.multiproc
def test_cp2_ring_with_reference_block_kernels(tmp_path: Path) -> None:
    """The same with ``PORTSPEED_TE_KERNELS=reference``: the merge and the ring do not depend on the kernel."""
    rows = _cp_results(tmp_path, PORTSPEED_TE_KERNELS="reference")
    assert {r["kernel"] for r in rows} == {"reference"}, rows
    check_rows(rows)


@pytest.mark.testdev
@pytest.mark.multiproc
def test_cp2_ring_on_the_test_device(tmp_path: Path) -> None:
    """CP2 on portspeed's test device (testccl through portspeed's router), against the CPU CP1 attention."""
    rows = _cp_results(tmp_path, PORTSPEED_ACCELERATOR="testdev")
    assert {r["device"].split(":")[0] for r in rows} == {"testdev"}, rows
    check_rows(rows)
