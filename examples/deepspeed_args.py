"""The options of ``examples/deepspeed_train.py``: its ``--runs`` items (ZeRO stage, dtype, options) and its flags.

Kept apart from the trainer so it reads as a training loop; ``deepspeed_features.py`` takes the same items.
"""

from __future__ import annotations

import argparse
from typing import NamedTuple

__all__ = ["DTYPES", "OFFLOADS", "STAGES", "TORCH_DTYPES", "ZEROPP", "Run", "build_parser", "parse_runs"]

STAGES = (0, 1, 2, 3)
DTYPES = ("fp32", "bf16", "fp16")
#: where ZeRO keeps optimizer state / parameters: "" (with the model), and the stage each needs at least
OFFLOADS = {"offload": 1, "offload_param": 3, "nvme": 3}
#: ZeRO++ options (ZeRO-3 only): their DeepSpeed settings (hpz: the secondary partition spans the world)
ZEROPP = {"qwz": "zero_quantized_weights", "qgz": "zero_quantized_gradients", "hpz": "zero_hpz_partition_size"}
#: the dtype's torch name, for the inputs
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class Run(NamedTuple):
    """One ``--runs`` item: ZeRO stage, dtype, where ZeRO keeps its state, optimizer, planted overflow."""

    key: str
    stage: int
    dtype: str
    where: str
    optimizer: str | None  # None: --optimizer
    overflow: bool
    zeropp: tuple[str, ...] = ()  # of ZEROPP


def parse_runs(text: str) -> list[Run]:
    """Parse ``"0:fp32,3:bf16:offload+adam"`` into Runs, or raise naming the bad item."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        stage, sep, rest = item.partition(":")
        dtype, _, opts = rest.partition(":")
        words = [w for w in opts.split("+") if w]
        where = [w for w in words if w in OFFLOADS]
        optimizer = [w for w in words if w in ("sgd", "adam")]
        zeropp = tuple(w for w in words if w in ZEROPP)
        bad = (not sep or not stage.isdigit() or int(stage) not in STAGES or dtype not in DTYPES
               or len(where) > 1 or len(optimizer) > 1 or len(words) != len(set(words))
               or any(w not in OFFLOADS and w not in ZEROPP and w not in ("sgd", "adam", "overflow") for w in words)
               or (where and int(stage) < OFFLOADS[where[0]]) or ("overflow" in words and dtype != "fp16")
               or (zeropp and int(stage) != 3))
        if bad:
            raise argparse.ArgumentTypeError(
                f"--runs item {item!r} must be STAGE:DTYPE[:OPTIONS] with STAGE in {STAGES}, DTYPE in {DTYPES} and "
                "OPTIONS '+'-joined from: offload (ZeRO 1-3), offload_param or nvme (ZeRO-3); sgd or adam; overflow "
                "(fp16); qwz, qgz, hpz (ZeRO++, ZeRO-3); e.g. '0:fp32,3:bf16,2:fp32:offload+adam,3:fp16:qwz+qgz+hpz'")
        out.append(Run(item, int(stage), dtype, where[0] if where else "", optimizer[0] if optimizer else None,
                       "overflow" in words, zeropp))
    if not out:
        raise argparse.ArgumentTypeError("--runs needs at least one STAGE:DTYPE item")
    return out


def build_parser(description: str) -> argparse.ArgumentParser:
    """``deepspeed_train.py``'s options."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--runs", type=parse_runs, default=parse_runs("2:fp32"),
                   help="comma-separated ZeRO_STAGE:DTYPE[:OPTIONS] runs (default 2:fp32); OPTIONS joined by '+': "
                        "offload (optimizer state and step on the host), offload_param (ZeRO-3: parameters too), "
                        "nvme (ZeRO-3: both on disk under --nvme-dir); sgd / adam (else --optimizer); overflow "
                        "(fp16: step --overflow-at overflows); qwz / qgz / hpz (ZeRO-3: ZeRO++'s quantized weights, "
                        "quantized gradients, secondary partition over all ranks)")
    p.add_argument("--nvme-dir", default=None, help="directory for nvme runs (a local disk)")
    p.add_argument("--overflow-at", type=int, default=2,
                   help="the step (from 0) whose scaled gradients overflow in 'overflow' runs (it must be skipped)")
    p.add_argument("--fp16-stage0-as-is", action="store_true",
                   help="ZeRO-0 fp16: leave DeepSpeed 0.19.8's unscaled loss as it is (shows the upstream bug)")
    p.add_argument("--dist-port", type=int, default=29500,
                   help="port DeepSpeed's MPI discovery gives MASTER_PORT (under mpirun)")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run")
    p.add_argument("--global-batch", type=int, default=8, help="samples per step over all ranks")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--no-portspeed", action="store_true", help="do not import portspeed (stock baseline)")
    p.add_argument("--dist-backend", default=None,
                   help="backend asked of deepspeed.init_distributed (e.g. nccl); default: the accelerator's")
    p.add_argument("--torch-dist-first", action="store_true",
                   help="call torch.distributed.init_process_group before DeepSpeed does")
    p.add_argument("--save-dir", default=None, help="save a ZeRO checkpoint per run here")
    p.add_argument("--save-at", type=int, default=3, help="step after which to save (with --save-dir)")
    p.add_argument("--resume-from", default=None,
                   help="load each run's checkpoint from this directory and train the remaining steps")
    p.add_argument("--megatron", action="store_true",
                   help="Megatron-DeepSpeed style: also import portspeed.megatron_adaptor and hand DeepSpeed "
                        "Megatron-Core's parallel state (tensor/pipeline parallel 1) as its mpu")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                   help="sgd: a client torch SGD (momentum 0.9); adam: DeepSpeed's own Adam from the config "
                        "(DeepSpeedCPUAdam, a host kernel JIT-built on first use, in offload runs; torch's Adam "
                        "otherwise)")
    p.add_argument("--gradient-clipping", type=float, default=None,
                   help="DeepSpeed's gradient_clipping (default: DeepSpeed's own, 1.0 in 0.19; 0 turns it off)")
    p.add_argument("--count-all-to-all", action="store_true",
                   help="count torch.distributed.all_to_all_single calls per run and dtype (qgZ's quantized "
                        "gradients travel as int8), into the record")
    p.add_argument("--out", default=None, help="JSON file rank 0 writes the losses to")
    return p
