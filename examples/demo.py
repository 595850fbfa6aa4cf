"""The demo (`make demo`): a Megatron-Core GPT trained on CPU/Gloo with TP, PP and DP, and on the test device.

Every run goes through `portspeed run` (torchrun-compatible), starts from one shared
initial checkpoint so that layouts are comparable, prints its per-iteration losses as it
trains, and writes a JSON loss record. At the end `portspeed compare` checks every layout
against the single-process run (fp32: |diff| <= 1e-5) and exits non-zero if one parts.
``tp2-testdev`` runs TP2 on portspeed's test device (a C++ PrivateUse1 device with its own
collective backend; a test device, not hardware), so the comparison is across devices.

    python examples/demo.py                    # TP1, TP2, PP2, DP2, TP2xPP2
    python examples/demo.py --layouts tp2 dp2  # a subset
    python examples/demo.py --iters 20 --workdir /tmp/demo
"""

from __future__ import annotations

import argparse
import os
import pathlib
import socket
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAINER = ROOT / "examples" / "pretrain_gpt.py"

#: name -> (ranks, extra trainer flags)
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "tp1": (1, []),
    "tp2": (2, ["--tp", "2"]),
    "pp2": (2, ["--pp", "2"]),
    "dp2": (2, []),
    "tp2pp2": (4, ["--tp", "2", "--pp", "2"]),
    "tp2-testdev": (2, ["--tp", "2"]),
}
#: layouts that run on another adapter than the CPU (PORTSPEED_ACCELERATOR)
ACCELERATOR: dict[str, str] = {"tp2-testdev": "testdev"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(ranks: int, args: list[str], timeout: float, accelerator: str | None = None) -> None:
    """Run the trainer under `portspeed run` on `ranks` local processes, streaming its output."""
    cmd = [sys.executable, "-m", "portspeed.cli", "run", "--nproc-per-node", str(ranks),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(TRAINER), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PORTSPEED_ACCELERATOR=accelerator or os.environ.get("PORTSPEED_ACCELERATOR", "cpu"))
    proc = subprocess.run(cmd, env=env, cwd=ROOT, timeout=timeout)
    if proc.returncode != 0:
        sys.exit(f"demo: run failed (exit {proc.returncode}): {' '.join(cmd)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--workdir", default=None, help="where checkpoints and loss records go (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run before it is killed")
    args = p.parse_args(argv)

    work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="portspeed-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    init = work / "init-ckpt"
    print(f"== shared initial weights -> {init}", flush=True)
    launch(1, ["--iters", "0", "--save", str(init)], args.timeout)

    layouts = ["tp1"] + [name for name in args.layouts if name != "tp1"]
    records = []
    for name in layouts:
        ranks, flags = LAYOUTS[name]
        record = work / f"{name}.json"
        where = "the test device (testdev/testccl)" if name in ACCELERATOR else "CPU/Gloo"
        print(f"\n== {name}: {ranks} rank(s) on {where} through portspeed", flush=True)
        launch(ranks, [*flags, "--iters", str(args.iters), "--load", str(init), "--finetune",
                       "--loss-log", str(record)], args.timeout, ACCELERATOR.get(name))
        records.append(str(record))

    print("\n== loss parity against tp1 (fp32 band: atol 1e-5)", flush=True)
    cmp = [sys.executable, "-m", "portspeed.cli", "compare", *records,
           "--markdown", str(work / "parity.md"), "--json", str(work / "parity.json")]
    return subprocess.run(cmp, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
