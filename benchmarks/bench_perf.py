"""A/B in one run: the example trainer's step with the perf recording off, at module level, at op level.

One process (TP1, world size 1, Gloo) builds examples/pretrain_gpt.py's model once and runs its
``train_step`` round after round, each round one step per configuration in a rotating order:

- ``off``: no perf session (the Megatron patches of ``--perf`` are installed, since the process was
  started with ``PORTSPEED_PERF``, and pass straight through);
- ``spans``: module level without the dispatch mode (the module hooks and clock stamps alone: what the
  spans cost, to read the next line by);
- ``module``: ``--perf-level module`` as a run gets it (spans, the dispatch mode counting host syncs,
  copies and CPU fallbacks, the collectives' wrappers, one JSON line per iteration);
- ``op``: ``--perf-level op`` (also each operator's start and end).

Each configuration has its own session and folder; the step time includes the iteration's end (the
clock read, the line written). Prints the medians and their ratios to ``off``::

    OMP_NUM_THREADS=1 python benchmarks/bench_perf.py --rounds 20
    OMP_NUM_THREADS=1 python benchmarks/bench_perf.py --rounds 6 --hidden-size 512 --seq-length 256
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
_ROOT = tempfile.mkdtemp(prefix="bench-perf-")
# the perf patches (Megatron's iterations, the collectives' wrappers) are declared at the adaptor's set-up
os.environ.update({"PORTSPEED_PERF": os.path.join(_ROOT, "unused")})

import portspeed.megatron_adaptor  # noqa: E402,F401

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from portspeed import config  # noqa: E402
from portspeed.perf import session as perf_session  # noqa: E402
from portspeed.testing import free_port  # noqa: E402

CONFIGS = ("off", "spans", "module", "op")


def _sessions() -> dict[str, perf_session.PerfSession | None]:
    base = config.settings()
    out: dict[str, perf_session.PerfSession | None] = {"off": None}
    for name, level in (("spans", "module"), ("module", "module"), ("op", "op")):
        s = perf_session.PerfSession(dataclasses.replace(base, perf_dir=os.path.join(_ROOT, name), perf_level=level,
                                                         perf_iterations=(1, 10**8)))
        s.host_watch = name != "spans"
        out[name] = s
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=20, help="timed rounds (one step of each configuration each)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--num-layers", default="4")
    p.add_argument("--hidden-size", default="64")
    p.add_argument("--seq-length", default="32")
    opts = p.parse_args(argv)
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port())}.items():
        os.environ.setdefault(k, v)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import pretrain_gpt as pg

    args = pg.parse_args(["--num-layers", opts.num_layers, "--hidden-size", opts.hidden_size, "--seq-length",
                          opts.seq_length, "--vocab-size", "128", "--global-batch-size", "8", "--micro-batch-size",
                          "2"])
    model, optimizer, _, _ = pg.setup(args)
    sessions = _sessions()
    chosen: list[perf_session.PerfSession | None] = [None]
    perf_session.current = lambda: chosen[0]  # the patches ask for the session each step: this round's, or none
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    it = 0
    for r in range(opts.warmup + opts.rounds):
        order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]
        for name in order:
            chosen[0] = sessions[name]
            it += 1
            t0 = time.perf_counter()
            pg.train_step(args, model, optimizer, it)
            dt = (time.perf_counter() - t0) * 1000
            if r >= opts.warmup:
                times[name].append(dt)
    off = statistics.median(times["off"])
    print(f"example step (TP1, {opts.num_layers} layers, hidden {opts.hidden_size}, seq {opts.seq_length}, "
          f"4 micro-batches), {opts.rounds} rounds")
    for name in CONFIGS:
        med = statistics.median(times[name])
        print(f"{name:7s} median {med:8.1f} ms  x off {med / off:5.2f}  min {min(times[name]):8.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
