"""The example trainer and the small GPT the parity tests run it with (shared so they train the same model)."""

from __future__ import annotations

__all__ = ["MODEL", "SCRIPT"]

SCRIPT = "examples/pretrain_gpt.py"
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--vocab-size", "128", "--global-batch-size", "8", "--micro-batch-size", "2", "--lr", "1e-3",
         "--seed", "1234"]
