"""The portable Transformer Engine's layers against plain torch references (portspeed/portable_te).

In process (TP = 1): Linear / LayerNormLinear forward and backward equal ``F.linear`` (after
``F.layer_norm`` / RMS), zero-centred gamma, the weight gradient fused into ``main_grad``,
DotProductAttention (causal, padding, GQA, both layouts) equal to an explicit softmax
attention, the RNG tracker's forks, ``checkpoint`` recomputing with the same dropout mask, the
``_extra_state`` round trip, and every refusal naming its flag. Two ranks (Gloo, torchrun):
column- and row-parallel layers with and without sequence parallelism equal the
single-process layer built from the same full weights, forward and input/weight gradients.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers.launch import torchrun

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


MEGATRON_TE_SPEC_ROUND_TRIP = """
import json, sys
sys.argv = ["te_spec_round_trip"]                     # no --transformer-impl: Megatron's default, the TE path
import portspeed.megatron_adaptor
import torch, torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{PORT}")
from megatron.core import dist_checkpointing, parallel_state as ps
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
ps.initialize_model_parallel(1, 1)

def build(seed):
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    cfg = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(), vocab_size=32,
                    max_sequence_length=8)

src = build(1)
attn = src.decoder.layers[0].self_attention.core_attention
out = {"attention": [c.__module__ + "." + c.__name__ for c in type(attn).__mro__[:2]]}
sharded = src.sharded_state_dict()
out["sharded_extra"] = sorted(k for k in sharded if k.endswith("_extra_state"))
out["state_dict_extra"] = sorted(k for k in src.state_dict() if k.endswith("_extra_state"))
dist_checkpointing.save(sharded, CKPT)
dst = build(2)
before = max((a - b).abs().max().item() for a, b in zip(src.parameters(), dst.parameters()))
loaded = dist_checkpointing.load(dst.sharded_state_dict(), CKPT)
result = dst.load_state_dict(loaded)                  # strict, as Megatron's checkpointing loads
out["missing"], out["unexpected"] = result.missing_keys, result.unexpected_keys
out["diff_before"] = before
out["diff_after"] = max((a - b).abs().max().item() for a, b in zip(src.parameters(), dst.parameters()))
dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.mark.megatron
def test_megatron_te_spec_gpt_dist_checkpoint_round_trip(tmp_path: Path) -> None:
    """A TE-spec GPT (portable TE) saved and loaded through Megatron's dist_checkpointing, loaded strictly.

    This is what 22 tests of Megatron's ``dist_checkpointing/models/test_gpt_model.py`` do; before the fix
    every one failed with "Missing key(s) in state_dict: decoder.layers.N.self_attention.core_attention._extra_state".
    """
    from helpers.launch import child_json, free_port
    from helpers.requires import require

    require("megatron.core", "pip install -e '.[megatron]'")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    code = f"PORT = {free_port()}\nCKPT = {str(ckpt)!r}\n" + MEGATRON_TE_SPEC_ROUND_TRIP
    out = child_json(code, timeout=300, env={"PORTSPEED_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    assert out["attention"] == ["megatron.core.extensions.transformer_engine.TEDotProductAttention",
                                "portspeed.portable_te.attention.DotProductAttention"], out["attention"]
    layers = ("decoder.layers.0.", "decoder.layers.1.")
    attn = {p + "self_attention.core_attention._extra_state" for p in layers}
    linears = {p + m + "._extra_state" for p in layers
               for m in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")}
    # (others vary by release: Megatron's output layer's, megatron-core 0.19's TE final layer norm's)
    assert attn | linears <= set(out["state_dict_extra"]), out["state_dict_extra"]
    assert linears <= set(out["sharded_extra"]), out["sharded_extra"]
    assert not attn & set(out["sharded_extra"]), "Megatron's sharded state dict leaves the attention's extra state out"
    assert out["missing"] == [] and out["unexpected"] == []
    assert out["diff_before"] > 0 and out["diff_after"] == 0


MEGATRON_ROPE_FUSION = """
import json, sys
sys.argv = ["rope_fusion"]                            # no --transformer-impl: Megatron's default, the TE path
import portspeed.megatron_adaptor
import torch, torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{PORT}")
from megatron.core import parallel_state as ps
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.transformer_config import TransformerConfig
ps.initialize_model_parallel(1, 1)
out = {}
for interleaved in (False, True):
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            init_method_std=1.0, attention_dropout=0.0, rotary_interleaved=interleaved)
    cfg.apply_rope_fusion = True                      # after construction, as Megatron's test_attention.py does
    attn = SelfAttention(cfg, get_gpt_layer_with_transformer_engine_spec().submodules.self_attention.submodules,
                         layer_number=1)
    freqs = RotaryEmbedding(cfg.kv_channels, 0.5, rotary_interleaved=interleaved, use_cpu_initialization=True)(16)
    x = torch.randn(16, 2, 32)
    fused, _ = attn(x, None, rotary_pos_emb=freqs)
    cfg.apply_rope_fusion = False                     # Megatron's own unfused RoPE
    plain, _ = attn(x, None, rotary_pos_emb=freqs)
    none, _ = attn(x, None)
    out[str(interleaved)] = {"diff": (fused - plain).abs().max().item(),
                             "vs_no_rope": (fused - none).abs().max().item()}
dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.mark.megatron
def test_megatron_rope_fusion_equals_megatrons_unfused_rope() -> None:
    """``config.apply_rope_fusion`` on the TE path: Megatron's SelfAttention with the served fused RoPE equals the
    same attention with Megatron's own unfused RoPE (half the head dimension rotated, plain and interleaved).

    The field is set after the config is built, as Megatron's ``transformer/test_attention.py`` does (portspeed's
    kernel-fallback patch turns it off inside ``TransformerConfig.__post_init__``). Without the served RoPE the
    attention asserts "apply_rope_fusion is not available."
    """
    from helpers.launch import child_json, free_port
    from helpers.requires import require

    require("megatron.core", "pip install -e '.[megatron]'")
    out = child_json(f"PORT = {free_port()}\n" + MEGATRON_ROPE_FUSION, timeout=300,
                     env={"PORTSPEED_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    for interleaved, d in out.items():
        assert d["diff"] <= 1e-6, (interleaved, d)
        assert d["vs_no_rope"] > 1e-3, (interleaved, d)   # the rotation did something


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
