"""DeepSpeed's 2026 features on whatever portspeed runs on, in one process group.

Unmodified DeepSpeed usage (the only portspeed line is the adaptor import; ``--no-portspeed`` leaves
it out for the stock baseline, with ``DS_ACCELERATOR=cpu``). ``--features`` (comma-separated):

- ``ulysses`` / ``ulysses_stream``: DeepSpeed-Ulysses ``DistributedAttention`` over all ranks (without
  and with ``sp_stream``), causal attention on a sequence split over the ranks, forward and backward,
  against the whole sequence's attention computed on each rank;
- ``zero3``: ZeRO-3 with a leaf module (``set_z3_leaf_modules``, a two-expert block), rank 0's
  weights changed under ``GatheredParameters(modifier_rank=0)``, a checkpoint converted by
  ``get_fp32_state_dict_from_zero_checkpoint`` (``zero_to_fp32``) against the gathered weights, and the
  same run without the leaf mark; on one process also plain torch;
- ``autotp``: AutoTP training (``tensor_parallel.autotp_size`` = the world size) of a tiny Llama built
  from a ``LlamaConfig`` (no download).

``--runs`` takes ``examples/deepspeed_train.py``'s items (ZeRO++: ``3:fp32:qwz+qgz+hpz``) into the same
launch. Rank 0 writes ``{"world_size", "ds_accelerator", "node_size", "features": {...}, "runs": {...}}``.
Launch as ``deepspeed_train.py`` (qgZ engages only with more than one node: one rank per node)::

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/deepspeed_features.py --features ulysses,zero3 --out f.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import deepspeed_train as dt  # noqa: E402  (the ZeRO runs, the launcher-less environment)
from deepspeed_args import build_parser, parse_runs  # noqa: E402  (deepspeed_train.py's options)

FEATURES = ("ulysses", "ulysses_stream", "zero3", "autotp")


def _max_over_ranks(value: float, device: Any) -> float:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64).to(device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def ulysses(stream: bool) -> dict[str, Any]:
    """DistributedAttention vs the whole sequence's attention: relative differences of outputs and q/k/v gradients."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from deepspeed.accelerator import get_accelerator
    from deepspeed.sequence.layer import DistributedAttention

    world, rank = dist.get_world_size(), dist.get_rank()
    dev = get_accelerator().current_device_name()
    s, b, h, d = 16, 2, 4, 8  # [sequence, batch, heads, head dim]: DeepSpeed's layout, batch_dim_idx 1
    g = torch.Generator().manual_seed(7)
    q, k, v, w = (torch.randn(s, b, h, d, generator=g) for _ in range(4))

    def attention(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
        out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True)
        return out.permute(2, 0, 1, 3)

    sp_stream = get_accelerator().Stream() if stream else None
    layer = DistributedAttention(attention, dist.new_group(list(range(world))), scatter_idx=2, gather_idx=0,
                                 sp_stream=sp_stream)
    part = slice(rank * s // world, (rank + 1) * s // world)
    mine = [t[part].to(dev).requires_grad_() for t in (q, k, v)]
    out = layer(*mine, batch_dim_idx=1)
    (out * w[part].to(dev)).sum().backward()
    whole = [t.to(dev).requires_grad_() for t in (q, k, v)]
    ref = attention(*whole)
    (ref * w.to(dev)).sum().backward()

    def rel(a: Any, r: Any) -> float:
        return float((a.detach() - r.detach()).abs().max() / r.detach().abs().max())

    grads = max(rel(m.grad, full.grad[part]) for m, full in zip(mine, whole))
    total = out.detach().double().sum()
    dist.all_reduce(total)
    return {"out_rel": _max_over_ranks(rel(out, ref[part]), dev), "grad_rel": _max_over_ranks(grads, dev),
            "out_sum": float(total.item()), "sp_stream": type(sp_stream).__name__ if stream else None}


class Experts(torch.nn.Module):
    """Two experts mixed by a softmax gate: the kind of block ZeRO-3 is told to treat as a leaf."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(width, 2)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(2))

    def forward(self, x: Any) -> Any:
        mix = self.gate(x).softmax(-1)
        return mix[:, :1] * self.experts[0](x) + mix[:, 1:] * self.experts[1](x)


def _leaf_model(seed: int) -> Any:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), Experts(32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 8, bias=False))


def zero3(args: argparse.Namespace, data: tuple[Any, Any], leaf: bool, save_dir: str | None) -> dict[str, Any]:
    """ZeRO-3 with (or without) the leaf mark: losses, every rank's gathered checksum, zero_to_fp32's difference."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import set_z3_leaf_modules
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    world, rank = dist.get_world_size(), dist.get_rank()
    config = dt.ds_config(3, "fp32", args.global_batch, world)
    config["gradient_clipping"] = 0.0  # DeepSpeed 0.19 clips at 1.0 by default; plain torch does not
    with deepspeed.zero.Init(config_dict_or_path=config):  # each parameter partitioned as it is made
        model = _leaf_model(args.seed)
    first = model[0].weight
    with deepspeed.zero.GatheredParameters([first], modifier_rank=0):
        if rank == 0:  # rank 0's change reaches every rank's partition when the context ends
            first.data.mul_(0.5)
    if leaf:
        set_z3_leaf_modules(model, [Experts])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        checksum = torch.tensor([float(sum(p.detach().double().abs().sum() for p in params))], dtype=torch.float64)
    sums: list[Any] = [None] * world
    dist.all_gather_object(sums, float(checksum.item()))
    x, y = data
    micro = args.global_batch // world
    losses = []
    for step in range(args.steps):
        xb = x[step, rank * micro:(rank + 1) * micro].to(engine.device)
        loss = torch.nn.functional.mse_loss(engine(xb), y[step, rank * micro:(rank + 1) * micro].to(engine.device))
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    record: dict[str, Any] = {"losses": losses, "checksums": sums,
                              "partitioned_params": sum(1 for p in params if p.ds_tensor.numel() < p.ds_numel)}
    if save_dir:
        engine.save_checkpoint(save_dir, tag="zero3")
        with deepspeed.zero.GatheredParameters(params):
            full = {n: p.detach().cpu().float().clone() for n, p in engine.module.named_parameters()}
        dist.barrier()
        if rank == 0:
            converted = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="zero3")
            record["zero_to_fp32_max_diff"] = max(float((converted[n].detach().float() - t).abs().max())
                                                  for n, t in full.items())
            record["zero_to_fp32_keys"] = sorted(converted) == sorted(full)
    engine.destroy()
    return record


