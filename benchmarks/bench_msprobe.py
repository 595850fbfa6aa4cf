"""A/B in one run: Ascend's msprobe (``PrecisionDebugger``) and portspeed's probe on the same small torch GPT.

Why: portspeed records its dumps itself and keeps msprobe an optional extra; this measures what
msprobe would cost as the engine, on a model comparable to the example trainer's (4 layers, hidden
64, 4 heads, sequence 32, vocabulary 128, 4 micro-batches of 2 per step, Adam), CPU, one process.
Each run alternates unprobed and probed steps (probed: every module's statistics, written each step)
and prints the medians and their ratio. msprobe is driven as its documentation says (``start(model)``,
``stop()``, ``step()`` around a step; ``task: statistics``, level ``L0`` (modules) or ``mix`` (modules
and APIs)); portspeed's probe through its documented call (``portspeed.probe.iteration``). Run it in a
Python that has msprobe (``pip install 'portspeed[probe]'``); portspeed is found on PYTHONPATH::

    PYTHONPATH=. OMP_NUM_THREADS=1 /tmp/msp/bin/python benchmarks/bench_msprobe.py --engine msprobe --level L0
    PYTHONPATH=. OMP_NUM_THREADS=1 /tmp/msp/bin/python benchmarks/bench_msprobe.py --engine portspeed --level module
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.attn = nn.MultiheadAttention(h, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        y = self.ln1(x)
        x = x + self.attn(y, y, y, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 128, h: int = 64, heads: int = 4, layers: int = 4, seq: int = 32) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.layers = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(h), nn.Linear(h, vocab)
        self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for layer in self.layers:
            x = layer(x, self.mask)
        return self.head(self.norm(x))


def step(model: nn.Module, opt: torch.optim.Optimizer, g: torch.Generator) -> float:
    total = 0.0
    for _ in range(4):
        batch = torch.randint(0, 128, (2, 33), generator=g)
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 128), batch[:, 1:].reshape(-1)) / 4
        loss.backward()
        total += float(loss)
    opt.step()
    opt.zero_grad()
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=("msprobe", "portspeed"), required=True)
    p.add_argument("--level", required=True, help="msprobe: L0 or mix; portspeed: module or op")
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    out = Path(tempfile.mkdtemp(prefix=f"bench-{args.engine}-"))
    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    if args.engine == "msprobe":
        from msprobe.pytorch import PrecisionDebugger

        cfg = out / "config.json"
        cfg.write_text(json.dumps({"task": "statistics", "dump_path": str(out / "dump"), "rank": [], "step": [],
                                   "level": args.level, "statistics": {"scope": [], "list": [], "data_mode": ["all"],
                                                                       "summary_mode": "statistics"}}))
        debugger = PrecisionDebugger(config_path=str(cfg))

        def probed() -> float:
            debugger.start(model=model)
            loss = step(model, opt, g)
            debugger.stop()
            debugger.step()
            return loss
    else:
        os.environ.update({"PORTSPEED_PROBE_DIR": str(out / "dump"), "PORTSPEED_PROBE_LEVEL": args.level,
                           "PORTSPEED_PROBE_ITERATIONS": "1:1000000"})
        import portspeed.probe

        count = [0]

        def probed() -> float:
            count[0] += 1
            with portspeed.probe.iteration(count[0], model):
                return step(model, opt, g)
    times: dict[str, list[float]] = {"off": [], "probed": []}
    for i in range(args.warmup + args.pairs):
        for name in (("off", "probed") if i % 2 == 0 else ("probed", "off")):
            t0 = time.perf_counter()
            step(model, opt, g) if name == "off" else probed()
            if i >= args.warmup:
                times[name].append((time.perf_counter() - t0) * 1000)
    off, on = statistics.median(times["off"]), statistics.median(times["probed"])
    files = [f for f in (out / "dump").rglob("*") if f.is_file()]
    steps = {f.parent for f in files if f.name == "dump.json"}
    disk = sum(f.stat().st_size for f in files) / max(1, len(steps))
    print(f"{args.engine} {args.level}: step median off {off:.1f} ms, probed {on:.1f} ms, x {on / off:.2f}; "
          f"{len(steps)} dumps, {disk / 1024:.0f} KiB per probed step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
