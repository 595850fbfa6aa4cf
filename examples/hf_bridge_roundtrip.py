"""Hugging Face weights into Megatron-Core and back through NVIDIA's Megatron-Bridge, off CUDA.

What an RL or fine-tuning trainer does with ``AutoBridge`` (verl's ``models/mcore/bridge.py``):
load a Hugging Face checkpoint into an mcore ``GPTModel`` in the parallel layout it trains in,
train, and stream the weights back out in Hugging Face names. Here, for each ``--arch`` and
each ``--layouts`` entry (``tp1``, ``tp2``, ``pp2``: with 2 ranks ``tp1`` is two data-parallel
replicas), the script

1. builds a tiny random model from a ``transformers`` config (GQA, RoPE, SwiGLU, RMSNorm;
   Qwen2 with QKV bias) and ``save_pretrained``s it (or reads ``--hf-dir``),
2. converts it with ``AutoBridge.from_hf_pretrained(...).to_megatron_provider()`` and
   ``provide_distributed_model`` (Megatron's DDP, the Bridge's default Transformer Engine
   layer spec, served by portspeed's portable TE off CUDA),
3. compares the mcore logits (forward-only through ``get_forward_backward_func``, gathered over
   tensor parallelism, on the last pipeline stage) with the Hugging Face model's,
4. exports with ``export_hf_weights`` and compares every tensor with the checkpoint's, bit for bit,
5. runs one training step (``get_megatron_optimizer``, ``finalize_model_grads``) and the loss after it.

Run (2 CPU ranks; ``portspeed run`` imports the adaptor in every worker first)::

    OMP_NUM_THREADS=1 portspeed run --nproc-per-node 2 examples/hf_bridge_roundtrip.py \\
        --arch llama,qwen2 --layouts tp1,tp2,pp2 --report /tmp/bridge.json

The first line below is all a user adds: ``import portspeed.megatron_adaptor`` before Megatron.
``--report`` (written by rank 0) holds every layout's numbers; the exit status is 1 when a
logit differs by more than ``--tol`` or an exported tensor differs at all.
"""

import portspeed.megatron_adaptor  # noqa: F401  (first line: translation and patches before Megatron loads)

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron.bridge import AutoBridge  # served portspeed's portable Transformer Engine off CUDA

from portspeed.comm import real_backend

VOCAB, SEQ, BATCH = 128, 16, 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="llama,qwen2", help="comma-separated: llama, qwen2 (tiny random models)")
    p.add_argument("--hf-dir", default=None, help="convert this Hugging Face checkpoint instead of --arch")
    p.add_argument("--layouts", default="tp1", help="comma-separated: tp1, tp2, pp2 (tp2 and pp2 need 2 ranks)")
    p.add_argument("--tol", type=float, default=1e-4, help="largest |mcore logit - HF logit| accepted (fp32)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--report", default=None, help="JSON file rank 0 writes the results to")
    return p.parse_args(argv)


def tiny_hf_model(arch: str, seed: int) -> Any:
    """A tiny random Llama or Qwen2 (GQA: 4 query heads, 2 KV heads), the same on every rank."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * SEQ, rms_norm_eps=1e-5,
                  tie_word_embeddings=False)
    torch.manual_seed(seed)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    if arch == "qwen2":  # Qwen2 puts a bias on q, k and v (and none on o)
        return Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    raise SystemExit(f"unknown --arch {arch!r}: give llama or qwen2, or --hf-dir for a checkpoint of your own")


def hf_checkpoint(arch: str, seed: int, workdir: Path) -> Path:
    """``save_pretrained`` of the tiny model into ``workdir/arch`` (every rank writes its own copy)."""
    path = workdir / arch
    tiny_hf_model(arch, seed).save_pretrained(path)
    return path


def hf_reference(path: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The Hugging Face model's logits for ``tokens`` and the checkpoint's tensors, as saved."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(tokens).logits
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    return logits, tensors


def tp_gather(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits from the tensor-parallel shards (the output layer is vocab-parallel)."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def run_schedule(model: list, tokens: torch.Tensor, *, forward_only: bool) -> list[dict]:
    """One micro-batch through ``get_forward_backward_func``: full logits (forward-only) or the mean loss."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = next(model[0].parameters()).device  # the adapter's device (cpu, testdev, npu, ...): no torch.cuda here
    tokens = tokens.to(device)
    position_ids = torch.arange(SEQ, device=device).unsqueeze(0).expand(BATCH, -1)
    labels = torch.roll(tokens, -1, dims=1)

    def forward_step(batch_iter: Any, chunk: Any) -> tuple[torch.Tensor, Any]:
        next(batch_iter)
        if forward_only:
            out = chunk(tokens, position_ids, None)
            return out, lambda o: (o.new_zeros(()), {"logits": tp_gather(o).detach().cpu()})
        out = chunk(tokens, position_ids, None, labels=labels)  # per-token cross entropy, vocab-parallel

        def loss_func(o: torch.Tensor) -> tuple[torch.Tensor, dict]:
            loss = o.float().mean()
            return loss, {"loss": loss.detach()}
        return out, loss_func

    return get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=model,
                                       num_microbatches=1, seq_length=SEQ, micro_batch_size=BATCH,
                                       forward_only=forward_only)


