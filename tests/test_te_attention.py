"""The portable TE's attention kernels: torch's fused SDPA against the reference arithmetic (``portable_te/sdpa.py``).

Bands (measured on CPU, torch 2.13, these shapes): fp32 torch vs reference ~5e-7 (asserted 1e-5, no relative
slack); bf16 ~1e-2 (asserted 3e-2 absolute + 3e-2 relative: the reference rounds the scores and probabilities to
bf16 between its matmuls, the fused kernel accumulates in fp32). The log-sum-exp functions are checked against
the reference and, for the backward given the *final* output and log-sum-exp, against autograd of the whole
attention split into two key blocks merged through their log-sum-exp (what ring context parallelism does).

Dropout: SDPA's dropout on CPU runs in torch's math path, which draws one Bernoulli mask over the probabilities,
as ``nn.Dropout`` does in the reference: under the same generator state the two agree (asserted here on CPU);
on other devices the masks may differ, so the module-level tests compare a kernel with itself under the same
RNG tracker state and check the tracker (not the caller's generator) supplies the randomness.
"""

from __future__ import annotations

import pytest
import torch

from portspeed.portable_te import attention, packed, rng, sdpa

FP32 = {"atol": 1e-5, "rtol": 0.0}
BF16 = {"atol": 3e-2, "rtol": 3e-2}


def _qkv(b: int, hq: int, hkv: int, sq: int, sk: int, d: int = 8, dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype).requires_grad_()  # noqa: E731
    return mk(b, hq, sq, d), mk(b, hkv, sk, d), mk(b, hkv, sk, d), torch.randn(b, hq, sq, d, generator=g).to(dtype)


def _run(fn, q, k, v, grad, **kw):
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v, scale=0.3, dropout_p=0.0, **kw)
    out.backward(grad)
    return [out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()]


def _masks() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    pad = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    pad[1, ..., 5:] = False                                 # the second sequence has 5 real keys
    arb = torch.rand(2, 1, 5, 7, generator=g) > 0.4
    arb[0, 0, 2] = False                                    # a fully masked row
    return {"padding": pad, "arbitrary": arb}


