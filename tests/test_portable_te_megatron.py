"""The portable Transformer Engine inside real megatron-core: Megatron's TE layer spec and its fused RoPE.

A GPT built from Megatron's TE spec (served by the portable TE) saves and loads a distributed checkpoint
round trip; ``config.apply_rope_fusion`` on the TE path equals Megatron's own unfused RoPE. Each runs in a fresh
interpreter. The layers against plain torch: test_portable_te.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

@pytest.fixture(autouse=True)
def _cpu(portspeed_env) -> None:
    portspeed_env(PORTSPEED_ACCELERATOR="cpu")


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
