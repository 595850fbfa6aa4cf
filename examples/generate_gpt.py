"""Greedy text generation with Megatron-Core's static inference engine, on whatever accelerator portspeed picks.

The model is examples/pretrain_gpt.py's GPT (same flags, same torch_dist checkpoint), so a
checkpoint that script wrote is generated from here in any TP x PP layout::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc-per-node 2 --master-port 29515 \\
        examples/generate_gpt.py --pp 2 --load /tmp/ckpt --tokens 12 --out /tmp/gen_pp2.json

It runs megatron.core.inference as a Megatron-Core user does: a ``StaticInferenceContext``,
``GPTInferenceWrapper``, ``TextGenerationController`` and ``StaticInferenceEngine(legacy=True)``
(the engine's own static-batch loop; without ``legacy`` the 0.16 engine hands work to the
dynamic engine, which sizes its KV buffer for a GPU). With PP > 1 the last stage's logits
reach the other stages through ``broadcast_from_last_pipeline_stage``.

The tokenizer is ``AsciiTokenizer``: one token per 7-bit character (the example model's
vocabulary is 128), NUL is end-of-document. Each prompt's result is printed by global
rank 0 as ``greedy N | tokens: [...] | text: '...'`` and, with ``--out``, written as JSON
with the per-token log-probabilities and the top-1/top-2 log-probability margin (how far
greedy decoding was from a tie). ``--sample-top-k K`` adds a sampled pass (``sampled N | ...``).
"""

import portspeed.megatron_adaptor  # noqa: F401  (first: translation + patches before Megatron loads)

import argparse
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.engines import StaticInferenceEngine
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)

import portspeed
import portspeed.comm as ps_comm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pretrain_gpt  # noqa: E402  (the model, its flags, its checkpoint layout)

DEFAULT_PROMPTS = ["The quick brown", "portspeed", "Megatron", "abc"]


