"""One training step of a tiny torch model, recorded by msprobe's PrecisionDebugger or by portspeed's probe.

Both engines must see the same run, so the model, the seed, the data and the step are fixed here and
only the recorder differs:

- ``--engine msprobe``: msprobe's documented calls (``PrecisionDebugger(config_path)``, ``start(model)``,
  ``stop()``, ``step()``; task ``statistics``, level ``mix``: modules and APIs). Needs mindstudio-probe
  (``pip install 'portspeed[probe]'``); it wrote tests/data/msprobe_dump/ (see tests/data/README.md).
- ``--engine portspeed``: portspeed's own-loop call ``portspeed.probe.iteration(1, model)`` at op level
  (``PORTSPEED_PROBE_*`` set here, before the probe is imported); torch alone.

``--plant MODULE`` (TEST-ONLY) multiplies that module's output by 1 + 1e-3, so a compare of the two
dumps must name it first. Run from the repository root::

    .venv/bin/python tests/data/msprobe_model.py --engine portspeed --out /tmp/ps
    /tmp/msp/bin/python tests/data/msprobe_model.py --engine msprobe --out /tmp/ms
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn as nn

#: the planted relative error of --plant
OFF = 1e-3


class Net(nn.Module):
    """Linear, GELU, LayerNorm, Linear: a few modules and the torch functions they call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(self.act(self.fc1(x))))


def step(model: nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    """One micro-batch, forward and backward, and the optimizer's step."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 8, generator=g)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=("msprobe", "portspeed"), required=True)
    p.add_argument("--out", required=True, help="the dump folder (must not exist)")
    p.add_argument("--plant", default=None, metavar="MODULE", help="TEST-ONLY: scale MODULE's output by 1 + 1e-3")
    args = p.parse_args()
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if args.plant:
        model.get_submodule(args.plant).register_forward_hook(lambda m, i, out: out * (1 + OFF))
    out = Path(args.out)
    if args.engine == "msprobe":
        from msprobe.pytorch import PrecisionDebugger

        out.mkdir(parents=True)
        cfg = out.parent / f"{out.name}.config.json"
        cfg.write_text(json.dumps({"task": "statistics", "dump_path": str(out), "rank": [], "step": [],
                                   "level": "mix", "statistics": {"scope": [], "list": [], "data_mode": ["all"],
                                                                  "summary_mode": "statistics"}}))
        debugger = PrecisionDebugger(config_path=str(cfg))
        debugger.start(model=model)
        loss = step(model, opt)
        debugger.stop()
        debugger.step()
    else:
        os.environ.update({"PORTSPEED_PROBE_DIR": str(out), "PORTSPEED_PROBE_LEVEL": "op"})
        import portspeed.probe

        with portspeed.probe.iteration(1, model):
            loss = step(model, opt)
    print(f"loss {loss.item()!r}")


if __name__ == "__main__":
    main()