CASES = {  # name: (hq, hkv, sq, sk, mask, causal)
    "no-mask-mha": (4, 4, 5, 7, None, None),
    "top-left-square": (4, 2, 6, 6, None, "top_left"),
    "top-left-sq<sk": (4, 2, 5, 7, None, "top_left"),
    "bottom-right-sq<sk": (4, 2, 5, 7, None, "bottom_right"),
    "bottom-right-sq>sk": (4, 2, 7, 5, None, "bottom_right"),    # the first two rows see no key
    "padding": (4, 2, 5, 7, "padding", None),
    "padding-causal": (4, 1, 5, 7, "padding", "top_left"),
    "arbitrary-dead-row": (4, 2, 5, 7, "arbitrary", None),
    "arbitrary-bottom-right": (4, 2, 5, 7, "arbitrary", "bottom_right"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_torch_attention_equals_reference(case: str, dtype: torch.dtype) -> None:
    """Values and q/k/v gradients of the SDPA kernel equal the reference's within the stated band."""
    hq, hkv, sq, sk, mask_name, causal = CASES[case]
    q, k, v, grad = _qkv(2, hq, hkv, sq, sk, dtype=dtype)
    mask = _masks()[mask_name] if mask_name else None
    got = _run(sdpa.attention_torch, q, k, v, grad, attn_mask=mask, causal=causal)
    ref = _run(sdpa.attention_reference, q, k, v, grad, attn_mask=mask, causal=causal)
    band = FP32 if dtype == torch.float32 else BF16
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert a.dtype == dtype and a.shape == b.shape, name
        torch.testing.assert_close(a.float(), b.float(), **band, msg=lambda m, n=name: f"{case} {n}: {m}")


@pytest.mark.parametrize("fn", [sdpa.attention_torch, sdpa.attention_reference], ids=["torch", "reference"])
def test_fully_masked_row_is_the_mean_of_v(fn) -> None:
    """A row with nothing to attend gives the mean of v over all keys (TE's unfused result), with finite gradients
    that only v receives from it."""
    q, k, v, _ = _qkv(1, 2, 2, 3, 4)
    mask = torch.ones(1, 1, 3, 4, dtype=torch.bool)
    mask[..., 1, :] = False
    out = fn(q, k, v, attn_mask=mask, causal=None, scale=0.5, dropout_p=0.0)
    torch.testing.assert_close(out[:, :, 1], v.mean(dim=2), **FP32)
    grad = torch.zeros_like(out)
    grad[:, :, 1] = 1.0                                     # only the dead row's output is differentiated
    out.backward(grad)
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    assert q.grad.abs().max() == 0 and k.grad.abs().max() == 0
    torch.testing.assert_close(v.grad, torch.full_like(v, 1 / 4), **FP32)


def test_grouped_query_native_equals_expanded() -> None:
    """``enable_gqa`` (K/V with fewer heads) gives what K/V expanded to every query head give."""
    q, k, v, grad = _qkv(2, 6, 2, 5, 5)
    got = _run(sdpa.attention_torch, q, k, v, grad, attn_mask=None, causal="top_left")
    ke, ve = (t.detach().repeat_interleave(3, dim=1).requires_grad_() for t in (k, v))
    ref = _run(sdpa.attention_torch, q, ke, ve, grad, attn_mask=None, causal="top_left")
    torch.testing.assert_close(got[0], ref[0], **FP32)
    torch.testing.assert_close(got[1], ref[1], **FP32)
    torch.testing.assert_close(got[2], ref[2].reshape(2, 2, 3, 5, 8).sum(2), **FP32)


def test_dropout_on_cpu_draws_the_reference_mask() -> None:
    """On CPU, SDPA with dropout (torch's math path) under the same generator state equals the reference with
    ``nn.Dropout`` on its probabilities; a different state gives a different result."""
    q, k, v, _ = _qkv(2, 4, 2, 5, 7)
    outs = []
    for seed in (11, 11, 12):
        for fn in (sdpa.attention_torch, sdpa.attention_reference):
            torch.manual_seed(seed)
            outs.append(fn(q, k, v, attn_mask=None, causal="top_left", scale=0.3, dropout_p=0.4).detach())
    torch.testing.assert_close(outs[0], outs[1], **FP32)
    torch.testing.assert_close(outs[0], outs[2], atol=0, rtol=0)
    assert (outs[0] - outs[4]).abs().max() > 1e-3


def _tracker() -> rng.CudaRNGStatesTracker:
    tracker = rng.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    return tracker


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_module_dropout_draws_from_the_tracker_fork(sequence_parallel: bool) -> None:
    """Training: dropout inside the tracker's fork (the caller's generator untouched), outside it with sequence
    parallelism; the same tracker state gives the same result, an advanced one another; eval: no dropout."""
    tracker = _tracker()
    dpa = attention.DotProductAttention(4, 8, num_gqa_groups=2, attention_dropout=0.5, attn_mask_type="causal",
                                        sequence_parallel=sequence_parallel, get_rng_state_tracker=lambda: tracker)
    q, k, v = (torch.randn(6, 2, h, 8) for h in (4, 2, 2))
    states, cpu = tracker.get_states(), torch.get_rng_state()
    first = dpa(q, k, v)
    assert torch.equal(torch.get_rng_state(), cpu) != sequence_parallel
    assert any(not torch.equal(a, tracker.get_states()[n]) for n, a in states.items()) != sequence_parallel
    tracker.set_states(states)
    torch.set_rng_state(cpu)
    again = dpa(q, k, v)
    torch.testing.assert_close(again, first, atol=0, rtol=0)
    third = dpa(q, k, v)
    assert (third - first).abs().max() > 1e-3
    dpa.eval()
    plain = attention.DotProductAttention(4, 8, num_gqa_groups=2, attn_mask_type="causal")
    torch.testing.assert_close(dpa(q, k, v), plain(q, k, v), atol=0, rtol=0)


@pytest.mark.parametrize("mask_type", ["causal_bottom_right", "padding_causal", "arbitrary"])
def test_module_torch_kernel_equals_reference_kernel(mask_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """DotProductAttention through SDPA equals the same module through the reference (Megatron's True = masked
    padding mask inverted on the way in), outputs and input gradients, sq != sk."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(s, 2, h, 8, generator=g) for s, h in ((5, 4), (7, 2), (7, 2)))
    masked = torch.rand(2, 1, 5, 7, generator=g) > 0.6
    masked[1, 0, 3] = True                                  # a row with nothing to attend
    results = []
    for fn in (sdpa.attention_torch, sdpa.attention_reference):
        monkeypatch.setattr(attention, "attention_kernel", lambda fn=fn: fn)
        dpa = attention.DotProductAttention(4, 8, num_gqa_groups=2, attn_mask_type=mask_type)
        qi, ki, vi = (t.clone().requires_grad_() for t in (q, k, v))
        out = dpa(qi, ki, vi, None if mask_type == "causal_bottom_right" else masked)
        out.square().sum().backward()
        results.append([out.detach(), qi.grad, ki.grad, vi.grad])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **FP32)


@pytest.mark.parametrize("setting, served", [("", "attention_torch"), ("reference", "attention_reference"),
                                             ("attention=reference", "attention_reference")])
def test_module_runs_the_registry_choice(setting: str, served: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """DotProductAttention calls the kernel the registry chose (``PORTSPEED_TE_KERNELS``), once per forward."""
    from portspeed import config
    from portspeed.portable_te import kernels

    calls: list[str] = []
    for name in ("attention_torch", "attention_reference"):
        real = getattr(sdpa, name)
        monkeypatch.setattr(sdpa, name, lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
    monkeypatch.setenv("PORTSPEED_TE_KERNELS", setting)
    config.reload()
    kernels.reset()
    try:
        dpa = attention.DotProductAttention(4, 8, num_gqa_groups=2)
        dpa(*(torch.randn(6, 2, h, 8) for h in (4, 2, 2)))
    finally:
        monkeypatch.delenv("PORTSPEED_TE_KERNELS")
        config.reload()
        kernels.reset()
    assert calls == [served]


def test_packed_sequences_torch_equals_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """thd (two packed sequences and trailing padding): per-sequence SDPA on CPU equals the reference; CPU has no
    varlen kernel, which is probed once and remembered."""
    g = torch.Generator().manual_seed(4)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q, k, v = (torch.randn(14, h, 8, generator=g) for h in (4, 2, 2))
    results = []
    for fn in (sdpa.attention_torch, sdpa.attention_reference):
        monkeypatch.setattr(attention, "attention_kernel", lambda fn=fn: fn)
        dpa = attention.DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="thd", attn_mask_type="padding_causal")
        qi, ki, vi = (t.clone().requires_grad_() for t in (q, k, v))
        out = dpa(qi, ki, vi, cu_seqlens_q=cu, cu_seqlens_kv=cu)
        out.square().sum().backward()
        results.append([out.detach(), qi.grad, ki.grad, vi.grad])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **FP32)
    assert results[0][0][12:].abs().max() == 0, "padding tokens' outputs are zero"
    assert packed.varlen_supported(torch.device("cpu"), torch.float32) is False
    assert ("cpu", torch.float32) in packed._VARLEN


# --- one block with its log-sum-exp ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_lse_torch_equals_reference(causal: bool, dtype: torch.dtype) -> None:
    q, k, v, _ = _qkv(2, 4, 2, 6, 6, dtype=dtype)
    out, lse = sdpa.attention_lse_torch(q, k, v, causal=causal, scale=0.3)
    ref_out, ref_lse = sdpa.attention_lse_reference(q, k, v, causal=causal, scale=0.3)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (2, 4, 6)
    band = FP32 if dtype == torch.float32 else BF16
    torch.testing.assert_close(out.float(), ref_out.float(), **band)
    torch.testing.assert_close(lse, ref_lse, **FP32 if dtype == torch.float32 else {"atol": 2e-2, "rtol": 0})
    full = sdpa.attention_reference(q.double(), k.double(), v.double(), attn_mask=None,
                                    causal="top_left" if causal else None, scale=0.3, dropout_p=0.0)
    torch.testing.assert_close(ref_out.double(), full, **band)


@pytest.mark.parametrize("impl", ["torch", "reference"])
@pytest.mark.parametrize("hkv", [4, 2])
def test_lse_backward_of_a_two_block_merge_equals_autograd(impl: str, hkv: int) -> None:
    """Queries of one block attend keys in two blocks: the earlier one whole, their own causally (ring CP's
    pattern, bottom-right over the whole key range). Merging the blocks' outputs through their log-sum-exp gives
    the attention; each block's backward given the *final* out and lse, summed, gives autograd's gradients."""
    fwd = getattr(sdpa, f"attention_lse_{impl}")
    bwd = getattr(sdpa, f"attention_lse_backward_{impl}")
    q, k, v, grad = _qkv(2, 4, hkv, 6, 12, seed=5)
    blocks = [(slice(0, 6), False), (slice(6, 12), True)]
    parts = [fwd(q, k[:, :, s], v[:, :, s], causal=c, scale=0.3) for s, c in blocks]
    lse = torch.logaddexp(parts[0][1], parts[1][1])
    out = sum(o.float() * torch.exp(l - lse).unsqueeze(-1) for o, l in parts).to(q.dtype)
    full = sdpa.attention_reference(q, k, v, attn_mask=None, causal="bottom_right", scale=0.3, dropout_p=0.0)
    full.backward(grad)
    torch.testing.assert_close(out, full.detach(), **FP32)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for s, c in blocks:
        gq, gk, gv = bwd(grad, q, k[:, :, s], v[:, :, s], out, lse, causal=c, scale=0.3)
        assert gk.shape == k[:, :, s].shape and gv.shape == v[:, :, s].shape
        dq += gq
        dk[:, :, s] += gk
        dv[:, :, s] += gv
    for name, a, b in (("dq", dq, q.grad), ("dk", dk, k.grad), ("dv", dv, v.grad)):
        torch.testing.assert_close(a, b, **FP32, msg=lambda m, n=name: f"{n}: {m}")


def test_lse_backward_with_the_block_lse_is_not_the_merged_gradient() -> None:
    """The final lse matters: a block's own lse (a planted merge error) gives a different dq."""
    q, k, v, grad = _qkv(1, 2, 2, 4, 8, seed=6)
    parts = [sdpa.attention_lse_torch(q, k[:, :, s], v[:, :, s], causal=False, scale=0.3)
             for s in (slice(0, 4), slice(4, 8))]
    lse = torch.logaddexp(parts[0][1], parts[1][1])
    out = sum(o * torch.exp(l - lse).unsqueeze(-1) for o, l in parts)
    right = sdpa.attention_lse_backward_torch(grad, q, k[:, :, :4], v[:, :, :4], out, lse, causal=False, scale=0.3)
    wrong = sdpa.attention_lse_backward_torch(grad, q, k[:, :, :4], v[:, :, :4], parts[0][0], parts[0][1],
                                              causal=False, scale=0.3)
    assert (right[0] - wrong[0]).abs().max() > 1e-3
