"""Ring context parallelism in the portable Transformer Engine (``portspeed/portable_te/ring.py``).

- one process: the float32 log-sum-exp merge of two key blocks equals attention over both (a plain
  average does not); the one-message packing round-trips mixed dtypes;
- two ranks (CP2; Gloo on CPU, and the test device through portspeed's router): through
  ``DotProductAttention``, the ring (``cp_comm_type="p2p"``, and ``"a2a"``) equals the all-gather
  form (``"all_gather"``) and the single-process attention (CP1) within 1e-5 in float32, output and
  q / k / v gradients, causal and not, MHA and GQA, with the registry's block kernels (torch's and
  the reference); a planted merge error (no log-sum-exp correction) and a planted chunk-order error
  (earlier- and later-rank blocks swapped) each break the comparison, which proves the ring ran.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.launch import torchrun

from portspeed.portable_te import ring
from portspeed.portable_te.sdpa import attention_lse_reference

pytestmark = pytest.mark.usefixtures("_cpu")

TOL = 1e-5


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
    specs = [(torch.Size([2, 3]), torch.bfloat16), (torch.Size([3]), torch.bfloat16), (torch.Size([2, 2]), torch.float32)]
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
    """p2p and a2a take the ring, all_gather the all-gather form; active dropout and a causal mask over unequal
    query/key lengths fall back to the all-gather form, each said once (dropout is never dropped)."""
    ring._told.clear()
    assert ring.ring_serves("p2p", "causal", 0.0, 8, 8) and ring.ring_serves("a2a", "no_mask", 0.0, 8, 8)
    assert ring.ring_serves(None, "causal", 0.0, 8, 8)  # TE's default cp_comm_type is p2p
    assert not ring.ring_serves("all_gather", "causal", 0.0, 8, 8)
    assert ring.ring_serves("p2p", "no_mask", 0.0, 8, 4)
    with caplog.at_level("WARNING", logger="portspeed.portable_te"):
        assert not ring.ring_serves("p2p", "causal", 0.1, 8, 8)
        assert not ring.ring_serves("p2p", "causal", 0.1, 8, 8)
        assert not ring.ring_serves("p2p", "causal", 0.0, 8, 4)
    said = [r.getMessage() for r in caplog.records]
    assert sum("attention dropout" in m for m in said) == 1, said
    assert sum("as many queries as keys" in m for m in said) == 1, said
    with pytest.raises(ValueError, match="divisible by 2 x the context-parallel size"):
        ring.ring_attention(*(torch.zeros(1, 2, 5, 4) for _ in range(3)), None, causal=True, scale=1.0)


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
    mine = torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])
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


def _check(rows: list[dict]) -> None:
    """Ring = all-gather = a2a = CP1 within 1e-5 (output, dq, dk, dv); each planted error off by far more."""
    for row in rows:
        for case, errs in row.items():
            if not isinstance(errs, list):
                continue
            worst = max(errs)
            where = f"rank {row['rank']} {case} (y, dq, dk, dv): {errs}"
            if "plant-merge" in case or ("plant-order" in case and "-causal " in case):
                assert worst > 1e-2, f"a planted error went unnoticed: {where}"
            elif "plant-order" in case:
                assert worst <= TOL, where  # without a mask every block is full: the order does not matter
            else:
                assert worst <= TOL, where


@pytest.mark.multiproc
def test_cp2_ring_equals_all_gather_and_cp1_on_gloo(tmp_path: Path) -> None:
    """CP2 on CPU / Gloo, the registry's block kernels (torch's CPU flash op with its log-sum-exp)."""
    rows = _cp_results(tmp_path)
    assert {(r["device"], r["kernel"]) for r in rows} == {("cpu", "torch")}, rows
    _check(rows)


@pytest.mark.multiproc
def test_cp2_ring_with_reference_block_kernels(tmp_path: Path) -> None:
    """The same with ``PORTSPEED_TE_KERNELS=reference``: the merge and the ring do not depend on the kernel."""
    rows = _cp_results(tmp_path, PORTSPEED_TE_KERNELS="reference")
    assert {r["kernel"] for r in rows} == {"reference"}, rows
    _check(rows)


@pytest.mark.testdev
@pytest.mark.multiproc
def test_cp2_ring_on_the_test_device(tmp_path: Path) -> None:
    """CP2 on portspeed's test device (testccl through portspeed's router), against the CPU CP1 attention."""
    rows = _cp_results(tmp_path, PORTSPEED_ACCELERATOR="testdev")
    assert {r["device"].split(":")[0] for r in rows} == {"testdev"}, rows
    _check(rows)