class AsciiTokenizer:
    """Character-level tokenizer over 7-bit ASCII: what the controller needs (tokenize, detokenize, eod, bos)."""

    def __init__(self, vocab_size: int = 128) -> None:
        if vocab_size < 128:
            raise SystemExit(f"generate_gpt.py: AsciiTokenizer needs --vocab-size >= 128, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eod = 0
        self.bos = None

    def tokenize(self, text: str) -> list[int]:
        bad = sorted({c for c in text if not 0 < ord(c) < 128})
        if bad:
            raise ValueError(f"AsciiTokenizer: prompt has characters outside 1..127: {bad}")
        return [ord(c) for c in text]

    def detokenize(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(t) if 0 < t < 128 else ("" if skip_special_tokens else f"<{t}>") for t in tokens)

    def offsets(self, tokens: list[int], text: str) -> list[int]:
        return list(range(len(tokens)))


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """Generation flags here; everything else (model shape, --tp/--pp, --load) is pretrain_gpt.py's."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeat for a batch)")
    p.add_argument("--tokens", type=int, default=12, help="tokens to generate per prompt")
    p.add_argument("--sample-top-k", type=int, default=0, metavar="K",
                   help="after the greedy pass, a second pass sampling among the K most likely tokens with the "
                        "controller's sampling generator (a torch.Generator on the device, seeded by "
                        "inference_sampling_seed); 0: greedy only")
    p.add_argument("--batch-times-seqlen-threshold", type=int, default=8,
                   help="PP > 1: batches with more tokens than this run as micro-batches through the pipeline "
                        "(Megatron's inference_batch_times_seqlen_threshold; -1: never)")
    p.add_argument("--out", default=None, help="JSON file of the results (written by global rank 0)")
    p.add_argument("-h", "--help", action="store_true")
    gen, rest = p.parse_known_args(argv)
    if gen.help:
        p.print_help()
        print("\nmodel and layout flags: those of examples/pretrain_gpt.py (--tp, --pp, --load, --num-layers, ...)")
        raise SystemExit(0)
    model_args = pretrain_gpt.parse_args(rest)
    if not model_args.load:
        raise SystemExit("generate_gpt.py: --load DIR is required (a checkpoint written by pretrain_gpt.py --save)")
    if model_args.vpp is not None:
        raise SystemExit("generate_gpt.py: --vpp: Megatron's inference wrappers take one model chunk per rank")
    if model_args.dp != 1:
        raise SystemExit(
            f"generate_gpt.py: world size must be tp x pp (data parallel {model_args.dp} is not used here)")
    gen.prompts = gen.prompt or DEFAULT_PROMPTS
    longest = max(len(p) for p in gen.prompts)
    if longest + gen.tokens > model_args.seq_length:
        raise SystemExit(f"generate_gpt.py: longest prompt ({longest} tokens) + --tokens {gen.tokens} exceeds "
                         f"--seq-length {model_args.seq_length} (the model's position embeddings)")
    return gen, model_args


def load_weights(args: argparse.Namespace, model: list) -> None:
    """Weights only, from pretrain_gpt.py's torch_dist layout (the optimizer state is not needed)."""
    state = dist_checkpointing.load(pretrain_gpt.sharded_state(model, None, 0, False, loading=True), str(args.load_dir))
    for i, chunk in enumerate(model):
        chunk.module.load_state_dict(state["model" if len(model) == 1 else f"model{i}"])


def build_engine(gen: argparse.Namespace, args: argparse.Namespace, model: torch.nn.Module) -> StaticInferenceEngine:
    """Megatron-Core's static inference stack around the bare GPTModel."""
    batch = len(gen.prompts)
    wrapper_config = InferenceWrapperConfig(
        hidden_size=args.hidden_size, params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        inference_batch_times_seqlen_threshold=gen.batch_times_seqlen_threshold,
        padded_vocab_size=args.vocab_size, inference_max_requests=batch,
        inference_max_seq_length=args.seq_length)
    context = StaticInferenceContext(batch, args.seq_length)
    wrapped = GPTInferenceWrapper(model, wrapper_config, context)
    controller = TextGenerationController(inference_wrapped_model=wrapped,
                                          tokenizer=AsciiTokenizer(args.vocab_size))
    return StaticInferenceEngine(text_generation_controller=controller, max_batch_size=batch, legacy=True)


def margin(top: list[dict[str, float]]) -> list[float]:
    """Per generated token: log p(top-1) - log p(top-2), i.e. how far greedy decoding was from a tie."""
    out = []
    for d in top:
        v = sorted(d.values(), reverse=True)
        out.append(v[0] - v[1] if len(v) > 1 else float("inf"))
    return out


def generate(engine: StaticInferenceEngine, prompts: list[str], tokens: int, top_k: int) -> list[dict[str, Any]]:
    """One batch through the engine; per prompt: tokens, text, log-probs and top-1/top-2 margins."""
    params = SamplingParams(top_k=top_k, num_tokens_to_generate=tokens, return_log_probs=True, top_n_logprobs=2)
    records = []
    for r in engine.generate(prompts=prompts, sampling_params=params):
        records.append({"prompt": r.prompt, "prompt_tokens": list(r.prompt_tokens),
                        "generated_tokens": [int(t) for t in r.generated_tokens.tolist()],
                        "generated_text": r.generated_text, "generated_log_probs": list(r.generated_log_probs),
                        "top1_top2_margin": margin(r.generated_top_n_logprobs)})
    return records


def main(argv: list[str] | None = None) -> int:
    gen, args = parse_args(argv)
    pretrain_gpt.init_distributed(args)
    chunks, _ = pretrain_gpt.build_model(args)
    load_weights(args, chunks)
    model = chunks[0].module  # the GPTModel: inference needs no DDP wrapper
    engine = build_engine(gen, args, model)
    passes = {"greedy": generate(engine, gen.prompts, gen.tokens, top_k=1)}
    if gen.sample_top_k:
        passes["sampled"] = generate(engine, gen.prompts, gen.tokens, top_k=gen.sample_top_k)
    if dist.get_rank() == 0:
        for name, records in passes.items():
            for i, rec in enumerate(records):
                print(f"{name} {i} | tokens: {rec['generated_tokens']} | text: {rec['generated_text']!r}", flush=True)
        if gen.out:
            patches = {r["name"]: r["status"] for r in portspeed.report()
                       if r["name"].startswith("megatron.core.inference")}
            meta = {"tp": args.tp, "pp": args.pp, "device": str(pretrain_gpt.get_accelerator().device()),
                    "backend": ps_comm.real_backend(), "engine": "StaticInferenceEngine(legacy=True)",
                    "sample_top_k": gen.sample_top_k, "patches": patches}
            with open(gen.out, "w") as f:
                json.dump({"meta": meta, **passes}, f, indent=1)
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