def convert(bridge: Any, tp: int, pp: int) -> list:
    """The mcore model (in Megatron's DDP) in layout TP x PP, weights loaded from Hugging Face by the Bridge."""
    from megatron.core.distributed import DistributedDataParallelConfig

    provider = bridge.to_megatron_provider(load_weights=True)
    provider.tensor_model_parallel_size = tp
    provider.pipeline_model_parallel_size = pp
    provider.pipeline_dtype = torch.float32
    provider.finalize()
    provider.initialize_model_parallel(seed=0)
    # as on a GPU: built on torch.cuda.current_device(), which the translation answers with the adapter's device
    return provider.provide_distributed_model(ddp_config=DistributedDataParallelConfig(), wrap_with_ddp=True)


def one_layout(bridge: Any, layout: str, tokens: torch.Tensor, ref_logits: torch.Tensor,
               ref_tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Convert, compare logits, export, train one step: this rank's findings for ``layout``."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    tp, pp = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}[layout]
    t0 = time.perf_counter()
    model = convert(bridge, tp, pp)
    out: dict[str, Any] = {"rank": dist.get_rank(), "layout": layout, "convert_s": round(time.perf_counter() - t0, 2)}
    last_stage = ps.is_pipeline_last_stage()
    with torch.no_grad():
        collected = run_schedule(model, tokens, forward_only=True)
    if last_stage:
        out["logits_max_abs_diff"] = (collected[0]["logits"] - ref_logits).abs().max().item()
    out["device"] = str(next(model[0].parameters()).device)

    exported = {name: t.clone() for name, t in bridge.export_hf_weights(model, cpu=True, show_progress=False)}
    out["export_missing"] = sorted(set(ref_tensors) - set(exported))
    out["export_extra"] = sorted(set(exported) - set(ref_tensors))
    both = set(ref_tensors) & set(exported)
    out["export_differ"] = sorted(n for n in both if exported[n].dtype != ref_tensors[n].dtype
                                  or not torch.equal(exported[n], ref_tensors[n]))  # dtype, shape and every bit
    out["export_tensors"] = len(exported)

    config = model[0].config
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, params_dtype=torch.float32), model)
    config.grad_scale_func = optimizer.scale_loss
    losses = []
    for step in range(2):  # step 0 trains; step 1 only measures the loss after the update
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        got = run_schedule(model, tokens, forward_only=step == 1)
        if step == 0:
            ok, grad_norm, _ = optimizer.step()
            out["step_ok"], out["grad_norm"] = bool(ok), grad_norm
        if last_stage and step == 0:
            losses.append(got[0]["loss"].item())
        elif last_stage:
            logits = got[0]["logits"]
            losses.append(torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                            torch.roll(tokens, -1, 1).reshape(-1)).item())
    if last_stage:
        out["loss_before"], out["loss_after"] = losses
    ps.destroy_model_parallel()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dist.init_process_group("nccl")  # the collective router gives Gloo (or the device's CCL) off CUDA

    workdir = Path(tempfile.mkdtemp(prefix=f"hf_bridge_rank{dist.get_rank()}_"))
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    if args.hf_dir:
        sources = [Path(args.hf_dir)]
    else:
        sources = [hf_checkpoint(arch, args.seed, workdir) for arch in args.arch.split(",")]
    results = []
    for path in sources:
        bridge = AutoBridge.from_hf_pretrained(path, dtype=torch.float32)
        ref_logits, ref_tensors = hf_reference(path, tokens)
        for layout in args.layouts.split(","):
            results.append({"model": path.name, **one_layout(bridge, layout, tokens, ref_logits, ref_tensors)})
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    rows = [r for per_rank in gathered for r in per_rank]
    bad = [r for r in rows if r.get("logits_max_abs_diff", 0.0) > args.tol or r["export_differ"]
           or r["export_missing"] or r["export_extra"] or not r["step_ok"]]
    if dist.get_rank() == 0:
        for r in rows:
            print(f"{r['model']:>6} {r['layout']} rank{r['rank']}: logits |diff| {r.get('logits_max_abs_diff', '-')}, "
                  f"export {r['export_tensors']} tensors, {len(r['export_differ'])} differ, "
                  f"loss {r.get('loss_before', '-')} -> {r.get('loss_after', '-')}")
        if args.report:
            # get_backend() answers "nccl", as asked; real_backend() is the one the router chose (gloo, testccl, ...)
            Path(args.report).write_text(json.dumps({"rows": rows, "world_size": dist.get_world_size(),
                                                     "backend": dist.get_backend(), "real_backend": real_backend(),
                                                     "tol": args.tol}, indent=1))
    dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
