"""The portable Transformer Engine's layers against plain torch references (portspeed/portable_te).

In process (TP = 1): Linear / LayerNormLinear forward and backward equal ``F.linear`` (after
``F.layer_norm`` / RMS), zero-centred gamma, the weight gradient fused into ``main_grad``,
DotProductAttention (causal, padding, GQA, both layouts) equal to an explicit softmax
attention, the RNG tracker's forks, ``checkpoint`` recomputing with the same dropout mask, the
``_extra_state`` round trip, and every refusal naming its flag. Two ranks: test_portable_te_ranks.py;
inside megatron-core: test_portable_te_megatron.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from portspeed.errors import UnsupportedOptionError
from portspeed.portable_te import attention, grouped, linear, namespace, norms, rng

ATOL = 1e-6


@pytest.fixture(autouse=True)
def _cpu(portspeed_env) -> None:
    portspeed_env(PORTSPEED_ACCELERATOR="cpu")


def _init(w: torch.Tensor) -> None:
    torch.nn.init.normal_(w, std=0.2)


def test_linear_and_layernorm_linear_equal_torch() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 3, 8, requires_grad=True)
    lin = linear.Linear(8, 6, init_method=_init, bias=True, params_dtype=torch.float32, device="cpu")
    w, b = lin.weight.detach().clone().requires_grad_(), lin.bias.detach().clone().requires_grad_()
    y = lin(x)
    ref = F.linear(x, w, b)
    torch.testing.assert_close(y, ref, atol=ATOL, rtol=0)
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g, retain_graph=True)
    y.backward(g)
    ref.backward(g)
    torch.testing.assert_close(lin.weight.grad, w.grad, atol=ATOL, rtol=0)
    torch.testing.assert_close(lin.bias.grad, b.grad, atol=ATOL, rtol=0)

    for norm in ("LayerNorm", "RMSNorm"):
        lnl = linear.LayerNormLinear(8, 6, eps=1e-5, init_method=_init, normalization=norm, zero_centered_gamma=True,
                                     device="cpu", return_bias=True)
        with torch.no_grad():
            lnl.layer_norm_weight.normal_()
        out, bias = lnl(x)
        gamma = lnl.layer_norm_weight + 1
        if norm == "LayerNorm":
            h = F.layer_norm(x, (8,), gamma, lnl.layer_norm_bias, 1e-5)
        else:
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * gamma
        torch.testing.assert_close(out, F.linear(h, lnl.weight), atol=ATOL, rtol=0)
        assert bias is lnl.bias, "return_bias hands the bias back, not added"
        assert (norm == "RMSNorm") == (lnl.layer_norm_bias is None)


@pytest.mark.parametrize("mode", [None, "column", "row"])
@pytest.mark.parametrize("tp", [1, 2])
def test_parameter_attributes_are_transformer_engines(mode: str | None, tp: int) -> None:
    """Megatron's tensor-parallel attributes as NVIDIA's TE sets them: every weight tensor-parallel (dim 1 for row,
    else 0), parallel_mode=None included (Megatron's tensor-parallel experts: their shards count in the grad
    norm); a column bias tensor-parallel; a row bias and the norm parameters sequence-parallel only when tp > 1."""
    layers = [linear.Linear(8, 8, parallel_mode=mode, tp_size=tp, sequence_parallel=True, device="cpu")]
    if mode != "row":
        layers.append(linear.LayerNormLinear(8, 8, parallel_mode=mode, tp_size=tp, sequence_parallel=True,
                                             device="cpu"))
    for layer in layers:
        w, b = layer.weight, layer.bias
        assert (w.tensor_model_parallel, w.partition_dim, w.partition_stride) == (True, int(mode == "row"), 1)
        assert getattr(b, "tensor_model_parallel", None) is (True if mode == "column" else None)
        assert getattr(b, "sequence_parallel", None) is (tp > 1 if mode == "row" else None)
        if isinstance(layer, linear.LayerNormLinear):
            assert layer.layer_norm_weight.sequence_parallel is layer.layer_norm_bias.sequence_parallel is (tp > 1)


@pytest.mark.parametrize("return_bias", [False, True])
def test_grouped_linear_equals_one_linear_per_expert(return_bias: bool) -> None:
    """GroupedLinear (``--moe-grouped-gemm``) equals F.linear per expert on its rows, forward and every gradient,
    an expert with no tokens included; with fuse_wgrad_accumulation the weight gradients go into main_grad."""
    torch.manual_seed(0)
    splits = [3, 0, 5]
    x = torch.randn(8, 4, requires_grad=True)
    layer = grouped.GroupedLinear(3, 4, 6, init_method=_init, bias=True, return_bias=return_bias, device="cpu")
    ws = [getattr(layer, f"weight{i}").detach().clone().requires_grad_() for i in range(3)]
    bs = [torch.randn(6) for _ in range(3)]
    with torch.no_grad():
        for i, b in enumerate(bs):
            getattr(layer, f"bias{i}").copy_(b)
    bs = [b.requires_grad_() for b in bs]
    got = layer(x, splits)
    out, biases = got if return_bias else (got, None)
    ref = torch.cat([F.linear(c, w) for c, w in zip(torch.split(x, splits), ws)])
    if not return_bias:
        ref = ref + torch.cat([b.expand(n, -1) for b, n in zip(bs, splits)])
    else:
        assert [b.data_ptr() for b in biases] == [getattr(layer, f"bias{i}").data_ptr() for i in range(3)]
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    g = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, g, retain_graph=True)
    (rx,) = torch.autograd.grad(ref, x, g, retain_graph=True)
    torch.testing.assert_close(gx, rx, atol=ATOL, rtol=0)
    out.backward(g)
    ref.backward(g)
    for i in range(3):
        torch.testing.assert_close(getattr(layer, f"weight{i}").grad, ws[i].grad, atol=ATOL, rtol=0)
        if not return_bias:
            torch.testing.assert_close(getattr(layer, f"bias{i}").grad, bs[i].grad, atol=ATOL, rtol=0)
    assert torch.count_nonzero(layer.weight1.grad) == 0  # expert 1 saw no tokens
    assert all(getattr(layer, f"weight{i}").tensor_model_parallel for i in range(3))

    fused = grouped.GroupedLinear(3, 4, 6, init_method=_init, bias=False, fuse_wgrad_accumulation=True, device="cpu")
    for i in range(3):
        w = getattr(fused, f"weight{i}")
        w.main_grad = torch.zeros_like(w)
        w.grad_added_to_main_grad = False
    y = fused(x.detach(), splits)
    y.backward(g)
    for i, (c, gc) in enumerate(zip(torch.split(x.detach(), splits), torch.split(g, splits))):
        torch.testing.assert_close(getattr(fused, f"weight{i}").main_grad, gc.t() @ c, atol=ATOL, rtol=0)
        assert getattr(fused, f"weight{i}").grad_added_to_main_grad
    with pytest.raises(ValueError, match="splits"):
        fused(x.detach(), [1, 2])
    with pytest.raises(UnsupportedOptionError, match="parallel_mode"):
        grouped.GroupedLinear(2, 4, 4, parallel_mode="column", tp_size=2, device="cpu")


@pytest.mark.parametrize("mask", ["padding_causal", "padding"])
@pytest.mark.parametrize("padded", [False, True])
def test_packed_sequences_equal_one_attention_per_sequence(mask: str, padded: bool) -> None:
    """qkv_format='thd' (Megatron's PackedSeqParams): each packed sequence equals the unpacked attention of that
    sequence alone (causal or not, GQA), forward and gradients; padding tokens (cu_seqlens_*_padded) give zeros."""
    torch.manual_seed(0)
    lens, pads = [3, 5, 2], ([4, 6, 2] if padded else [3, 5, 2])
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    cu_pad = torch.tensor([0] + list(torch.tensor(pads).cumsum(0)), dtype=torch.int32)
    t = int(cu_pad[-1])
    q, k, v = (torch.randn(t, h, 8, requires_grad=True) for h in (4, 2, 2))
    att = attention.DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="thd", attn_mask_type=mask)
    extra = {"cu_seqlens_q_padded": cu_pad, "cu_seqlens_kv_padded": cu_pad} if padded else {}
    out = att(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(pads), max_seqlen_kv=max(pads), **extra)
    assert out.shape == (t, 32)
    one = attention.DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="sbhd",
                                        attn_mask_type="causal" if "causal" in mask else "no_mask")
    g = torch.randn_like(out)
    out.backward(g)
    refs = []
    for start, n in zip(cu_pad[:-1].tolist(), lens):
        qi, ki, vi = (x.detach()[start:start + n].unsqueeze(1).requires_grad_() for x in (q, k, v))
        y = one(qi, ki, vi)
        y.backward(g[start:start + n].unsqueeze(1))
        torch.testing.assert_close(out[start:start + n], y.squeeze(1), atol=ATOL, rtol=0)
        for got, want in ((q, qi), (k, ki), (v, vi)):
            torch.testing.assert_close(got.grad[start:start + n], want.grad.squeeze(1), atol=ATOL, rtol=0)
        refs.append((start, n))
    real = torch.zeros(t, dtype=torch.bool)
    for start, n in refs:
        real[start:start + n] = True
    assert torch.count_nonzero(out[~real]) == 0, "padding tokens must give zeros"


def test_packed_rope_equals_rope_per_sequence() -> None:
    """The served RoPE with tensor_format='thd' rotates each packed sequence from position 0."""
    rope = namespace.build("2.6.0")["transformer_engine.pytorch.attention.rope"].apply_rotary_pos_emb
    torch.manual_seed(0)
    cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    t = torch.randn(10, 2, 8)
    freqs = torch.randn(16, 1, 1, 8)
    got = rope(t, freqs, tensor_format="thd", cu_seqlens=cu, fused=True)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        want = rope(t[a:b].unsqueeze(1), freqs, tensor_format="sbhd").squeeze(1)
        torch.testing.assert_close(got[a:b], want, atol=ATOL, rtol=0)


def test_norms_zero_centred_gamma() -> None:
    torch.manual_seed(1)
    x = torch.randn(4, 2, 16)
    ln = norms.LayerNorm(16, eps=1e-6, zero_centered_gamma=True, sequence_parallel=True, device="cpu")
    assert torch.all(ln.weight == 0) and ln.weight.sequence_parallel is True
    torch.testing.assert_close(ln(x), F.layer_norm(x, (16,), eps=1e-6), atol=ATOL, rtol=0)
    rms = norms.RMSNorm(16, eps=1e-6, device="cpu")
    torch.testing.assert_close(rms(x), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), atol=ATOL, rtol=0)


def test_fused_wgrad_goes_into_main_grad() -> None:
    torch.manual_seed(2)
    lin = linear.Linear(8, 4, init_method=_init, bias=False, fuse_wgrad_accumulation=True, device="cpu")
    lin.weight.main_grad = torch.ones(4, 8)
    lin.weight.grad_added_to_main_grad = False
    x = torch.randn(3, 2, 8)
    g = torch.randn(3, 2, 4)
    lin(x).backward(g)
    expect = torch.ones(4, 8) + g.reshape(-1, 4).t() @ x.reshape(-1, 8)
    torch.testing.assert_close(lin.weight.main_grad, expect, atol=ATOL, rtol=0)
    assert lin.weight.grad_added_to_main_grad is True


def _explicit_attention(q, k, v, mask, scale):  # [b, h, s, d]
    reps = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(reps, 1), v.repeat_interleave(reps, 1)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = torch.where(mask, torch.full_like(s, -10000.0), s) if mask is not None else s
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, -1), v)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("mask_type", ["causal", "padding", "no_mask"])
def test_attention_equals_explicit_softmax(fmt: str, mask_type: str) -> None:
    torch.manual_seed(3)
    b, s, h, g, d = 2, 6, 4, 2, 8
    dpa = attention.DotProductAttention(h, d, num_gqa_groups=g, attn_mask_type=mask_type, qkv_format=fmt)
    q4, k4, v4 = torch.randn(b, h, s, d), torch.randn(b, g, s, d), torch.randn(b, g, s, d)
    pad = torch.zeros(b, 1, s, s, dtype=torch.bool)
    pad[1, :, :, 4:] = True
    mask = {"causal": torch.ones(s, s, dtype=torch.bool).triu(1), "padding": pad, "no_mask": None}[mask_type]
    ref = _explicit_attention(q4, k4, v4, mask, 1 / math.sqrt(d))
    perm = (2, 0, 1, 3) if fmt == "sbhd" else (0, 2, 1, 3)
    q, k, v = (t.permute(*perm).contiguous().requires_grad_() for t in (q4, k4, v4))
    out = dpa(q, k, v, pad if mask_type == "padding" else None)
    expect = ref.permute(*perm).reshape(out.shape)
    torch.testing.assert_close(out, expect, atol=ATOL, rtol=0)
    out.sum().backward()
    assert k.grad is not None and k.grad.shape == k.shape


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_equals_complex_rotation(fmt: str, interleaved: bool) -> None:
    """RoPE as complex multiplication: channel pairs (i, i + r/2), or (2i, 2i + 1) interleaved, turned by e^(j theta).
    """
    from portspeed.portable_te import rope

    torch.manual_seed(5)
    s, b, h, d, r = 7, 2, 3, 12, 8                         # r < d: the last d - r channels pass through
    theta = torch.rand(s + 2, r // 2) * 3                  # freqs longer than the sequence: the first s are used
    freqs = (theta.repeat_interleave(2, -1) if interleaved else torch.cat((theta, theta), -1))[:, None, None, :]
    t = torch.randn(s, b, h, d, dtype=torch.float64)
    x = t[..., :r]
    pairs = torch.stack((x[..., 0::2], x[..., 1::2]), -1) if interleaved else torch.stack(x.chunk(2, -1), -1)
    z = torch.view_as_complex(pairs.contiguous()) * torch.polar(torch.ones_like(theta[:s]), theta[:s])[:, None, None]
    turned = torch.view_as_real(z)
    turned = turned.flatten(-2) if interleaved else torch.cat((turned[..., 0], turned[..., 1]), -1)
    expect = torch.cat((turned, t[..., r:]), -1).float()
    inp = t.float() if fmt == "sbhd" else t.float().transpose(0, 1)
    got = rope.apply_rotary_pos_emb(inp, freqs, tensor_format=fmt, interleaved=interleaved, fused=True)
    torch.testing.assert_close(got if fmt == "sbhd" else got.transpose(0, 1), expect, atol=ATOL, rtol=0)
    bf = rope.apply_rotary_pos_emb(inp.bfloat16(), freqs, tensor_format=fmt, interleaved=interleaved)
    assert bf.dtype == torch.bfloat16


def test_rng_tracker_and_checkpoint_recompute_same_dropout() -> None:
    tracker = rng.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 123)
    with pytest.raises(RuntimeError, match="already exists"):
        tracker.add("other", 123)
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    with tracker.fork():
        b = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before), "fork changed the caller's generator"
    assert not torch.equal(a, b), "the tracked state did not advance"

    torch.manual_seed(4)
    lin = linear.Linear(8, 8, init_method=_init, device="cpu")

    def block(x: torch.Tensor) -> torch.Tensor:
        with tracker.fork():
            return F.dropout(lin(x), p=0.5, training=True)

    x = torch.randn(4, 8, requires_grad=True)
    states = tracker.get_states()
    y_plain = block(x)
    y_plain.sum().backward()
    g_plain, gw_plain = x.grad.clone(), lin.weight.grad.clone()
    x.grad = None
    lin.weight.grad = None
    tracker.set_states(states)
    y_ckpt = rng.checkpoint(block, x, get_rng_state_tracker=lambda: tracker)
    y_ckpt.sum().backward()
    torch.testing.assert_close(y_ckpt, y_plain, atol=0, rtol=0)
    torch.testing.assert_close(x.grad, g_plain, atol=0, rtol=0)
    torch.testing.assert_close(lin.weight.grad, gw_plain, atol=0, rtol=0)


def test_extra_state_round_trip() -> None:
    lin = linear.LayerNormLinear(8, 4, init_method=_init, device="cpu")
    sd = lin.state_dict()
    assert "_extra_state" in sd and sd["_extra_state"].numel() == 0
    other = linear.LayerNormLinear(8, 4, device="cpu")
    other.load_state_dict(sd)
    torch.testing.assert_close(other.weight, lin.weight, atol=0, rtol=0)


def test_attention_loads_without_its_extra_state_as_transformer_engine() -> None:
    """TE's DotProductAttention keeps ``_extra_state`` in ``state_dict()`` but may load without it; the linears may not.

    Megatron's ``TEDotProductAttention.sharded_state_dict`` leaves the attention out of distributed
    checkpoints, so a strict load from one has no ``core_attention._extra_state`` (the Megatron round trip
    below).
    """
    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.core_attention = attention.DotProductAttention(4, 8)
            self.linear_proj = linear.Linear(8, 8, init_method=_init, device="cpu")

    layer = Layer()
    sd = layer.state_dict()
    assert "core_attention._extra_state" in sd and sd["core_attention._extra_state"].numel() == 0
    del sd["core_attention._extra_state"]
    assert layer.load_state_dict(sd).missing_keys == []          # strict: raises if the key were still missing
    del sd["linear_proj._extra_state"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*linear_proj\._extra_state"):
        layer.load_state_dict(sd)                                 # only the attention's key may be absent
    seen = []
    layer.core_attention.set_extra_state = seen.append            # present: still handed to set_extra_state
    layer.load_state_dict({**sd, "core_attention._extra_state": torch.empty(0, dtype=torch.uint8)}, strict=False)
    assert len(seen) == 1


@pytest.mark.parametrize("build, flag", [
    (lambda: linear.Linear(8, 8, ub_overlap_ag=True), "--tp-comm-overlap"),
    (lambda: linear.Linear(8, 8, delay_wgrad_compute=True), "--delay-wgrad-compute"),
    (lambda: linear.Linear(8, 8, symmetric_ar_type="two_shot"), "--symmetric-ar-type"),
    (lambda: attention.DotProductAttention(4, 8, window_size=(4, 0)), "--window-size"),
    (lambda: attention.DotProductAttention(4, 8, softmax_type="learnable"), "--softmax-type"),
    (lambda: grouped.GroupedLinear(2, 8, 8, delay_wgrad_compute=True, device="cpu"), "--delay-wgrad-compute"),
    (lambda: namespace.DelayedScaling(), "--fp8-format"),
    (lambda: namespace.fp8_autocast(enabled=True).__enter__(), "--fp8-format"),
    (lambda: namespace.build("2.6.0")["transformer_engine.pytorch.ops"].SwiGLU(), "--use-te-activation-func"),
    (lambda: rng.checkpoint(lambda: None, distribute_saved_activations=True), "--distribute-saved-activations"),
    (lambda: namespace.build("2.6.0")["transformer_engine.pytorch.attention.rope"].apply_rotary_pos_emb(
        torch.zeros(4, 1, 1, 8), torch.zeros(4, 1, 1, 8), cp_size=2), "--context-parallel-size 1"),
])
def test_refusals_name_the_flag(build, flag: str) -> None:
    with pytest.raises(UnsupportedOptionError, match=flag.replace("-", r"\-")) as info:
        build()
    assert "--transformer-impl local" in str(info.value)


def test_context_parallel_refusals_name_what_avoids_them() -> None:
    with pytest.raises(UnsupportedOptionError, match="--cp-comm-type"):
        attention.DotProductAttention(4, 8, cp_group=[None, None], cp_comm_type="a2a+p2p")
    with pytest.raises(UnsupportedOptionError, match="--cp-comm-type"):
        attention.DotProductAttention(4, 8, cp_comm_type="ring")


@pytest.mark.parametrize("field, flag", [("fp8", "--fp8-format"), ("fp4", "--fp4-format"),
                                         ("cpu_offloading", "--cpu-offloading"),
                                         ("tp_comm_overlap", "--tp-comm-overlap")])
def test_megatron_config_options_applied_outside_the_layers_are_refused(field: str, flag: str) -> None:
    """Megatron's TE wrappers set self.config before TE's __init__; fp8 etc. there are refused, not ignored."""
    import types

    class Wrapper(linear.Linear):  # as megatron's TELinear: config first, then TE's constructor
        def __init__(self, config: object) -> None:
            self.config = config
            super().__init__(8, 8, device="cpu")

    Wrapper(types.SimpleNamespace())  # nothing asked: builds
    with pytest.raises(UnsupportedOptionError, match=flag.replace("-", r"\-")):
        Wrapper(types.SimpleNamespace(**{field: "hybrid" if field == "fp8" else True}))
