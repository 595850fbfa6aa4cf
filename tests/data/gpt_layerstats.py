"""Record layer statistics of one megatron-core GPTModel training step (single process, Gloo).

Used by tests/test_layerstats.py: ``python gpt_layerstats.py OUTDIR`` writes ``a.json`` (one
forward/backward) and ``b.json`` (the same step after one weight of decoder layer 1's first
MLP linear was changed), so the comparison must name ``decoder.layers.1.mlp.linear_fc1`` as
the first differing module.
"""
import portspeed.megatron_adaptor  # noqa
import socket
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from portspeed.parity.layerstats import LayerStatsRecorder

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
ps.initialize_model_parallel(1, 1)
model_parallel_cuda_manual_seed(1234)
cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                        hidden_dropout=0.0, attention_dropout=0.0)
m = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16)
tok = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
pos = torch.arange(16).unsqueeze(0).expand(2, 16)
for name in ("a", "b"):
    if name == "b":
        with torch.no_grad():
            m.decoder.layers[1].mlp.linear_fc1.weight[0, 0] += 1e-2
    m.zero_grad()
    with LayerStatsRecorder(m, iterations={1}, path=f"{sys.argv[1]}/{name}.json") as rec:
        with rec.iteration(1):
            loss = m(tok, pos, None, labels=tok).float().mean()
            loss.backward()
print("saved", len(rec.data["1"]["forward"]), len(rec.data["1"]["backward"]))
dist.destroy_process_group()
