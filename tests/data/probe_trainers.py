"""DeepSpeed's engine and the Hugging Face Trainer under the probe (TEST-ONLY script, no portspeed line in it).

``deepspeed``: ``deepspeed.initialize`` on a small MLP, ZeRO-0, 2 micro-batches per step
(gradient accumulation), ``--steps`` steps; prints ``iteration N | lm loss: X | grad norm: None``.

``trainer``: the HF Trainer (no DeepSpeed) on a small torch model with a loss head, 2 accumulated
micro-batches per step, ``--steps`` steps, trained twice from the same seed: first with the probe's
callback taken off (``plain iteration N | ...``), then as made (``iteration N | ...``).
"""

import argparse
import os

import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> dict:
        out = self.body(x)
        return {"loss": (out.squeeze(-1) - y).pow(2).mean(), "logits": out} if y is not None else {"logits": out}


def data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, 8, generator=g), torch.randn(n, generator=g)


def deepspeed_run(steps: int) -> None:
    import deepspeed

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.05}}, "zero_optimization": {"stage": 0}}
    model = Net()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x, y = data(64)
    rank, world = engine.global_rank, engine.world_size
    i = 0
    for step in range(1, steps + 1):
        total = 0.0
        for _ in range(2):
            lo = (i * world + rank) * 2
            loss = engine(x[lo:lo + 2], y[lo:lo + 2])["loss"]
            engine.backward(loss)
            engine.step()
            total += float(loss) / 2
            i += 1
        if rank == 0:
            print(f"iteration {step} | lm loss: {total!r} | grad norm: None", flush=True)


def trainer_run(steps: int, out: str) -> None:
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments

    x, y = data(64)

    class Rows(Dataset):
        def __len__(self) -> int:
            return len(x)

        def __getitem__(self, i: int) -> dict:
            return {"x": x[i], "y": y[i]}

    for probed in (False, True):
        torch.manual_seed(0)
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                 max_steps=steps, learning_rate=0.05, optim="sgd", lr_scheduler_type="constant",
                                 logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
                                 dataloader_drop_last=True, disable_tqdm=True)
        trainer = Trainer(model=Net(), args=args, train_dataset=Rows())
        if not probed:
            for cb in list(trainer.callback_handler.callbacks):
                if type(cb).__name__ == "ProbeCallback":
                    trainer.remove_callback(cb)
        trainer.train()
        for entry in trainer.state.log_history:
            if "loss" in entry and "step" in entry:
                print(f"{'' if probed else 'plain '}iteration {entry['step']} | lm loss: {entry['loss']!r} | "
                      "grad norm: None", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("deepspeed", "trainer"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("TMPDIR", "/tmp"))
    a = p.parse_args()
    deepspeed_run(a.steps) if a.mode == "deepspeed" else trainer_run(a.steps, a.out)