def torch_reference(args: argparse.Namespace, data: tuple[Any, Any]) -> list[float]:
    """The ``zero3`` model trained by plain torch on one process (rank 0's weight change included)."""
    model = _leaf_model(args.seed)
    with torch.no_grad():
        model[0].weight.mul_(0.5)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    x, y = data
    losses = []
    for step in range(args.steps):
        loss = torch.nn.functional.mse_loss(model(x[step]), y[step])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def autotp(args: argparse.Namespace) -> dict[str, Any]:
    """AutoTP over all ranks (one process: no TP) on a tiny Llama: per-step losses and the sharded weights' shapes."""
    import deepspeed
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    world = dist.get_world_size()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    ds = {"train_micro_batch_size_per_gpu": 4, "train_batch_size": 4 * world, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 0}, "gradient_clipping": 0.0, "steps_per_print": 10**9}
    if world > 1:
        ds["tensor_parallel"] = {"autotp_size": world}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    ids = torch.randint(0, 128, (1, 4, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for step in range(args.steps):
        batch = ids[0].to(engine.device)  # the same batch every step (the loss must fall), on every TP rank
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    q_proj = engine.module.model.layers[0].self_attn.q_proj
    weight = getattr(q_proj, "weight", None)
    record = {"losses": losses, "q_proj": type(q_proj).__name__,
              "q_proj_shape": list(weight.shape) if weight is not None else None,
              "param_device": str(next(engine.module.parameters()).device)}
    engine.destroy()
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--features", default=",".join(FEATURES), help=f"comma-separated of {', '.join(FEATURES)}")
    p.add_argument("--runs", type=parse_runs, default=[], help="deepspeed_train.py run items, e.g. 3:fp32:qgz")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per feature run (--runs: 6)")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--save-dir", default=None, help="where zero3 saves its checkpoint (default: a temporary folder)")
    p.add_argument("--count-all-to-all", action="store_true", help="as deepspeed_train.py's")
    p.add_argument("--no-portspeed", action="store_true", help="do not import portspeed (stock baseline)")
    p.add_argument("--out", default=None, help="JSON file rank 0 writes")
    args = p.parse_args(argv)
    features = [f.strip() for f in args.features.split(",") if f.strip()]
    unknown = sorted(set(features) - set(FEATURES))
    if unknown:
        p.error(f"--features: unknown {', '.join(unknown)}; choose from {', '.join(FEATURES)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dt._single_process_env()
    if not args.no_portspeed:
        import portspeed.deepspeed_adaptor  # noqa: F401  (the one portspeed line)
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    if args.count_all_to_all:
        dt.count_all_to_all()
    deepspeed.init_distributed()
    world = dist.get_world_size()
    record: dict[str, Any] = {"world_size": world, "backend": str(dist.get_backend()),
                              "ds_accelerator": type(deepspeed.accelerator.get_accelerator()).__name__,
                              "node_size": deepspeed.accelerator.get_accelerator().device_count(),
                              "features": {}, "runs": {}}
    train_args = build_parser("deepspeed_train.py").parse_args(
        ["--steps", "6", "--global-batch", str(args.global_batch), "--seed", str(args.seed), "--lr", str(args.lr)])
    for run in args.runs:
        record["runs"][run.key] = dt.train_run(train_args, run, dt.make_data(train_args))
    data = dt.make_data(args)
    for name in features:
        if name in ("ulysses", "ulysses_stream"):
            record["features"][name] = ulysses(stream=name == "ulysses_stream")
        elif name == "zero3":
            shared = [args.save_dir or (tempfile.mkdtemp(prefix="ds_zero3_") if dist.get_rank() == 0 else None)]
            dist.broadcast_object_list(shared)  # every rank saves its partition into rank 0's folder
            record["features"]["zero3"] = zero3(args, data, leaf=True, save_dir=shared[0])
            dist.barrier()
            if dist.get_rank() == 0 and not args.save_dir:
                shutil.rmtree(shared[0], ignore_errors=True)
            record["features"]["zero3_no_leaf"] = zero3(args, data, leaf=False, save_dir=None)
            if world == 1:
                record["features"]["zero3_torch"] = {"losses": torch_reference(args, data)}
        elif name == "autotp":
            record["features"]["autotp"] = autotp(args)
    if dist.get_rank() == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
