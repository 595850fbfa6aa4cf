"""Train a tiny Llama with Hugging Face's ``Trainer`` and ``TrainingArguments(deepspeed=...)``, as DeepSpeed users do.

The script is plain Trainer usage with no portspeed import of its own: the adaptor comes from
the launcher (``portspeed run --adaptor deepspeed``), and the stock baseline is the same
script under ``torchrun`` with ``DS_ACCELERATOR=cpu``. Two modes:

* ``--init-model DIR``: build a 2-layer, hidden-64 Llama from a ``LlamaConfig`` (offline, a
  fixed seed) and save it once, so every run starts from the same checkpoint;
* ``--model DIR --out OUT``: train it on a fixed synthetic token dataset for ``--steps``
  Trainer steps, once per ``--runs`` item (``2``, ``3``: the ZeRO stage; ``:offload``: the
  optimizer state and step on the host), one fresh Trainer after the other, logging every
  step; rank 0 writes one portspeed loss record per run, ``OUT/<run>.json`` (``portspeed
  compare`` reads it), with the per-step loss the Trainer logs (the mean over all ranks) and
  where the model and the first batch lived. ``--save-at N`` saves a Trainer checkpoint every
  N steps; ``--resume-at N`` resumes each run from its step-N checkpoint
  (``resume_from_checkpoint``).

Launch on 2 CPU ranks::

    python examples/hf_trainer_deepspeed.py --init-model /tmp/llama
    OMP_NUM_THREADS=1 portspeed run --adaptor deepspeed --nproc-per-node 2 examples/hf_trainer_deepspeed.py \\
        --model /tmp/llama --runs 2,3 --out /tmp/losses --output-dir /tmp/trainer
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

VOCAB, SEQ, SAMPLES = 128, 16, 64


def init_model(path: str) -> None:
    """Save the tiny Llama every run starts from (fp32, seed 0, no network)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path)


class TokenDataset(torch.utils.data.Dataset):
    """A fixed set of random token sequences (seed 1); the labels are the inputs (causal LM)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def ds_config(zero: int, offload: bool) -> dict[str, Any]:
    """A DeepSpeed config as Trainer users write it ("auto" filled in by the Trainer)."""
    zero_cfg: dict[str, Any] = {"stage": zero}
    if offload:
        zero_cfg["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_optimization": zero_cfg,
        # torch's AdamW: the same optimizer on every accelerator (no fused or JIT-built kernel)
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
    }


def parse_runs(text: str) -> list[tuple[str, int, bool]]:
    """``"2,3,2:offload"`` -> [(key, ZeRO stage, offload)], or raise naming the bad item."""
    out = []
    for key in (t.strip() for t in text.split(",") if t.strip()):
        stage, _, opt = key.partition(":")
        if stage not in ("2", "3") or opt not in ("", "offload"):
            raise SystemExit(f"--runs item {key!r}: expected STAGE[:offload] with STAGE 2 or 3")
        out.append((key, int(stage), opt == "offload"))
    return out


def train(args: argparse.Namespace, key: str, zero: int, offload: bool) -> None:
    """One Trainer run (a fresh model from the saved checkpoint); rank 0 writes ``OUT/<key>.json``."""
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    out_dir = os.path.join(args.output_dir, key.replace(":", "_"))
    targs = TrainingArguments(
        output_dir=out_dir, deepspeed=ds_config(zero, offload), max_steps=args.steps,
        per_device_train_batch_size=args.batch, learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1,
        save_strategy="steps" if args.save_at else "no", save_steps=args.save_at or 1, report_to=[],
        dataloader_num_workers=0, seed=0, data_seed=0, disable_tqdm=True)
    model = LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    seen: dict[str, Any] = {}

    class Record(TrainerCallback):
        """Collect the loss the Trainer logs each step (already averaged over the ranks)."""

        def __init__(self) -> None:
            self.losses: list[tuple[int, float]] = []

        def on_log(self, a: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                self.losses.append((state.global_step, float(logs["loss"])))

    record = Record()

    class DeviceTrainer(Trainer):
        """The stock Trainer, noting where the first batch and the parameters are (for the tests)."""

        def compute_loss(self, model: Any, inputs: dict[str, Any], *a: Any, **kw: Any) -> Any:
            if "batch_device" not in seen:
                seen["batch_device"] = str(inputs["input_ids"].device)
                seen["param_device"] = str(next(model.parameters()).device)
            return super().compute_loss(model, inputs, *a, **kw)

    trainer = DeviceTrainer(model=model, args=targs, train_dataset=TokenDataset(), callbacks=[record])
    resume = os.path.join(out_dir, f"checkpoint-{args.resume_at}") if args.resume_at else None
    trainer.train(resume_from_checkpoint=resume)
    if torch.distributed.get_rank() == 0:
        from portspeed.parity.losslog import LossRecordWriter

        import deepspeed
        from deepspeed.accelerator import get_accelerator

        meta = {"backend": torch.distributed.get_backend(), "accelerator": type(get_accelerator()).__name__,
                "dtype": "fp32", "layout": {"tp": 1, "pp": 1, "dp": targs.world_size, "vpp": None},
                "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__},
                "zero": zero, "offload": offload, "resumed_at": args.resume_at,
                "ranks": torch.distributed.get_world_size(), "args_device": str(targs.device), **seen}
        if "portspeed.deepspeed_adaptor" in sys.modules:  # under `portspeed run`: what became of Accelerate's patches
            import portspeed

            meta["patches"] = {r["name"]: r["status"] for r in portspeed.report()
                               if r["name"].startswith("accelerate.")}
        writer = LossRecordWriter(os.path.join(args.out, key.replace(":", "_") + ".json"), meta=meta)
        for step, loss in record.losses:
            writer.add(step, loss)
        writer.flush()
    trainer.accelerator.free_memory()
    del trainer, model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--init-model", metavar="DIR", help="save the tiny Llama to DIR and exit")
    p.add_argument("--model", metavar="DIR", help="the saved tiny Llama to train")
    p.add_argument("--out", metavar="DIR", help="folder for the loss records, one per run (rank 0)")
    p.add_argument("--runs", default="2", help="Trainer runs, one after the other: STAGE[:offload],... (2,3,2:offload)")
    p.add_argument("--output-dir", default="hf_trainer_out", help="the Trainer's output_dir (checkpoints)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=2, help="per_device_train_batch_size (the global batch: x ranks)")
    p.add_argument("--save-at", type=int, default=0, help="save a Trainer checkpoint every N steps (0: never)")
    p.add_argument("--resume-at", type=int, default=0, help="resume each run from its checkpoint of step N")
    args = p.parse_args()
    if args.init_model:
        init_model(args.init_model)
        return
    if not (args.model and args.out):
        p.error("--model and --out are required to train (or --init-model DIR)")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for key, zero, offload in parse_runs(args.runs):
        train(args, key, zero, offload)


if __name__ == "__main__":
    main()
